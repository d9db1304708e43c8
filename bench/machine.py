"""What a benchmark ran on, printed above its table: a figure means little without its CPU.

The machines this project runs on differ between sessions (some have AVX-512, AMX and native
bfloat16, some only AVX2), so every bench names the CPU (model name, family/model/stepping), its
cores, the ISA flags that decide torch's CPU kernels, torch's version and threads, and a GPU if one
is used.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["ISA_FLAGS", "machine_info", "machine_line"]

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
"""The ``/proc/cpuinfo`` flags reported: AVX2, AVX-512, native bfloat16 dot products, AMX."""


def _cpuinfo() -> tuple[str, str, set[str]]:
    """The CPU's model name, ``family F model M stepping S``, and flags (Linux ``/proc/cpuinfo``)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if not key:
                break  # the first processor's block is enough
            fields.setdefault(key, value.strip())
    except OSError:
        pass
    names = (("family", "cpu family"), ("model", "model"), ("stepping", "stepping"))
    family = " ".join(f"{name} {fields[key]}" for name, key in names if key in fields)
    return fields.get("model name", "unknown CPU"), family, set(fields.get("flags", "").split())


def machine_line(device: str = "cpu") -> str:
    """One line naming the machine: ``CPU: AMD EPYC (family 25 model 17 stepping 1), 2 cores; avx2 yes,
    avx512f yes, ...; torch 2.13.0, 2 threads, AVX512 kernels`` (and the GPU's name where ``device`` is CUDA)."""
    import torch

    name, family, flags = _cpuinfo()
    isa = ", ".join(f"{flag} {'yes' if flag in flags else 'no'}" for flag in ISA_FLAGS)
    line = (
        f"CPU: {name}{f' ({family})' if family else ''}, {os.cpu_count()} cores; {isa}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{torch.backends.cpu.get_cpu_capability()} kernels"
    )
    if os.environ.get("ATEN_CPU_CAPABILITY"):
        line += f" (capped by ATEN_CPU_CAPABILITY={os.environ['ATEN_CPU_CAPABILITY']})"
    if str(device).startswith("cuda") and torch.cuda.is_available():
        line += f"; GPU: {torch.cuda.get_device_name(torch.device(device))}"
    return line


def machine_info(device: str = "cpu") -> dict[str, object]:
    """The machine as a dict, for a benchmark's JSON results: the fields of :func:`machine_line` and the line.

    Parameters
    ----------
    device : str
        The torch device the benchmark ran on; a CUDA device adds the GPU's name.

    Returns
    -------
    dict
        ``cpu`` (model name), ``cpu_family``, ``cores``, ``isa`` (flag to bool), ``torch``, ``threads``,
        ``kernels`` (torch's CPU capability), ``gpu`` (or ``None``), ``line`` (:func:`machine_line`) and
        ``date`` (UTC, ISO 8601).
    """
    import datetime

    import torch

    name, family, flags = _cpuinfo()
    gpu = None
    if str(device).startswith("cuda") and torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(torch.device(device))
    return {
        "cpu": name,
        "cpu_family": family,
        "cores": os.cpu_count(),
        "isa": {flag: flag in flags for flag in ISA_FLAGS},
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "kernels": torch.backends.cpu.get_cpu_capability(),
        "gpu": gpu,
        "line": machine_line(device),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }

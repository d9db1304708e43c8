"""The command line, in process, on a tiny model saved to a folder."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from constrain.serving.cli import main


@pytest.fixture(scope="module")
def model_dir(smol_tokenizer, tmp_path_factory):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(smol_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=2)  # fmt: skip
    folder = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(config).save_pretrained(folder)
    smol_tokenizer.save_pretrained(folder)
    return str(folder)


def test_generate_with_schema_prints_text_then_value(model_dir, tmp_path, capsys):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    path = tmp_path / "s.json"
    path.write_text(json.dumps(schema))
    assert main(["generate", "Answer:", "--model", model_dir, "--schema", str(path), "--seed", "1"]) == 0
    out = capsys.readouterr().out
    text, value = out.split("\n", 1)
    assert json.loads(text) == json.loads(value) and set(json.loads(value)) == {"ok"}


def test_generate_with_choices_and_errors(model_dir, tmp_path, capsys):
    assert main(["generate", "x", "--model", model_dir, "--choices", "red", "green", "--raw", "--seed", "3"]) == 0
    assert capsys.readouterr().out.strip() in ("red", "green")
    assert main(["generate", "x", "--model", model_dir, "--regex", "a("]) == 2
    assert "invalid regex" in capsys.readouterr().err
    assert main(["generate", "x", "--model", "/nowhere.gguf"]) == 2
    broken = tmp_path / "broken.json"
    broken.write_text('{"type": "object", "properties": \n')
    assert main(["generate", "x", "--model", model_dir, "--schema", str(broken)]) == 2
    assert f"{broken} is not JSON text: Expecting value (line 2, column 1)" in capsys.readouterr().err


def test_generate_with_reasoning_and_beams(model_dir, capsys):
    args = ["generate", "x", "--model", model_dir, "--choices", "red", "green", "--raw", "--seed", "3"]
    assert main([*args, "--reasoning", "12"]) == 0
    captured = capsys.readouterr()
    thought = captured.err.split("-- finish_reason")[0].splitlines()[-1]  # (after any loading progress bar)
    assert captured.out.strip() in ("red", "green") and thought.strip(), "the thinking goes to stderr"
    assert main([*args[:-2], "--num-beams", "2"]) == 0
    captured = capsys.readouterr()
    beams = [line.rsplit(": ", 1)[1] for line in captured.err.splitlines() if line.startswith("-- beam score=")]
    assert beams and beams[0] == captured.out.strip() and len(set(beams)) == len(beams) <= 2
    assert main([*args, "--reasoning", "1"]) == 2
    assert "reasoning.max_tokens" in capsys.readouterr().err

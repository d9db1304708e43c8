"""Exporting a model as a Hugging Face folder: transformers loads it back and generates the same tokens."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

import constrain
import constrain.models.export
from constrain.models.export import export_model
from constrain.serving.cli import main

MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def tied(smol_tokenizer):
    """The ``tiny`` model with its output embedding tied to its input embedding (as SmolLM2's is)."""
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=len(smol_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=2, tie_word_embeddings=True)  # fmt: skip
    return constrain.load_model((LlamaForCausalLM(config), smol_tokenizer))


@pytest.mark.parametrize("fixture", ["tiny", "tied"])
def test_transformers_generates_the_same_tokens(fixture, request, tmp_path):
    handle = request.getfixturevalue(fixture)
    folder = export_model(handle, tmp_path / "out")
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert model.dtype == torch.float32 and model.config.tie_word_embeddings == (fixture == "tied")
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    expected = constrain.generate(handle, MESSAGES, max_tokens=12, temperature=0)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=12, do_sample=False)  # fmt: skip
    assert out[0, len(ids) :].tolist() == expected.token_ids


@pytest.mark.parametrize("fixture", ["tiny", "tied"])
def test_weights_and_config(fixture, request, tmp_path):
    handle = request.getfixturevalue(fixture)
    folder = export_model(handle, tmp_path / "out")
    tensors = load_file(folder / "model.safetensors")
    assert set(tensors) == set(handle.model.state_dict())
    embedding = handle.model.model.embed_tokens.weight
    torch.testing.assert_close(tensors["model.embed_tokens.weight"], embedding, rtol=0, atol=0)
    torch.testing.assert_close(tensors["lm_head.weight"], handle.model.lm_head.weight, rtol=0, atol=0)
    if fixture == "tied":
        assert handle.model.lm_head.weight is embedding  # so both names hold the same values
    else:
        assert not torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] == (fixture == "tied")
    assert config["dtype"] == config["torch_dtype"] == "float32" and "quantization_config" not in config
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == list(handle.eos_token_ids) and len(handle.eos_token_ids) > 1


def test_tied_config_writes_the_input_embedding_under_both_names(smol_tokenizer, tmp_path):
    """Loaders tie by ``tie_word_embeddings``, so the file agrees with them even where the model's
    output embedding was untied in memory."""
    config = LlamaConfig(vocab_size=len(smol_tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, tie_word_embeddings=True)  # fmt: skip
    model = LlamaForCausalLM(config)
    model.lm_head.weight = torch.nn.Parameter(torch.zeros_like(model.lm_head.weight))
    tensors = load_file(export_model((model, smol_tokenizer), tmp_path / "out") / "model.safetensors")
    assert torch.equal(tensors["lm_head.weight"], model.model.embed_tokens.weight)
    assert torch.equal(tensors["model.embed_tokens.weight"], model.model.embed_tokens.weight)


def test_bfloat16_export_casts_a_copy(tied, tmp_path):
    folder = export_model(tied, tmp_path / "out", dtype="bfloat16")
    tensors = load_file(folder / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    assert tied.model.dtype == torch.float32  # the model itself is not cast
    expected = tied.model.model.embed_tokens.weight.to(torch.bfloat16)
    assert torch.equal(tensors["lm_head.weight"], expected)
    assert torch.equal(tensors["model.embed_tokens.weight"], expected)


def test_chat_template_survives(tiny, tmp_path):
    folder = export_model(tiny, tmp_path / "out")
    assert tiny.tokenizer.chat_template
    assert json.loads((folder / "tokenizer_config.json").read_text())["chat_template"] == tiny.tokenizer.chat_template
    loaded = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    for tokenize in (False, True):
        assert loaded.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=tokenize) == (
            tiny.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=tokenize)
        )


def test_refuses_a_folder_that_holds_something_else(tiny, tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    for overwrite in (False, True):
        with pytest.raises(ValueError, match="not empty and holds no previous export"):
            export_model(tiny, tmp_path, overwrite=overwrite)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    with pytest.raises(ValueError, match="is a file"):
        export_model(tiny, tmp_path / "notes.txt")
    with pytest.raises(ValueError, match="floating-point"):
        export_model(tiny, tmp_path / "new", dtype="int8")


def test_replaces_a_previous_export_only_when_asked(tiny, tmp_path):
    folder = export_model(tiny, tmp_path / "out")
    (folder / "stale.txt").write_text("from an earlier export")
    with pytest.raises(ValueError, match="overwrite=True"):
        export_model(tiny, folder)
    assert export_model(tiny, folder, overwrite=True, dtype=torch.float16) == folder
    assert not (folder / "stale.txt").exists()
    assert json.loads((folder / "config.json").read_text())["dtype"] == "float16"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary folder left


def test_cli_exports_a_model_folder(tied, tmp_path, capsys):
    source = export_model(tied, tmp_path / "source")
    out = tmp_path / "out"
    assert main(["export", "--model", str(source), str(out), "--dtype", "bfloat16"]) == 0
    printed = capsys.readouterr().out
    assert str(out) in printed and "model.safetensors" in printed
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert model.dtype == torch.bfloat16
    torch.testing.assert_close(model.lm_head.weight, tied.model.lm_head.weight.to(torch.bfloat16), rtol=0, atol=0)
    assert main(["export", "--model", str(source), str(out)]) == 2  # no --overwrite
    assert "--overwrite" in capsys.readouterr().err
    assert main(["export", "--model", str(source), str(out), "--overwrite"]) == 0


def test_cli_rejects_a_bad_folder_before_loading(tmp_path, capsys, monkeypatch):
    def load_model(*args, **kwargs):
        raise AssertionError("the folder is checked before the model is loaded")

    monkeypatch.setattr(constrain.models.export, "load_model", load_model)
    (tmp_path / "notes.txt").write_text("keep me")
    assert main(["export", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("constrain: error:") and "not empty" in err and err.count("\n") == 1
    with pytest.raises(SystemExit) as exit_info:
        main(["export", str(tmp_path / "new"), "--dtype", "int8"])
    assert exit_info.value.code == 2

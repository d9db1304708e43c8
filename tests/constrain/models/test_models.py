"""Model loading: the packaged default (GGUF, converted once and cached), pairs, and clear errors."""

from __future__ import annotations

import copy
import os
import shutil

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import constrain
from constrain.models.loading import (
    ModelNotFoundError,
    PrepackedLinear,
    _file_key,
    cache_dir,
    default_dtype,
    gguf_path,
    prepack_linears,
)


@pytest.mark.real_model
def test_default_model_loads_and_runs(smollm2):
    """Two fresh loads in this test (``smollm2``, loaded earlier in the session, may run other kernels
    since: torch's thread count and oneDNN's choices are process state); it skips where it is absent."""
    handle = constrain.load_model()
    assert handle.vocab_size == 49152 == len(handle.tokenizer)
    eos = handle.tokenizer.convert_ids_to_tokens(list(handle.eos_token_ids))
    assert "<|im_end|>" in eos and "<|endoftext|>" in eos
    ids = handle.tokenizer.encode("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        logits = handle.model(ids).logits  # [1, T, V]
    assert logits.shape == (1, ids.shape[1], 49152) and torch.isfinite(logits).all()
    assert any((cache_dir() / "models").glob("SmolLM2-135M-Instruct*/model.safetensors"))
    again = constrain.load_model("smollm2-135m-instruct")  # from the converted cache
    with torch.no_grad():
        torch.testing.assert_close(again.model(ids).logits, logits)


@pytest.mark.real_model
def test_the_packaged_gguf_installed_elsewhere_reuses_its_conversion(smollm2, tmp_path, monkeypatch):
    """Another environment's copy of the same GGUF file (another path, another install time) loads the
    weights converted before: nothing is converted, nor another 514 MB kept."""
    copy_of = tmp_path / "elsewhere" / gguf_path().name
    copy_of.parent.mkdir()
    shutil.copyfile(gguf_path(), copy_of)
    models = set((cache_dir() / "models").iterdir())

    def convert(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(constrain.models.loading, "_convert_gguf", convert)
    handle = constrain.load_model(str(copy_of))
    assert handle.vocab_size == 49152 and set((cache_dir() / "models").iterdir()) == models


def test_a_files_cache_key_is_its_content(tmp_path, monkeypatch):
    """Conversions are cached under the file's content: equal files at two paths and times key alike,
    another content apart; the digest is worked out once per path, size and time."""
    monkeypatch.setenv("CONSTRAIN_CACHE", str(tmp_path / "cache"))
    data, other = bytes(range(256)) * 5000, bytes(reversed(range(256))) * 5000
    paths = [tmp_path / name / "m.gguf" for name in ("a", "b", "c")]
    for path, content in zip(paths, (data, data, other), strict=True):
        path.parent.mkdir()
        path.write_bytes(content)
    os.utime(paths[1], ns=(10**18, 10**18))  # installed at another time
    key = _file_key(paths[0])
    assert key == _file_key(paths[1]) != _file_key(paths[2])
    times = paths[0].stat()
    paths[0].write_bytes(other)  # the same size and times: the kept digest answers, the file is not read
    os.utime(paths[0], ns=(times.st_atime_ns, times.st_mtime_ns))
    assert _file_key(paths[0]) == key
    os.utime(paths[0], ns=(times.st_atime_ns, times.st_mtime_ns + 1))  # changed: read again
    assert _file_key(paths[0]) == _file_key(paths[2])


def test_a_model_tokenizer_pair(smol_tokenizer):
    config = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=2)  # fmt: skip
    handle = constrain.load_model((LlamaForCausalLM(config), smol_tokenizer))
    assert handle.eos_token_ids[0] == 2 and not handle.model.training


def test_missing_models_say_what_to_do():
    with pytest.raises(ValueError, match="unknown packaged model"):
        constrain.models.loading.gguf_path("gpt-5")
    with pytest.raises(ModelNotFoundError, match="neither a packaged model"):
        constrain.load_model("/nowhere/model.bin")
    with pytest.raises(ValueError, match="pair"):
        constrain.load_model((1, 2, 3))


def _tiny_llama(dtype):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    return LlamaForCausalLM(config).to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepacked_linears_give_the_plain_forward(dtype):
    plain = _tiny_llama(dtype)
    packed = copy.deepcopy(plain)
    assert prepack_linears(packed) == 2 * 7 + 1 and prepack_linears(packed) == 0  # once per layer
    ids = torch.randint(0, 256, (3, 9))
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    with torch.inference_mode():
        expected, got = plain(ids, use_cache=True), packed(ids, use_cache=True)  # prefill
        torch.testing.assert_close(got.logits, expected.logits)
        step = {"input_ids": ids[:, :1], "attention_mask": mask, "position_ids": mask.sum(-1, keepdim=True) - 1}
        torch.testing.assert_close(packed(**step, cache=got.cache).logits, plain(**step, cache=expected.cache).logits)


def test_prepacked_linears_follow_their_weights():
    plain = _tiny_llama(torch.bfloat16)
    packed = copy.deepcopy(plain)
    prepack_linears(packed)
    ids = torch.randint(0, 256, (2, 5))
    with torch.no_grad():
        for model in (plain, packed):
            model.model.layers[0].mlp.down_proj.weight.mul_(2)  # in place
        torch.testing.assert_close(packed(ids).logits, plain(ids).logits)
        again = copy.deepcopy(packed)  # carries the module, repacks at its first call
        assert isinstance(again.lm_head.forward, type(packed.lm_head.forward))
        torch.testing.assert_close(again(ids).logits, plain(ids).logits)
        torch.testing.assert_close(packed.float()(ids).logits, plain.float()(ids).logits)  # cast: repacked
    packed(ids).logits.sum().backward()  # autograd recording: plain F.linear
    assert packed.lm_head.weight.grad is not None


def test_a_given_model_is_prepacked_only_when_asked_and_then_a_copy(smol_tokenizer):
    mine = _tiny_llama(torch.bfloat16)
    handle = constrain.load_model((mine, smol_tokenizer))
    assert handle.model is mine and not isinstance(mine.lm_head.forward, PrepackedLinear)
    handle = constrain.load_model((mine, smol_tokenizer), prepack=True)
    assert isinstance(handle.model.lm_head.forward, PrepackedLinear)
    assert handle.model is not mine and not isinstance(mine.lm_head.forward, PrepackedLinear)


def test_a_given_model_comes_back_as_it_went_in(smol_tokenizer):
    """Training mode, another dtype, prepacking: constrain runs a copy; the caller's model keeps its mode,
    parameters and modules' forwards (a model already ready is used as it is, without a copy)."""
    mine = _tiny_llama(torch.float32).train()
    before = {name: p.clone() for name, p in mine.state_dict().items()}
    forwards = {name: m.forward for name, m in mine.named_modules()}
    handle = constrain.load_model((mine, smol_tokenizer), dtype=torch.bfloat16, prepack=True)
    constrain.generate(handle, "a", max_tokens=3, temperature=0)
    assert not handle.model.training and handle.model.dtype == torch.bfloat16
    assert mine.training and all(m.training for m in mine.modules())
    assert all(torch.equal(p, before[name]) and p.dtype == torch.float32 for name, p in mine.state_dict().items())
    assert {name: m.forward for name, m in mine.named_modules()} == forwards
    ready = _tiny_llama(torch.float32)
    assert constrain.load_model((ready, smol_tokenizer)).model is ready


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
def test_load_model_prepacks_float32_and_natively_multiplied_bfloat16(smol_tokenizer, tmp_path):
    """A model ``load_model`` loads itself has its linear layers packed for oneDNN by default: in float32 on
    any CPU, in bfloat16 where the CPU multiplies it natively (elsewhere oneDNN emulates it); never when
    ``prepack=False``."""
    _tiny_llama(torch.float32).save_pretrained(tmp_path)
    smol_tokenizer.save_pretrained(tmp_path)

    def packed(**options):
        return isinstance(constrain.load_model(str(tmp_path), **options).model.lm_head.forward, PrepackedLinear)

    assert packed(dtype=torch.float32) and not packed(dtype=torch.float32, prepack=False)
    assert packed(dtype=torch.bfloat16) == (default_dtype("cpu") == torch.bfloat16)
    assert packed()  # the CPU's default dtype


def test_prepacked_linears_fall_back_where_onednn_cannot_pack(monkeypatch):
    plain = _tiny_llama(torch.bfloat16)
    packed = copy.deepcopy(plain)

    refused = []

    def refuse(weight):
        refused.append(weight.shape)
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)  # as on an AVX2-only CPU
    prepack_linears(packed)
    ids = torch.randint(0, 256, (2, 5))
    with torch.inference_mode():
        torch.testing.assert_close(packed(ids).logits, plain(ids).logits)
    assert len(refused) == 15  # tried once per layer, at prepack_linears

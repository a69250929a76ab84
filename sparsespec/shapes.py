"""Real model shapes with random weights: timing and kernel checks without downloading checkpoints.

``SHAPES`` holds the architectures of the production presets as ``ModelConfig`` (numbers from
each checkpoint's ``config.json``); ``random_transformer`` builds a ``Transformer`` of that shape
with random weights on any device. Random weights move exactly the bytes of the real model, so step
times and rooflines are real; acceptance and quality on them mean nothing.
"""
from __future__ import annotations

import math

import torch

from sparsespec.config import ModelConfig
from sparsespec.model import Transformer

_LLAMA3_EOS = (128001, 128008, 128009)


def _llama3_rope(factor: float) -> dict:
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


SHAPES: dict[str, ModelConfig] = {
    # meta-llama/Llama-3.1-8B-Instruct
    "llama-3.1-8b": ModelConfig(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=_llama3_rope(8.0), tie_word_embeddings=False,
        eos_token_ids=_LLAMA3_EOS, bos_token_id=128000,
    ),
    # meta-llama/Llama-3.2-3B-Instruct
    "llama-3.2-3b": ModelConfig(
        model_type="llama", vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_layers=28,
        num_heads=24, num_kv_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=_llama3_rope(32.0), tie_word_embeddings=True,
        eos_token_ids=_LLAMA3_EOS, bos_token_id=128000,
    ),
    # Qwen/Qwen2.5-7B-Instruct (qkv bias, untied embeddings)
    "qwen2.5-7b": ModelConfig(
        model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
        num_heads=28, num_kv_heads=4, head_dim=128, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_theta=1000000.0, attention_bias=True, tie_word_embeddings=False,
        eos_token_ids=(151645, 151643), bos_token_id=151643,
    ),
    # Qwen/Qwen2.5-Coder-0.5B-Instruct as provisioned offline (sparsespec.provision): qkv bias,
    # untied head (the GGUF ships its own output.weight), 14 query / 2 KV heads, 32K window
    "qwen2.5-coder-0.5b": ModelConfig(
        model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
        num_heads=14, num_kv_heads=2, head_dim=64, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_theta=1000000.0, attention_bias=True, tie_word_embeddings=False,
        eos_token_ids=(151645, 151643), bos_token_id=151643,
    ),
    # HuggingFaceTB/SmolLM2-135M-Instruct
    "smollm2-135m": ModelConfig(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_theta=100000.0, tie_word_embeddings=True, eos_token_ids=(2,), bos_token_id=1,
    ),
    # plumbing tests: GQA G=2, two layers
    "tiny": ModelConfig(
        model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=True, eos_token_ids=(2,), bos_token_id=1,
    ),
}


def get_shape(shape: str | ModelConfig) -> ModelConfig:
    """The ``ModelConfig`` of a shape name (or the config itself).

    Raises:
        ValueError: unknown name, listing the known ones.
    """
    if isinstance(shape, ModelConfig):
        return shape
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {sorted(SHAPES)}")
    return SHAPES[shape]


@torch.no_grad()
def random_transformer(shape: str | ModelConfig, dtype: torch.dtype = torch.float32, device="cpu",
                       seed: int = 0) -> Transformer:
    """A ``Transformer`` of ``shape`` with random weights (deterministic given seed and device).

    Scales: every projection ``N(0, 1/fan_in)``, so that q, k (after RMSNorm) have unit-variance
    entries and the attention logits ``q.k/sqrt(D)`` are about ``N(0, 1)`` (a spread,
    non-degenerate softmax) and each residual branch adds O(1) per entry (the stream grows like
    ``sqrt(L)``; RMSNorm keeps every layer's input at unit scale). Embeddings ``N(0, 1/E)``: small
    next to the branch outputs, so the final hidden state is not dominated by the input token's own
    embedding (with tied embeddings that would make the model echo its input, accepting every
    draft); the token still steers everything through the first layer, whose input is normalised.
    Logits come out about ``N(0, 1)``. Norm weights ``N(1, 0.1)``; Qwen qkv biases ``N(0, 0.02)``.
    """
    cfg = get_shape(shape)
    model = Transformer(cfg, dtype=dtype, device=device)
    gen = torch.Generator(device=model.device).manual_seed(seed)
    E = cfg.hidden_size

    def normal_(p: torch.Tensor, std: float) -> None:
        p.normal_(0.0, std, generator=gen)

    normal_(model.embed, 1.0 / math.sqrt(E))
    if not cfg.tie_word_embeddings:
        normal_(model.lm_head, 1.0 / math.sqrt(E))
    for layer in model.layers:
        normal_(layer.wqkv, 1.0 / math.sqrt(E))
        if layer.bqkv is not None:
            normal_(layer.bqkv, 0.02)
        normal_(layer.wo, 1.0 / math.sqrt(cfg.num_heads * cfg.head_dim))
        normal_(layer.w_gate_up, 1.0 / math.sqrt(E))
        normal_(layer.w_down, 1.0 / math.sqrt(cfg.intermediate_size))
    # norm weights N(1, 0.1), drawn after everything else (the other weights stay as they were):
    # with every norm at 1, a path that reads one norm's weights for another's (the attention
    # norm before the MLP, say) gives the same numbers and no test could see it
    for w in [model.norm] + [t for layer in model.layers for t in (layer.ln_attn, layer.ln_mlp)]:
        w.normal_(1.0, 0.1, generator=gen)
    return model.prepack_()


class IdTokenizer:
    """Just enough tokenizer for ``Engine`` on a random-weight model (ids in, ids out)."""

    def __call__(self, text, add_special_tokens: bool = True):
        raise ValueError("random-weight models take token-id prompts, not strings")

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


def random_engine(shape: str | ModelConfig, dtype: torch.dtype = torch.float32, device="cpu", seed: int = 0):
    """An ``Engine`` over ``random_transformer(shape, ...)`` with an ``IdTokenizer`` (token-id prompts)."""
    from sparsespec.engine import Engine

    name = shape if isinstance(shape, str) else "custom"
    return Engine(random_transformer(shape, dtype, device, seed), IdTokenizer(), name=f"random:{name}")

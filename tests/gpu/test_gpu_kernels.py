"""GPU checks: the Triton kernels at real shapes, and the engine with the kernels active.

Marked ``gpu``; skipped without CUDA (or without triton). Run: ``pytest -q -m gpu tests/gpu``
(``benchmarks/gpu_check.sh`` does, then times the steps).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from sparsespec import kernels
from sparsespec.kernels import sparse_attention_ref, verify_attention_ref
from sparsespec.shapes import SHAPES, random_engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not kernels.triton_available(), reason="needs triton"),
]

DEV = "cuda"


def _err(a, b):
    return (a.float() - b.float()).abs().max().item()


def _cos(a, b):
    return torch.nn.functional.cosine_similarity(a.float().flatten(0, -2), b.float().flatten(0, -2), dim=-1).min().item()


def _qkv(B, H, Hkv, T, D, S_max, dtype, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(B, H, T, D, device=DEV, generator=g, dtype=dtype)
    kc = torch.randn(B, Hkv, S_max, D, device=DEV, generator=g, dtype=dtype)
    vc = torch.randn(B, Hkv, S_max, D, device=DEV, generator=g, dtype=dtype)
    return q, kc, vc


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T, W", [(1, 1), (5, 5), (9, 9), (17, 16)])
def test_verify_kernel_llama8b_heads(dtype, T, W):
    B, H, Hkv, D = 2, 32, 8, 128
    starts = torch.tensor([16000, 12345], device=DEV)
    q, kc, vc = _qkv(B, H, Hkv, T, D, 16400, dtype, seed=T)
    out, rows = kernels.verify_attention(q, kc, vc, starts, W, D**-0.5, 16000, use=True)
    exact_out, exact_rows = verify_attention_ref(q.float(), kc.float(), vc.float(), starts, W, D**-0.5, 16000)
    torch_out, torch_rows = verify_attention_ref(q, kc, vc, starts, W, D**-0.5, 16000)  # the torch path
    assert rows.shape == exact_rows.shape == (B, Hkv, W, 16000 + T)
    if dtype == torch.float32:
        assert _err(out, exact_out) < 1e-4 and _err(rows, exact_rows) < 1e-5
    else:
        assert _err(out, exact_out) <= max(2 * _err(torch_out, exact_out), 1e-2)
        assert _err(rows, exact_rows) <= max(2 * _err(torch_rows, exact_rows), 1e-3)
    assert rows[1, :, :, 12345 + T :].abs().max().item() == 0.0  # the short row's unused tail


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sparse_kernel_llama8b_heads(dtype):
    B, H, Hkv, D, S, E = 2, 32, 8, 128, 32768, 5
    N = S // 10
    q, kc, vc = _qkv(B, H, Hkv, 1, D, S, dtype, seed=7)
    g = torch.Generator(device=DEV).manual_seed(8)
    index = torch.sort(torch.rand(B, Hkv, S, device=DEV, generator=g).topk(N, dim=-1).indices, dim=-1).values
    index = index.to(torch.int32)
    n_valid = torch.tensor([N, N - 333], device=DEV)
    kt = torch.randn(B, Hkv, E, D, device=DEV, dtype=dtype, generator=g)
    vt = torch.randn(B, Hkv, E, D, device=DEV, dtype=dtype, generator=g)
    out = kernels.sparse_attention(q, kc, vc, index, n_valid, kt, vt, D**-0.5, use=True)
    exact = sparse_attention_ref(q.float(), kc.float(), vc.float(), index, n_valid, kt.float(), vt.float(), D**-0.5)
    ref = sparse_attention_ref(q, kc, vc, index, n_valid, kt, vt, D**-0.5)
    tol = 1e-4 if dtype == torch.float32 else max(2 * _err(ref, exact), 1e-2)
    assert _err(out, exact) <= tol


def _prompts(V, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, V, (n,), generator=g).tolist() for n in lengths]


SMALL_8B = dataclasses.replace(SHAPES["llama-3.1-8b"], num_layers=4)  # 8B heads/width, 4 layers


@pytest.mark.parametrize("shape", ["smollm2-135m", "llama8b-4layers"])
def test_greedy_lossless_with_kernels_fp32(shape, monkeypatch):
    """sparsespec-l vs ar with the kernels active (fp32: argmax ties cannot flip), ragged batch;
    and the kernel path gives the same tokens as the torch path."""
    monkeypatch.delenv("SPARSESPEC_ATTENTION", raising=False)
    engine = random_engine(SMALL_8B if shape == "llama8b-4layers" else shape, torch.float32, DEV, seed=0)
    assert kernels.use_triton(engine.model.device)
    prompts = _prompts(engine.model.cfg.vocab_size, [3000, 2200])
    opts = {"k": 4, "budget_frac": 0.1, "min_budget": 128}
    kw = dict(max_new_tokens=48, ignore_eos=True)
    ar = engine.generate(prompts, method="ar", **kw)
    for method in ("sparsespec-l", "magicdec-streaming", "magicdec-snapkv"):
        out = engine.generate(prompts, method=method, method_options=opts, **kw)
        assert sum(o.stats["num_drafted"] for o in out) > 0, f"{method}: drafted nothing (inconclusive)"
        for o, a in zip(out, ar):
            assert o.token_ids == a.token_ids, f"{method} diverged from ar"
    auto = engine.generate(prompts, method="sparsespec-l", method_options={"k": "auto"}, **kw)
    monkeypatch.setenv("SPARSESPEC_ATTENTION", "torch")
    torch_ar = engine.generate(prompts, method="ar", **kw)
    torch_auto = engine.generate(prompts, method="sparsespec-l", method_options={"k": "auto"}, **kw)
    assert [o.token_ids for o in torch_ar] == [o.token_ids for o in ar]
    assert [o.token_ids for o in torch_auto] == [o.token_ids for o in auto]
    assert [o.stats["num_accepted"] for o in torch_auto] == [o.stats["num_accepted"] for o in auto]


def test_model_paths_kernel_vs_torch_bf16_llama8b_shape(monkeypatch):
    """Verify logits and importance rows, and a draft step, at 8B width (4 layers), bf16, 8K context."""
    from sparsespec.kv.cache import KVCache
    from sparsespec.model import DraftKV

    monkeypatch.delenv("SPARSESPEC_ATTENTION", raising=False)
    engine = random_engine(SMALL_8B, torch.bfloat16, DEV, seed=1)
    m, cfg = engine.model, engine.model.cfg
    P, T = 8192, 9
    ids = torch.randint(3, cfg.vocab_size, (1, P + T), device=DEV, generator=torch.Generator(device=DEV).manual_seed(2))
    cache = KVCache(cfg, 1, P + T + 8, torch.bfloat16, DEV)
    m.prefill(ids[:, :P], cache)
    logits_k, rows_k = m.forward_dense(ids[:, P:], cache, want_rows=T)
    cache.rollback([P])
    monkeypatch.setenv("SPARSESPEC_ATTENTION", "torch")
    logits_t, rows_t = m.forward_dense(ids[:, P:], cache, want_rows=T)
    assert rows_k.shape == rows_t.shape and _err(rows_k, rows_t) < 2e-2
    # bf16 end to end through 4 layers: logits within bf16 noise (argmax may legitimately flip on
    # near-ties of a random model, so compare the vectors, not the argmax)
    assert _cos(logits_k, logits_t) > 0.995 and _err(logits_k, logits_t) < 0.5
    # a draft step: gather-in-kernel layout vs the compact layout, same index
    N = 819
    index = torch.sort(torch.randperm(P, device=DEV)[:N]).values.expand(cfg.num_layers, 1, cfg.num_kv_heads, N)
    index = index.contiguous()
    shape = (cfg.num_layers, 1, cfg.num_kv_heads, N + 2, cfg.head_dim)
    compact = DraftKV(torch.zeros(shape, dtype=torch.bfloat16, device=DEV), torch.zeros(shape, dtype=torch.bfloat16, device=DEV), N, N)
    gi = index[..., None].expand(*index.shape, cfg.head_dim)
    compact.k[:, :, :, :N] = torch.gather(cache.k, 3, gi)
    compact.v[:, :, :, :N] = torch.gather(cache.v, 3, gi)
    tail = (cfg.num_layers, 1, cfg.num_kv_heads, 2, cfg.head_dim)
    indexed = DraftKV(torch.zeros(tail, dtype=torch.bfloat16, device=DEV), torch.zeros(tail, dtype=torch.bfloat16, device=DEV),
                      N, N, index=index.to(torch.int32), source=cache)
    pos = torch.tensor([P], device=DEV)
    lt = m.forward_draft(ids[:, P : P + 1], pos, compact)
    monkeypatch.delenv("SPARSESPEC_ATTENTION")
    lk = m.forward_draft(ids[:, P : P + 1], pos, indexed)
    assert _cos(lk, lt) > 0.995 and _err(lk, lt) < 0.5

"""Triton kernel parity cases, run under the CPU interpreter in their own process.

Not collected by a plain ``pytest`` run (the file name has no ``test_`` prefix):
``tests/test_kernels.py::test_kernel_parity_under_the_interpreter`` runs it in a subprocess with
``TRITON_INTERPRET=1``, because triton fixes compiled-vs-interpreted when ``triton.language`` is
first imported, process-wide; running these in the test process would leak the interpreter into
any later GPU test (or fail if triton was already imported compiled).

Shapes are small (the interpreter is slow) but cover GQA (G = 3), ragged rows, key counts that are
not a multiple of the block, split-K with a combine, W < T, the draft tail's causal rule, strided
index views, fp32/fp16/bf16, and the whole engine running through the kernels.
"""
from __future__ import annotations

import os
import sys

import pytest

if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton already imported without the interpreter: run this file in its own process with "
                "TRITON_INTERPRET=1 (see tests/test_kernels.py)", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not importable: the Triton kernels cannot be checked")

import torch  # noqa: E402

from sparsespec import kernels  # noqa: E402
from sparsespec.kernels import _triton as tk  # noqa: E402
from sparsespec.kernels import sparse_attention_ref, verify_attention_ref  # noqa: E402

assert type(tk._attn_fwd).__name__ == "InterpretedFunction", "kernels were compiled, not interpreted"


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # triton reads it again while launching


B, H, HKV, D, SMAX = 2, 6, 2, 16, 64
SCALE = D**-0.5
STARTS = torch.tensor([9, 43])  # ragged rows; row 0's new tokens end far before row 1's


def _qkv(T, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g)
    kc, vc = torch.randn(B, HKV, SMAX, D, generator=g), torch.randn(B, HKV, SMAX, D, generator=g)
    return q.to(dtype), kc.to(dtype), vc.to(dtype)


def _max_err(a, b):
    return (a.float() - b.float()).abs().max().item()


def test_verify_attention_and_importance_rows_fp32():
    T, W, splits = 4, 3, 3
    q, kc, vc = _qkv(T, torch.float32)
    out, rows = tk.verify_attention_triton(q, kc, vc, STARTS, W, SCALE, int(STARTS.max()), num_splits=splits,
                                           block_n=16)
    ref_out, ref_rows = verify_attention_ref(q, kc, vc, STARTS, W, SCALE)
    assert out.shape == (B, H, T, D) and rows.shape == (B, HKV, W, int(STARTS.max()) + T)
    assert _max_err(out, ref_out) < 1e-5
    assert _max_err(rows, ref_rows) < 1e-5
    # rows are attention mass: G per KV head and query, exactly zero past each query's position
    torch.testing.assert_close(rows.sum(-1), torch.full((B, HKV, W), float(H // HKV)), atol=1e-5, rtol=0)
    for b, s in enumerate(STARTS.tolist()):
        for w in range(W):
            assert rows[b, :, w, s + T - W + w + 1 :].abs().sum().item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_verify_attention_half_is_as_close_to_fp32_as_the_torch_path(dtype):
    T, W = 3, 3
    q, kc, vc = _qkv(T, dtype, seed=1)
    out, rows = tk.verify_attention_triton(q, kc, vc, STARTS, W, SCALE, block_n=16)
    assert out.dtype == dtype and rows.dtype == torch.float32
    exact_out, exact_rows = verify_attention_ref(q.float(), kc.float(), vc.float(), STARTS, W, SCALE)
    half_out, half_rows = verify_attention_ref(q, kc, vc, STARTS, W, SCALE)  # the model's torch path
    eps = torch.finfo(dtype).eps
    assert _max_err(out, exact_out) <= max(_max_err(half_out, exact_out), 4 * eps)
    assert _max_err(rows, exact_rows) <= max(_max_err(half_rows, exact_rows), eps)


def test_verify_attention_single_token_decode_uniform_rows():
    q, kc, vc = _qkv(1, torch.float32, seed=2)
    starts = torch.tensor([41, 41])
    out, rows = tk.verify_attention_triton(q, kc, vc, starts, 1, SCALE, 41, block_n=32)
    ref_out, ref_rows = verify_attention_ref(q, kc, vc, starts, 1, SCALE)
    assert _max_err(out, ref_out) < 1e-5 and _max_err(rows, ref_rows) < 1e-5
    out0, rows0 = tk.verify_attention_triton(q, kc, vc, starts, 0, SCALE, 41, block_n=32)
    assert rows0 is None and _max_err(out0, ref_out) < 1e-5


def _index(N, seed=3, dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(SMAX, generator=g)[:N].sort().values for _ in range(B * HKV)]).view(B, HKV, N)
    return idx.to(dtype)


@pytest.mark.parametrize("T, splits, idx_dtype", [(1, 1, torch.int64), (1, 2, torch.int32), (3, 2, torch.int64)])
def test_sparse_attention_gathers_in_kernel_fp32(T, splits, idx_dtype):
    q, kc, vc = _qkv(T, torch.float32, seed=4)
    N, E = 23, 4  # N not a multiple of the block; rows use 23 and 10 of the index
    big = torch.zeros(2, B, HKV, 40, dtype=idx_dtype)  # a strided view, as the drafter passes it
    big[1, :, :, :N] = _index(N, dtype=idx_dtype)
    index = big[1, :, :, :N]
    n_valid = torch.tensor([23, 10])
    g = torch.Generator().manual_seed(5)
    kt, vt = torch.randn(B, HKV, E, D, generator=g), torch.randn(B, HKV, E, D, generator=g)
    out = tk.sparse_attention_triton(q, kc, vc, index, n_valid, kt, vt, SCALE, num_splits=splits, block_n=16)
    ref = sparse_attention_ref(q, kc, vc, index, n_valid, kt, vt, SCALE)
    assert _max_err(out, ref) < 1e-5
    # same as the compact-buffer math the model's torch draft path runs
    if T == 1:
        gi = index.long()[..., None].expand(B, HKV, N, D)
        keys = torch.cat([torch.gather(kc, 2, gi), kt], 2)
        vals = torch.cat([torch.gather(vc, 2, gi), vt], 2)
        j = torch.arange(N + E)
        mask = ((j[None, :] < n_valid[:, None]) | (j[None, :] >= N))[:, None, :]
        compact, _ = kernels.grouped_attention(q, keys, vals, mask, 0, SCALE)
        assert _max_err(out, compact) < 1e-5


def test_sparse_attention_bf16_without_tail():
    q, kc, vc = _qkv(1, torch.bfloat16, seed=6)
    index = _index(37, seed=7)
    out = tk.sparse_attention_triton(q, kc, vc, index, None, None, None, SCALE, num_splits=3, block_n=16)
    exact = sparse_attention_ref(q.float(), kc.float(), vc.float(), index, None, None, None, SCALE)
    half = sparse_attention_ref(q, kc, vc, index, None, None, None, SCALE)
    assert out.dtype == torch.bfloat16
    assert _max_err(out, exact) <= max(_max_err(half, exact), 4 * torch.finfo(torch.bfloat16).eps)


def test_engine_through_the_kernels_matches_the_torch_path(monkeypatch):
    """The tiny model end to end with every attention in the kernels (interpreted): prefill rows,
    verify with importance, gather-in-kernel drafts. Greedy: token-identical to the torch path
    and to AR."""
    from sparsespec.shapes import random_engine

    engine = random_engine("tiny", torch.float32, "cpu", seed=0)
    prompt = torch.randint(0, engine.model.cfg.vocab_size, (48,), generator=torch.Generator().manual_seed(8)).tolist()
    opts = {"k": 3, "min_budget": 24, "max_budget": 24, "n_sink": 2, "n_recent": 8, "window": 4}
    kw = dict(max_new_tokens=5, ignore_eos=True)
    monkeypatch.setenv("SPARSESPEC_ATTENTION", "torch")
    ref = engine.generate([prompt], method="sparsespec-l", method_options=opts, **kw)[0]
    monkeypatch.setenv("SPARSESPEC_ATTENTION", "triton")
    got = engine.generate([prompt], method="sparsespec-l", method_options=opts, **kw)[0]
    ar = engine.generate([prompt], method="ar", **kw)[0]
    assert got.stats["num_drafted"] > 0, "drafted nothing: inconclusive"
    assert got.token_ids == ref.token_ids == ar.token_ids
    assert got.stats["num_accepted"] == ref.stats["num_accepted"]

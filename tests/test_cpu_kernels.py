"""Our CPU kernels (``sparsespec.kernels.cpu``) and the kernel plan, against independent oracles:
float64 matmuls, the PyTorch reference attention and a plain masked softmax, the eager model.

Also the property the kernels are built for: a row's result does not depend on its batch, on the
number of queries of the step or on the threads, bit for bit, so a verify's logits equal the AR
step's and greedy speculation reproduces AR exactly.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from sparsespec.kernels import cpu
from sparsespec.kernels.plan import (LINEAR_RANGES, TIE_MARGIN, KernelPlan, apply_tiles, choose, kt_rows_from_trial,
                                    FETCH_TRIAL_KEY, FETCH_TRIAL_REPS, decode_kprefetch_from_trial,
                                    kt_variant_from_trial, linear_fetch_widths, linear_wide_prefetch_from_trial,
                                    next_kprefetch_from_trial, ours_plan,
                                    verify_kprefetch_from_trial,
                                    pv_prefetch_from_trial, range_worst, tune_plan)
from sparsespec.kernels.reference import sparse_attention_ref, verify_attention_ref
from sparsespec.kv.cache import KVCache
from sparsespec.shapes import random_transformer

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"CPU kernels unavailable: {cpu.unavailable_reason()}")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------ linear
@pytest.mark.parametrize("N", [16, 17, 33, 300])
@pytest.mark.parametrize("M", [1, 2, 3, 5, 6, 7, 13])
def test_linear_packed_matches_float64_and_is_row_invariant(N, M):
    g = _gen(N * 100 + M)
    K = 72
    x, w, b = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    ref = F.linear(x.double(), w.double(), b.double()).float()
    wp = cpu.pack_weight(w)
    assert wp.shape == ((N + 15) // 16, K, 16)
    y = cpu.linear_packed(x, wp, N, b)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(cpu.linear(x, w, b), ref, rtol=1e-5, atol=1e-4)  # the unpacked kernel
    for m in range(M):  # each row alone: bitwise the same
        assert torch.equal(cpu.linear_packed(x[m : m + 1], wp, N, b)[0], y[m])
    acc = torch.randn(M, N, generator=g)
    out = acc.clone()
    assert cpu.linear_packed(x, wp, N, None, out=out, accumulate=True) is out
    torch.testing.assert_close(out, acc + (x.double() @ w.double().T).float(), rtol=1e-5, atol=1e-4)


def test_linear_results_do_not_depend_on_the_threads():
    g = _gen(1)
    x, w = torch.randn(9, 64, generator=g), torch.randn(200, 64, generator=g)
    wp = cpu.pack_weight(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.linear_packed(x, wp, 200)
        torch.set_num_threads(2)
        assert torch.equal(cpu.linear_packed(x, wp, 200), one)
    finally:
        torch.set_num_threads(before)


def test_the_wide_linear_fetch_distance_is_a_speed_choice_only():
    """The first row tile's fetch distance with two or more row tiles (``set_linear_wide_prefetch``)
    changes no bit at any width, on either tiles, at the panel ends too (odd N, the last panel's
    fetches run past the weight); the setter clamps to [0, ``LINEAR_PREFETCH_MAX``]."""
    g = _gen(5)
    K, N = 96, 200
    w, b = torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    wp = cpu.pack_weight(w)
    tiles = ["avx2"] + (["avx512"] if cpu.set_linear_avx512(True) == "avx512" else [])
    try:
        for isa in tiles:
            cpu.set_linear_avx512(isa == "avx512")
            for M in (1, 2, 3, 6, 7, 9, 12, 13, 25, 30):
                x = torch.randn(M, K, generator=g)
                ref = F.linear(x.double(), w.double(), b.double()).float()
                outs = []
                for rows in (0, 1, cpu.LINEAR_WIDE_PREFETCH_ROWS, cpu.LINEAR_WIDE_PREFETCH_FAR,
                             cpu.LINEAR_PREFETCH_MAX):
                    assert cpu.set_linear_wide_prefetch(rows) == rows == cpu.linear_wide_prefetch()
                    outs.append(cpu.linear_packed(x, wp, N, b))
                assert all(torch.equal(o, outs[0]) for o in outs), (isa, M)
                torch.testing.assert_close(outs[0], ref, rtol=1e-5, atol=1e-4)
        assert cpu.set_linear_wide_prefetch(-5) == 0
        assert cpu.set_linear_wide_prefetch(cpu.LINEAR_PREFETCH_MAX + 1) == cpu.LINEAR_PREFETCH_MAX
    finally:
        cpu.set_linear_avx512(True)
        cpu.set_linear_wide_prefetch(cpu.LINEAR_WIDE_PREFETCH_ROWS)


def test_the_linear_fetch_trial_times_both_distances_and_decides_by_paired_ratios(monkeypatch):
    """The trial runs every weight at the two two-tile widths of the tiles in use, near and far
    fetch in every round, each call under its own setting; the decision reads the geometric mean of
    the per-round ratio medians, not the medians of the seconds."""
    from sparsespec.kernels import plan as plan_mod

    assert linear_fetch_widths(6) == (8, 12) and linear_fetch_widths(12) == (14, 24)  # two tiles each
    model = random_transformer("tiny")
    seen, real = [], cpu.linear_packed

    def spy(x, *args, **kwargs):
        seen.append((x.shape[0], cpu.linear_wide_prefetch()))
        return real(x, *args, **kwargs)

    monkeypatch.setattr(cpu, "linear_packed", spy)
    out = plan_mod._linear_fetch_trial(model, reps=2)
    widths = linear_fetch_widths(cpu.LINEAR_TILE_ROWS[cpu.linear_isa()])
    assert set(out) == {f"M{m}:{v}" for m in widths for v in ("near", "far", "far/near")} - \
        {f"M{m}:near/near" for m in widths}
    weights = len(plan_mod._weights(model))
    for m in widths:  # warm-up + 2 rounds, every weight, each distance
        for rows in (cpu.LINEAR_WIDE_PREFETCH_ROWS, cpu.LINEAR_WIDE_PREFETCH_FAR):
            assert seen.count((m, rows)) == 3 * weights
    assert len(seen) == 12 * weights and cpu.linear_wide_prefetch() == cpu.LINEAR_WIDE_PREFETCH_ROWS
    rounds = {"M8:near": [1.0, 2.0, 4.0], "M8:far": [0.9, 2.2, 3.0], "M12:near": [1.0, 1.0, 1.0],
              "M12:far": [1.0, 1.02, 1.01]}
    monkeypatch.setattr(plan_mod, "_interleaved", lambda fns, reps: {n: rounds[n] for n in fns})
    monkeypatch.setattr(plan_mod, "linear_fetch_widths", lambda rows: (8, 12))
    out = plan_mod._linear_fetch_trial(model)
    assert out["M8:far/near"] == pytest.approx(0.9) and out["M8:far"] == 2.2 > out["M8:near"]  # ratio, not seconds
    assert out["M12:far/near"] == pytest.approx(1.01)
    assert linear_wide_prefetch_from_trial(out) == cpu.LINEAR_WIDE_PREFETCH_FAR  # 0.9 x 1.01 < 1
    assert linear_wide_prefetch_from_trial({**out, "M12:far/near": 1.2}) == cpu.LINEAR_WIDE_PREFETCH_ROWS
    assert linear_wide_prefetch_from_trial({}) == cpu.LINEAR_WIDE_PREFETCH_ROWS  # not timed


def test_the_trials_time_a_large_models_first_layers_and_copy_only_those(monkeypatch):
    """A large model's linear trials run its first whole layers (every layer has one shape) and
    copy only the weights they run: a fresh tune of Qwen2.5-Coder-1.5B packed all its 7 GB for the
    fetch trial and twice for the linear trial (85 s, 19.7 GiB of a 23 GiB machine)."""
    from sparsespec.kernels import plan as plan_mod

    model = random_transformer("tiny")
    weights = plan_mod._weights(model)
    per_layer = [sum(w.numel() for w, _ in weights[i : i + 4]) for i in range(0, len(weights) - 1, 4)]
    assert len(per_layer) == model.cfg.num_layers >= 2 and len(weights) == 4 * len(per_layer) + 1
    assert plan_mod._first_layers(weights, lambda n: n >= 1) == weights[:4]
    assert plan_mod._first_layers(weights, lambda n: n >= per_layer[0] + 1) == weights[:8]
    assert plan_mod._first_layers(weights, lambda n: n > sum(per_layer)) == weights  # the LM head too

    packed = []
    real_pack = cpu.pack_weight
    monkeypatch.setattr(cpu, "pack_weight", lambda w: packed.append(id(w)) or real_pack(w))
    monkeypatch.setattr(plan_mod, "TRIAL_STREAM_BYTES", 4 * per_layer[0])  # one layer's panels
    seen = []
    real_linear = cpu.linear_packed
    monkeypatch.setattr(cpu, "linear_packed",
                        lambda x, wp, n, b=None: seen.append(wp.shape) or real_linear(x, wp, n, b))
    plan_mod._linear_fetch_trial(model, reps=1)
    first = {id(w) for w, _ in weights[:4]}
    assert set(packed) == first and len(packed) == 4
    assert len(seen) == 8 * 4 and set(seen) == {real_pack(w).shape for w, _ in weights[:4]}

    # the linear trial: a width so wide that ~1 GFLOP is one layer -> that layer's copies only
    packed.clear()
    monkeypatch.setattr(plan_mod, "TRIAL_ROWS", (1, int(1e9 / (2 * per_layer[0])) + 1))
    res = plan_mod._linear_trial(model, ["ss", "mkl"], 1)
    assert set(res) == set(plan_mod.TRIAL_ROWS)
    assert len(packed) == len(weights) and set(packed) == {id(w) for w, _ in weights}  # M = 1: every weight
    packed.clear()
    monkeypatch.setattr(plan_mod, "TRIAL_ROWS", (int(1e9 / (2 * per_layer[0])) + 1,))
    plan_mod._linear_trial(model, ["ss", "mkl"], 1)
    assert set(packed) == first and len(packed) == 4
    # a memory-bound width of a large model: ~1 GFLOP would be every layer; the byte cap is one
    packed.clear()
    total = sum(w.numel() for w, _ in weights)
    monkeypatch.setattr(plan_mod, "TRIAL_ROWS", (int(1e9 / total) + 1,))
    plan_mod._linear_trial(model, ["ss", "mkl"], 1)
    assert set(packed) == first and len(packed) == 4


def test_the_forward_trial_copies_nothing_where_only_prefill_goes_to_a_library(monkeypatch):
    """Only the decode and verify ranges are confirmed in whole forwards; where the linear trial gave
    a library the prefill range only, nothing is timed and no copy of the weights is made."""
    from sparsespec.kernels.plan import _confirm_in_forward

    model = random_transformer("tiny")
    calls = []
    monkeypatch.setattr(model, "prepack_", lambda *a, **k: calls.append("prepack"))
    choice = [(1, "ss"), (8, "ss"), (16, "ss"), (32, "ss"), (64, "ss"), (128, "ss"), (None, "onednn")]

    def timer(fns, reps):
        calls.append("timed")
        return {k: 1.0 for k in fns}

    assert _confirm_in_forward(model, choice, 1, 2, timer=timer) == (choice, {})
    assert calls == []
    out, timings = _confirm_in_forward(model, [(1, "ss"), (8, "mkl"), (None, "ss")], 1, 2, timer=timer)
    assert calls[0] == "prepack" and "timed" in calls and set(timings) == {"4", "8"}


def test_the_wide_linear_fetch_follows_the_plan_and_the_environment(monkeypatch):
    for bad in (-1, cpu.LINEAR_PREFETCH_MAX + 1, True, 16.0, None):
        with pytest.raises(ValueError, match="linear_wide_prefetch"):
            KernelPlan(((None, "ss"),), linear_wide_prefetch=bad)
    far = KernelPlan(((None, "ss"),), linear_tiles="avx2", linear_wide_prefetch=128)
    assert "linear ss (avx2, wide rows fetch 128 ahead)" in far.summary()
    assert far.describe()["linear_wide_prefetch"] == 128
    near = dataclasses.replace(far, linear_wide_prefetch=cpu.LINEAR_WIDE_PREFETCH_ROWS)
    assert "linear ss (avx2)," in near.summary() and near.describe()["linear_wide_prefetch"] == 16
    mkl = KernelPlan(((None, "mkl"),), linear_wide_prefetch=128)  # no packed linear: moot
    assert mkl.describe()["linear_wide_prefetch"] is None and "fetch" not in mkl.summary()
    try:
        _assert_plan_then_env_apply(monkeypatch, "linear_wide_prefetch", cpu.linear_wide_prefetch,
                                    cpu.LINEAR_WIDE_PREFETCH_FAR, "SPARSESPEC_LINEAR_WIDE_PREFETCH", 64,
                                    ("-1", "far", str(cpu.LINEAR_PREFETCH_MAX + 1)),
                                    "SPARSESPEC_LINEAR_WIDE_PREFETCH=.*weight rows ahead")
    finally:
        cpu.set_linear_wide_prefetch(cpu.LINEAR_WIDE_PREFETCH_ROWS)


def test_accumulate_needs_out():
    with pytest.raises(ValueError, match="accumulate needs out"):
        cpu.linear(torch.zeros(1, 8), torch.zeros(4, 8), accumulate=True)


# ------------------------------------------------------------------ small fused ops
def test_rms_norm_silu_mul_and_rope_split_against_torch():
    g = _gen(2)
    x, w = torch.randn(5, 40, generator=g), torch.randn(40, generator=g)
    want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(cpu.rms_norm(x, w, 1e-5), want, rtol=1e-5, atol=1e-6)
    gu = torch.randn(3, 2, 2 * 36, generator=g) * 5
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(cpu.silu_mul(gu), F.silu(gate) * up, rtol=1e-5, atol=1e-5)
    B, T, H, Hkv, D = 2, 3, 6, 2, 16
    qkv = torch.randn(B, T, (H + 2 * Hkv) * D, generator=g)
    cos, sin = torch.randn(B, T, D, generator=g), torch.randn(B, T, D, generator=g)
    q, k, v = cpu.rope_split(qkv, cos, sin, H, Hkv, D)
    qq, kk, vv = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)

    def rope(t, heads):
        t = t.view(B, T, heads, D).transpose(1, 2)
        rot = torch.cat([-t[..., D // 2 :], t[..., : D // 2]], dim=-1)
        return t * cos[:, None] + rot * sin[:, None]

    assert torch.equal(q, rope(qq, H)) and torch.equal(k, rope(kk, Hkv))  # the same three roundings
    assert torch.equal(v, vv.view(B, T, Hkv, D).transpose(1, 2))


# ------------------------------------------------------------------ attention
SHAPES = [(3, 3, 64), (2, 2, 16), (2, 7, 64), (1, 4, 128), (2, 3, 32)]  # (H_kv, G, D)
BATCHES = [(1, [700], 0), (5, [300, 1000], 5), (9, [513, 255, 1], 4), (17, [256, 3], 17), (2, [0], 2)]  # (T, starts, W)


@pytest.fixture(params=["tiles-as-loaded", "keys-in-lanes-for-verifies"])
def kt_tiles(request):
    """The library's tiles as loaded, then with the keys-in-lanes score tiles for every step wider
    than one query per head (an AR step keeps the other tiles: the two paths must agree bitwise)."""
    before = cpu.attention_kt_rows()
    if request.param == "tiles-as-loaded":
        yield None
    else:
        if not (cpu.set_attention_avx512(True) or "").startswith("avx512"):
            pytest.skip("no AVX-512 tiles in this build")
        yield "kt"
    cpu.set_attention_kt(before)


@pytest.mark.parametrize("Hkv,G,D", SHAPES)
@pytest.mark.parametrize("T,starts,W", BATCHES)
def test_attention_matches_the_reference_and_is_batch_and_width_invariant(Hkv, G, D, T, starts, W, kt_tiles):
    if kt_tiles:
        cpu.set_attention_kt(G + 1)
    g = _gen(Hkv * 1000 + G * 100 + D + T)
    B, H = len(starts), Hkv * G
    S_max = max(starts) + T + 5
    kc, vc = torch.randn(B, Hkv, S_max, D, generator=g), torch.randn(B, Hkv, S_max, D, generator=g)
    q = torch.randn(B, H, T, D, generator=g)
    st = torch.tensor(starts)
    ref, ref_rows = verify_attention_ref(q, kc, vc, st, W, D ** -0.5)
    rows = torch.full((B, Hkv, W, max(starts) + T), 7.0) if W else None  # garbage to be overwritten
    out = cpu.attention(q, kc, vc, st, max(starts), D ** -0.5, rows)
    torch.testing.assert_close(out, ref.transpose(1, 2).reshape(B, T, H * D), rtol=1e-5, atol=1e-5)
    if W:
        torch.testing.assert_close(rows, ref_rows, rtol=1e-5, atol=1e-6)
    for b in range(B):  # row b's query t alone, as an AR step at that position: bitwise equal
        for t in range(T):
            alone = cpu.attention(q[b : b + 1, :, t : t + 1].contiguous(), kc[b : b + 1], vc[b : b + 1],
                                  st[b : b + 1] + t, starts[b] + t, D ** -0.5)
            assert torch.equal(alone[0, 0], out[b, t])


def test_attention_against_a_plain_masked_softmax_over_many_chunks():
    g = _gen(5)
    B, Hkv, G, D, T = 2, 2, 3, 32, 3
    starts = [1300, 777]  # several 256-key chunks, ragged
    S_max = max(starts) + T
    kc, vc = torch.randn(B, Hkv, S_max, D, generator=g), torch.randn(B, Hkv, S_max, D, generator=g)
    q = torch.randn(B, Hkv * G, T, D, generator=g)
    rows = torch.empty(B, Hkv, T, S_max)
    out = cpu.attention(q, kc, vc, torch.tensor(starts), max(starts), 0.2, rows).view(B, T, Hkv * G, D)
    for b in range(B):
        for h in range(Hkv * G):
            sc = (q[b, h].double() @ kc[b, h // G].double().T) * 0.2  # [T, S]
            vis = torch.arange(S_max)[None, :] <= (starts[b] + torch.arange(T))[:, None]
            p = torch.softmax(sc.masked_fill(~vis, float("-inf")), dim=-1)
            torch.testing.assert_close(out[b, :, h].double(), p @ vc[b, h // G].double(), rtol=1e-5, atol=1e-5)
    assert torch.allclose(rows.sum(-1), torch.full((B, Hkv, T), float(G)), atol=1e-5)
    assert float(rows[1, :, :, starts[1] + T :].abs().sum()) == 0.0  # zero past the row's keys


@pytest.mark.parametrize("Hkv,G,D", SHAPES)
def test_sparse_attention_matches_the_reference(Hkv, G, D):
    g = _gen(G * 10 + D)
    B, N, E, S_max = 3, 300, 3, 900
    kc, vc = torch.randn(B, Hkv, S_max, D, generator=g), torch.randn(B, Hkv, S_max, D, generator=g)
    idx = torch.randint(0, S_max, (B, Hkv, N), generator=g, dtype=torch.int32)
    nv = torch.tensor([N, 17, 260])
    kt, vt = torch.randn(B, Hkv, E, D, generator=g), torch.randn(B, Hkv, E, D, generator=g)
    q = torch.randn(B, Hkv * G, 1, D, generator=g)
    ref = sparse_attention_ref(q, kc, vc, idx, nv, kt, vt, 0.3)
    out = cpu.sparse_attention(q, kc, vc, idx, nv, kt, vt, 0.3)
    torch.testing.assert_close(out, ref.transpose(1, 2).reshape(B, 1, -1), rtol=1e-5, atol=1e-5)


needs_prefill_kernel = pytest.mark.skipif(not cpu.prefill_attention_supported(16),
                                          reason="our CPU kernels do not load here")


@pytest.fixture(params=["avx2", "avx512"])
def prefill_tiles(request):
    """The prefill attention on its AVX2 tiles, then (where built) its AVX-512 ones."""
    if request.param == "avx512" and not (cpu.set_attention_avx512(True) or "").startswith("avx512"):
        pytest.skip("no AVX-512 tiles in this build")
    cpu.set_attention_avx512(request.param == "avx512")
    yield request.param
    cpu.set_attention_avx512(True)


def _causal_ref(q, kc, vc, starts, scale):
    """Float64 causal softmax attention of T new queries per row: out [B, T, H * D]."""
    B, H, T, D = q.shape
    G = H // kc.shape[1]
    out = torch.empty(B, T, H, D, dtype=torch.float64)
    for b in range(B):
        n = int(starts[b]) + T
        vis = torch.arange(n)[None, :] <= (int(starts[b]) + torch.arange(T))[:, None]  # [T, n]
        for h in range(H):
            sc = (q[b, h].double() @ kc[b, h // G, :n].double().T) * scale
            out[b, :, h] = torch.softmax(sc.masked_fill(~vis, float("-inf")), dim=-1) @ vc[b, h // G, :n].double()
    return out.reshape(B, T, H * D)


@needs_prefill_kernel
@pytest.mark.parametrize("B,Hkv,G,T,D,starts", [
    (1, 3, 3, 512, 64, [1536]),  # SmolLM2's heads, a chunk inside a prompt
    (1, 3, 3, 97, 64, [0]),      # a first chunk: every block on the causal diagonal
    (2, 2, 7, 100, 64, [0, 37]),  # Qwen2.5's G = 7: items of 27 positions, ragged starts
    (3, 1, 1, 33, 32, [5, 0, 200]),  # one head; partial key blocks everywhere
    (1, 2, 4, 300, 128, [77]),   # D = 128: two P.V column slabs
    (2, 1, 13, 50, 16, [3, 64]),  # 13 heads per KV head: rows past 192 per item
    (1, 1, 2, 40, 256, [70]),    # D = 256
])
def test_prefill_attention_matches_a_float64_causal_softmax(B, Hkv, G, T, D, starts, prefill_tiles):
    g = _gen(B * 1000 + G * 10 + D)
    S_max = max(starts) + T + 7
    kc, vc = torch.randn(B, Hkv, S_max, D, generator=g), torch.randn(B, Hkv, S_max, D, generator=g)
    q = torch.randn(B, Hkv * G, T, D, generator=g)
    st = torch.tensor(starts)
    out = cpu.prefill_attention(q, kc, vc, st, D ** -0.5)
    assert out.shape == (B, T, Hkv * G * D) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _causal_ref(q, kc, vc, st, D ** -0.5), rtol=1e-5, atol=2e-6)


@needs_prefill_kernel
def test_prefill_attention_is_batch_and_thread_invariant_and_reads_strided_caches(prefill_tiles):
    """A row's output is the same bits alone or in a batch and on 1 or 2 threads; the caches may be
    one layer of a [L, B, H_kv, S, D] pool (strided batch and head)."""
    g = _gen(31)
    B, Hkv, G, T, D = 3, 2, 3, 130, 64
    pool_k, pool_v = torch.randn(2, B, Hkv, 900, D, generator=g), torch.randn(2, B, Hkv, 900, D, generator=g)
    q = torch.randn(B, Hkv * G, T, D, generator=g)
    st = torch.tensor([700, 0, 333])
    out = cpu.prefill_attention(q, pool_k[1], pool_v[1], st, 0.125)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.prefill_attention(q, pool_k[1], pool_v[1], st, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(out, one)
    for b in range(B):
        alone = cpu.prefill_attention(q[b : b + 1], pool_k[1, b : b + 1], pool_v[1, b : b + 1], st[b : b + 1], 0.125)
        assert torch.equal(alone[0], out[b])
    torch.testing.assert_close(out.double(), _causal_ref(q, pool_k[1], pool_v[1], st, 0.125), rtol=1e-5, atol=2e-6)


@needs_prefill_kernel
def test_prefill_attentions_avx2_tiles_give_the_avx512_tiles_bits():
    """Where the library has AVX-512 tiles, the prefill attention's AVX2 tiles (the only ones on a CPU
    without AVX-512) run the same operations per element: the same bits. Rows per item not a multiple
    of 8 or 16 (G = 7), a partial last key block, ragged starts, D = 64 and 128."""
    if not (cpu.set_attention_avx512(True) or "").startswith("avx512"):
        pytest.skip("this CPU's build has no AVX-512 tiles")
    g = _gen(41)
    try:
        for B, Hkv, G, T, D, starts in ((2, 2, 7, 100, 64, [0, 37]), (1, 3, 3, 300, 128, [517])):
            kc = torch.randn(B, Hkv, max(starts) + T + 3, D, generator=g)
            vc = torch.randn(B, Hkv, max(starts) + T + 3, D, generator=g)
            q = torch.randn(B, Hkv * G, T, D, generator=g)
            got = []
            for on in (True, False):
                cpu.set_attention_avx512(on)
                got.append(cpu.prefill_attention(q, kc, vc, torch.tensor(starts), D ** -0.5))
            assert torch.equal(got[0], got[1]), (G, D)
    finally:
        cpu.set_attention_avx512(True)


def test_prefill_attention_says_where_it_cannot_run(monkeypatch):
    q = torch.randn(1, 2, 40, 24)
    kc = torch.randn(1, 1, 40, 24)
    assert not cpu.prefill_attention_supported(24)
    with pytest.raises(RuntimeError, match="head_dim % 16 == 0"):
        cpu.prefill_attention(q, kc, kc, torch.tensor([0]), 0.2)
    monkeypatch.setitem(cpu._state, "lib", None)  # our kernels did not load (no compiler, SPARSESPEC_CPU_KERNELS=0)
    monkeypatch.setitem(cpu._state, "reason", "no compiler")
    assert not cpu.prefill_attention_supported(64)
    with pytest.raises(RuntimeError, match="no compiler"):
        cpu.prefill_attention(torch.randn(1, 2, 40, 64), torch.randn(1, 1, 40, 64), torch.randn(1, 1, 40, 64),
                              torch.tensor([0]), 0.2)


def test_the_library_builds_for_a_cpu_without_avx512(tmp_path):
    """The AVX-512 tiles are compiled only where the CPU has AVX-512; an AVX2-only CPU (the AMD EPYC
    of benchmarks/RESULTS.md) builds the rest: compile with AVX-512 off and load it. On a CPU without
    AVX-512 the library this process loaded is that build (``-march=native``): it is checked as is
    (a second compile takes ~20 s of the test budget there)."""
    import ctypes
    import subprocess

    if "avx512f" not in cpu.cpu_flags() and cpu.available():
        lib = cpu.library()
    else:
        out = tmp_path / "avx2only.so"
        flags = [f for f in cpu.FLAGS if f != "-shared"] + ["-mno-avx512f", "-shared"]
        res = subprocess.run([cpu._compiler(), *flags, str(cpu.SOURCE), "-o", str(out), "-lm"], capture_output=True,
                             text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        lib = ctypes.CDLL(str(out))
    assert lib.ss_abi_version() == cpu.ABI_VERSION
    assert lib.ss_set_attention_avx512(1) == 0 and lib.ss_set_linear_avx512(1) == 0  # nothing to switch on
    args, res = cpu._SIGNATURES["ss_prefill_attention"]
    lib.ss_prefill_attention.argtypes, lib.ss_prefill_attention.restype = args, res
    assert lib.ss_prefill_attention(*([0] * 5 + [None] * 2 + [0, 0, None, 0, 0, None, 1.0, None, 0, 0, 1])) == -1  # D 0


def test_the_avx512_linear_tile_gives_the_avx2_tiles_results_bit_for_bit():
    if cpu.set_linear_avx512(True) != "avx512":
        pytest.skip("this CPU's build has no AVX-512 tiles")
    g = _gen(12)
    try:
        # M = 1 and 2 included: with the AVX-512 tile on they take it too (the AVX2 pair tile otherwise)
        for N, K, M in ((33, 70, 3), (576, 576, 36), (100, 24, 13), (48, 9, 25), (17, 70, 1), (48, 40, 2), (576, 64, 2)):
            w, b, x = torch.randn(N, K, generator=g), torch.randn(N, generator=g), torch.randn(M, K, generator=g)
            wp = cpu.pack_weight(w)
            got = []
            for on in (True, False):
                cpu.set_linear_avx512(on)
                y = cpu.linear_packed(x, wp, N, b)
                acc = torch.ones(M, N)
                cpu.linear_packed(x, wp, N, out=acc, accumulate=True)
                got.append((y, acc))
            assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1]), (N, K, M)
            torch.testing.assert_close(got[0][0], (x.double() @ w.double().T + b.double()).float(), rtol=1e-4, atol=1e-4)
    finally:
        cpu.set_linear_avx512(True)


@pytest.mark.parametrize("G,D", [(7, 64), (3, 64), (3, 32)])
def test_the_avx512_tiles_give_the_avx2_tiles_results_bit_for_bit(G, D):
    """Where the library has AVX-512 tiles (score row pairs, 16-lane exp and P.V; keys-in-lanes score
    tiles from 6 query rows of a KV head), they run the same operations as the AVX2 ones: dense
    (decode and verify widths, with rows) and sparse attention. Rows per KV head G * T: 3 .. 119
    (keys-in-lanes tiles of 6 .. 12 rows; odd counts, the row-pair tiles' padded row), keys not a
    multiple of the 32-key block, causal tails inside a block."""
    if not (cpu.set_attention_avx512(True) or "").startswith("avx512"):
        pytest.skip("this CPU's build has no AVX-512 tiles")
    g = _gen(11)
    B, Hkv = 3, 2
    starts = [1000, 37, 255]  # 255 + 17: query 0 sees none of the second chunk's 16 keys (m_c = -inf)
    S_max = max(starts) + 17
    kc, vc = torch.randn(B, Hkv, S_max, D, generator=g), torch.randn(B, Hkv, S_max, D, generator=g)
    idx = torch.randint(0, S_max, (B, Hkv, 300), generator=g, dtype=torch.int32)
    nv, kt, vt = torch.tensor([300, 17, 260]), torch.randn(B, Hkv, 3, D, generator=g), torch.randn(B, Hkv, 3, D, generator=g)
    modes = {"avx512-kt": (True, 1), "avx512": (True, 0), "avx2": (False, 0)}
    try:
        for T in (1, 2, 3, 5, 9, 17):  # T = 3, G = 3: nine rows, one row-pair tile of five pairs (one padded)
            q = torch.randn(B, Hkv * G, T, D, generator=g)
            got = {}
            for mode, (on, kt_on) in modes.items():
                cpu.set_attention_avx512(on)
                assert cpu.set_attention_kt(kt_on) == mode
                rows = torch.zeros(B, Hkv, T, S_max)
                out = cpu.attention(q, kc, vc, torch.tensor(starts), max(starts), D ** -0.5, rows)
                sp = cpu.sparse_attention(q, kc, vc, idx, nv, kt, vt, 0.3)
                got[mode] = (out, rows, sp)
            for mode in ("avx512", "avx2"):
                for name, x, y in zip(("out", "rows", "sparse"), got["avx512-kt"], got[mode]):
                    assert torch.equal(x, y), (T, mode, name)
    finally:
        cpu.set_attention_avx512(True)
        cpu.set_attention_kt(0)


# ------------------------------------------------------------------ the sparse index
@pytest.mark.parametrize("S,budget,n_sink,n_recent", [(900, 90, 4, 16), (5000, 512, 4, 64), (300, 299, 0, 0),
                                                      (64, 20, 20, 0), (64, 20, 0, 20), (2049, 1, 0, 0)])
def test_build_index_matches_topk_and_sort(S, budget, n_sink, n_recent):
    from sparsespec.kv.index import build_index

    g = _gen(S + budget)
    scores = torch.rand(3, 2, 4, S + 7, generator=g, dtype=torch.float64)[..., :S]  # [L, B, H_kv, S] a view
    scores[0, 0, 0] *= 1e-30  # tiny and negative scores (a running sum's rounding) order correctly
    scores[1, 0, 1, :10] = -1e-18 * torch.arange(1, 11, dtype=torch.float64)  # distinct: ties are the next test
    want = build_index(scores, S, budget, n_sink, n_recent)
    got = build_index(scores, S, budget, n_sink, n_recent, kernel=True)
    assert got.dtype == torch.int64 and got.shape == want.shape == (3, 2, 4, budget)
    assert torch.equal(got, want)


def test_build_index_ties_at_the_cut_keep_the_earliest():
    from sparsespec.kv.index import build_index

    S, budget = 1000, 100
    scores = torch.zeros(1, 1, 2, S, dtype=torch.float64)  # nobody attended: every middle key ties at 0
    scores[0, 0, 1, 500:530] = 1.0  # 30 keys above the cut, the rest of the top from the tie, earliest first
    got = build_index(scores, S, budget, 4, 16, kernel=True)[0, 0]  # [H_kv, N]
    assert got[0].tolist() == list(range(4)) + list(range(4, 84)) + list(range(984, 1000))
    assert got[1].tolist() == list(range(4)) + list(range(4, 54)) + list(range(500, 530)) + list(range(984, 1000))
    with pytest.raises(ValueError, match="budget"):
        cpu.build_index(scores[:, 0], S, S, 4, 16)


# ------------------------------------------------------------------ the draft's compact KV
def _compact_oracle(k, idx):
    """What a compact list must hold for index ``idx``: the cache rows at those positions."""
    return k[idx]


def test_compact_update_keeps_every_indexed_row_and_copies_only_what_entered():
    """Index after index (growing, shrinking, replaced, unchanged, from scratch), the state says
    which position each slot holds, the slots are exactly 0 .. N - 1, each slot holds its
    position's cache row, and the rows copied are the entering positions plus the kept ones that
    had to move down (a shrink)."""
    g = _gen(21)
    L, H, S, D = 3, 2, 300, 16
    k, v = torch.randn(L, H, S, D, generator=g), torch.randn(L, H, S, D, generator=g)
    n_max = 120
    ck, cv = torch.full((L, H, n_max, D), float("nan")), torch.full((L, H, n_max, D), float("nan"))
    pos, slot = torch.zeros(L, H, n_max, dtype=torch.int32), torch.zeros(L, H, n_max, dtype=torch.int32)
    n_cur = 0

    def rand_index(N):
        return torch.stack([torch.stack([torch.randperm(S, generator=g)[:N].sort().values for _ in range(H)])
                            for _ in range(L)])

    first = rand_index(100)
    steps = [first, first.clone(), torch.cat([first[..., :60], first[..., 70:]], -1),  # unchanged, then 10 leave
             rand_index(120), rand_index(40), rand_index(1), rand_index(120)]  # replaced, shrunk, grown
    nudged = first.clone()
    nudged[..., 50] = torch.where(nudged[..., 49] + 1 < nudged[..., 50], nudged[..., 49] + 1, nudged[..., 50])
    steps.insert(2, nudged)
    for idx in steps:
        N = idx.shape[-1]
        slots_before = {(l, h): dict(zip(pos[l, h, :n_cur].tolist(), slot[l, h, :n_cur].tolist()))
                        for l in range(L) for h in range(H)}
        copied = cpu.compact_update(idx, pos, slot, n_cur, k, v, ck, cv)
        want_copied = 0
        for l in range(L):
            for h in range(H):
                p = idx[l, h]
                assert torch.equal(pos[l, h, :N].long(), p)
                s = slot[l, h, :N].long()
                assert sorted(s.tolist()) == list(range(N))
                assert torch.equal(ck[l, h, s], _compact_oracle(k[l, h], p))
                assert torch.equal(cv[l, h, s], _compact_oracle(v[l, h], p))
                before = slots_before[(l, h)]
                want_copied += sum(1 for q in p.tolist() if q not in before or before[q] >= N)
                # a kept position below N keeps its slot: nothing is copied for it
                for q, sl in zip(p.tolist(), s.tolist()):
                    if q in before and before[q] < N:
                        assert sl == before[q]
        assert copied == want_copied
        n_cur = N
    assert cpu.compact_update(steps[-1], pos, slot, 0, k, v, ck, cv) == L * H * 120  # n_cur = 0: every row again


def test_compact_update_rejects_what_it_cannot_hold():
    L, H, S, D = 2, 2, 50, 16
    k = torch.zeros(L, H, S, D)
    ck = torch.zeros(L, H, 10, D)
    pos = torch.zeros(L, H, 10, dtype=torch.int32)
    idx = torch.arange(10).expand(L, H, 10).contiguous()
    with pytest.raises(ValueError, match="int64"):
        cpu.compact_update(idx.int(), pos, pos.clone(), 0, k, k, ck, ck.clone())
    with pytest.raises(ValueError, match="cannot hold"):
        cpu.compact_update(torch.arange(11).expand(L, H, 11).contiguous(), pos, pos.clone(), 0, k, k, ck, ck.clone())
    with pytest.raises(ValueError, match="lie in"):
        cpu.compact_update(idx + 45, pos, pos.clone(), 0, k, k, ck, ck.clone())
    with pytest.raises(ValueError, match="float32"):
        cpu.compact_update(idx, pos, pos.clone(), 0, k.double(), k.double(), ck, ck.clone())


@pytest.mark.parametrize("method", ["sparsespec-l", "magicdec-streaming"])
def test_the_compact_draft_kv_follows_the_index_through_rebuilds_and_moves(method, monkeypatch):
    """The indexed drafters on our kernels keep each row's indexed K and V in a compact buffer:
    after prefills, rounds and a row moving down, every row's compact slots hold the cache rows
    of its current index, and a greedy draft over them gives the tokens (and nearly the
    entropies) of the draft that reads the indexed rows in place (the same sum in another order)."""
    from sparsespec.adaptive import FixedK
    from sparsespec.config import SamplingParams
    from sparsespec.drafters import sparse_self as ssd
    from sparsespec.registry import DRAFTERS
    from sparsespec.sampling import BatchSampling

    model = random_transformer("tiny", seed=5).use_kernels(KernelPlan(((None, "ss"),), "ss", True))
    cfg = model.cfg
    B, P, K = 3, 260, 3
    cls = DRAFTERS.get(method)
    spec = cls.options.from_options(method, {"k": K, "budget_frac": 0.2})
    drafters = {}
    for env in ("1", "0"):
        monkeypatch.setenv(ssd.ENV_COMPACT, env)
        drafters[env] = cls(model, spec, P + 4 * (K + 1), B, K)
    assert drafters["1"].compact is not None and drafters["0"].compact is None
    assert drafters["1"].index_buf is None and drafters["0"].index_buf is not None  # no unused padded index
    cache = KVCache(cfg, B, P + 4 * (K + 1), model.dtype, "cpu")
    _fill(cache, P + 4 * (K + 1), _gen(30))
    cache.lengths = [P, P - 30, P - 61]
    g = _gen(31)
    for b in range(B):
        rows = torch.rand(cfg.num_layers, 1, cfg.num_kv_heads, 8, cache.lengths[b], generator=g)
        for d in drafters.values():
            d.prefill_row(b, cache, rows)
    sampling = BatchSampling([SamplingParams(max_new_tokens=K + 2, temperature=0.0)] * B, [None] * B)
    tok = torch.randint(0, cfg.vocab_size, (B, 1), generator=g)

    def check(d, nrows):
        c = d.compact
        for b in range(nrows):
            idx = d.index[b][:, 0]  # [L, H_kv, N]
            N = idx.shape[-1]
            assert c.n[b] == N
            for l in range(cfg.num_layers):
                for h in range(cfg.num_kv_heads):
                    s = c.slot[b, l, h, :N].long()
                    assert torch.equal(c.pos[b, l, h, :N].long(), idx[l, h])
                    assert torch.equal(c.k[l, b, h, s], cache.k[l, b, h, idx[l, h]])
                    assert torch.equal(c.v[l, b, h, s], cache.v[l, b, h, idx[l, h]])

    for rnd in range(3):
        drafts = {e: d.propose(cache, tok, [K] * B, [FixedK(K)] * B, sampling) for e, d in drafters.items()}
        check(drafters["1"], B)
        assert torch.equal(drafts["1"].token_ids, drafts["0"].token_ids)
        torch.testing.assert_close(drafts["1"].entropies, drafts["0"].entropies, rtol=1e-4, atol=1e-4)
        counts = [rnd + 1, 2, K + 1]
        for b in range(B):  # the verify's rows: positions past the old length join the index
            cache.lengths[b] += counts[b]
        for d in drafters.values():
            if method == "sparsespec-l":
                d.commit(cache, torch.rand(cfg.num_layers, B, cfg.num_kv_heads, K + 1, max(cache.lengths),
                                           generator=_gen(40 + rnd)), counts)
            else:
                d.commit(cache, None, counts)
    cache.move(2, 0)  # row 0 finished: the last row moves into its slot, as the engine does
    for d in drafters.values():
        d.move(2, 0)
    two = cache.head(2)
    sampling2 = BatchSampling([SamplingParams(max_new_tokens=K + 2, temperature=0.0)] * 2, [None] * 2)
    drafts = {e: d.propose(two, tok[:2], [K] * 2, [FixedK(K)] * 2, sampling2) for e, d in drafters.items()}
    check(drafters["1"], 2)
    assert torch.equal(drafts["1"].token_ids, drafts["0"].token_ids)
    # a new request in slot 1: other rows of the cache, a fresh prefill (nothing of the old compact rows kept)
    two.k[:, 1].normal_(generator=_gen(50))
    two.v[:, 1].normal_(generator=_gen(51))
    two.lengths[1] = P - 5
    rows = torch.rand(cfg.num_layers, 1, cfg.num_kv_heads, 8, P - 5, generator=g)
    for d in drafters.values():
        d.prefill_row(1, two, rows)
    drafts = {e: d.propose(two, tok[:2], [K] * 2, [FixedK(K)] * 2, sampling2) for e, d in drafters.items()}
    check(drafters["1"], 2)
    assert torch.equal(drafts["1"].token_ids, drafts["0"].token_ids)


# ------------------------------------------------------------------ the plan
def test_plan_validation_and_queries():
    p = KernelPlan(((1, "ss"), (32, "onednn"), (None, "mkl")), "ss", True)
    assert [p.linear_backend(m) for m in (1, 2, 32, 33, 1000)] == ["ss", "onednn", "onednn", "mkl", "mkl"]
    assert p.uses_onednn and p.uses_panels and not p.batch_invariant
    assert ours_plan().batch_invariant  # decode widths (<= 128 rows) on ours; prefill chunks on MKL do not matter
    assert KernelPlan(((None, "ss"),), "ss", True).batch_invariant
    assert "linear ss<=1 onednn<=32 mkl" in p.summary()
    d = p.describe()
    assert d["linear"] == {"1": "ss", "32": "onednn", "inf": "mkl"} and d["cpu"] and "isa" in d
    for bad in [((1, "ss"),), ((None, "ss"), (None, "mkl")), ((32, "ss"), (1, "mkl"), (None, "mkl"))]:
        with pytest.raises(ValueError, match="ascend"):
            KernelPlan(bad)
    with pytest.raises(ValueError, match="linear backend"):
        KernelPlan(((None, "cublas"),))
    with pytest.raises(ValueError, match="attention"):
        KernelPlan(attention="flash")
    with pytest.raises(ValueError, match="prefill_attention"):
        KernelPlan(prefill_attention="flash")
    assert "prefill torch" in p.summary() and p.describe()["prefill_attention"] == "torch"
    assert ours_plan().prefill_attention == ("ss" if cpu.prefill_attention_supported(16) else "torch")


def test_choose_follows_the_environment(monkeypatch):
    model = random_transformer("tiny")
    monkeypatch.setenv("SPARSESPEC_KERNELS", "torch")
    assert choose(model).attention == "torch" and not choose(model).fused
    monkeypatch.setenv("SPARSESPEC_KERNELS", "ss")
    assert choose(model).attention == "ss" and choose(model).fused and choose(model).source == "env"
    monkeypatch.setenv("SPARSESPEC_LINEAR", "onednn")
    assert choose(model).linear == ((None, "onednn"),)
    monkeypatch.setenv("SPARSESPEC_KERNELS", "fast")
    with pytest.raises(ValueError, match="SPARSESPEC_KERNELS"):
        choose(model)
    monkeypatch.setenv("SPARSESPEC_KERNELS", "auto")
    monkeypatch.setenv("SPARSESPEC_LINEAR", "cublas")
    with pytest.raises(ValueError, match="SPARSESPEC_LINEAR"):
        choose(model)


def test_non_fp32_models_get_the_torch_plan():
    model = random_transformer("tiny", dtype=torch.bfloat16)
    assert model.kernel_plan.attention == "torch" and "dtype" in model.kernel_plan.note
    with pytest.raises(ValueError, match="cannot run"):
        model.use_kernels("ss")


def test_tune_measures_caches_and_reads_back(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSESPEC_CACHE", str(tmp_path))
    model = random_transformer("tiny")
    plan = tune_plan(model, reps=1)
    assert plan.source == "measured" and plan.tune_s > 0
    lin = plan.timings["linear"]
    assert set(lin) == {"1", "4", "8", "12", "16", "24", "32", "36", "64", "96", "128", "256", "512"}
    assert all("ss" in v and "mkl" in v for v in lin.values())
    if cpu.set_linear_avx512(True) == "avx512":  # both tiles timed: the faster over all widths is "ss"
        avx2 = sum(v["ss-avx2"] for v in lin.values()) < sum(v["ss"] for v in lin.values())
        assert plan.linear_tiles in ("", "avx2" if avx2 else "avx512")
        assert plan.linear_tiles or not plan.uses_panels
        lin = {m: {**{be: t for be, t in v.items() if be != "ss-avx2"}, "ss": v["ss-avx2" if avx2 else "ss"]}
               for m, v in lin.items()}
    else:
        assert plan.linear_tiles == "" and all("ss-avx2" not in v for v in lin.values())
    fwd = plan.timings["forward"]
    lows = (1, 2, 9, 17, 33, 65, 129)
    for (upper, widths), low in zip(LINEAR_RANGES, lows):  # each range: the backend whose worst width
        worst = {be: max(lin[str(m)][be] / min(lin[str(m)].values()) for m in widths)  # is fastest,
                 for be in lin[str(widths[0])]}                                      # ours within the margin
        best = min(worst, key=worst.get)
        if upper is not None and worst["ss"] <= worst[best] * (1 + TIE_MARGIN):  # decode widths only
            best = "ss"
        # then a library keeps its range only if whole forwards at every width agree
        # (not run when the attention trial chose PyTorch's: no forward of ours to compare)
        kept = best == "ss" or upper is None or plan.attention != "ss" or all(
            fwd[str(m)][best] * (1 + TIE_MARGIN) < fwd[str(m)]["ss"] for m in widths)
        for rows in (low, upper or 10**6):
            assert plan.linear_backend(rows) == (best if kept else "ss")
    files = list((tmp_path / "tuning").glob("plan-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["cpu"] == cpu.cpu_model()
    att = plan.timings["attention"]
    if (cpu.set_attention_avx512(True) or "").startswith("avx512"):  # both tiles timed; the faster kept
        base = [s for s in att if "torch" in att[s]]
        assert sorted(base) == ["T1", "T9"] and sorted(att) == ["T1", "T17", "T3", "T5", "T9", FETCH_TRIAL_KEY]
        ss, avx2 = (sum(att[s][be] for s in base) for be in ("ss", "ss-avx2"))
        want = "avx2" if avx2 < ss else "avx512"
        assert all("ss-kt" in v and "ss-kt-late" in v for s, v in att.items() if s != FETCH_TRIAL_KEY)
        kt = kt_variant_from_trial(att)
        rows = 0 if want == "avx2" else kt_rows_from_trial(att, model.cfg.num_heads // model.cfg.num_kv_heads, kt)
        want = "avx512-kt" if rows else want
        assert plan.attention_tiles == (want if plan.attention == "ss" else "")
        assert plan.attention_kt_rows == (rows if plan.attention == "ss" else 0)
        assert plan.attention_kt_vprefetch == (kt == "ss-kt" or not plan.attention_kt_rows)
        assert {"ss-pv-off/ss", "T3:ss-pv-off/ss"} <= set(att[FETCH_TRIAL_KEY])  # the P.V's value fetch
        assert plan.attention_pv_prefetch == (pv_prefetch_from_trial(att) if want != "avx2" else cpu.PV_PREFETCH_KEYS)
        assert cpu.attention_pv_prefetch() == plan.attention_pv_prefetch
        assert "ss-nk-off/ss" in att[FETCH_TRIAL_KEY]
        assert plan.attention_next_kprefetch == (next_kprefetch_from_trial(att) if want != "avx2" else True)
        assert cpu.attention_next_kprefetch() == plan.attention_next_kprefetch
    # the packed linear's wide fetch, timed in a trial of its own at the tiles' two-tile widths
    assert plan.linear_wide_prefetch == linear_wide_prefetch_from_trial(plan.timings["linear_fetch"])
    assert cpu.linear_wide_prefetch() == plan.linear_wide_prefetch
    assert {k for k in plan.timings["linear_fetch"] if k.endswith("/near")} == {
        f"M{m}:far/near" for m in linear_fetch_widths(cpu.LINEAR_TILE_ROWS[cpu.linear_isa()])}
    if plan.attention == "ss":  # the far key fetch, timed in the decode fetch trial on and off
        assert plan.attention_decode_kprefetch == decode_kprefetch_from_trial(att) == cpu.attention_decode_kprefetch()
    else:
        assert plan.attention_tiles == "" and all("ss-avx2" not in v for v in att.values())
    pre = plan.timings["prefill"]  # our prefill attention against PyTorch's flash, where ours runs
    if plan.attention == "ss" and cpu.prefill_attention_supported(model.cfg.head_dim):
        assert set(pre) == {"ss", "torch"}
        assert plan.prefill_attention == ("ss" if pre["ss"] < pre["torch"] else "torch")
    else:
        assert pre == {} and plan.prefill_attention == "torch"
    again = tune_plan(model)
    assert again.prefill_attention == plan.prefill_attention
    assert again.source == "cache" and again.linear == plan.linear and again.attention == plan.attention
    assert again.attention_tiles == plan.attention_tiles and again.linear_tiles == plan.linear_tiles
    assert again.attention_kt_vprefetch == plan.attention_kt_vprefetch
    assert again.attention_pv_prefetch == plan.attention_pv_prefetch
    assert again.attention_decode_kprefetch == plan.attention_decode_kprefetch
    assert again.attention_next_kprefetch == plan.attention_next_kprefetch
    assert again.linear_wide_prefetch == plan.linear_wide_prefetch
    files[0].write_text("{not json")  # a corrupt entry is measured again, not an error
    assert tune_plan(model, reps=1).source == "measured"


def test_choose_switches_the_attention_tiles_and_the_environment_keeps_them_off(monkeypatch):
    if not (cpu.set_attention_avx512(True) or "").startswith("avx512"):
        pytest.skip("this CPU's build has no AVX-512 tiles")
    model = random_transformer("tiny")
    monkeypatch.setenv("SPARSESPEC_KERNELS", "ss")
    try:
        plan = choose(model)  # the tiles are measured: whichever won here is applied (a busy core can flip it)
        assert plan.attention_tiles in ("avx512-kt", "avx512", "avx2") and plan.linear_tiles in ("avx512", "avx2")
        assert plan.attention_tiles == cpu.attention_isa() and plan.linear_tiles == cpu.linear_isa()
        assert plan.describe()["attention_tiles"] == plan.attention_tiles
        assert plan.describe()["linear_tiles"] == plan.linear_tiles
        plan = dataclasses.replace(plan, attention_tiles="avx512", linear_tiles="avx512",
                                   attention_kt_rows=0, attention_kt_vprefetch=True,
                                   attention_pv_prefetch=cpu.PV_PREFETCH_KEYS, attention_next_kprefetch=True,
                                   attention_verify_kprefetch=cpu.VERIFY_KPREFETCH_T)
        assert plan.summary().count("(avx512)") == 2
        cpu.set_attention_avx512(False)  # a plan that says avx512 switches them back on
        cpu.set_linear_avx512(False)
        assert cpu.attention_isa() == "avx2" == cpu.linear_isa()
        from sparsespec.kernels.plan import apply_tiles
        assert apply_tiles(plan) == plan and cpu.attention_isa() == "avx512" == cpu.linear_isa()
        kt_plan = dataclasses.replace(plan, attention_tiles="avx512-kt", attention_kt_rows=6)  # and keys in lanes
        assert apply_tiles(kt_plan) == kt_plan and cpu.attention_isa() == "avx512-kt" and cpu.attention_kt_rows() == 6
        assert "(avx512-kt from 6 rows)" in kt_plan.summary() and kt_plan.describe()["attention_kt_rows"] == 6
        assert apply_tiles(plan) == plan and cpu.attention_isa() == "avx512" and cpu.attention_kt_rows() == 0
        monkeypatch.setenv("SPARSESPEC_ATTENTION_KT", "9")  # the user's row count wins over the plan's
        assert apply_tiles(plan) == dataclasses.replace(plan, attention_tiles="avx512-kt", attention_kt_rows=9)
        assert cpu.attention_kt_rows() == 9
        monkeypatch.setenv("SPARSESPEC_ATTENTION_KT", "0")
        assert apply_tiles(kt_plan) == plan and cpu.attention_isa() == "avx512"
        monkeypatch.setenv("SPARSESPEC_ATTENTION_KT", "some")
        with pytest.raises(ValueError, match="SPARSESPEC_ATTENTION_KT='some'"):
            apply_tiles(plan)
        monkeypatch.delenv("SPARSESPEC_ATTENTION_KT")
        monkeypatch.setenv("SPARSESPEC_AVX512", "0")
        plan = choose(model)
        assert plan.attention_tiles == "avx2" == cpu.attention_isa() == plan.linear_tiles == cpu.linear_isa()
        monkeypatch.setenv("SPARSESPEC_KERNELS", "torch")  # PyTorch's ops: no tiles to choose
        plan = choose(model)
        assert plan.attention_tiles == "" == plan.linear_tiles
    finally:
        monkeypatch.delenv("SPARSESPEC_AVX512", raising=False)
        cpu.set_attention_avx512(True)
        cpu.set_attention_kt(True)
        cpu.set_linear_avx512(True)
    try:  # use_kernels with a named or given plan applies its tiles too (not only choose)
        cpu.set_attention_avx512(False)
        cpu.set_linear_avx512(False)
        assert model.use_kernels("ss").kernel_plan.attention_tiles == "avx2" == cpu.attention_isa()  # kept
        given = dataclasses.replace(model.kernel_plan, attention_tiles="avx512", linear_tiles="avx512",
                                   attention_kt_rows=0)
        assert model.use_kernels(given).kernel_plan == given and cpu.attention_isa() == "avx512" == cpu.linear_isa()
    finally:
        cpu.set_attention_avx512(True)
        cpu.set_attention_kt(True)
        cpu.set_linear_avx512(True)
    for name in ("attention_tiles", "linear_tiles"):
        with pytest.raises(ValueError, match=name):
            KernelPlan(attention="ss", **{name: "sse"})
    for tiles, rows in (("avx512", 6), ("avx512-kt", 0), ("avx512-kt", -1)):
        with pytest.raises(ValueError, match="attention_kt_rows"):
            KernelPlan(attention="ss", attention_tiles=tiles, attention_kt_rows=rows)


def test_the_environment_picks_the_prefill_attention(monkeypatch):
    from sparsespec.kernels.plan import apply_tiles

    plan = ours_plan()
    monkeypatch.setenv("SPARSESPEC_PREFILL_ATTENTION", "torch")
    got = apply_tiles(plan)
    assert got.prefill_attention == "torch" and got.source == "env" and "SPARSESPEC_PREFILL_ATTENTION=torch" in got.note
    monkeypatch.setenv("SPARSESPEC_PREFILL_ATTENTION", "flash")
    with pytest.raises(ValueError, match="SPARSESPEC_PREFILL_ATTENTION must be ss or torch"):
        apply_tiles(plan)
    monkeypatch.setenv("SPARSESPEC_PREFILL_ATTENTION", "ss")
    with pytest.raises(ValueError, match="does not run here"):  # PyTorch's plan: not ours
        apply_tiles(KernelPlan())
    if cpu.prefill_attention_supported(16):
        assert apply_tiles(dataclasses.replace(plan, prefill_attention="torch")).prefill_attention == "ss"
    monkeypatch.setattr(cpu, "prefill_attention_supported", lambda head_dim: False)  # e.g. head_dim 24
    with pytest.raises(ValueError, match="does not run here"):
        apply_tiles(plan)
    monkeypatch.delenv("SPARSESPEC_PREFILL_ATTENTION")  # a plan measured with it, read where it cannot run
    got = apply_tiles(dataclasses.replace(plan, prefill_attention="ss"))
    assert got.prefill_attention == "torch" and got.source == plan.source
    assert apply_tiles(KernelPlan(prefill_attention="ss")).prefill_attention == "torch"  # PyTorch's attention


@needs_prefill_kernel
def test_a_prefill_through_our_attention_matches_pytorchs_flash_path(monkeypatch):
    """A chunked prefill (chunks of 512 and 188 queries) with the plan's prefill attention ours
    against the same plan with PyTorch's: the last logits and the importance rows agree, and ours ran."""
    import sparsespec.kernels.cpu as cpu_mod

    model = random_transformer("smollm2-135m", seed=5)
    model.layers = model.layers[:2]
    model.cfg = type(model.cfg)(**{**model.cfg.__dict__, "num_layers": 2})
    ids = torch.randint(0, model.cfg.vocab_size, (2, 700), generator=_gen(6))
    calls = []
    real = cpu_mod.prefill_attention
    monkeypatch.setattr(cpu_mod, "prefill_attention", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    outs = {}
    for kind in ("ss", "torch"):
        model.use_kernels(dataclasses.replace(ours_plan(), prefill_attention=kind))
        cache = KVCache(model.cfg, 2, 720, model.dtype, "cpu")
        outs[kind] = model.prefill(ids, cache, want_rows=16)
    assert [s[2] for s in calls] == [512, 512, 188, 188]  # two layers x two chunks, ours only with "ss"
    torch.testing.assert_close(outs["ss"][0], outs["torch"][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outs["ss"][1], outs["torch"][1], rtol=1e-4, atol=1e-6)


def test_the_keys_in_lanes_rows_are_where_the_trial_measured_them_faster_at_every_wider_width():
    t = {"T1": {"ss": 1.0, "ss-kt": 1.2}, "T3": {"ss": 2.0, "ss-kt": 1.9}, "T5": {"ss": 3.0, "ss-kt": 3.1},
         "T9": {"ss": 5.0, "ss-kt": 4.0}, "T17": {"ss": 9.0, "ss-kt": 7.0}}
    assert kt_rows_from_trial(t, 3) == 27  # T = 3 won, T = 5 lost: from T = 9 on
    t["T5"]["ss-kt"] = 2.9  # 3 % faster: within TIE_MARGIN, a tie, so still from T = 9
    assert kt_rows_from_trial(t, 3) == 27
    t["T5"]["ss-kt"] = 2.8
    assert kt_rows_from_trial(t, 7) == 21  # from T = 3 (5 % faster), 7 rows per KV head each
    t["T17"]["ss-kt"] = 8.7  # 3 % faster at the widest: a tie, never
    assert kt_rows_from_trial(t, 3) == 0
    t["T17"]["ss-kt"] = 9.0
    assert kt_rows_from_trial(t, 3) == 0
    assert kt_rows_from_trial({"T1": {"ss": 1.0, "torch": 2.0}}, 3) == 0  # not timed (no AVX-512)
    late = {s: {**v, "ss-kt-late": v["ss-kt"] * 0.5} for s, v in t.items()}  # the late fetch: faster
    assert kt_variant_from_trial(late) == "ss-kt-late" and kt_rows_from_trial(late, 3, "ss-kt-late") == 3
    late["T17"]["ss-kt-late"] = 100.0  # slower in all
    assert kt_variant_from_trial(late) == "ss-kt" and kt_variant_from_trial(t) == "ss-kt"


def test_the_late_value_fetch_is_a_speed_choice_only_and_follows_the_plan():
    """The keys-in-lanes path with its value rows fetched early or late gives the same bits; a
    plan's choice is applied, summarised and described, and is valid only with those tiles."""
    if not (cpu.set_attention_avx512(True) or "").startswith("avx512"):
        pytest.skip("this CPU's build has no AVX-512 tiles")
    g = _gen(60)
    B, Hkv, G, T, D, S = 2, 3, 3, 9, 64, 700
    q = torch.randn(B, Hkv * G, T, D, generator=g)
    kc, vc = torch.randn(B, Hkv, S + T, D, generator=g), torch.randn(B, Hkv, S + T, D, generator=g)
    starts = torch.tensor([S, S - 99])
    got = []
    try:
        cpu.set_attention_kt(1)
        for early in (True, False):
            assert cpu.set_attention_kt_vprefetch(early) is early and cpu.attention_kt_vprefetch() is early
            rows = torch.zeros(B, Hkv, T, S + T)
            got.append((cpu.attention(q, kc, vc, starts, S, 0.125, rows), rows))
    finally:
        cpu.set_attention_kt(0)
        cpu.set_attention_kt_vprefetch(True)
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    plan = KernelPlan(((None, "ss"),), "ss", True, 2, "user", attention_tiles="avx512-kt", linear_tiles="avx512",
                      attention_kt_rows=9,
                      attention_kt_vprefetch=False)
    try:
        assert apply_tiles(plan) == plan and cpu.attention_kt_vprefetch() is False
        assert "values fetched late" in plan.summary() and plan.describe()["attention_kt_vprefetch"] is False
        early = dataclasses.replace(plan, attention_kt_vprefetch=True)
        assert apply_tiles(early) == early and cpu.attention_kt_vprefetch() is True
    finally:
        cpu.set_attention_kt(0)
        cpu.set_attention_kt_vprefetch(True)
    other = KernelPlan(attention="ss", attention_tiles="avx512", attention_kt_vprefetch=False)  # meaningless there
    assert "late" not in other.summary() and other.describe()["attention_kt_vprefetch"] is None


@pytest.mark.parametrize("D", [64, 128])
def test_the_pv_value_fetch_is_a_speed_choice_only(D):
    """The dense attention's P.V with value rows fetched 0, 1, 16 or 256 keys ahead gives the same
    bits (outputs and importance rows) for a decode, a verify on the row-lanes tiles and one on the
    keys-in-lanes tiles; the setter clamps to [0, CHUNK]."""
    if not (cpu.set_attention_avx512(True) or "").startswith("avx512"):
        pytest.skip("this CPU's build has no AVX-512 tiles")
    g = _gen(61 + D)
    B, Hkv, G, S = 2, 2, 3, 600
    kc, vc = torch.randn(B, Hkv, S + 9, D, generator=g), torch.randn(B, Hkv, S + 9, D, generator=g)
    starts = torch.tensor([S, S - 77])
    try:
        for T, kt in ((1, 0), (3, 0), (9, 1)):
            q = torch.randn(B, Hkv * G, T, D, generator=g)
            got = []
            cpu.set_attention_kt(kt)
            for ahead in (0, 1, 16, 256):
                assert cpu.set_attention_pv_prefetch(ahead) == ahead == cpu.attention_pv_prefetch()
                rows = torch.zeros(B, Hkv, T, S + T) if T > 1 else None
                got.append((cpu.attention(q, kc, vc, starts, S, D ** -0.5, rows), rows))
            ref, _ = verify_attention_ref(q, kc, vc, starts, 0, D ** -0.5)  # [B, H, T, D]
            ref = ref.transpose(1, 2).reshape(B, T, -1)
            torch.testing.assert_close(got[0][0], ref, rtol=1e-4, atol=1e-5)  # and right, not only equal
            for out, rows in got[1:]:
                assert torch.equal(out, got[0][0]) and (rows is None or torch.equal(rows, got[0][1]))
        assert cpu.set_attention_pv_prefetch(-3) == 0 and cpu.set_attention_pv_prefetch(10**6) == cpu.CHUNK
    finally:
        cpu.set_attention_kt(0)
        cpu.set_attention_pv_prefetch(cpu.PV_PREFETCH_KEYS)


def test_the_attention_trial_times_the_fetches_on_and_off_in_their_own_trial(monkeypatch):
    if not (cpu.set_attention_avx512(True) or "").startswith("avx512"):
        pytest.skip("this CPU's build has no AVX-512 tiles")
    from sparsespec.kernels.plan import _attention_trial

    seen, real = set(), cpu.attention

    def spy(q, *args, **kwargs):  # the fetch settings each timed call ran with, by batch and width
        seen.add((q.shape[0], q.shape[2], cpu.attention_pv_prefetch(), cpu.attention_decode_kprefetch(),
                  cpu.attention_next_kprefetch(), cpu.attention_verify_kprefetch()))
        return real(q, *args, **kwargs)

    monkeypatch.setattr(cpu, "attention", spy)
    att = _attention_trial(random_transformer("tiny"), reps=1, context=64)
    widths = {s: v for s, v in att.items() if s != FETCH_TRIAL_KEY}
    assert sorted(widths) == ["T1", "T17", "T3", "T5", "T9"] and all("ss" in v for v in widths.values())
    fetch = att[FETCH_TRIAL_KEY]  # on and off in their own trial, one off at a time
    assert set(fetch) == {"ss", "ss-dk-off", "ss-nk-off", "ss-pv-off", "T3:ss", "T3:ss-pv-off", "T3:ss-nk-off",
                          "ss-dk-off/ss", "ss-nk-off/ss", "ss-pv-off/ss", "T3:ss-pv-off/ss", "T3:ss-nk-off/ss"}
    assert not any(name.startswith(("ss-dk", "ss-nk", "ss-pv")) for v in widths.values() for name in v)
    on = (cpu.PV_PREFETCH_KEYS, cpu.DECODE_KPREFETCH_KEYS, True, cpu.VERIFY_KPREFETCH_T)
    offs = {(B, T, *f) for B, T, *f in seen if tuple(f) != on}
    # at batch 4 (at batch 1, where the caches are a quarter, the decisions flipped from run to run):
    # the decode without each fetch, the k = 2 verify without the value fetch and without its next keys
    assert offs == {(4, 1, 0, *on[1:]), (4, 1, on[0], 0, *on[2:]), (4, 1, *on[:2], False, on[3]),
                    (4, 3, 0, *on[1:]), (4, 3, *on[:3], 0)}
    assert {(B, T) for B, T, *f in seen if B == 4} == {(4, 1), (4, 3)}
    assert (cpu.attention_pv_prefetch(), cpu.attention_decode_kprefetch(), cpu.attention_next_kprefetch(),
            cpu.attention_verify_kprefetch()) == on


def test_the_far_key_fetch_of_a_one_token_forward_is_a_speed_choice_only():
    """Decode (dense, T = 1) and the sparse draft with keys fetched 0, 1, 32 or 256 positions ahead
    into L2 give the same bits, on either tiles; the setter clamps to [0, CHUNK]."""
    g = _gen(71)
    B, Hkv, G, D, S, N, E = 3, 2, 3, 64, 900, 300, 3
    kc, vc = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    starts = torch.tensor([S - 1, 400, 37])
    idx = torch.sort(torch.randint(0, S, (B, Hkv, N), generator=g, dtype=torch.int32), dim=-1).values
    nv = torch.tensor([N, 17, 260])
    kt, vt = torch.randn(B, Hkv, E, D, generator=g), torch.randn(B, Hkv, E, D, generator=g)
    q = torch.randn(B, Hkv * G, 1, D, generator=g)
    tiles = [True, False] if (cpu.set_attention_avx512(True) or "").startswith("avx512") else [False]
    try:
        for on in tiles:
            cpu.set_attention_avx512(on)
            got = []
            for ahead in (0, 1, 32, 256):
                assert cpu.set_attention_decode_kprefetch(ahead) == ahead == cpu.attention_decode_kprefetch()
                got.append((cpu.attention(q, kc, vc, starts, S - 1, 0.125),
                            cpu.sparse_attention(q, kc, vc, idx, nv, kt, vt, 0.3)))
            ref, _ = verify_attention_ref(q, kc, vc, starts, 0, 0.125)
            torch.testing.assert_close(got[0][0], ref.transpose(1, 2).reshape(B, 1, -1), rtol=1e-5, atol=1e-5)
            for dense, sparse in got[1:]:
                assert torch.equal(dense, got[0][0]) and torch.equal(sparse, got[0][1])
        assert cpu.set_attention_decode_kprefetch(-3) == 0 and cpu.set_attention_decode_kprefetch(10**6) == cpu.CHUNK
    finally:
        cpu.set_attention_avx512(True)
        cpu.set_attention_decode_kprefetch(cpu.DECODE_KPREFETCH_KEYS)


def _assert_plan_then_env_apply(monkeypatch, field, current, on, env, user, bads, match):
    """A plan's integer kernel switch ``field`` is applied at 0 and at ``on`` (``current()`` reads the
    library's setting), the environment variable ``env`` at ``user`` wins over the plan (the user's
    setting), and each of ``bads`` there is a ValueError matching ``match``."""
    plan = KernelPlan(((None, "ss"),), "ss", True, 2, "user", attention_tiles=cpu.attention_isa() or "avx2",
                      attention_kt_rows=cpu.attention_kt_rows(), **{field: 0})
    assert getattr(apply_tiles(plan), field) == 0 == current()
    back = dataclasses.replace(plan, **{field: on})
    assert getattr(apply_tiles(back), field) == on == current()
    monkeypatch.setenv(env, str(user))
    assert getattr(apply_tiles(plan), field) == user == current()
    for bad in bads:
        monkeypatch.setenv(env, bad)
        with pytest.raises(ValueError, match=match):
            apply_tiles(plan)


def test_the_far_key_fetch_follows_the_trial_the_plan_and_the_environment(monkeypatch):
    # the median ratio decides, not the median seconds (a drift between rounds cancels in the ratios)
    assert decode_kprefetch_from_trial({FETCH_TRIAL_KEY: {"ss": 1.0, "ss-dk-off": 0.9, "ss-dk-off/ss": 1.01}}) \
        == cpu.DECODE_KPREFETCH_KEYS
    assert decode_kprefetch_from_trial({FETCH_TRIAL_KEY: {"ss": 1.0, "ss-dk-off": 1.1, "ss-dk-off/ss": 0.99},
                                        "T9": {"ss": 1.0}}) == 0
    assert decode_kprefetch_from_trial({"T1": {"ss": 1.0, "ss-dk-off": 0.5}}) == cpu.DECODE_KPREFETCH_KEYS
    for bad in (-1, cpu.CHUNK + 1, True):
        with pytest.raises(ValueError, match="attention_decode_kprefetch"):
            KernelPlan(attention="ss", attention_decode_kprefetch=bad)
    off = KernelPlan(attention="ss", attention_tiles="avx2", attention_decode_kprefetch=0)
    assert "decode fetches no keys far ahead" in off.summary() and off.describe()["attention_decode_kprefetch"] == 0
    on = dataclasses.replace(off, attention_decode_kprefetch=cpu.DECODE_KPREFETCH_KEYS)
    assert "far ahead" not in on.summary() and on.describe()["attention_decode_kprefetch"] == cpu.DECODE_KPREFETCH_KEYS
    assert KernelPlan(attention="torch", attention_decode_kprefetch=0).describe()["attention_decode_kprefetch"] is None
    try:
        _assert_plan_then_env_apply(monkeypatch, "attention_decode_kprefetch", cpu.attention_decode_kprefetch,
                                    cpu.DECODE_KPREFETCH_KEYS, "SPARSESPEC_ATTENTION_DECODE_KPREFETCH", 64,
                                    ("-1", "far", str(cpu.CHUNK + 1)), "SPARSESPEC_ATTENTION_DECODE_KPREFETCH")
    finally:
        cpu.set_attention_decode_kprefetch(cpu.DECODE_KPREFETCH_KEYS)


def test_the_decode_fetch_of_the_next_chunks_keys_is_a_speed_choice_only():
    """Decode (dense, T = 1: the fetch runs; the chunk after the last of a row is the next row's
    or head's first, of any length), a verify in the row-pair tiles (T = 3: it runs up to the
    verify width set, ``set_attention_verify_kprefetch``; T = 5: it does not) and in the
    keys-in-lanes tiles (T = 3 with them from 1 row: it runs) give the same bits with the next
    chunk's keys fetched during P.V or not, on either tiles, right against the reference."""
    g = _gen(73)
    B, Hkv, G, D, S = 3, 2, 3, 64, 1100  # several chunks per row; rows of 1100, 300 and 37 keys
    kc, vc = torch.randn(B, Hkv, S + 5, D, generator=g), torch.randn(B, Hkv, S + 5, D, generator=g)
    starts = torch.tensor([S, 300, 37])
    tiles = [True, False] if (cpu.set_attention_avx512(True) or "").startswith("avx512") else [False]
    try:
        for on in tiles:
            cpu.set_attention_avx512(on)
            for T, kt, vt in ((1, 0, 0), (3, 0, 3), (3, 0, 0), (5, 0, 5), (5, 0, 3), (3, 1, 0)):
                cpu.set_attention_kt(kt)
                assert cpu.set_attention_verify_kprefetch(vt) == vt == cpu.attention_verify_kprefetch()
                q = torch.randn(B, Hkv * G, T, D, generator=g)
                got = []
                for fetch in (False, True):
                    assert cpu.set_attention_next_kprefetch(fetch) is fetch is cpu.attention_next_kprefetch()
                    rows = torch.zeros(B, Hkv, T, S + T) if T > 1 else None
                    got.append((cpu.attention(q, kc, vc, starts, S, 0.125, rows), rows))
                ref, _ = verify_attention_ref(q, kc, vc, starts, 0, 0.125)
                torch.testing.assert_close(got[0][0], ref.transpose(1, 2).reshape(B, T, -1), rtol=1e-5, atol=1e-5)
                assert torch.equal(got[1][0], got[0][0]) and (T == 1 or torch.equal(got[1][1], got[0][1]))
    finally:
        cpu.set_attention_avx512(True)
        cpu.set_attention_kt(0)
        cpu.set_attention_next_kprefetch(True)
        cpu.set_attention_verify_kprefetch(cpu.VERIFY_KPREFETCH_T)


def test_the_fetch_trial_decides_by_the_median_of_paired_ratios(monkeypatch):
    """Each variant's ratio to its width's ``ss`` is the median of its per-round ratios (a slow
    round hits both of its pair), not the ratio of the medians; every variant runs in every round."""
    from sparsespec.kernels import plan as plan_mod

    rounds = {"ss": [1.0, 2.0, 4.0], "ss-dk-off": [1.1, 1.0, 4.4], "ss-nk-off": [0.9, 2.2, 3.6],
              "ss-pv-off": [1.05, 2.1, 3.0], "T3:ss": [3.0, 6.0, 9.0], "T3:ss-pv-off": [2.7, 6.6, 8.1],
              "T3:ss-nk-off": [3.3, 5.4, 9.9]}
    seen = []

    def fake(fns, reps):
        seen.append((sorted(fns), reps))
        return {name: rounds[name] for name in fns}

    monkeypatch.setattr(plan_mod, "_interleaved", fake)
    out = plan_mod._fetch_trial(random_transformer("tiny"), 32, True)
    assert seen == [(sorted(rounds), FETCH_TRIAL_REPS)]
    assert out["ss-dk-off/ss"] == pytest.approx(1.1) and out["ss-dk-off"] == 1.1  # medians: 1.1 / 2.0 = 0.55
    assert out["ss-nk-off/ss"] == pytest.approx(0.9) and out["ss"] == 2.0
    assert out["ss-pv-off/ss"] == pytest.approx(1.05) and out["T3:ss-pv-off/ss"] == pytest.approx(0.9)  # own ss
    assert decode_kprefetch_from_trial({FETCH_TRIAL_KEY: out}) == cpu.DECODE_KPREFETCH_KEYS
    assert next_kprefetch_from_trial({FETCH_TRIAL_KEY: out}) is False
    assert pv_prefetch_from_trial({FETCH_TRIAL_KEY: out}) == 0  # 1.05 x 0.9 < 1
    assert out["T3:ss-nk-off/ss"] == pytest.approx(1.1)  # the verify's own switch, against its own ss
    assert verify_kprefetch_from_trial({FETCH_TRIAL_KEY: out}) == cpu.VERIFY_KPREFETCH_T
    seen.clear()
    out = plan_mod._fetch_trial(random_transformer("tiny"), 32, False)
    assert seen[0][0] == ["ss", "ss-dk-off"]  # without the AVX-512 tiles: neither P.V fetch to time
    assert pv_prefetch_from_trial({FETCH_TRIAL_KEY: out}) == cpu.PV_PREFETCH_KEYS


def test_the_next_key_fetch_follows_the_trial_the_plan_and_the_environment(monkeypatch):
    assert next_kprefetch_from_trial({FETCH_TRIAL_KEY: {"ss": 1.0, "ss-nk-off": 0.9, "ss-nk-off/ss": 1.01}}) is True
    assert next_kprefetch_from_trial({FETCH_TRIAL_KEY: {"ss": 1.0, "ss-nk-off": 1.1, "ss-nk-off/ss": 0.99},
                                      "T9": {"ss": 1.0}}) is False
    assert next_kprefetch_from_trial({"T1": {"ss": 1.0, "ss-nk-off": 0.5}}) is True  # the fetch trial's only
    assert next_kprefetch_from_trial({FETCH_TRIAL_KEY: {"ss": 1.0, "ss-dk-off/ss": 0.5}}) is True  # not timed
    for bad in (0, 1, "yes", None):
        with pytest.raises(ValueError, match="attention_next_kprefetch"):
            KernelPlan(attention="ss", attention_tiles="avx512", attention_next_kprefetch=bad)
    off = KernelPlan(attention="ss", attention_tiles="avx512", attention_next_kprefetch=False)
    assert "decode fetches no next keys" in off.summary() and off.describe()["attention_next_kprefetch"] is False
    on = dataclasses.replace(off, attention_next_kprefetch=True)
    assert "next keys" not in on.summary() and on.describe()["attention_next_kprefetch"] is True
    for other in (KernelPlan(attention="ss", attention_tiles="avx2", attention_next_kprefetch=False),
                  KernelPlan(attention="torch", attention_next_kprefetch=False)):  # no AVX-512 P.V: moot
        assert other.describe()["attention_next_kprefetch"] is None and "next keys" not in other.summary()
    if not (cpu.set_attention_avx512(True) or "").startswith("avx512"):
        return
    plan = KernelPlan(((None, "ss"),), "ss", True, 2, "user", attention_tiles=cpu.attention_isa(),
                      attention_kt_rows=cpu.attention_kt_rows(), attention_next_kprefetch=False)
    try:
        assert apply_tiles(plan).attention_next_kprefetch is False is cpu.attention_next_kprefetch()
        back = dataclasses.replace(plan, attention_next_kprefetch=True)
        assert apply_tiles(back).attention_next_kprefetch is True is cpu.attention_next_kprefetch()
        monkeypatch.setenv("SPARSESPEC_ATTENTION_NEXT_KPREFETCH", "0")  # the user's setting wins
        assert apply_tiles(back).attention_next_kprefetch is False is cpu.attention_next_kprefetch()
        monkeypatch.setenv("SPARSESPEC_ATTENTION_NEXT_KPREFETCH", "1")
        assert apply_tiles(plan).attention_next_kprefetch is True is cpu.attention_next_kprefetch()
        for bad in ("2", "on", "-1"):
            monkeypatch.setenv("SPARSESPEC_ATTENTION_NEXT_KPREFETCH", bad)
            with pytest.raises(ValueError, match="SPARSESPEC_ATTENTION_NEXT_KPREFETCH"):
                apply_tiles(plan)
    finally:
        cpu.set_attention_next_kprefetch(True)


def test_the_verify_next_key_fetch_follows_the_trial_the_plan_and_the_environment(monkeypatch):
    assert verify_kprefetch_from_trial({FETCH_TRIAL_KEY: {"T3:ss-nk-off/ss": 1.02}}) == cpu.VERIFY_KPREFETCH_T
    assert verify_kprefetch_from_trial({FETCH_TRIAL_KEY: {"T3:ss-nk-off/ss": 0.98, "ss-nk-off/ss": 1.2}}) == 0
    assert verify_kprefetch_from_trial({FETCH_TRIAL_KEY: {"ss-nk-off/ss": 0.5}}) == cpu.VERIFY_KPREFETCH_T  # not timed
    for bad in (-1, cpu.CHUNK + 1, True, 2.0, None):
        with pytest.raises(ValueError, match="attention_verify_kprefetch"):
            KernelPlan(attention="ss", attention_tiles="avx512", attention_verify_kprefetch=bad)
    off = KernelPlan(attention="ss", attention_tiles="avx512", attention_verify_kprefetch=0)
    assert "verify fetches no next keys" in off.summary() and off.describe()["attention_verify_kprefetch"] == 0
    assert "next keys" not in dataclasses.replace(off, attention_verify_kprefetch=3).summary()
    assert "verify fetches" not in dataclasses.replace(off, attention_next_kprefetch=False).summary()  # all off
    assert KernelPlan(attention="torch").describe()["attention_verify_kprefetch"] is None  # moot
    if not (cpu.set_attention_avx512(True) or "").startswith("avx512"):
        return
    try:
        _assert_plan_then_env_apply(monkeypatch, "attention_verify_kprefetch", cpu.attention_verify_kprefetch, 3,
                                    "SPARSESPEC_ATTENTION_VERIFY_KPREFETCH", 9, ("-1", "x", str(cpu.CHUNK + 1)),
                                    "SPARSESPEC_ATTENTION_VERIFY_KPREFETCH=.*widest verify")
    finally:
        cpu.set_attention_verify_kprefetch(cpu.VERIFY_KPREFETCH_T)


def test_the_pv_value_fetch_follows_the_trial_the_plan_and_the_environment(monkeypatch):
    t = {FETCH_TRIAL_KEY: {"ss": 1.0, "ss-pv-off": 1.03, "ss-pv-off/ss": 1.03, "T3:ss": 5.0,
                           "T3:ss-pv-off": 4.9, "T3:ss-pv-off/ss": 0.98}}
    assert pv_prefetch_from_trial(t) == cpu.PV_PREFETCH_KEYS  # ratios 1.03 x 0.98 > 1 (the sums: off wins)
    t[FETCH_TRIAL_KEY]["ss-pv-off/ss"] = 1.01
    assert pv_prefetch_from_trial(t) == 0  # 1.01 x 0.98 < 1: off won
    assert pv_prefetch_from_trial({"T1": {"ss": 1.0, "ss-pv-off": 0.5}}) == cpu.PV_PREFETCH_KEYS  # not timed
    for bad in (-1, cpu.CHUNK + 1, 1.5):
        with pytest.raises(ValueError, match="attention_pv_prefetch"):
            KernelPlan(attention="ss", attention_tiles="avx512", attention_pv_prefetch=bad)
    off = KernelPlan(attention="ss", attention_tiles="avx512", attention_pv_prefetch=0)
    assert "P.V fetches nothing ahead" in off.summary() and off.describe()["attention_pv_prefetch"] == 0
    on = dataclasses.replace(off, attention_pv_prefetch=cpu.PV_PREFETCH_KEYS)
    assert "P.V" not in on.summary() and on.describe()["attention_pv_prefetch"] == cpu.PV_PREFETCH_KEYS
    assert KernelPlan(attention="torch", attention_pv_prefetch=0).describe()["attention_pv_prefetch"] is None
    if not (cpu.set_attention_avx512(True) or "").startswith("avx512"):
        return
    plan = KernelPlan(((None, "ss"),), "ss", True, 2, "user", attention_tiles="avx512", linear_tiles="avx512",
                      attention_pv_prefetch=0)
    try:
        assert apply_tiles(plan) == plan and cpu.attention_pv_prefetch() == 0
        assert apply_tiles(on) == on and cpu.attention_pv_prefetch() == cpu.PV_PREFETCH_KEYS
        monkeypatch.setenv("SPARSESPEC_ATTENTION_PV_PREFETCH", "32")  # the user's setting wins
        assert apply_tiles(plan).attention_pv_prefetch == 32 == cpu.attention_pv_prefetch()
        for bad in ("-1", "many", str(cpu.CHUNK + 1)):
            monkeypatch.setenv("SPARSESPEC_ATTENTION_PV_PREFETCH", bad)
            with pytest.raises(ValueError, match="SPARSESPEC_ATTENTION_PV_PREFETCH"):
                apply_tiles(plan)
    finally:
        cpu.set_attention_pv_prefetch(cpu.PV_PREFETCH_KEYS)


def test_a_library_keeps_a_range_only_where_whole_forwards_are_faster_at_every_width():
    from sparsespec.kernels.plan import _confirm_in_forward

    model = random_transformer("tiny")
    before = model.kernel_plan
    widths_run, plans_run, forwards = [], [], []
    real_forward = model.forward_dense_features

    def forward(ids, *a, **kw):  # the rows each forward runs, and the backend they get
        forwards.append((ids.numel(), model.kernel_plan.linear_backend(ids.numel())))
        return real_forward(ids, *a, **kw)

    model.forward_dense_features = forward
    # fake timings per width (library, ours): faster at both widths of 9-16; at 17-32 only at 24;
    # 65-128 within the margin at 96; the prefill range is never confirmed
    fake = {12: (0.5, 1.0), 16: (0.5, 1.0), 24: (0.5, 1.0), 32: (1.0, 0.5), 96: (0.98, 1.0), 128: (0.5, 1.0)}

    def timer(fns, reps):
        for f in fns.values():
            f()  # the real forward runs (shapes, the plan it sets)
            plans_run.append(model.kernel_plan)
        width = fake_order.pop(0)
        widths_run.append(width)
        lib, ours = fake[width]
        return {"ss": ours, **{k: lib for k in fns if k != "ss"}}

    fake_order = [12, 16, 24, 32, 96, 128]
    choice = [(1, "ss"), (8, "ss"), (16, "mkl"), (32, "onednn"), (64, "ss"), (128, "mkl"), (None, "onednn")]
    out, timings = _confirm_in_forward(model, choice, 1, 2, timer=timer)
    assert out == [(1, "ss"), (8, "ss"), (16, "mkl"), (32, "ss"), (64, "ss"), (128, "ss"), (None, "onednn")]
    assert widths_run == [12, 16, 24, 32, 96, 128] and set(timings) == {str(w) for w in widths_run}
    # each timed pair ran ours for the range under test and the library's plan otherwise
    assert plans_run[0].linear_backend(12) == "ss" and plans_run[1].linear_backend(12) == "mkl"
    assert all(p.linear_backend(200) == "onednn" for p in plans_run)
    assert model.kernel_plan is before  # the model's plan is restored
    # every forward runs exactly its width, ours first, then the library the range was given
    libs = {12: "mkl", 16: "mkl", 24: "onednn", 32: "onednn", 96: "mkl", 128: "mkl"}
    assert forwards == [f for w in widths_run for f in ((w, "ss"), (w, libs[w]))]


def test_the_forward_trial_runs_exactly_its_width():
    from sparsespec.kernels.plan import FORWARD_TRIAL_K, forward_trial_tokens

    for width in (1, 4, 8, 12, 16, 24, 32, 36, 64, 96, 128, 7, 11):
        t = forward_trial_tokens(width)
        assert width % t == 0 and 1 <= t <= FORWARD_TRIAL_K + 1
    assert forward_trial_tokens(36) == 9 and forward_trial_tokens(64) == 8 and forward_trial_tokens(7) == 7


def test_a_range_goes_to_the_backend_whose_worst_width_is_fastest():
    # MKL fastest at 32 but slow at 24; oneDNN never the fastest yet never far: oneDNN's worst wins
    lin = {24: {"ss": 1.10, "onednn": 1.05, "mkl": 1.50}, 32: {"ss": 1.30, "onednn": 1.05, "mkl": 1.00}}
    worst = range_worst(lin, (24, 32))
    assert worst == pytest.approx({"ss": 1.30, "onednn": 1.05, "mkl": 1.50 / 1.05})


# ------------------------------------------------------------------ the model
def _fill(cache, P, g):
    cache.k[:, :, :, :P].normal_(generator=g)
    cache.v[:, :, :, :P].normal_(generator=g)


@pytest.mark.parametrize("shape", ["tiny", "smollm2-135m"])
def test_model_with_our_kernels_matches_the_eager_model(shape):
    cfg_layers = 2 if shape != "tiny" else None
    model = random_transformer(shape, seed=3)
    if cfg_layers:  # two layers of the real shape: the real head dims, vocabulary and widths
        model.layers = model.layers[:cfg_layers]
        model.cfg = type(model.cfg)(**{**model.cfg.__dict__, "num_layers": cfg_layers})
    g = _gen(4)
    B, P, T = 2, 300, 5
    ids = torch.randint(0, model.cfg.vocab_size, (B, T), generator=g)
    outs = {}
    for kind in ("torch", "ss"):
        model.use_kernels(kind)
        cache = KVCache(model.cfg, B, P + T, model.dtype, "cpu")
        _fill(cache, P, _gen(9))
        cache.lengths = [P, P - 40]
        outs[kind] = model.forward_dense(ids, cache, want_rows=T)
    torch.testing.assert_close(outs["ss"][0], outs["torch"][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outs["ss"][1], outs["torch"][1], rtol=1e-4, atol=1e-5)


def test_verify_logits_equal_the_ar_steps_bit_for_bit():
    """With our kernels (one backend for every decode width), the k + 1 queries of a verify give
    exactly the logits that k + 1 AR steps give, row by row, whatever else is in the batch."""
    model = random_transformer("tiny", seed=1).use_kernels(KernelPlan(((None, "ss"),), "ss", True))
    assert model.kernel_plan.batch_invariant
    g = _gen(7)
    B, P, T = 3, 200, 4
    ids = torch.randint(0, model.cfg.vocab_size, (B, T), generator=g)
    cache = KVCache(model.cfg, B, P + T, model.dtype, "cpu")
    _fill(cache, P, _gen(8))
    cache.lengths = [P, P - 7, P - 100]
    verify, _ = model.forward_dense(ids, cache)  # [B, T, V]
    for b in range(B):
        row = KVCache._wrap(cache.k[:, b : b + 1].clone(), cache.v[:, b : b + 1].clone(), [cache.lengths[b] - T])
        for t in range(T):
            step, _ = model.forward_dense(ids[b : b + 1, t : t + 1], row)
            assert torch.equal(step[0, 0], verify[b, t]), (b, t)


def test_one_call_layers_equal_the_per_op_path_bit_for_bit(monkeypatch):
    """``cpu.forward_layers`` (every layer in one call) runs the same kernels as the per-op layer
    loop: the same logits and importance rows for a verify into a ring target, and the same draft
    logits through the index, bit for bit."""
    from sparsespec.kv.index import ImportanceWindow
    from sparsespec.model import DraftKV, Transformer

    model = random_transformer("tiny", seed=2).use_kernels(KernelPlan(((None, "ss"),), "ss", True))
    cfg = model.cfg
    g = _gen(11)
    B, P, T = 2, 150, 4
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    results = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(Transformer, "_fused_layers", lambda self, *a: None)
        assert (model._fused_layers(B * T, None) is not None) == fused
        cache = KVCache(cfg, B, P + T + 1, model.dtype, "cpu")
        _fill(cache, P, _gen(12))
        cache.lengths = [P, P - 9]
        win = ImportanceWindow(cfg.num_layers, B, cfg.num_kv_heads, 4, P + T + 1, "cpu", spare=T)
        logits, _, _ = model.forward_dense_features(ids, cache, rows_into=win.target(B, T))
        # a draft step over an index of the cache (gather in the kernel) with a 2-slot tail
        N = 40
        index = torch.randint(0, P - 9, (cfg.num_layers, B, cfg.num_kv_heads, N), generator=_gen(13), dtype=torch.int32)
        tail = torch.zeros(cfg.num_layers, B, cfg.num_kv_heads, 3, cfg.head_dim)
        dkv = DraftKV(tail.clone(), tail.clone(), N + 1, N, torch.tensor([N, 25], dtype=torch.int32), index, cache)
        dkv.k[:, :, :, 0].normal_(generator=_gen(14))
        dkv.v[:, :, :, 0].normal_(generator=_gen(15))
        draft = model.forward_draft(ids[:, :1], torch.tensor([P + T, P + T - 9]), dkv)
        # hidden-state features (what EAGLE-3 reads), layers out of order and repeated, T = 1 and T
        hl = (cfg.num_layers - 1, 0, 0)
        feats = []
        for width in (1, T):
            c2 = KVCache(cfg, B, P + T + 1, model.dtype, "cpu")
            _fill(c2, P, _gen(16))
            c2.lengths = [P, P - 5]
            lg, _, f = model.forward_dense_features(ids[:, :width], c2, hl)
            assert f.shape == (B, width, 3 * cfg.hidden_size)
            feats += [lg, f]
        results[fused] = (logits, win.rows.clone(), cache.k.clone(), draft, dkv.k.clone(), *feats)
    for a, b in zip(results[True], results[False]):
        assert torch.equal(a, b)
    E = cfg.hidden_size
    assert torch.equal(results[True][-1][..., E : 2 * E], results[True][-1][..., 2 * E :])  # the repeated layer
    assert not torch.equal(results[True][-1][..., :E], results[True][-1][..., E : 2 * E])

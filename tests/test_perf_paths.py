"""Issue 15's fast paths against independent oracles: the tail-only causal mask and the in-place
importance rows, the running-sum importance window, oneDNN prepacked linears, the verify cost
model and the cost-aware controller's decision."""
from __future__ import annotations

import math

import numpy as np

import pytest
import torch
import torch.nn.functional as F

from sparsespec.adaptive import (CostAwareController, RowAcceptance, VerifyCostModel, _nnls,
                                 expected_tokens_geometric)
from sparsespec.engine import resolve_method_options
from sparsespec.kernels.reference import grouped_attention, tail_mask, verify_mask
from sparsespec.kv.index import ImportanceWindow
from sparsespec.quant import PACKED_ATTR, PANELS_ATTR, linear, prepack_, prepack_available


# ------------------------------------------------------------------ attention
@pytest.mark.skipif(not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"),
                    reason="this torch has no fused CPU flash attention op")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("B,H,Hkv,T,start", [(2, 9, 3, 33, 0), (2, 9, 3, 70, 131), (1, 14, 2, 40, 1),
                                             (3, 4, 4, 36, 64)])
def test_prefill_chunk_attention_equals_a_float64_causal_softmax(B, H, Hkv, T, start, dtype, tol):
    """The prefill chunk's split attention (prefix with grouped query rows + causal own block,
    merged by log-sum-exp) against a plain float64 softmax over the causal mask, reading keys from
    a strided cache slice as the model does."""
    from sparsespec.model import chunk_attention_cpu

    g = torch.Generator().manual_seed(B * 1000 + T + start)
    D, S = 16, start + T
    q = torch.randn(B, T, H, D, generator=g).to(dtype).transpose(1, 2)  # [B, H, T, D], strided
    kc = torch.randn(B, Hkv, S + 20, D, generator=g).to(dtype)  # the cache past S holds junk
    vc = torch.randn(B, Hkv, S + 20, D, generator=g).to(dtype)
    out = chunk_attention_cpu(q, kc[:, :, :S], vc[:, :, :S], start, 0.3)
    assert out.shape == (B, H, T, D) and out.dtype == dtype
    k64 = kc[:, :, :S].double().repeat_interleave(H // Hkv, dim=1)
    v64 = vc[:, :, :S].double().repeat_interleave(H // Hkv, dim=1)
    scores = 0.3 * q.double() @ k64.transpose(-1, -2)  # [B, H, T, S]
    visible = torch.arange(S)[None, :] <= torch.arange(start, S)[:, None]  # [T, S]
    ref = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v64
    assert (out.double() - ref).abs().max().item() < tol


@pytest.mark.parametrize("starts", [[40, 40], [0, 0], [40, 7]])
def test_a_prefill_chunk_over_rows_equals_each_row_alone(tmp_path, starts):
    """A T > 32 forward (the prefill chunk path) over a batch, uniform or ragged, gives each row
    what that row gets alone (and a T = 1 decode after it agrees too): the split chunk attention
    must only run where every row starts at the same position."""
    from sparsespec.kv.cache import KVCache
    from sparsespec.model import Transformer
    from tests.helpers import write_tiny_llama

    model = Transformer.from_folder(write_tiny_llama(tmp_path / "m", vocab_size=300, heads=6, kv_heads=2))
    g = torch.Generator().manual_seed(sum(starts) + 1)
    T, B = 48, len(starts)
    prefix = [torch.randint(3, 300, (1, s), generator=g) for s in starts]
    new = torch.randint(3, 300, (B, T), generator=g)

    def fill(cache, ids):
        if ids.shape[1]:
            model.forward_dense(ids, cache)

    batch = KVCache(model.cfg, B, max(starts) + T + 1, torch.float32, "cpu")
    for b in range(B):  # each row's prefix, then the batch's chunk at its own offset
        one = KVCache(model.cfg, 1, max(starts) + T + 1, torch.float32, "cpu")
        fill(one, prefix[b])
        batch.k[:, b : b + 1, :, : starts[b]] = one.k[:, :, :, : starts[b]]
        batch.v[:, b : b + 1, :, : starts[b]] = one.v[:, :, :, : starts[b]]
    batch.lengths = list(starts)
    got, _ = model.forward_dense(new, batch)  # [B, T, V]
    for b in range(B):
        one = KVCache(model.cfg, 1, max(starts) + T + 1, torch.float32, "cpu")
        fill(one, prefix[b])
        want, _ = model.forward_dense(new[b : b + 1], one)
        assert (got[b] - want[0]).abs().max().item() < 1e-4


@pytest.mark.parametrize("starts", [[37, 37, 37], [37, 20, 45], [0, 5, 3]])
@pytest.mark.parametrize("T", [1, 5])
def test_tail_mask_attention_equals_the_dense_mask_and_a_plain_softmax(starts, T):
    g = torch.Generator().manual_seed(len(starts) * 7 + T)
    B, H, Hkv, D = len(starts), 6, 2, 16
    S = max(starts) + T
    q = torch.randn(B, H, T, D, generator=g)
    k = torch.randn(B, Hkv, S, D, generator=g)
    v = torch.randn(B, Hkv, S, D, generator=g)
    st = torch.tensor(starts)
    m0 = min(starts)
    rows_buf = torch.full((B, Hkv, T, S), 7.0)
    out, rows = grouped_attention(q, k, v, tail_mask(st, T, S, m0), T, 0.25, mask_from=m0, rows_out=rows_buf)
    assert rows.data_ptr() == rows_buf.data_ptr()  # written in place
    # oracle: per row, per head, a plain masked softmax with repeated KV heads
    G = H // Hkv
    for b in range(B):
        for h in range(H):
            sc = (q[b, h] @ k[b, h // G].T) * 0.25  # [T, S]
            vis = torch.arange(S)[None, :] <= (starts[b] + torch.arange(T))[:, None]
            p = torch.softmax(sc.masked_fill(~vis, float("-inf")), dim=-1)
            torch.testing.assert_close(out[b, h], p @ v[b, h // G], rtol=1e-5, atol=1e-5)
    dense_out, dense_rows = grouped_attention(q, k, v, verify_mask(st, T, S), T, 0.25)
    torch.testing.assert_close(out, dense_out)
    torch.testing.assert_close(rows, dense_rows)
    # rows: probabilities summed over the G heads of each KV head, zero past each query
    assert torch.allclose(rows.sum(-1), torch.full((B, Hkv, T), float(G)), atol=1e-5)
    for b in range(B):
        assert float(rows[b, :, :, starts[b] + T :].abs().sum()) == 0.0


# ------------------------------------------------------------------ running-sum window
def test_running_sum_window_equals_the_sum_of_the_last_w_rows():
    L, B, H, W, cap = 2, 3, 2, 4, 40
    win = ImportanceWindow(L, B, H, W, cap, "cpu")
    win.exact_every = 7  # the periodic re-sum runs inside this test too
    g = torch.Generator().manual_seed(3)
    hist: dict[int, list[torch.Tensor]] = {b: [] for b in range(B)}  # per row: every pushed query row [L, H, cap]
    lengths = [5, 9, 2]

    def push(b, T):
        S = lengths[b] + T
        rows = torch.rand(L, H, T, S, generator=g)
        win.push_row(b, rows)
        for t in range(T):
            full = torch.zeros(L, H, cap)
            full[..., :S] = rows[:, :, t]
            hist[b].append(full)
        lengths[b] = S

    def check():
        for b in range(B):
            want = torch.stack(hist[b][-W:]).double().sum(0) if hist[b] else torch.zeros(L, H, cap, dtype=torch.float64)
            got = win.scores(cap, b)[:, 0]
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(win.rows[:, b].sum(2).double(), want, rtol=1e-6, atol=1e-6)

    for T, b in [(3, 0), (1, 1), (6, 2), (2, 0), (3, 0), (1, 1), (4, 1), (2, 2), (1, 0), (5, 1)]:  # wraps, T > W
        push(b, T)
        check()
    win.move(2, 0)  # compaction: row 2's window into slot 0
    hist[0], lengths[0] = list(hist[2]), lengths[2]
    check()
    win.reset(1)
    hist[1], lengths[1] = [], 0
    check()
    push(1, 3)
    check()
    win.select([1, 0])
    hist = {0: hist[1], 1: hist[0], 2: []}
    B = 2
    check()


def test_window_ring_targets_commit_in_place_like_pushes():
    """A verify writes its T rows into the spare slots (``target``) and commits the accepted ones
    without a copy; interleaved with pushes, the running sum is always the last W committed rows,
    and rejected rows in spare slots never count. (A slot is rewritten only by a later query, whose
    keys cover the old row's non-zero columns, so the stale tail of a narrower write is zero.)"""
    L, B, H, W, cap, spare = 2, 2, 2, 4, 60, 5
    win = ImportanceWindow(L, B, H, W, cap, "cpu", spare=spare)
    win.exact_every = 9
    g = torch.Generator().manual_seed(5)
    hist: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    lengths = [6, 11]

    def full(row, S):
        out = torch.zeros(L, H, cap)
        out[..., :S] = row
        return out

    def causal(rows, start):  # query t sees keys <= start + t: zero past them, as the kernels write rows
        T, S = rows.shape[2], rows.shape[3]
        return rows * (torch.arange(S)[None, :] <= start + torch.arange(T)[:, None])

    def verify(T, accepted):  # accepted[b]: rows committed of the T written
        width = max(lengths) + T
        tgt = win.target(B, T)
        assert tgt.slots.shape == (B, T)
        for b in range(B):
            rows = causal(torch.rand(L, H, T, width, generator=g), lengths[b])
            for t in range(T):
                tgt.ring[:, b, :, int(tgt.slots[b, t]), :width] = rows[:, :, t]
            hist[b] += [full(rows[:, :, t], width) for t in range(accepted[b])]
            lengths[b] += accepted[b]
        for b in range(B):
            win.commit_row(b, accepted[b], width)

    def push(b, T):
        S = lengths[b] + T
        rows = causal(torch.rand(L, H, T, S, generator=g), lengths[b])
        win.push_row(b, rows)
        hist[b] += [full(rows[:, :, t], S) for t in range(T)]
        lengths[b] = S

    def check():
        for b in range(B):
            want = torch.stack(hist[b][-W:]).double().sum(0)
            torch.testing.assert_close(win.scores(cap, b)[:, 0], want, rtol=1e-6, atol=1e-6)

    push(0, 3)
    push(1, 2)
    check()
    for T, acc in [(5, [1, 5]), (3, [3, 0]), (5, [2, 2]), (1, [1, 1]), (4, [4, 3]), (5, [5, 5]), (2, [0, 1])]:
        verify(T, acc)
        check()
    push(0, 6)  # more than W at once
    check()
    verify(5, [2, 4])
    check()
    with pytest.raises(ValueError, match="spare"):
        win.target(B, spare + 1)


# ------------------------------------------------------------------ prepacked linears
@pytest.mark.skipif(not prepack_available(), reason="oneDNN prepacked linear unavailable")
def test_prepacked_linear_matches_f_linear_and_is_dropped_on_request():
    g = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(48, 32, generator=g), requires_grad=False)
    bias = torch.randn(48, generator=g)
    x = torch.randn(2, 3, 32, generator=g)
    assert prepack_([w]) == w.numel() * 4 and hasattr(w, PACKED_ATTR)
    with torch.inference_mode():
        torch.testing.assert_close(linear(x, w, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    # the copy is what linear reads: a stale copy shows (so prepack_ must follow an in-place change)
    w.data.mul_(2.0)
    with torch.inference_mode():
        assert not torch.allclose(linear(x, w), F.linear(x, w), atol=1e-3)
        prepack_([w])
        torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    prepack_([w], enable=False)
    assert not hasattr(w, PACKED_ATTR)


@pytest.mark.parametrize("linear_backend", ["onednn", "ss", "mkl"])
def test_model_keeps_the_copies_its_plan_reads_and_quantize_drops_them(tmp_path, linear_backend):
    from sparsespec.kernels import cpu
    from sparsespec.kernels.plan import KernelPlan
    from sparsespec.model import Transformer
    from tests.helpers import write_tiny_llama

    if linear_backend == "onednn" and not prepack_available():
        pytest.skip("oneDNN prepacked linear unavailable")
    if linear_backend == "ss" and not cpu.available():
        pytest.skip(f"CPU kernels unavailable: {cpu.unavailable_reason()}")
    model = Transformer.from_folder(write_tiny_llama(tmp_path / "m", vocab_size=300))
    model.use_kernels(KernelPlan(((None, linear_backend),), "torch"))
    dense = sum(p.numel() * 4 for p in model.parameters() if p.dim() == 2)
    for attr, wanted in ((PACKED_ATTR, linear_backend == "onednn"), (PANELS_ATTR, linear_backend == "ss")):
        assert [hasattr(w, attr) for w in (model.lm_head, model.layers[0].wqkv)] == [wanted] * 2
    # panels are padded to 16 columns (vocab 300 -> 304 rows of the head)
    assert model.prepacked_bytes >= (dense if linear_backend != "mkl" else 0)
    assert (model.prepacked_bytes == 0) == (linear_backend == "mkl")
    model.quantize_("int8")
    assert not hasattr(model.embed, PACKED_ATTR) and not hasattr(model.embed, PANELS_ATTR)  # a tied head's copy goes
    assert model.prepacked_bytes == 0


# ------------------------------------------------------------------ cost model
def test_nnls_recovers_nonnegative_coefficients():
    rng = np.random.default_rng(0)
    X = rng.uniform(0.5, 2.0, size=(40, 3))
    y = X @ np.array([2.0, 0.0, 0.5])
    np.testing.assert_allclose(_nnls(X, y), [2.0, 0.0, 0.5], atol=1e-9)
    y2 = X @ np.array([1.0, -3.0, 0.0])  # the best fit wants a negative coefficient: it is clamped
    assert (_nnls(X, y2) >= 0).all()


def test_verify_cost_model_fits_the_roofline_terms():
    c = [2e-3, 1e-4, 3e-8, 5e-7]  # fixed, per token, per token-key, per row-key
    m = VerifyCostModel()
    assert m.predict(1, 1, 100) is None  # nothing measured
    for B, w, S in [(1, 1, 64), (4, 1, 64), (4, 9, 64), (4, 1, 1024), (4, 9, 1024), (1, 1, 1024), (2, 5, 512)]:
        m.observe(B, w, S, sum(ci * f for ci, f in zip(c, VerifyCostModel.features(B, w, S))), calibration=True)
    m.observe(1, 1, 10, float("nan"))  # ignored
    want = sum(ci * f for ci, f in zip(c, VerifyCostModel.features(8, 17, 8192)))
    assert m.predict(8, 17, 8192) == pytest.approx(want, rel=1e-6)  # extrapolates along the terms


def test_verify_cost_model_refits_every_few_rounds_and_predicts_many_at_once():
    c = [2e-3, 1e-4, 3e-8, 5e-7]
    m = VerifyCostModel(refit_every=4)
    for B, w, S in [(1, 1, 64), (4, 1, 64), (4, 9, 64), (4, 1, 1024), (4, 9, 1024)]:
        m.observe(B, w, S, sum(ci * f for ci, f in zip(c, VerifyCostModel.features(B, w, S))), calibration=True)
    before = m.predict(4, 3, 2048)
    ws, Ss = np.array([1.0, 2.0, 3.0, 9.0]), np.array([100.0, 2048.0, 2048.0, 512.0])
    np.testing.assert_allclose(m.predict_many(4, ws, Ss), [m.predict(4, w, S) for w, S in zip(ws, Ss)], rtol=1e-12)
    for _ in range(3):  # three rounds twice as slow: the fit waits for the fourth
        m.observe(4, 3, 2048, 2 * before)
        assert m.predict(4, 3, 2048) == before
    m.observe(4, 3, 2048, 2 * before)
    assert m.predict(4, 3, 2048) > 1.2 * before
    m.observe(4, 1, 64, 1.0, calibration=True)  # a calibration point refits at once
    fitted = m.predict(4, 1, 64)
    m._fit()
    assert m.predict(4, 1, 64) == fitted
    assert VerifyCostModel().predict_many(1, ws, 10.0) is None  # nothing measured


def test_verify_cost_model_refits_when_rounds_drift_not_for_a_spike():
    """Rounds the fit predicts (within refit_tol) never refit it; one slow round among them does
    not either (the median error of the last refit_every decides); a host that slows every round
    by a third does, within refit_every rounds; and after history rounds it refits whatever they
    were."""
    c = [2e-3, 1e-4, 3e-8, 5e-7]
    m = VerifyCostModel(history=40, refit_every=4)
    for B, w, S in [(1, 1, 64), (4, 1, 64), (4, 9, 64), (4, 1, 1024), (4, 9, 1024)]:
        m.observe(B, w, S, sum(ci * f for ci, f in zip(c, VerifyCostModel.features(B, w, S))), calibration=True)
    coef = m.coefficients()
    t = m.predict(4, 3, 2048)
    for i in range(22):  # on the fit, +-1 %, and a 3x spike every seventh round
        m.observe(4, 3, 2048, t * (3.0 if i % 7 == 3 else 1.0 + 0.01 * (-1) ** i))
        assert m.coefficients() is coef
    m.observe(4, 3, 2048, 1.33 * t)  # every round a third slower: not after the first
    assert m.coefficients() is coef
    for _ in range(3):  # within refit_every rounds (the median of the last four moves)
        m.observe(4, 3, 2048, 1.33 * t)
    assert m.coefficients() is not coef and m.predict(4, 3, 2048) > 1.05 * t
    coef = m.coefficients()
    for i in range(40):  # history (40) rounds on the new fit: one refit at the 40th
        m.observe(4, 3, 2048, m.predict(4, 3, 2048))
        assert (m.coefficients() is coef) == (i < 39), i
    for kw in ({"refit_tol": -0.1}, {"refit_tol": float("nan")}, {"refit_every": 0}, {"history": 2.5}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            VerifyCostModel(**kw)


def test_expected_tokens_geometric():
    assert expected_tokens_geometric(1.0, 5) == 6.0
    assert expected_tokens_geometric(0.0, 5) == 1.0
    assert expected_tokens_geometric(0.5, 2) == pytest.approx(1.75)


def _controller(c, **kw):
    ctl = CostAwareController(8, draft_ratio=kw.pop("draft_ratio", 0.2), **kw)
    for B, w, S in [(1, 1, 100), (1, 9, 100), (4, 1, 100), (4, 9, 100), (4, 1, 4000), (4, 9, 4000), (1, 5, 2000)]:
        ctl.verify_cost.observe(B, w, S, sum(ci * f for ci, f in zip(c, VerifyCostModel.features(B, w, S))),
                                calibration=True)
    ctl.other_s = 0.0
    return ctl


def _rows(alpha, n, labels=100):
    out = []
    for _ in range(n):
        p = RowAcceptance(8)
        p.alpha, p.num_labels = alpha, labels
        out.append(p)
    return out


def test_controller_k_is_the_argmax_of_tokens_per_second():
    # memory-bound verify (flat in w): long drafts pay at alpha 0.9 with a cheap draft
    flat = [10e-3, 0.0, 0.0, 0.0]
    ctl = _controller(flat, draft_ratio=0.05)
    S, N, B = 4000, 400, 4

    def rate(k, a):
        return B * expected_tokens_geometric(a, k) / (k * 0.05 * 10e-3 + 10e-3)

    want = max(range(9), key=lambda k: (rate(k, 0.9), -k))
    assert ctl.best_k([0.9] * B, [8] * B, B, S, N)[0] == want == 8
    # compute-bound verify (cost linear in B*w) at batch 4: each verified token costs 2 ms, the
    # fixed part 4 ms; alpha 0.8: worked out by hand below
    lin = [4e-3, 2e-3, 0.0, 0.0]
    ctl = _controller(lin, draft_ratio=0.0)

    def rate2(k):
        return 4 * expected_tokens_geometric(0.8, k) / (4e-3 + 2e-3 * 4 * (k + 1))

    want2 = max(range(9), key=lambda k: (rate2(k), -k))
    assert want2 == 1  # 4*1.8/0.02=360 vs 4*1/0.012=333 vs 4*2.44/0.028=349
    assert ctl.best_k([0.8] * 4, [8] * 4, 4, S, N)[0] == 1
    # nothing is accepted: never speculate
    assert ctl.best_k([0.0] * 4, [8] * 4, 4, S, N)[0] == 0
    # limits cap every row
    assert _controller(flat, draft_ratio=0.05).plan(_rows(0.9, 2), [8, 3], [4000, 4000], [400, 400]) == [8, 3]


def test_controller_explores_new_rows_and_probes_after_skipping():
    ctl = _controller([10e-3, 0.0, 0.0, 0.0], draft_ratio=5.0, probe_every=2, explore_k=4, probe_k=2)
    # no label yet, the draft cost only a prior: explore at a probe's size (it measures the cost)
    assert ctl.plan(_rows(0.9, 1, labels=0), [8], [100], [100]) == [2]
    assert ctl.plan(_rows(0.9, 1, labels=0), [1], [100], [100]) == [1]  # within the limit
    cheap = _controller([10e-3, 0.0, 0.0, 0.0], draft_ratio=1.0, explore_k=4, probe_k=2)
    cheap.observe_round(1, 100, 100, 2, 2 * 0.2 * cheap.verify_cost.predict(1, 1, 101), 10e-3, 0.0)
    assert cheap.plan(_rows(0.9, 1, labels=0), [8], [100], [100]) == [4]  # measured: explore_k
    assert cheap.plan(_rows(0.9, 1, labels=0), [3], [100], [100]) == [3]  # within the limit
    ks = [ctl.plan(_rows(0.9, 1), [8], [100], [100])[0] for _ in range(16)]
    # drafting never pays: probes of probe_k after 2, then 4, 8 skipped steps (backing off)
    assert ks == [0, 2, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0]
    assert ctl.num_skipped == 13
    # a later core starts from the measurements: no exploration, the learned alpha as prior
    ctl.row_finished(_rows(0.25, 1)[0])
    later = CostAwareController(8)
    later.load(ctl.export())
    assert later.draft_ratio == 1.0  # a prior that was never measured is not handed on
    d1 = ctl.verify_cost.predict(1, 1, 100 + 1)
    ctl.observe_round(1, 100, 100, 2, 2 * 3.0 * d1, 10e-3, 0.0)  # a measured draft forward: 3x C_v(1, 1, N)
    later = CostAwareController(8)
    later.load(ctl.export())
    # the finished row's alpha over its labels (100, of which its EMA remembers 20) shrunk
    # towards prior_alpha (0.6) by one pseudo-label, then that one vote by one pseudo-request
    want = ((20 * 0.25 + 1 * 0.6) / 21 + 0.6) / 2
    assert later.learned_prior == pytest.approx(want) and later.draft_ratio == pytest.approx(3.0)
    assert not later.exploring(_rows(0.9, 1, labels=0))
    assert later.alphas([RowAcceptance(8)]) == [pytest.approx(want)]
    # one row that accepted its 2 drafts hands on ((2 * 1.0 + 0.6) / 3 + 0.6) / 2, not 1.0
    few = _controller([10e-3, 0.0, 0.0, 0.0])
    few.row_finished(_rows(1.0, 1, labels=2)[0])
    assert few.export()["alpha"] == pytest.approx((2.6 / 3 + 0.6) / 2)
    # each request one vote, however many labels: a long row at 1.0 and a short one at 0.0 meet
    # halfway (pooled by labels: (20 + 0.6) / 23 = 0.896); a row that never drafted has no vote
    votes = _controller([10e-3, 0.0, 0.0, 0.0])
    votes.row_finished(_rows(1.0, 1, labels=100)[0])
    votes.row_finished(_rows(0.0, 1, labels=2)[0])
    votes.row_finished(RowAcceptance(8))
    assert votes.export()["alpha"] == pytest.approx(((20 + 0.6) / 21 + 0.6 / 3 + 0.6) / 3)


def test_controller_skips_a_probe_whose_finding_the_rows_could_not_use():
    """A probe is due after probe_every declined rounds (then 2x, 4x, ...); it is skipped while no
    row has as many tokens left as the declined rounds it waited."""
    ctl = _controller([10e-3, 0.0, 0.0, 0.0], draft_ratio=5.0, probe_every=2, probe_k=2)
    rows = _rows(0.9, 2)
    ks = [ctl.plan(rows, [8, 8], [100, 100], [100, 100], remaining=[20 - i, 3])[0] for i in range(16)]
    # probes after 2, then 4 declined rounds (20 - 2 and 20 - 7 tokens left); after 8 more only
    # 20 - 15 = 5 < 8 are left: no probe, and none later
    assert ks == [0, 2, 0, 0, 0, 2] + [0] * 10
    # remaining unknown: the overdue probe runs at once
    assert [ctl.plan(rows, [8, 8], [100, 100], [100, 100])[0] for _ in range(2)] == [2, 0]


def test_controller_skips_a_probe_the_finished_requests_lengths_say_comes_too_late():
    """A row's expected rest is its budget capped by its residual life: the median of n - generated
    over the finished requests longer than it (none: unbounded). RULER niah answers end after 9
    or 10 tokens: with such requests finished, the probe due after 8 declined rounds is skipped,
    and taken once the row has outlived them all; the lengths go to later cores."""
    ctl = _controller([10e-3, 0.0, 0.0, 0.0], draft_ratio=5.0, probe_every=8, probe_k=1)
    assert ctl.residual(0) == math.inf
    for n in (10, 9, 10, 128):
        ctl.row_finished(RowAcceptance(8), n)
    assert list(ctl.finished_lengths) == [10, 9, 10, 128]
    assert ctl.residual(0) == 10  # 10, 9, 10, 128: (10 + 10) / 2
    assert ctl.residual(8) == 2.0  # 2, 1, 2, 120: (2 + 2) / 2
    assert ctl.residual(9) == 1.0  # 1, 1, 119
    assert ctl.residual(10) == 118.0 and ctl.residual(128) == math.inf
    # a fresh core of the same engine starts from the lengths; without the 128-token one, a row
    # whose budget is 126 tokens skips the probe due at 8 tokens and takes it at 10
    later = _controller([10e-3, 0.0, 0.0, 0.0], draft_ratio=5.0, probe_every=8, probe_k=1)
    state = ctl.export()
    state["lengths"] = state["lengths"][:3]
    later.load(state)
    assert list(later.finished_lengths) == [10, 9, 10]
    rows = _rows(0.3, 1)
    ks = [later.plan(rows, [8], [100], [100], remaining=[126 - i], generated=[1 + i])[0] for i in range(12)]
    assert ks == [0] * 9 + [1, 0, 0]
    # the budget still caps it: 5 tokens left, no probe however long the finished requests ran
    late = _controller([10e-3, 0.0, 0.0, 0.0], draft_ratio=5.0, probe_every=8, probe_k=1)
    late.row_finished(RowAcceptance(8), 1000)
    assert [late.plan(rows, [8], [100], [100], remaining=[5], generated=[3])[0] for _ in range(10)] == [0] * 10
    assert late.plan(rows, [8], [100], [100], remaining=None, generated=[3]) == [1]  # 997 expected: probe


def test_controller_explores_until_every_row_has_explore_labels():
    """One exploring round gives a row one or two labels; the controller drafts explore_k until
    every row has explore_labels of them (a declined round measures none, so a low first
    estimate would decide the whole decode), then the costs decide (here: drafting never pays).
    The draft cost is only a prior here, so every exploring round is probe-sized (one draft)."""
    ctl = _controller([10e-3, 0.0, 0.0, 0.0], draft_ratio=5.0, probe_every=100, explore_k=2, explore_labels=4)
    rows = [ctl.policy(), ctl.policy()]
    ks = []
    for _ in range(6):
        k = ctl.plan(rows, [8, 8], [100, 100], [100, 100])
        ks.append(k)
        rows[0].update([0.0] * k[0], k[0])  # accepts every draft: two labels a round
        rows[1].update([0.0] * k[1], 0)  # rejects the first: one label a round
    assert ks == [[1, 1]] * 4 + [[0, 0]] * 2
    assert [p.num_labels for p in rows] == [4, 4]
    assert not ctl.exploring(rows)
    with pytest.raises(ValueError, match="explore_labels"):
        CostAwareController(8, explore_labels=0)


def test_controller_stops_exploring_when_the_rows_own_labels_say_drafting_loses():
    """Exploring stops once not even each row's optimistic alpha (the one-sided 90 % Wilson bound
    over its labels and one pseudo-label at the prior, 0.6) would pay, by the 5 % margin, at the
    measured costs. Flat verify 10 ms, a measured draft forward of 0.8x: a round of k drafts costs
    10 + 8 k ms, so k = 8 pays at alpha 1 (9 tokens / 74 ms: not futile). A row that accepted one
    of two drafts allows 0.819 at most: k = 1 gives 1.819 tokens / 18 ms, 1.1 % over AR, k = 8
    4.7 / 74 ms: it stops; one that accepted both (0.977) goes on exploring, and so does a row
    with no label (the prior's bound, 0.929)."""
    ctl = _controller([10e-3, 0.0, 0.0, 0.0], draft_ratio=1.0, probe_every=100, explore_k=2, explore_labels=6)
    assert ctl.plan([ctl.policy()], [8], [100], [100]) == [1]  # the draft cost unmeasured: a probe-sized round
    d1 = ctl.verify_cost.predict(1, 1, 100 + 1)
    ctl.observe_round(1, 100, 100, 2, 2 * 0.8 * d1, 10e-3, 0.0)
    assert ctl.draft_measured and ctl.draft_ratio == pytest.approx(0.8) and not ctl.futile([8], 1, 100, 100)
    half, whole = ctl.policy(), ctl.policy()
    assert ctl.plan([half], [8], [100], [100]) == [2]  # no label yet, the draft measured: explore_k
    half.update([0.0, 0.0], 1)
    whole.update([0.0, 0.0], 2)
    assert half.alpha == pytest.approx(0.5) and half.num_labels == 2 < ctl.explore_labels
    z = 1.2816  # Wilson's bound by hand: (a + z^2/2n + z sqrt(a(1-a)/n + z^2/4n^2)) / (1 + z^2/n)

    def wilson(a, n):
        return (a + z * z / (2 * n) + z * (a * (1 - a) / n + z * z / (4 * n * n)) ** 0.5) / (1 + z * z / n)

    want = [wilson((2 * 0.5 + 0.6) / 3, 3), wilson((2 * 1.0 + 0.6) / 3, 3), wilson(0.6, 1)]
    assert want == [pytest.approx(0.819, abs=1e-3), pytest.approx(0.977, abs=1e-3), pytest.approx(0.929, abs=1e-3)]
    assert ctl.optimistic_alphas([half, whole, ctl.policy()]) == [pytest.approx(w, rel=1e-4) for w in want]
    assert ctl.hopeless([half], [8], 1, 100, 100) and ctl.plan([half], [8], [100], [100]) == [0]
    assert not ctl.hopeless([whole], [8], 1, 100, 100) and ctl.plan([whole], [8], [100], [100]) == [2]
    assert not ctl.hopeless([ctl.policy()], [8], 1, 100, 100)
    # the batch decides together: with a row that accepted everything beside it, exploring goes on
    assert not ctl.hopeless([half, whole], [8, 8], 2, 100, 100)
    # a draft cost that is only a prior decides nothing: explore, at a probe's size
    prior = _controller([10e-3, 0.0, 0.0, 0.0], draft_ratio=0.8, probe_every=100, explore_k=2)
    assert not prior.hopeless([half], [8], 1, 100, 100) and prior.plan([half], [8], [100], [100]) == [1]


def test_controller_declines_unless_drafting_beats_ar_by_the_margin():
    """k = 0 unless the best drafting rate beats not drafting by more than ``margin`` (5 %). Flat
    verify 10 ms, draft forward 9 ms (ratio 0.9): a round drafting 1 costs 19 ms and emits
    1 + alpha tokens, so it beats an AR step's 1 / 10 ms by (1 + alpha) / 1.9 - 1: 2.6 % at alpha
    0.95 (declined; drafted with no margin), 5.3 % at alpha 1 (drafted). The margin also rules
    futility and hopelessness (k = 8 at alpha 1: 9 / 82 ms, 9.8 % over AR, still worth
    probing), and a bad margin is refused."""
    flat = [10e-3, 0.0, 0.0, 0.0]
    ctl = _controller(flat, draft_ratio=0.9)
    assert ctl.margin == 0.05
    assert ctl.best_k([0.95], [1], 1, 100, 100)[0] == 0
    assert _controller(flat, draft_ratio=0.9, margin=0.0).best_k([0.95], [1], 1, 100, 100)[0] == 1
    k, rate = ctl.best_k([1.0], [1], 1, 100, 100)
    assert k == 1 and rate == pytest.approx(2 / 19e-3)
    assert ctl.best_k([0.95], [1], 1, 100, 100)[1] == pytest.approx(1 / 10e-3)  # declined: AR's rate
    # k = 2 at alpha 1: 3 / 28 ms, 7.1 % over AR; k = 1 at 5.3 %: the argmax among drafting ks
    assert ctl.best_k([1.0], [2], 1, 100, 100)[0] == 2
    ctl.observe_round(1, 100, 100, 2, 2 * 0.9 * ctl.verify_cost.predict(1, 1, 101), 10e-3, 0.0)
    assert ctl.draft_measured and not ctl.futile([8], 1, 100, 100) and ctl.futile([1], 1, 100, 100) is False
    assert _controller(flat, draft_ratio=0.9, margin=0.2).best_k([1.0], [8], 1, 100, 100)[0] == 0
    for bad in (-0.1, float("nan"), "5%"):
        with pytest.raises(ValueError, match="margin"):
            CostAwareController(8, margin=bad)


def test_controller_best_k_equals_the_argmax_of_the_scalar_step_cost():
    """best_k (every k at once) against the plain formula: sum_b E(alpha_b, min(k, limit_b)) /
    step_cost(k), the shorter k on ties, at mixed alphas and per-row limits; 0 unless the best
    drafting k beats k = 0 by more than the margin."""
    rng = np.random.default_rng(0)
    for trial in range(40):
        c = [rng.uniform(1e-3, 2e-2), rng.uniform(0, 2e-3), rng.uniform(0, 1e-6), rng.uniform(0, 1e-5)]
        ctl = _controller(c, draft_ratio=float(rng.uniform(0.05, 1.5)))
        ctl.other_s = float(rng.uniform(0, 5e-3))
        B = int(rng.integers(1, 6))
        alphas = rng.uniform(0.3, 1.0, size=B).tolist()
        limits = rng.integers(0, 9, size=B).tolist()
        S, N = float(rng.integers(100, 8000)), float(rng.integers(16, 600))
        rates = [sum(expected_tokens_geometric(a, min(k, lim)) for a, lim in zip(alphas, limits)) / ctl.step_cost(k, B, S, N)
                 for k in range(min(8, max(limits)) + 1)]
        want = 0
        for k in range(1, len(rates)):
            if rates[k] > rates[want] * (1 + 1e-9):
                want = k
        if want and rates[want] <= rates[0] * 1.05:
            want = 0
        k, rate = ctl.best_k(alphas, limits, B, S, N)
        assert k == want, trial
        if max(limits):
            assert rate == pytest.approx(rates[want], rel=1e-9)
    # equal rates at every k (free drafts, a flat verify, nothing accepted): the shortest, k = 0
    free = _controller([10e-3, 0.0, 0.0, 0.0], draft_ratio=0.0)
    assert free.best_k([0.0] * 2, [8, 8], 2, 1000, 100)[0] == 0
    assert free.best_k([1.0] * 2, [8, 3], 2, 1000, 100)[0] == 8  # alpha 1 exactly: every draft is a token


def test_controller_neither_explores_nor_probes_where_even_full_acceptance_cannot_pay():
    # flat verify 10 ms; a measured draft forward of 5x: k drafts cost 10 + 50 k ms for at most
    # k + 1 tokens, below AR's 1 per 10 ms at any alpha
    ctl = _controller([10e-3, 0.0, 0.0, 0.0], draft_ratio=1.0, probe_every=2, explore_k=4, probe_k=2)
    d1 = ctl.verify_cost.predict(1, 1, 100 + 1)
    ctl.observe_round(1, 100, 100, 2, 2 * 5.0 * d1, 10e-3, 0.0)
    assert ctl.draft_measured and ctl.draft_ratio == pytest.approx(5.0)
    assert ctl.futile([8], 1, 100, 100)
    assert ctl.plan(_rows(0.9, 1, labels=0), [8], [100], [100]) == [0]  # no exploring
    assert [ctl.plan(_rows(0.9, 1), [8], [100], [100])[0] for _ in range(16)] == [0] * 16  # no probes
    assert ctl.num_skipped == 17
    # a measured draft of 0.85x: at alpha 0.9 no k pays by the 5 % margin (k = 1: 1.9 tokens /
    # 18.5 ms, 2.7 % over AR), at alpha 1 long drafts do (k = 8: 9 / 78 ms, 15 %): acceptance
    # matters, so probes go on
    ctl = _controller([10e-3, 0.0, 0.0, 0.0], draft_ratio=1.0, probe_every=2, probe_k=2)
    ctl.observe_round(1, 100, 100, 2, 2 * 0.85 * d1, 10e-3, 0.0)
    assert not ctl.futile([8], 1, 100, 100)
    assert ctl.futile([0], 1, 100, 100) is False  # nothing may be drafted: nothing to decide
    assert [ctl.plan(_rows(0.9, 1), [8], [100], [100])[0] for _ in range(6)] == [0, 2, 0, 0, 0, 2]
    # a prior alone never rules drafting out (it would never be measured)
    assert not _controller([10e-3, 0.0, 0.0, 0.0], draft_ratio=5.0).futile([8], 1, 100, 100)


def test_controller_alpha_shrinks_towards_the_batch():
    ctl = CostAwareController(8, prior_alpha=0.5, prior_weight=2.0)
    rows = _rows(0.9, 1, labels=2) + _rows(0.3, 1, labels=100)
    rows[1].ema = 0.1  # memory 10 labels
    a = ctl.alphas(rows + [RowAcceptance(8)])
    assert a[0] == pytest.approx((2 * 0.9 + 2 * 0.3) / 4)  # towards the other rows, not itself
    assert a[1] == pytest.approx((10 * 0.3 + 2 * 0.9) / 12)
    assert a[2] == pytest.approx((0.9 + 0.3) / 2)  # no labels: the batch's
    assert ctl.alphas([RowAcceptance(8)]) == [0.5]  # nobody measured: prior_alpha
    assert ctl.alphas(_rows(1.0, 1, labels=2)) == [pytest.approx((2 * 1.0 + 2 * 0.5) / 4)]  # alone: prior_alpha


def test_row_acceptance_labels():
    p = RowAcceptance(8)
    p.update([0.1, 0.2, 0.3], 2)  # 1, 1, 0
    assert p.num_labels == 3 and p.alpha == pytest.approx(2 / 3)
    p.update([0.1, 0.2], 2)  # 1, 1 (no rejection)
    assert p.num_labels == 5 and p.alpha == pytest.approx(4 / 5)
    with pytest.raises(ValueError):
        p.update([0.1], 2)


def test_row_reach_ramps_on_whole_acceptance_and_falls_on_rejection():
    p = RowAcceptance(16, reach=2)
    reach = []
    for m, a in [(2, 2), (4, 4), (8, 8), (16, 0), (2, 1), (4, 4), (1, 1), (0, 0)]:
        p.update([0.1] * m, a)
        reach.append(p.reach)
    # doubles while whole rounds pass (capped at max_k), twice the accepted run + 1 after a
    # rejection, a shorter whole round keeps it, a round that drafted nothing changes nothing
    assert reach == [4, 8, 16, 2, 4, 8, 8, 8]
    assert RowAcceptance(16).reach == 16 and RowAcceptance(16, reach=99).reach == 16


def test_controller_caps_each_row_at_its_reach():
    # drafting pays up to k = 8 at alpha 0.9 (see the argmax test), but a row's evidence caps it
    ctl = _controller([10e-3, 0.0, 0.0, 0.0], draft_ratio=0.05)
    rows = _rows(0.9, 2)
    rows[0].reach, rows[1].reach = 2, 4
    assert ctl.plan(rows, [8, 8], [4000, 4000], [400, 400]) == [2, 4]
    rows[0].update([0.1, 0.1], 2)  # a whole round: the reach doubles
    assert ctl.plan(rows, [8, 3], [4000, 4000], [400, 400]) == [4, 3]
    assert ctl.policy().reach == ctl.explore_k  # a new row starts at explore_k


def test_controller_option_changes_only_auto_run_ids():
    fixed = resolve_method_options("sparsespec-l", {"k": 4})
    assert "controller" not in fixed
    assert resolve_method_options("sparsespec-l", {"k": 4, "controller": "entropy"}) == fixed
    auto = resolve_method_options("sparsespec-l", {"k": "auto"})
    assert auto["controller"] == "cost"
    assert resolve_method_options("sparsespec-l", {"k": "auto", "controller": "entropy"})["controller"] == "entropy"
    with pytest.raises(ValueError, match="controller"):
        resolve_method_options("sparsespec-l", {"k": "auto", "controller": "oracle"})

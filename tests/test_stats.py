"""The one derivation of every ratio, and the controller's measured round costs, by hand."""
import pytest

from sparsespec.adaptive import EntropyAdaptive, StepCosts
from sparsespec.stats import (DERIVED_KEYS, bench_spec_decode, derive, itl_percentiles, ledger_speedup,
                              mean_acceptance_length, pool, request_tpot)

ONE = {"num_output_tokens": 11, "num_steps": 4, "num_drafting_steps": 3, "num_emitted": 10, "num_drafted": 12,
       "num_accepted": 6, "num_draft_forwards": 12, "draft_s": 0.24, "verify_s": 0.4, "other_s": 0.16,
       "decode_s": 0.9, "total_s": 1.0, "budget_tokens_sum": 300, "context_tokens_sum": 3000}


def test_derive_by_hand():
    d = derive(ONE)
    assert set(d) == set(DERIVED_KEYS)
    assert d["alpha"] == pytest.approx(0.5)
    assert d["tau"] == pytest.approx(2.5)
    assert d["mean_k"] == pytest.approx(4.0)
    assert d["gamma"] == pytest.approx((0.24 / 12) / (0.4 / 4))  # 0.2
    assert d["tpot_s"] == pytest.approx(0.09)
    assert d["tokens_per_s"] == pytest.approx(11.0)
    assert d["budget_frac"] == pytest.approx(0.1)
    assert d["round_s"] == pytest.approx(0.2)
    assert d["predicted_speedup"] == pytest.approx((0.5 * 4 + 1) / (4 * 0.2 + 1))
    ar = {"num_steps": 10, "verify_s": 0.5, "other_s": 0.1, "draft_s": 0.0}
    assert derive(ONE, ar)["predicted_speedup_round"] == pytest.approx(2.5 * 0.06 / 0.2)
    assert derive(ONE)["predicted_speedup_round"] is None


def test_derive_of_nothing_and_of_ar():
    d = derive({})
    assert all(v is None for v in d.values())
    ar = derive({"num_output_tokens": 5, "num_steps": 4, "num_emitted": 4, "decode_s": 0.4, "total_s": 0.5})
    assert ar["alpha"] is None and ar["mean_k"] is None and ar["tau"] == 1.0 and ar["predicted_speedup"] == 1.0


def test_pool_sums_and_pooled_tpot_counts_each_request():
    two = pool([ONE, {**ONE, "num_output_tokens": 1, "decode_s": 0.0, "num_drafted": 0, "num_accepted": 0}])
    assert two["num_drafted"] == 12 and two["num_output_tokens"] == 12
    d = derive(two)
    assert d["tpot_s"] == pytest.approx(0.9 / 10)  # (11 - 1) + (1 - 1) decode tokens, not 12 - 1
    assert d["alpha"] == pytest.approx(6 / 12)
    # rows stored before num_drafting_steps: steps with k > 0 in the histogram
    old = {k: v for k, v in ONE.items() if k != "num_drafting_steps"} | {"accept_hist": {"4:2": 3, "0:0": 1}}
    assert derive(old)["mean_k"] == pytest.approx(4.0)


def test_request_level_ratios_by_hand():
    assert request_tpot(2.5, 0.5, 11) == pytest.approx(0.2)  # (E2EL - TTFT) / (tokens - 1)
    assert request_tpot(2.5, 0.5, 1) is None and request_tpot(None, 0.5, 11) is None
    assert mean_acceptance_length(6, 4) == pytest.approx(2.5) and mean_acceptance_length(3, 0) is None
    assert itl_percentiles([0.1, 0.2, 0.3, 0.4, 1.0]) == pytest.approx(
        {"itl_p50_s": 0.3, "itl_p95_s": 0.88, "itl_p99_s": 0.976})  # linear interpolation
    assert itl_percentiles([]) == {"itl_p50_s": None, "itl_p95_s": None, "itl_p99_s": None}


def test_bench_spec_decode_by_hand():
    """vllm bench serve's spec_decode_* from counter deltas: 20 drafts of 4 tokens, 50 accepted."""
    assert bench_spec_decode(20, 80, 50, [18, 14, 10, 8]) == {
        "spec_decode_acceptance_rate": pytest.approx(62.5),  # a percentage: 100 * 50 / 80
        "spec_decode_acceptance_length": pytest.approx(3.5),  # 1 + 50 / 20
        "spec_decode_num_drafts": 20, "spec_decode_draft_tokens": 80, "spec_decode_accepted_tokens": 50,
        "spec_decode_per_position_acceptance_rates": pytest.approx([0.9, 0.7, 0.5, 0.4]),  # per pos / drafts
    }
    assert bench_spec_decode(0, 0, 0, [0, 0]) == {}  # nothing drafted: vLLM omits the keys
    odd = bench_spec_decode(0, 6, 3, [3])  # draft tokens without drafts: vLLM's 0.0 and []
    assert odd["spec_decode_acceptance_length"] == 0.0 and odd["spec_decode_per_position_acceptance_rates"] == []


def test_ledger_speedup():
    assert ledger_speedup(1.0, 4, 0.0) == 5.0
    assert ledger_speedup(0.0, 4, 0.25) == 0.5
    assert ledger_speedup(None, 4, 0.1) is None


def test_verify_cost_per_width_is_interpolated_and_extrapolated():
    c = StepCosts(ema=1.0)
    assert c.verify(3) == 1.0 and c.draft() == pytest.approx(0.3) and c.other() == 0.0  # unitless prior
    c.observe(0.001, 0.010, verify_tokens=1, other_s=0.002)
    c.observe(0.001, 0.030, verify_tokens=5, other_s=0.002)
    assert c.verify(0) == pytest.approx(0.010) and c.verify(4) == pytest.approx(0.030)
    assert c.verify(2) == pytest.approx(0.020)  # width 3: halfway
    assert c.verify(8) == pytest.approx(0.030 + 4 * 0.005)  # width 9: the last slope
    assert c.round_cost(2) == pytest.approx(2 * 0.001 + 0.020 + 0.002)


def test_controller_k_moves_with_the_verify_cost_slope():
    ps_h = [0.3] * 16  # low entropy: p ~ 0.95 per token under the initial centroids

    def k_for(slope):
        costs = StepCosts(ema=1.0)
        for w in (1, 9):
            costs.observe(0.001, 0.010 + slope * (w - 1), verify_tokens=w)
        pol = EntropyAdaptive(costs=costs)
        k = pol.start_step(16)
        m = 0
        while m < k:
            m += 1
            if not pol.should_continue(ps_h[:m]):
                break
        return m

    flat, steep = k_for(0.0), k_for(0.004)  # verify of k+1 tokens costs 10 ms, or 10 + 4k ms
    assert flat >= 8 and steep < flat


def test_other_cost_makes_longer_drafts_pay():
    ps = [0.8] * 16
    cheap_round, dear_round = StepCosts(ema=1.0), StepCosts(ema=1.0)
    cheap_round.observe(0.002, 0.010, verify_tokens=None, other_s=0.0)
    dear_round.observe(0.002, 0.010, verify_tokens=None, other_s=0.050)  # a costly fixed round overhead
    k_cheap = EntropyAdaptive(costs=cheap_round).best_k(ps)
    k_dear = EntropyAdaptive(costs=dear_round).best_k(ps)
    assert k_dear > k_cheap


def test_step_clock_leaves_out_the_time_between_steps():
    """A fake base clock: the core's clock advances only while resumed, reads the pause instant
    while paused, and busy_s sums the resumed spans."""
    from sparsespec.stats import StepClock

    t = [100.0]
    clock = StepClock(lambda: t[0])
    assert clock() == 100.0 and clock.busy_s == 0.0  # created paused
    t[0] = 105.0  # idle: another core's steps
    assert clock() == 100.0
    clock.resume()
    t[0] = 107.0
    assert clock() == 102.0  # 2 s inside the step
    clock.pause()
    t[0] = 150.0
    assert clock() == 102.0 and clock.busy_s == 2.0
    clock.resume()
    clock.resume()  # idempotent
    t[0] = 153.0
    clock.pause()
    clock.pause()
    t[0] = 160.0
    assert clock() == 105.0 and clock.busy_s == 5.0

"""cluster.results.aggregate on the seeded store (tests/dashboard_seed.py): every value checked by hand."""
import math

import numpy as np
import pytest

from cluster.results import aggregate as q
from cluster.results.store import open_store
from tests import dashboard_seed as seed

CELL = ("model", "context_length", "batch_size", "method", "k")


@pytest.fixture(scope="module")
def store_rows(tmp_path_factory):
    url = f"sqlite:///{tmp_path_factory.mktemp('q')}/seed.db"
    ids = seed.seed(url)
    with open_store(url, create=False) as s:
        data = dict(results=q.with_run_fields(s.results(), s.runs()), runs=s.runs(), shards=s.shards(),
                    steps=s.acceptance_steps(), serve=s.serve_requests())
    return url, ids, data


def _cell(cells, **kw):
    hits = [c for c in cells if all(c[k] == v for k, v in kw.items())]
    assert len(hits) == 1, (kw, hits)
    return hits[0]


def test_paired_speedup_median_total_and_pairs(store_rows):
    _, _, d = store_rows
    cells = q.cell_table(d["results"], by=CELL)
    c = _cell(cells, context_length=2048, batch_size=1, method="sparsespec-l", k="auto")
    # two batches at 1.0x and 1.5x: median 1.25; total 2 x 1.0 s of ar / (1.0 + 1/1.5) s
    assert c["speedup"] == pytest.approx(1.25) and c["n_pairs"] == 2
    assert c["speedup_total"] == pytest.approx(2.0 / (1.0 + 1 / 1.5)) == pytest.approx(1.2)
    assert c["ci_low"] is None  # under MIN_CI_PAIRS pairs: no interval
    c = _cell(cells, context_length=2048, batch_size=2, method="sparsespec-l", k="auto")
    assert c["speedup"] == pytest.approx(1.6) and c["n_pairs"] == 1  # one batch of two rows
    ar = _cell(cells, context_length=1024, batch_size=2, method="ar", k=None)
    assert ar["speedup"] == 1.0 and ar["variant"] == "ar"


def test_counts_derive_alpha_tau_k_gamma_ledger(store_rows):
    _, _, d = store_rows
    cells = q.cell_table(d["results"], by=CELL)
    c = _cell(cells, context_length=1024, batch_size=1, method="sparsespec-l", k="auto")
    assert (c["alpha"], c["tau"], c["mean_k"]) == (pytest.approx(0.75), pytest.approx(2.5), pytest.approx(2.0))
    assert c["gamma"] == pytest.approx(0.1)
    assert c["predicted_speedup"] == pytest.approx((0.75 * 2 + 1) / (2 * 0.1 + 1))
    # full round: tau * T_AR / T_round; T_AR = ar's (verify + other) per step = D_ar / 10 = 0.1 s;
    # T_round = D / 4 with D = 10 x 0.125 s (0.8x): 2.5 x 0.1 / 0.3125 = 0.8, the measured speedup
    assert c["predicted_speedup_round"] == pytest.approx(0.8)
    # round costs in AR steps: verify 0.6 D / 4 / 0.1, other 0.28 D / 4 / 0.1, draft (0.12 D / 8) / 0.1
    D = 10 * 0.1 / 0.8
    assert c["c_verify"] == pytest.approx(0.6 * D / 4 / 0.1)
    assert c["c_other"] == pytest.approx(0.28 * D / 4 / 0.1)
    assert c["c_draft"] == pytest.approx(0.12 * D / 8 / 0.1) and c["draft_forwards_per_round"] == 2.0
    g = _cell(cells, context_length=1024, batch_size=1, method="ngram", k=3)
    assert g["alpha"] == pytest.approx(1 / 3) and g["tau"] == pytest.approx(2.0) and g["gamma"] is None
    assert g["variant"] == "ngram k=3"


def test_lossless_rate_scores_and_sampling(store_rows):
    _, _, d = store_rows
    cells = q.cell_table(d["results"])
    c = _cell(cells, benchmark="ruler", context_length=2048, batch_size=2, method="ngram")
    assert c["lossless_rate"] == 0.5 and c["n_conclusive"] == 2
    s = _cell(cells, benchmark="longbench", method="ngram")
    assert s["lossless_rate"] is None and s["n_sampling"] == 2
    assert s["score"] == pytest.approx(0.4) and s["score_ar"] == pytest.approx(0.5)
    assert s["score_delta"] == pytest.approx(-0.1)
    assert s["speedup"] == pytest.approx(1.2)


def test_latency_memory_throughput(store_rows):
    _, _, d = store_rows
    cells = q.cell_table(d["results"], by=CELL)
    c = _cell(cells, context_length=2048, batch_size=2, method="sparsespec-l", k="auto")
    # one batch of two rows, each charged the batch's decode seconds D = 20 x 0.1 / 1.6 = 1.25
    assert c["tpot_p50_s"] == pytest.approx(1.25 / 10) and c["ar_tpot_p50_s"] == pytest.approx(2.0 / 10)
    assert c["itl_p95_s"] == pytest.approx(0.25 * 1.25) and c["ar_itl_p95_s"] == pytest.approx(0.12 * 2.0)
    assert c["ttft_p50_s"] == pytest.approx(0.5)
    assert c["peak_mem_bytes"] == 1050 and c["ar_peak_mem_bytes"] == 1000 and c["kv_bytes"] == 100
    assert c["throughput"] == pytest.approx(20 / 1.25) and c["ar_throughput"] == pytest.approx(10.0)


def test_best_per_cell(store_rows):
    _, _, d = store_rows
    ruler = [r for r in d["results"] if r["benchmark"] == "ruler" and r["task"] == "niah"]
    best = {(b["context_length"], b["batch_size"]): b for b in
            q.best_per_cell(q.cell_table(ruler, by=CELL), ("model", "context_length", "batch_size"))}
    assert best[(1024, 1)]["best"] == "ar" and best[(1024, 1)]["runner_up"] == "ngram k=3"  # 0.9 > 0.8
    assert best[(1024, 2)]["best"] == "sparsespec-l" and best[(1024, 2)]["speedup"] == pytest.approx(1.05)
    assert best[(2048, 1)]["best"] == "sparsespec-l" and best[(2048, 1)]["speedup"] == pytest.approx(1.25)
    # ngram's lossy sample disqualifies it (0.9 would not beat ar anyway): ar is the runner-up
    assert best[(2048, 2)]["best"] == "sparsespec-l" and best[(2048, 2)]["runner_up"] == "ar"


def test_acceptance_by_position_from_the_histograms(store_rows):
    _, _, d = store_rows
    rows = [r for r in d["results"] if r["method"] == "sparsespec-l" and r["task"] == "niah"]
    pos = q.acceptance_by_position(rows)
    # 8 rows x 4 steps of k=2: half accept 2, half accept 1
    assert [(p["position"], p["drafted"], p["accepted"]) for p in pos] == [(1, 32, 32), (2, 32, 16)]
    assert pos[1]["rate"] == 0.5 and pos[1]["conditional"] == 0.5
    ng = q.acceptance_by_position([r for r in d["results"] if r["method"] == "ngram"])
    # every step drafts 3 and keeps exactly 1: position 3 is never reached
    assert [p["rate"] for p in ng] == [1.0, 0.0, 0.0] and ng[2]["reached"] == 0 and ng[2]["conditional"] is None


def test_s_vs_k_and_the_inversion_point(store_rows):
    _, _, d = store_rows
    cells = [c for c in q.cell_table(d["results"]) if c["task"] == "niah_k"]
    pts = q.s_vs_k(cells)
    assert [p["k"] for p in pts] == [1, 2, 4, 8]
    alpha = {k: a / (k * s) for k, (s, a) in seed.FIXED_K.items()}
    assert [p["alpha"] for p in pts] == pytest.approx([alpha[k] for k in (1, 2, 4, 8)])
    assert all(p["gamma"] == pytest.approx(0.15) for p in pts)
    e = {k: alpha[k] * k for k in alpha}  # 9/11, 1.5, 13/7, 7/3
    m = [e[1], e[2] - e[1], (e[4] - e[2]) / 2, (e[8] - e[4]) / 4]
    assert [p["marginal_acceptance"] for p in pts] == pytest.approx(m)
    # m(8) = 0.119 < gamma = 0.15: the first k whose extra drafts cost more than they return
    assert [p["inversion"] for p in pts] == [False, False, False, True]
    ar_dec = 2.2
    for p in pts:
        s, _ = seed.FIXED_K[p["k"]]
        assert p["speedup"] == pytest.approx(ar_dec / (0.015 * p["k"] * s + 0.11 * s))


def test_k_trace_from_the_acceptance_steps(store_rows):
    _, ids, d = store_rows
    tr = [t for t in q.k_trace(d["steps"]) if t["run_id"] == ids["cells"][(1024, 1)] and t["sample_id"] == "s0"
          and t["method"] == "sparsespec-l"]
    assert [(t["step"], t["k"], t["accepted"]) for t in tr] == [(0, 2, 2), (1, 2, 1), (2, 2, 2), (3, 2, 1)]
    assert tr[-1]["mean_k_so_far"] == 2.0 and tr[0]["context_length"] == 1024


def test_gates_pass_fail_and_thresholds(store_rows):
    _, _, d = store_rows
    rows = d["results"]
    g = {(r["benchmark"], r["context_length"], r["batch_size"], r["method"], r["k"]): r for r in q.gates_table(rows)}
    ok = g[("ruler", 2048, 2, "sparsespec-l", "auto")]
    # speedup 1.6, P95 ITL 0.3125 / 0.24 = 1.30x ar, memory 1.05x, throughput 1.6x: all four pass
    assert ok["passed"] and ok["itl_p95_ratio"] == pytest.approx(0.3125 / 0.24) and ok["reason"] == ""
    tight = {(r["benchmark"], r["context_length"], r["batch_size"], r["method"], r["k"]): r
             for r in q.gates_table(rows, q.GateThresholds(max_itl_ratio=1.2))}
    assert tight[("ruler", 2048, 2, "sparsespec-l", "auto")]["latency"] is False  # 1.30x > 1.2
    slow = g[("ruler", 1024, 1, "sparsespec-l", "auto")]
    assert slow["correctness"] and slow["quality"] and slow["latency"] is False and not slow["passed"]
    lossy = g[("ruler", 2048, 2, "ngram", 3)]
    assert lossy["correctness"] is False and "lossless rate 0.5" in lossy["reason"]
    sampled = g[("longbench", 1024, 1, "ngram", 3)]
    assert sampled["correctness"] is None and sampled["quality"] is False and not sampled["passed"]
    # thresholds move the verdicts: a 20-point tolerance passes the sampled run's quality
    loose = q.GateThresholds(max_score_drop=0.2, min_speedup=0.5, max_mem_ratio=1.01)
    g2 = {(r["benchmark"], r["context_length"], r["batch_size"], r["method"], r["k"]): r
          for r in q.gates_table(rows, loose)}
    assert g2[("longbench", 1024, 1, "ngram", 3)]["quality"] is True
    assert g2[("ruler", 2048, 2, "sparsespec-l", "auto")]["capacity"] is False  # 1.05x memory > 1.01
    assert ("ruler", 1024, 1, "ar", None) not in g


@pytest.mark.parametrize("bad", [dict(min_lossless_rate=1.5), dict(min_speedup=-1), dict(max_itl_ratio=math.nan),
                                 dict(max_kv_ratio="1")])
def test_gate_thresholds_validated(bad):
    with pytest.raises(ValueError, match="must be"):
        q.GateThresholds(**bad)


def test_ab_arms_decision_and_timeline(store_rows):
    _, _, d = store_rows
    arms = {a["arm"]: a for a in q.ab_arms(d["serve"])}
    assert arms["ar"]["requests"] == 6 and arms["ar"]["errors"] == 0
    assert arms["spec"]["requests"] == 7 and arms["spec"]["errors"] == 1  # the 499
    assert arms["spec"]["error_rate"] == pytest.approx(1 / 7)
    assert arms["(refused at the router)"]["errors"] == 1
    assert arms["ar"]["tpot_p50_s"] == pytest.approx(0.1) and arms["spec"]["tpot_p50_s"] == pytest.approx(0.08)
    assert arms["spec"]["alpha"] == pytest.approx(0.75) and arms["spec"]["mean_acceptance_length"] == pytest.approx(2.5)
    (dec,) = q.ab_decisions(d["serve"])
    assert dec["baseline"] == "ar" and dec["treatment"] == "spec"
    assert dec["tpot_ratio"] == pytest.approx(0.8) and dec["significant"] is True
    assert dec["tpot_ratio_ci"] == pytest.approx([0.8, 0.8])
    tl = q.ab_timeline(d["serve"], bucket_s=60)
    # 12 requests 30 s apart from 12:00:00 + the refusal at :05 and the 499 at 12:03:20
    per_bucket = {}
    for t in tl:
        per_bucket[t["t"].minute] = per_bucket.get(t["t"].minute, 0) + t["requests"]
    assert per_bucket == {0: 3, 1: 2, 2: 2, 3: 3, 4: 2, 5: 2}
    with pytest.raises(ValueError):
        q.ab_timeline(d["serve"], bucket_s=0)


def test_run_rows_and_environment(store_rows):
    _, ids, d = store_rows
    runs = {r["run_id"]: r for r in q.run_rows(d["runs"], d["shards"])}
    r = runs[ids["running"]]
    assert r["status"] == "running" and r["shards"] == 2 and r["shards_failed"] == 1 and r["shards_pending"] == 1
    assert r["last_error"].startswith("worker died") and r["attempts"] == 2 and r["events"] == 1
    assert runs[ids["cells"][(1024, 1)]]["shards_done"] == 2 and runs[ids["cells"][(1024, 2)]]["shards_done"] == 1
    assert r["device"] == "cpu (2 cores on vm)" and r["commit"] == "abc1234" and r["sweep"] == "seed"
    env = q.environment(d["runs"])
    assert env.devices == ["cpu (2 cores on vm)"] and env.commits == ["abc1234"]
    assert env.packages["torch"] == "2.13.0+cpu" and env.runs == len(d["runs"])


def test_leaderboard_has_an_ar_row_first_per_setting(store_rows):
    _, _, d = store_rows
    lb = q.leaderboard(d["results"])
    settings = {}
    for r in lb:
        settings.setdefault((r["benchmark"], r["context_length"], r["batch_size"]), []).append(r)
    for rows in settings.values():
        assert rows[0]["variant"] == "ar" and rows[0]["speedup"] == 1.0
        sp = [r["speedup"] for r in rows[1:]]
        assert sp == sorted(sp, reverse=True)
    top = settings[("ruler", 2048, 1)]
    assert [r["variant"] for r in top][:2] == ["ar", "sparsespec-l k=2"]


def test_bootstrap_interval_is_seeded_and_covers_the_median():
    x = np.array([0.9, 1.0, 1.1, 1.2, 1.3, 1.4])
    a = q.percentile_ci(q.bootstrap_medians(x, 500, np.random.default_rng(0)))
    b = q.percentile_ci(q.bootstrap_medians(x, 500, np.random.default_rng(0)))
    assert a == b and a[0] <= np.median(x) <= a[1] and a[0] >= 0.9 and a[1] <= 1.4
    assert q.percentile_ci(np.array([np.nan])) is None


def test_paired_speedup_gets_an_interval_from_five_pairs():
    def row(method, i, tpot):
        return {"run_id": "r", "benchmark": "b", "task": "t", "model": "m", "sample_id": str(i), "method": method,
                "stats": {"batch_key": f"b{i}", "batch_wall_s": 1.0 + 10 * tpot, "batch_prefill_s": 1.0,
                          "num_output_tokens": 11}}
    ratios = [1.0, 1.1, 1.2, 1.3, 1.4]
    ar = [row("ar", i, 0.1) for i in range(5)]
    sp = [row("x", i, 0.1 / s) for i, s in enumerate(ratios)]
    out = q.paired_speedup(sp, ar)
    assert out["n_pairs"] == 5 and out["speedup"] == pytest.approx(1.2)
    assert out["ci_low"] is not None and out["ci_low"] <= 1.2 <= out["ci_high"]
    assert out["speedup_total"] == pytest.approx(5 * 1.0 / sum(1 / s for s in ratios))
    assert q.paired_speedup(sp[:4], ar)["ci_low"] is None
    assert q.paired_speedup(sp, [])["speedup"] is None  # nothing paired


# --------------------------------------------------------------------------- synthetic cases (mutation-found)
def _row(method, i, tpot, *, score=None, mem=None, run="r", lossless=None, tokens=11):
    return {"run_id": run, "benchmark": "b", "task": "t", "model": "m", "sample_id": str(i), "method": method,
            "context_length": 1024, "batch_size": 1, "score": score, "lossless": lossless,
            "stats": {"batch_key": f"b{i}", "batch_wall_s": 1.0 + (tokens - 1) * tpot, "batch_prefill_s": 1.0,
                      "num_output_tokens": tokens, "decode_s": (tokens - 1) * tpot, "peak_mem_bytes": mem,
                      "k": None if method == "ar" else "auto"}}


def test_speedup_is_the_median_not_the_mean():
    ratios = [1.0, 1.0, 1.2, 1.3, 2.0]  # median 1.2, mean 1.3
    out = q.paired_speedup([_row("x", i, 0.1 / s) for i, s in enumerate(ratios)],
                           [_row("ar", i, 0.1) for i in range(5)])
    assert out["speedup"] == pytest.approx(1.2)


def test_score_delta_is_paired_per_sample_and_memory_is_the_peak():
    rows = [_row("ar", 0, 0.1, score=0.9, mem=1000), _row("ar", 1, 0.1, score=0.7, mem=1000),
            _row("x", 0, 0.1, score=0.9, mem=1000), _row("x", 1, 0.1, score=0.6, mem=1200)]
    c = _cell(q.cell_table(rows), method="x")
    assert c["score_delta"] == pytest.approx(-0.05) and c["score_ar"] == pytest.approx(0.8)
    assert c["peak_mem_bytes"] == 1200 and c["ar_peak_mem_bytes"] == 1000


def test_s_vs_k_marks_only_the_first_inversion():
    cells = [{"k": k, "alpha": a, "gamma": 0.2, "variant": f"x k={k}", "speedup": 1.0}
             for k, a in ((1, 0.9), (2, 0.5), (3, 0.36), (4, 0.27))]  # marginals 0.9, 0.1, 0.08, 0.0
    assert [p["inversion"] for p in q.s_vs_k(cells)] == [False, True, False, False]
    assert q.s_vs_k([{**cells[0], "k": "auto"}]) == []  # adaptive cells are not points of S(k)


def test_best_per_cell_skips_lossy_methods_and_needs_more_than_one():
    base = {"model": "m", "context_length": 1, "batch_size": 1}
    cells = [{**base, "method": "fast", "variant": "fast", "speedup": 2.0, "lossless_rate": 0.9},
             {**base, "method": "ok", "variant": "ok", "speedup": 1.3, "lossless_rate": 1.0}]
    (b,) = q.best_per_cell(cells, ("model", "context_length", "batch_size"))
    assert b["best"] == "ok" and b["speedup"] == 1.3
    slow = [{**base, "method": "slow", "variant": "slow", "speedup": 0.9, "lossless_rate": None}]  # no ar cell
    (b,) = q.best_per_cell(slow, ("model", "context_length", "batch_size"))
    assert b["best"] == "ar" and b["speedup"] == 1.0 and b["runner_up"] == "slow"


def test_latency_gate_checks_the_inter_token_gap_and_no_data_never_passes():
    cell = {"lossless_rate": 1.0, "n_conclusive": 2, "score_delta": 0.0, "speedup": 1.5, "itl_p95_s": 0.3,
            "ar_itl_p95_s": 0.1, "peak_mem_bytes": 1, "ar_peak_mem_bytes": 1, "throughput": 2, "ar_throughput": 1}
    g = q.gate_row(cell)
    assert g["latency"] is False and "P95 ITL 3x" in g["reason"] and not g["passed"]
    assert q.gate_row(cell, q.GateThresholds(max_itl_ratio=3.0))["passed"] is True
    g = q.gate_row({**cell, "lossless_rate": None, "itl_p95_s": 0.1})  # sampling only: correctness unknown
    assert g["correctness"] is None and g["quality"] and g["latency"] and g["capacity"] and g["passed"] is False


def test_an_int8_draft_is_its_own_cell_paired_with_the_same_ar():
    def r(method, i, tpot, drafted_bytes=0):
        row = _row(method, i, tpot)
        row["stats"]["draft_weight_bytes"] = drafted_bytes
        return row

    rows = [r("ar", 0, 0.1), r("ar", 1, 0.1), r("x", 0, 0.08), r("x", 1, 0.05, drafted_bytes=10)]
    cells = q.cell_table(rows)
    assert {c["variant"]: c["speedup"] for c in cells} == pytest.approx(
        {"ar": 1.0, "x": 1.25, "x int8-draft": 2.0})
    assert _cell(cells, method="x", draft_weights="int8")["n_pairs"] == 1


def test_a_static_batch_keeps_the_ledger_times_its_straggle():
    """A batch runs until its slowest row is done: rows needing 30, 34, 46 and 32 rounds keep
    mean / max = 35.5 / 46 of the per-row ledger; a batch whose rows all need 40 keeps it all;
    ar's rows of unequal length (an early stop) straggle too, and the ratio is against theirs."""
    from sparsespec.stats import batch_straggle

    assert batch_straggle([{"num_steps": s} for s in (30, 34, 46, 32)]) == pytest.approx(35.5 / 46)
    assert batch_straggle([{"num_steps": 12}]) == 1.0 and batch_straggle([{"num_steps": 0}]) is None
    assert batch_straggle([]) is None

    def r(method, batch, i, steps, **stats):
        row = _row(method, i, 0.1)
        row["batch_size"] = 4
        row["stats"].update(batch_key=f"b{batch}", num_steps=steps, **stats)
        return row

    spec = dict(num_drafted=30, num_accepted=20, num_drafting_steps=30, num_draft_forwards=30, num_emitted=50,
                draft_s=0.3, verify_s=3.0)
    rows = [r("ar", 0, i, 63) for i in range(4)] + [r("ar", 1, i, s) for i, s in enumerate((63, 63, 63, 50))]
    rows += [r("x", 0, i, s, **spec) for i, s in enumerate((30, 34, 46, 32))]
    rows += [r("x", 1, i, 40, **spec) for i in range(4)]
    want = float(np.median([35.5 / 46, 1.0 / (59.75 / 63)]))
    assert q.paired_straggle([x for x in rows if x["method"] == "x"], [x for x in rows if x["method"] == "ar"]) \
        == pytest.approx(want)
    cells = q.cell_table(rows)
    x, ar = _cell(cells, method="x"), _cell(cells, method="ar")
    assert x["straggle"] == pytest.approx(want)
    assert x["batch_predicted_speedup"] == pytest.approx(x["predicted_speedup"] * want)
    assert ar["straggle"] == 1.0 and ar["batch_predicted_speedup"] == 1.0
    assert q.paired_straggle([x for x in rows if x["method"] == "x"], []) is None  # nothing paired


def test_a_queue_straggles_by_its_empty_slot_rounds_and_is_a_cell_of_its_own():
    """A queue (continuous batching): rows of 5, 5, 5 and 3 rounds through 2 slots in 10 decode
    rounds used 18 of the 20 slot-rounds; four rows of 4 rounds that took 10 rounds (slots idle
    for 4 slot-rounds) used 16 (mean / max would say 1.0); in 8 rounds, all. Static batches and
    queues of the same batch size are never pooled, in every view's grouping, and tables print
    the queue beside the batch size."""
    from sparsespec.stats import batch_straggle

    def qst(steps, rounds):
        return [{"num_steps": n, "batch_size": 2, "queue_size": len(steps), "batch_rounds": rounds} for n in steps]

    assert batch_straggle(qst((5, 5, 5, 3), 10)) == pytest.approx(18 / 20)
    assert batch_straggle(qst((4, 4, 4, 4), 10)) == pytest.approx(16 / 20)
    assert batch_straggle(qst((4, 4, 4, 4), 8)) == 1.0
    rows = [_row("ar", i, 0.1) for i in range(2)] + [_row("x", i, 0.05) for i in range(2)]
    queued = [{**r, "run_id": "q", "queue_depth": 2, "stats": {**r["stats"], "batch_key": "q0"}}
              for r in (_row("ar", i, 0.1) for i in range(2))]
    queued += [{**r, "run_id": "q", "queue_depth": 2, "stats": {**r["stats"], "batch_key": "q0"}}
               for r in (_row("x", i, 0.08) for i in range(2))]
    for by in (q.CELL_KEYS, q.SETTING_KEYS, q.ENGINE_CELL_KEYS + ("method", "k")):
        cells = q.cell_table(rows + queued, by=by)
        got = {(c["queue_depth"], c["method"]): c["speedup"] for c in cells}
        assert got == pytest.approx({(1, "ar"): 1.0, (1, "x"): 2.0, (2, "ar"): 1.0, (2, "x"): 1.25}), by
    assert (q.batch_label(4), q.batch_label(4, None), q.batch_label(4, 4)) == ("4", "4", "4 (queue 16)")


def test_runs_that_differ_in_other_options_are_cells_of_their_own_each_against_its_run_ar():
    """Two runs of x k=auto, budget_frac 0.1 and 0.2 (run configs), plus a third option every run
    shares: two cells, named by the option they differ in, each paired with its own run's ar."""
    runs = [{"run_id": run, "config": {"method_options": {"ar": {}, "x": {"k": "auto", "draft_weights": "target",
                                                                          "budget_frac": bf, "window": 16}}}}
            for run, bf in (("r1", 0.1), ("r2", 0.2))]
    rows = [_row("ar", i, 0.1, run="r1") for i in range(2)] + [_row("x", i, 0.05, run="r1") for i in range(2)]
    rows += [_row("ar", i, 0.3, run="r2") for i in range(2)] + [_row("x", i, 0.3, run="r2") for i in range(2)]
    rows = q.with_run_fields(rows, runs)
    assert {r["options"] for r in rows if r["method"] == "ar"} == {""}
    assert q.run_options(runs[0]["config"], "x") == '{"budget_frac": 0.1, "window": 16}'  # k, draft weights apart
    cells = q.cell_table(rows)
    assert {c["variant"]: c["speedup"] for c in cells} == pytest.approx(
        {"ar": 1.0, "x (budget_frac=0.1)": 2.0, "x (budget_frac=0.2)": 1.0})
    assert all(c["n_pairs"] == 2 for c in cells if c["method"] == "x")
    # without the run configs (no options on the rows) the two runs pool, as before
    assert len([c for c in q.cell_table([{k: v for k, v in r.items() if k != "options"} for r in rows])
                if c["method"] == "x"]) == 1
    # the engines table keeps them apart too, each against our ar of the same cells
    eng = q.engines_table(rows)
    assert sorted((r["variant"], round(r["speedup"], 3)) for r in eng if r["method"] == "x") == [
        ("x (budget_frac=0.1)", 2.0), ("x (budget_frac=0.2)", 1.0)]


@pytest.fixture(scope="module")
def quant_rows(tmp_path_factory):
    url = f"sqlite:///{tmp_path_factory.mktemp('q8')}/quant.db"
    seed.seed_quantized(url)
    with open_store(url, create=False) as s:
        return url, q.with_run_fields(s.results(), s.runs())


def test_a_quantised_target_is_its_own_cell_paired_with_its_own_ar(quant_rows):
    _, rows = quant_rows
    assert {r["quantize"] for r in rows} == {"none", "int8"}
    cells = q.cell_table(rows)
    by = {c["variant"]: c for c in cells}
    assert set(by) == {"ar", "sparsespec-l k=2", "ar [int8 target]", "sparsespec-l k=2 [int8 target]"}
    # each method against the ar of its own target, never pooled with the other target's
    assert by["sparsespec-l k=2"]["speedup"] == pytest.approx(1.25)
    assert by["sparsespec-l k=2 [int8 target]"]["speedup"] == pytest.approx(1.2)
    assert by["sparsespec-l k=2 [int8 target]"]["score_delta"] == 0.0  # against the int8 ar's scores
    assert by["ar [int8 target]"]["n"] == 2 and by["sparsespec-l k=2 [int8 target]"]["n_pairs"] == 2
    lb = q.leaderboard(rows)
    assert [r["variant"] for r in lb] == ["ar", "sparsespec-l k=2", "ar [int8 target]", "sparsespec-l k=2 [int8 target]"]


def test_four_way_table_against_the_full_precision_ar(quant_rows):
    _, rows = quant_rows
    four = q.four_way(rows, n_boot=200)
    assert [r["arm"] for r in four] == list(q.FOUR_WAY_ARMS)
    assert all(tuple(r) == q.FOUR_WAY_KEYS for r in four)
    base, quant, spec, both = four
    assert base["variant"] == "ar" and base["speedup"] == 1.0 and base["score"] == 1.0 and base["score_delta"] == 0.0
    # quantisation alone: 1.6x, one of two samples lost (score 0.5, delta -0.5), tokens differ on s1
    assert quant["speedup"] == pytest.approx(1.6) and quant["n_pairs"] == 2
    assert quant["score"] == 0.5 and quant["score_delta"] == pytest.approx(-0.5)
    assert quant["agreement_with_baseline"] == 0.5 and quant["lossless_against"] is None
    # speculation alone: 1.25x, lossless against the full-precision ar, quality unchanged
    assert spec["speedup"] == pytest.approx(1.25) and spec["lossless_against"] == "ar"
    assert spec["lossless_rate"] == 1.0 and spec["score_delta"] == 0.0 and spec["agreement_with_baseline"] == 1.0
    # both: 1.6 x 1.2 = 1.92x the baseline, 1.2x its own ar, lossless against the int8 ar only
    assert both["speedup"] == pytest.approx(1.92) and both["speedup_vs_own_ar"] == pytest.approx(1.2)
    assert both["lossless_against"] == "ar [int8 target]" and both["lossless_rate"] == 1.0
    assert both["score_delta"] == pytest.approx(-0.5) and both["agreement_with_baseline"] == 0.5
    assert all(r["speculation"] == "sparsespec-l k=2" for r in four)
    # a store with only full-precision runs has no four-way table
    assert q.four_way([r for r in rows if r["quantize"] == "none"]) == []


def test_four_way_pairs_batches_across_runs_not_by_position(quant_rows):
    """The cross-run pairing matches batch keys without the run id: swapping which batch of the
    int8 run is slow must move the median only through the matched pairs."""
    _, rows = quant_rows
    rows = [dict(r, stats=dict(r["stats"])) for r in rows]
    for r in rows:  # the int8 ar's batch 1 is twice as slow: pairs are 1.6 and 0.8 -> median 1.2
        if r["quantize"] == "int8" and r["method"] == "ar" and r["stats"]["batch_key"].endswith("/1"):
            r["stats"]["decode_s"] *= 2
            r["stats"]["batch_wall_s"] = 0.5 + r["stats"]["decode_s"]
    quant = q.four_way(rows, n_boot=100)[1]
    assert quant["speedup"] == pytest.approx(1.2)
    assert q.shared_batch_key(rows[0])[-1] == "niah_q/0"


def test_four_way_compares_an_int8_run_with_its_own_twin_only(quant_rows):
    """Another sweep's full-precision run at the same setting (other config, 3x slower, other
    scores) must not enter the table: the int8 run's baseline is the run that differs from it
    only in ``quantize``."""
    _, rows = quant_rows
    assert len({r["twin"] for r in rows}) == 1  # the two seeded runs are twins
    other = []
    for r in rows:
        if r["quantize"] == "none":
            st = dict(r["stats"], decode_s=3 * r["stats"]["decode_s"],
                      batch_key=r["stats"]["batch_key"].replace(r["run_id"], "other"))
            other.append(dict(r, run_id="other", twin="another-config", stats=st, score=0.0))
    four = q.four_way(rows + other, n_boot=100)
    assert [r["speedup"] for r in four] == pytest.approx([1.0, 1.6, 1.25, 1.92])
    assert four[0]["score"] == 1.0 and four[1]["score_delta"] == pytest.approx(-0.5)
    assert q.twin_key({"a": 1, "quantize": "int8"}) == q.twin_key({"a": 1}) != q.twin_key({"a": 2})

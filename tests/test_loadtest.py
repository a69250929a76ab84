"""cluster.serve.loadtest: statistics against hand-computed numbers, the A/B bootstrap, arrivals, CLI
checks, and an end-to-end run against a fake OpenAI-compatible streaming server (Starlette served
by uvicorn on 127.0.0.1 in a background thread). No Ray, no model weights (the registry test
loads SmolLM2's tokenizer only).
"""
from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
import zlib

import httpx
import numpy as np
import pytest

from cluster.results.ab import RequestRecord, ab_decision, ab_decisions
from cluster.serve.loadtest import (
    Prompt,
    check_loopback,
    main,
    parse_goodput,
    parse_percentiles,
    parse_spec_decode_counters,
    poisson_gaps,
    run_load,
    summarize,
    summarize_by_arm,
    spec_decode_from_metrics,
)

# ----------------------------------------------------------------------------- summarize


def _hand_records() -> list[RequestRecord]:
    return [
        RequestRecord(0, arm="a", prompt_len=10, success=True, status=200, ttft_s=0.1, itl_s=[0.02, 0.04],
                      e2el_s=0.16, output_tokens=3,
                      speculation={"num_spec_steps": 2, "num_draft_tokens": 8, "num_accepted_draft_tokens": 3,
                                   "acceptance_histogram": [0, 1, 1]}),
        RequestRecord(1, arm="a", prompt_len=20, success=True, status=200, ttft_s=0.2, itl_s=[0.05],
                      e2el_s=0.25, output_tokens=2,
                      speculation={"num_spec_steps": 1, "num_draft_tokens": 4, "num_accepted_draft_tokens": 4,
                                   "acceptance_histogram": [0, 0, 0, 0, 1]}),
        RequestRecord(2, arm="b", prompt_len=30, success=True, status=200, ttft_s=0.3, itl_s=[],
                      e2el_s=0.3, output_tokens=1),
        RequestRecord(3, arm="b", prompt_len=40, success=True, status=200, ttft_s=0.4, itl_s=[0.1, 0.1, 0.1],
                      e2el_s=0.7, output_tokens=4),
        # failed: its numbers must not count anywhere
        RequestRecord(4, arm=None, prompt_len=50, success=False, status=503, error="HTTP 503: overloaded",
                      ttft_s=0.001, e2el_s=0.001, output_tokens=7,
                      speculation={"num_spec_steps": 100, "num_draft_tokens": 100, "num_accepted_draft_tokens": 100}),
    ]


def test_summarize_hand_computed():
    m = summarize(_hand_records(), 2.0, goodput={"ttft": 250, "tpot": 60}, percentiles=(99,))
    assert m["completed"] == 4 and m["failed"] == 1
    assert m["duration"] == 2.0
    assert m["total_input_tokens"] == 100 and m["total_output_tokens"] == 10
    assert m["request_throughput"] == pytest.approx(2.0)
    assert m["output_throughput"] == pytest.approx(5.0)
    assert m["total_token_throughput"] == pytest.approx(55.0)
    # TTFT 100, 200, 300, 400 ms
    assert m["mean_ttft_ms"] == pytest.approx(250.0)
    assert m["median_ttft_ms"] == pytest.approx(250.0)
    assert m["std_ttft_ms"] == pytest.approx(math.sqrt((150**2 + 50**2 + 50**2 + 150**2) / 4))  # population
    assert m["p99_ttft_ms"] == pytest.approx(397.0)  # 300 + 0.97 * 100
    # TPOT: (160-100)/2 = 30, (250-200)/1 = 50, (700-400)/3 = 100; one-token request has none
    assert m["mean_tpot_ms"] == pytest.approx(60.0)
    assert m["median_tpot_ms"] == pytest.approx(50.0)
    assert m["std_tpot_ms"] == pytest.approx(math.sqrt(2600.0 / 3))
    assert m["p99_tpot_ms"] == pytest.approx(99.0)  # 50 + 0.98 * 50
    # ITL pooled: 20, 40, 50, 100, 100, 100
    assert m["mean_itl_ms"] == pytest.approx(410.0 / 6)
    assert m["median_itl_ms"] == pytest.approx(75.0)
    assert m["p99_itl_ms"] == pytest.approx(100.0)
    # E2EL 160, 250, 300, 700
    assert m["mean_e2el_ms"] == pytest.approx(352.5)
    assert m["median_e2el_ms"] == pytest.approx(275.0)
    assert m["p99_e2el_ms"] == pytest.approx(688.0)  # 300 + 0.97 * 400
    # goodput ttft<=250 and tpot<=60: requests 0 and 1
    assert m["good_requests"] == 2
    assert m["request_goodput"] == pytest.approx(1.0)
    # speculation summed over completed requests only
    assert (m["num_spec_steps"], m["num_draft_tokens"], m["num_accepted_draft_tokens"]) == (3, 12, 7)
    assert m["draft_acceptance_rate"] == pytest.approx(7 / 12)
    assert m["mean_acceptance_length"] == pytest.approx(1 + 7 / 3)
    assert m["acceptance_histogram"] == [0, 1, 1, 0, 1]
    assert m["failure_reasons"] == {"HTTP 503": 1}


def test_summarize_goodput_variants_and_percentiles():
    recs = _hand_records()
    # e2el <= 300: requests 0, 1, 2 (300 ms is within the SLO)
    assert summarize(recs, 2.0, goodput={"e2el": 300})["request_goodput"] == pytest.approx(1.5)
    # tpot <= 40: request 0 (30) and request 2 (one token: TPOT 0 for the SLO, as vllm)
    assert summarize(recs, 2.0, goodput={"tpot": 40})["good_requests"] == 2
    assert summarize(recs, 2.0)["request_goodput"] is None  # vLLM's None without --goodput
    m = summarize(recs, 2.0, percentiles=(50, 95))
    assert m["p50_ttft_ms"] == pytest.approx(250.0)
    assert m["p95_ttft_ms"] == pytest.approx(385.0)  # 300 + 0.85 * 100
    assert "p99_ttft_ms" not in m


def test_summarize_empty_and_no_spec():
    m = summarize([RequestRecord(0, success=False, error="ConnectError: refused")], 1.0)
    assert m["completed"] == 0 and m["failed"] == 1
    assert m["mean_ttft_ms"] is None and m["p99_itl_ms"] is None
    assert m["draft_acceptance_rate"] is None and m["mean_acceptance_length"] is None
    assert m["failure_reasons"] == {"ConnectError": 1}


def test_summarize_by_arm_shares_duration():
    arms = summarize_by_arm(_hand_records(), 2.0)
    assert list(arms) == ["a", "b"]
    assert arms["a"]["completed"] == 2 and arms["b"]["completed"] == 2
    assert arms["a"]["request_throughput"] == pytest.approx(1.0)
    assert arms["a"]["mean_tpot_ms"] == pytest.approx(40.0)
    assert arms["b"]["mean_tpot_ms"] == pytest.approx(100.0)
    assert arms["b"]["num_spec_steps"] == 0 and arms["b"]["mean_acceptance_length"] is None
    assert arms["a"]["mean_acceptance_length"] == pytest.approx(1 + 7 / 3)


def test_tpot_property():
    r = RequestRecord(0, success=True, ttft_s=0.5, e2el_s=1.5, output_tokens=5)
    assert r.tpot_s == pytest.approx(0.25)
    assert RequestRecord(0, success=True, ttft_s=0.5, e2el_s=1.5, output_tokens=1).tpot_s is None
    assert RequestRecord(0, success=False, ttft_s=0.5, e2el_s=1.5, output_tokens=5).tpot_s is None


# ----------------------------------------------------------------------------- A/B decision


def _tpot_records(arm: str, tpots_s, start: int = 0, ttft: float = 0.1, n_out: int = 11):
    return [RequestRecord(start + i, arm=arm, success=True, status=200, ttft_s=ttft,
                          e2el_s=ttft + t * (n_out - 1), output_tokens=n_out) for i, t in enumerate(tpots_s)]


def test_ab_identical_distributions_not_significant():
    rng = np.random.default_rng(1)
    base = rng.normal(0.05, 0.01, 40).clip(0.01)
    treat = rng.normal(0.05, 0.01, 40).clip(0.01)
    recs = _tpot_records("ar", base) + _tpot_records("sparsespec-l", treat, 100)
    d = ab_decision(recs)
    assert d["baseline"] == "ar" and d["treatment"] == "sparsespec-l"
    assert d["n_baseline"] == 40 and d["n_treatment"] == 40
    lo, hi = d["tpot_ratio_ci"]
    assert lo < 1.0 < hi
    assert d["significant"] is False
    assert "not significant at this sample size" in d["conclusion"]
    # the very same values in both arms: ratio exactly 1
    same = ab_decision(_tpot_records("ar", base) + _tpot_records("x", base, 100))
    assert same["tpot_ratio"] == pytest.approx(1.0)
    assert same["tpot_ratio_ci"][0] < 1.0 < same["tpot_ratio_ci"][1]
    assert same["significant"] is False


def test_ab_clear_2x_shift_significant():
    rng = np.random.default_rng(2)
    base = rng.normal(0.05, 0.005, 40)
    treat = rng.normal(0.025, 0.0025, 40)
    recs = _tpot_records("ar", base) + _tpot_records("sparsespec-l", treat, 100)
    d = ab_decision(recs, n_boot=2000, seed=0)
    assert d["tpot_ratio"] == pytest.approx(0.5, abs=0.05)
    assert d["tpot_ratio"] == pytest.approx(np.median(treat) / np.median(base))
    lo, hi = d["tpot_ratio_ci"]
    assert lo < d["tpot_ratio"] < hi < 1.0
    assert d["significant"] is True
    assert d["speedup"] == pytest.approx(1 / d["tpot_ratio"])
    assert d["speedup_ci"][0] > 1.0
    assert "significantly faster" in d["conclusion"]
    assert "sparsespec-l's median TPOT is 0.5" in d["conclusion"] and "n=40/40" in d["conclusion"]
    # reproducible with the seed
    assert ab_decision(recs, n_boot=2000, seed=0)["tpot_ratio_ci"] == d["tpot_ratio_ci"]
    # reversed roles: significantly slower
    rev = ab_decision(recs, baseline="sparsespec-l", treatment="ar")
    assert rev["tpot_ratio"] == pytest.approx(2.0, abs=0.2)
    assert rev["significant"] is True and "significantly slower" in rev["conclusion"]


def test_ab_tiny_sample_too_small():
    recs = _tpot_records("ar", [0.05, 0.06, 0.05]) + _tpot_records("b", [0.02, 0.03, 0.02], 10)
    d = ab_decision(recs)
    assert d["too_small"] is True
    assert d["tpot_ratio_ci"] is None and d["significant"] is None
    assert "too small" in d["conclusion"]
    assert d["tpot_ratio"] == pytest.approx(0.02 / 0.05)


def test_ab_goodput_ratio():
    # baseline: 20 of 40 meet tpot <= 40 ms; treatment: all 40 do
    base = _tpot_records("ar", [0.03] * 20 + [0.05] * 20)
    treat = _tpot_records("t", [0.02] * 40, 100)
    d = ab_decision(base + treat, goodput={"tpot": 40})
    assert d["baseline_slo_attainment"] == pytest.approx(0.5)
    assert d["treatment_slo_attainment"] == pytest.approx(1.0)
    assert d["goodput_ratio"] == pytest.approx(2.0)
    assert d["goodput_ratio_ci"][0] > 1.0
    assert d["goodput_significant"] is True
    assert "goodput" in d["conclusion"] and "significantly higher" in d["conclusion"]


def test_ab_baseline_choice():
    recs = _tpot_records("zz", [0.05] * 6) + _tpot_records("ar", [0.05] * 6, 10)
    assert ab_decision(recs)["baseline"] == "ar"
    recs2 = _tpot_records("m2", [0.05] * 6) + _tpot_records("m1", [0.05] * 6, 10)
    assert ab_decision(recs2)["baseline"] == "m1"
    three = recs + _tpot_records("b", [0.05] * 6, 20)
    with pytest.raises(ValueError):
        ab_decision(three)
    ds = ab_decisions(three)
    assert [(d["baseline"], d["treatment"]) for d in ds] == [("ar", "b"), ("ar", "zz")]
    assert ab_decisions(_tpot_records("ar", [0.05] * 6)) == []


# ----------------------------------------------------------------------------- parsing


def test_poisson_gaps():
    a = poisson_gaps(4.0, 20000, seed=7)
    b = poisson_gaps(4.0, 20000, seed=7)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, poisson_gaps(4.0, 20000, seed=8))
    assert a.mean() == pytest.approx(0.25, rel=0.03)
    assert a.std() == pytest.approx(0.25, rel=0.05)  # exponential: std == mean
    assert (a >= 0).all()
    z = poisson_gaps(math.inf, 5, seed=0)
    assert z.shape == (5,) and not z.any()
    g = poisson_gaps(2.0, 20000, seed=1, burstiness=0.5)
    assert g.mean() == pytest.approx(0.5, rel=0.05)
    assert g.std() > 0.5 * 1.2  # burstier than Poisson
    with pytest.raises(ValueError):
        poisson_gaps(0.0, 3)


def test_parse_goodput():
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    assert parse_goodput("e2el:1000.5, TTFT:2") == {"e2el": 1000.5, "ttft": 2.0}
    for bad in (["ttft"], ["ttft:"], ["foo:3"], ["ttft:abc"], ["ttft:-1"], ["ttft:1", "ttft:2"], ["tpot:inf"], [":5"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
    assert parse_percentiles("50,95,99") == (50.0, 95.0, 99.0)
    for bad in ("0", "101", "x", ""):
        with pytest.raises(ValueError):
            parse_percentiles(bad)


def test_loopback_refused(capsys):
    assert check_loopback("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    assert check_loopback("http://localhost:8000") == "http://localhost:8000"
    assert check_loopback("http://[::1]:8000") == "http://[::1]:8000"
    rc = main(["--url", "http://10.1.2.3:8000", "--model", "smollm2-135m"], prompts=[[1, 2]])
    assert rc == 2
    err = capsys.readouterr().err
    assert "loopback" in err and "10.1.2.3" in err and "Traceback" not in err
    for url in ("http://example.com:8000", "http://127.0.0.1.evil.com:8000", "ftp://127.0.0.1/"):
        assert main(["--url", url, "--model", "m"], prompts=[[1]]) == 2


def test_bad_arguments_exit_2(capsys):
    assert main(["--url", "http://127.0.0.1:1", "--model", "m", "--goodput", "ttft:x"], prompts=[[1]]) == 2
    assert "goodput" in capsys.readouterr().err
    assert main(["--model", "m", "--num-prompts", "0"], prompts=[[1]]) == 2
    assert "must be >= 1" in capsys.readouterr().err
    assert main(["--model", "m", "--num-warmups", "-1"], prompts=[[1]]) == 2
    assert "must be >= 0" in capsys.readouterr().err
    assert main(["--model", "m", "--num-warmups", "x"], prompts=[[1]]) == 2
    assert "not an integer" in capsys.readouterr().err
    assert main(["--model", "m", "--request-rate", "-1"], prompts=[[1]]) == 2
    assert main(["--url", "http://127.0.0.1:1"], prompts=[[1]]) == 2  # --model missing


def test_unreachable_exit_2(capsys):
    with socket.socket() as s:  # a free port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc = main(["--url", f"http://127.0.0.1:{port}", "--model", "m", "--disable-tqdm"], prompts=[[1, 2]])
    assert rc == 2
    err = capsys.readouterr().err
    assert "cannot reach" in err and "Traceback" not in err


# ----------------------------------------------------------------------------- /metrics -> spec_decode_*

#: The keys vllm bench serve (vllm 0.32.0, vllm/benchmarks/serve.py) saves for a generation run
#: with speculative decoding, default percentiles (99) and no --save-detailed.
VLLM_RESULT_KEYS = (
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
    "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput", "latencies",
    "spec_decode_acceptance_rate", "spec_decode_acceptance_length", "spec_decode_num_drafts",
    "spec_decode_draft_tokens", "spec_decode_accepted_tokens", "spec_decode_per_position_acceptance_rates",
    *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "std", "p99")),
)


def _expo(arms: dict[str, tuple[int, int, int, list[int]]], extra: str = "") -> str:
    """A Prometheus text exposition as our /metrics writes it (prometheus_client: HELP/TYPE,
    _total and _created samples, labels sorted), arm -> (drafts, draft tokens, accepted, per pos)."""
    out = ["# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
           "# TYPE vllm:spec_decode_num_drafts_total counter"]
    for arm, (d, t, a, pos) in arms.items():
        lab = f'arm="{arm}",method="{arm}",model_name="m"'
        out += [f"vllm:spec_decode_num_drafts_total{{{lab}}} {float(d)}",
                f"vllm:spec_decode_num_drafts_created{{{lab}}} 1.764e+09",
                f"vllm:spec_decode_num_draft_tokens_total{{{lab}}} {float(t)}",
                f"vllm:spec_decode_num_accepted_tokens_total{{{lab}}} {float(a)}",
                *(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{lab},position="{p}"}} {float(v)}'
                  for p, v in enumerate(pos))]
    out.append('vllm:generation_tokens_total{arm="ar",method="ar",model_name="m"} 999.0')
    return "\n".join(out) + "\n" + extra


BEFORE = _expo({"sparsespec-l": (10, 40, 20, [8, 6, 4, 2]), "eagle3": (4, 12, 6, [3, 2, 1])})
AFTER = _expo({"sparsespec-l": (30, 120, 70, [26, 20, 14, 10]), "eagle3": (14, 42, 21, [11, 7, 3])})


def test_parse_spec_decode_counters():
    c = parse_spec_decode_counters(BEFORE)
    assert set(c) == {None, "sparsespec-l", "eagle3"}
    assert c["eagle3"] == {"num_drafts": 4, "num_draft_tokens": 12, "num_accepted_tokens": 6,
                           "accepted_per_pos": {0: 3, 1: 2, 2: 1}}
    assert c[None] == {"num_drafts": 14, "num_draft_tokens": 52, "num_accepted_tokens": 26,  # _created ignored
                       "accepted_per_pos": {0: 11, 1: 8, 2: 5, 3: 2}}
    # vllm serve's own labels (no arm): the whole server only; no spec series at all: None
    plain = ('vllm:spec_decode_num_drafts_total{engine="0",model_name="x"} 5.0\n'
             'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="x"} 15.0\n')
    assert set(parse_spec_decode_counters(plain)) == {None}
    assert parse_spec_decode_counters('vllm:generation_tokens_total{model_name="x"} 3.0\n# EOF\n') is None


def test_spec_decode_from_metrics_by_hand():
    got, why = spec_decode_from_metrics(BEFORE, AFTER)
    assert why is None and set(got) == {None, "sparsespec-l", "eagle3"}
    # sparsespec-l: +20 drafts, +80 draft tokens, +50 accepted, per position +18 +14 +10 +8
    assert got["sparsespec-l"] == {
        "spec_decode_acceptance_rate": pytest.approx(62.5), "spec_decode_acceptance_length": pytest.approx(3.5),
        "spec_decode_num_drafts": 20, "spec_decode_draft_tokens": 80, "spec_decode_accepted_tokens": 50,
        "spec_decode_per_position_acceptance_rates": pytest.approx([0.9, 0.7, 0.5, 0.4])}
    # eagle3: +10, +30, +15, per position +8 +5 +2
    assert got["eagle3"]["spec_decode_acceptance_rate"] == pytest.approx(50.0)
    assert got["eagle3"]["spec_decode_acceptance_length"] == pytest.approx(2.5)
    assert got["eagle3"]["spec_decode_per_position_acceptance_rates"] == pytest.approx([0.8, 0.5, 0.2])
    # the whole server, summed as vLLM sums every series: 30 drafts, 110 draft tokens, 65 accepted
    assert got[None] == {
        "spec_decode_acceptance_rate": pytest.approx(6500 / 110), "spec_decode_acceptance_length": pytest.approx(1 + 65 / 30),
        "spec_decode_num_drafts": 30, "spec_decode_draft_tokens": 110, "spec_decode_accepted_tokens": 65,
        "spec_decode_per_position_acceptance_rates": pytest.approx([26 / 30, 19 / 30, 12 / 30, 8 / 30])}


def test_spec_decode_from_metrics_without_numbers():
    # nothing drafted during the run
    got, why = spec_decode_from_metrics(BEFORE, BEFORE)
    assert got == {} and "drafted no token" in why
    # a server without speculative decoding (vllm serve without a speculative config, or all-AR)
    none = 'vllm:generation_tokens_total{model_name="x"} 3.0\n'
    for b, a in ((none, none), (BEFORE, none), (none, AFTER)):
        got, why = spec_decode_from_metrics(b, a)
        assert got == {} and "no vllm:spec_decode_* counters" in why
    # a replica restarted (its counters went down): that arm and the whole run are left out
    reset = _expo({"sparsespec-l": (3, 12, 5, [3, 1, 1, 0]), "eagle3": (14, 42, 21, [11, 7, 3])})
    got, why = spec_decode_from_metrics(BEFORE, reset)
    assert set(got) == {"eagle3"} and "went down" in why
    # an arm first seen after the run started counts from zero
    got, _ = spec_decode_from_metrics(_expo({"eagle3": (4, 12, 6, [3, 2, 1])}), AFTER)
    assert got["sparsespec-l"]["spec_decode_num_drafts"] == 30


# ----------------------------------------------------------------------------- fake server

TTFT_S = 0.06  # server-side sleep before the first text chunk
ITL_S = 0.03  # server-side sleep between text chunks
COLD_S = 0.5  # extra sleep for the first request the server ever answers (a warm-up)
FAIL, TRUNC, HANG = 999, 998, 997  # first prompt token -> 503 / stream without [DONE] / hang


def fake_arm(session: str) -> str:
    return "ar" if zlib.crc32(session.encode()) % 2 == 0 else "sparsespec-l"


class FakeState:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.calls: list[dict] = []
        self.inflight = 0
        self.max_inflight = 0
        self.cold = True
        self.metrics_on = True
        # vLLM's spec-decode counters of the drafting arm; never reset (counters only go up),
        # so every test's run starts from whatever the earlier ones left
        self.__dict__.setdefault("spec", {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": [0, 0, 0]})


def _make_app(state: FakeState):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    def chunk(text, finish=None):
        return {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"},
                                                         {"id": "m:ar", "object": "model"},
                                                         {"id": "m:sparsespec-l", "object": "model"}]})

    async def completions(request):
        body = await request.json()
        session = request.headers.get("x-session-id", "")
        arm = request.headers.get("x-arm") or fake_arm(session)
        state.calls.append({"session": session, "x_arm": request.headers.get("x-arm"), "body": body,
                            "warmup": request.headers.get("x-sparsespec-warmup"),
                            "auth": request.headers.get("authorization")})
        first = body["prompt"][0]
        headers = {"x-sparsespec-arm": arm, "x-sparsespec-method": arm}
        if first == FAIL:
            return JSONResponse({"error": {"message": "overloaded", "type": "overloaded", "param": None,
                                           "code": 503}}, status_code=503, headers=headers)
        cold, state.cold = state.cold, False
        spec = arm != "ar"
        pieces = ["ab", "cd"] if spec else ["a", "b", "c", "d"]

        async def gen():
            state.inflight += 1
            state.max_inflight = max(state.max_inflight, state.inflight)
            try:
                yield sse(chunk(""))  # an empty chunk at once: must not count as the first token
                await asyncio.sleep(TTFT_S + (COLD_S if cold else 0.0) + (30.0 if first == HANG else 0.0))
                for i, p in enumerate(pieces):
                    if i:
                        await asyncio.sleep(ITL_S)
                    yield sse(chunk(p, "length" if i == len(pieces) - 1 else None))
                if first == TRUNC:
                    return  # the stream ends without usage and [DONE]
                usage = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m", "choices": [],
                         "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": 4,
                                   "total_tokens": len(body["prompt"]) + 4},
                         "arm": arm, "method": arm}
                if spec:
                    usage["speculation"] = {"num_spec_steps": 2, "num_draft_tokens": 6,
                                            "num_accepted_draft_tokens": 2, "mean_acceptance_length": 2.0,
                                            "draft_acceptance_rate": 1 / 3, "acceptance_histogram": [0, 2]}
                    # the same request in vLLM's /metrics counters: 2 drafts of 3 tokens, each
                    # accepting 1 (position 0)
                    c = state.spec
                    c["drafts"] += 2
                    c["draft_tokens"] += 6
                    c["accepted"] += 2
                    c["per_pos"][0] += 2
                yield sse(usage)
                yield "data: [DONE]\n\n"
            finally:
                state.inflight -= 1

        return StreamingResponse(gen(), media_type="text/event-stream", headers=headers)

    async def metrics(request):
        if not state.metrics_on:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        c = state.spec
        lab = 'arm="sparsespec-l",method="sparsespec-l",model_name="m"'
        lines = ["# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
                 "# TYPE vllm:spec_decode_num_drafts_total counter",
                 f"vllm:spec_decode_num_drafts_total{{{lab}}} {float(c['drafts'])}",
                 f"vllm:spec_decode_num_drafts_created{{{lab}}} 1.7e+09",
                 f"vllm:spec_decode_num_draft_tokens_total{{{lab}}} {float(c['draft_tokens'])}",
                 f"vllm:spec_decode_num_accepted_tokens_total{{{lab}}} {float(c['accepted'])}",
                 *(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{lab},position="{p}"}} {float(v)}'
                   for p, v in enumerate(c["per_pos"])),
                 'vllm:generation_tokens_total{arm="ar",method="ar",model_name="m"} 123.0']
        return PlainTextResponse("\n".join(lines) + "\n")

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"]),
                             Route("/metrics", metrics)])


@pytest.fixture(scope="module")
def fake_server():
    import uvicorn

    state = FakeState()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_make_app(state), log_level="warning", lifespan="off",
                                           timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    t0 = time.monotonic()
    while not server.started:
        if time.monotonic() - t0 > 10 or not thread.is_alive():
            raise RuntimeError("fake server did not start")
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


@pytest.fixture
def server(fake_server):
    url, state = fake_server
    state.reset()
    return url, state


OK_PROMPTS = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]


def _run(url, **kw):
    async def go():
        async with httpx.AsyncClient(trust_env=False, timeout=30) as c:
            return await run_load(c, url=url, model="m", **kw)

    return asyncio.run(go())


def test_e2e_cli_against_fake_server(server, tmp_path, capsys):
    url, state = server
    out = tmp_path / "lt" / "result.json"
    prompts = OK_PROMPTS + [[FAIL, 1], [TRUNC, 1]]  # cycled: 4 ok, 1 x 503, 1 x truncated per 6
    n = 30
    rc = main(["--url", url, "--model", "m", "--num-prompts", str(n), "--num-warmups", "2",
               "--max-concurrency", "6", "--session-prefix", "t", "--max-tokens", "4", "--ignore-eos",
               "--goodput", "ttft:1000", "--percentiles", "50,99", "--output-json", str(out),
               "--save-requests", "--disable-tqdm", "--api-key", "secret-key"], prompts=prompts)
    assert rc == 0
    printed = capsys.readouterr().out
    assert "ar" in printed and "sparsespec-l" in printed and "A/B:" in printed

    # the server saw the warm-ups first, then the measured requests
    assert len(state.calls) == n + 2
    assert [c["session"] for c in state.calls[:2]] == ["t-warmup-0", "t-warmup-1"]
    body = state.calls[-1]["body"]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 4 and body["ignore_eos"] is True and body["temperature"] == 0.0
    assert body["model"] == "m" and body["user"] == state.calls[-1]["session"]
    assert all(c["auth"] == "Bearer secret-key" for c in state.calls)
    assert state.max_inflight <= 6

    doc = json.loads(out.read_text())
    assert "secret-key" not in out.read_text()
    assert doc["config"]["num_prompts"] == n and doc["config"]["request_rate"] == "inf"
    assert set(VLLM_RESULT_KEYS) | {"p50_ttft_ms", "p50_tpot_ms", "p50_itl_ms", "p50_e2el_ms"} <= set(doc)
    assert (doc["backend"], doc["model_id"], doc["num_prompts"], doc["request_rate"], doc["max_concurrency"]) == (
        "openai", "m", n, "inf", 6)
    assert len(doc["latencies"]) == n and "ttfts" not in doc  # the per-request lists need --save-detailed
    ov = doc  # the whole run at the top level, as vllm bench serve writes it
    assert ov["completed"] == 20 and ov["failed"] == 10
    assert ov["failure_reasons"] == {"HTTP 503": 5, "incomplete": 5}
    assert ov["total_output_tokens"] == 20 * 4
    assert ov["total_input_tokens"] == 5 * (3 + 2 + 1 + 4)

    # per-arm counts follow the fake's routing rule
    expect = {"ar": [0, 0], "sparsespec-l": [0, 0]}
    for i in range(n):
        p = prompts[i % len(prompts)]
        expect[fake_arm(f"t-{i}")][0 if p[0] not in (FAIL, TRUNC) else 1] += 1
    assert set(doc["arms"]) == {"ar", "sparsespec-l"}
    for arm, (ok, bad) in expect.items():
        assert (doc["arms"][arm]["completed"], doc["arms"][arm]["failed"]) == (ok, bad), arm
        assert doc["arms"][arm]["duration"] == ov["duration"]
    assert min(expect["ar"][0], expect["sparsespec-l"][0]) >= 5  # enough for a CI
    spec = doc["arms"]["sparsespec-l"]
    k = expect["sparsespec-l"][0]
    assert (spec["num_spec_steps"], spec["num_draft_tokens"], spec["num_accepted_draft_tokens"]) == (2 * k, 6 * k, 2 * k)
    assert spec["mean_acceptance_length"] == pytest.approx(2.0)
    assert spec["draft_acceptance_rate"] == pytest.approx(1 / 3)
    assert doc["arms"]["ar"]["num_spec_steps"] == 0 and doc["arms"]["ar"]["mean_acceptance_length"] is None
    # vLLM's spec_decode_* from the /metrics deltas over the measured phase only (the warm-up that
    # reached sparsespec-l happened before the first scrape): k requests x 2 drafts x 3 tokens,
    # 1 accepted per draft, at position 0
    want = {"spec_decode_num_drafts": 2 * k, "spec_decode_draft_tokens": 6 * k, "spec_decode_accepted_tokens": 2 * k,
            "spec_decode_acceptance_rate": pytest.approx(100 / 3), "spec_decode_acceptance_length": pytest.approx(2.0),
            "spec_decode_per_position_acceptance_rates": [1.0, 0.0, 0.0]}
    assert {key: spec[key] for key in want} == want
    assert {key: doc[key] for key in want} == want  # the whole server: only sparsespec-l drafts
    assert "spec_decode_unavailable" not in doc
    assert not any(key.startswith("spec_decode") for key in doc["arms"]["ar"])

    # timings: TTFT >= the server's sleep (the empty chunk at t=0 is ignored); warm-ups excluded
    # (the first warm-up slept COLD_S more)
    for arm in ("ar", "sparsespec-l"):
        m = doc["arms"][arm]
        assert TTFT_S * 1000 - 2 <= m["median_ttft_ms"] <= TTFT_S * 1000 + 150
        assert ITL_S * 1000 - 2 <= m["median_itl_ms"] <= ITL_S * 1000 + 100
        assert m["p99_ttft_ms"] < COLD_S * 1000
        assert m["request_goodput"] is not None
    # ar: 3 gaps for 4 tokens -> TPOT ~ ITL; spec: 1 gap for 4 tokens -> TPOT ~ ITL/3
    assert doc["arms"]["ar"]["median_tpot_ms"] == pytest.approx(ITL_S * 1000, abs=25)
    assert doc["arms"]["sparsespec-l"]["median_tpot_ms"] < doc["arms"]["ar"]["median_tpot_ms"]
    reqs = doc["requests"]
    assert len(reqs) == n and not any(r["warmup"] for r in reqs)
    assert {r["session"] for r in reqs}.isdisjoint({"t-warmup-0", "t-warmup-1"})
    ok = [r for r in reqs if r["success"]]
    assert all(r["output_tokens"] == 4 and r["finish_reason"] == "length" for r in ok)
    assert all(r["text"] in ("abcd",) for r in ok)
    assert all(len(r["itl_s"]) == (3 if r["arm"] == "ar" else 1) for r in ok)
    warm = doc["warmup_requests"]
    assert len(warm) == 2 and warm[0]["ttft_s"] >= COLD_S
    assert doc["warmup"] == {"sent": 2, "completed": 2}

    dec = doc["decision"]
    assert dec["baseline"] == "ar" and dec["treatment"] == "sparsespec-l"
    assert dec["n_baseline"] == expect["ar"][0] and dec["n_treatment"] == expect["sparsespec-l"][0]
    assert dec["tpot_ratio"] < 1.0 and dec["significant"] is True
    assert "significantly faster" in dec["conclusion"]
    assert dec["conclusion"] in printed


def test_e2e_server_without_metrics_and_result_file_flags(server, tmp_path, capsys):
    """A server without /metrics (404): the run completes, the spec_decode_* keys are absent and
    the reason is logged and saved; --save-result names the file as vLLM does, in --result-dir."""
    url, state = server
    state.metrics_on = False
    rc = main(["--url", url, "--model", "org/m", "--num-prompts", "4", "--max-concurrency", "2", "--max-tokens", "4",
               "--save-result", "--result-dir", str(tmp_path / "res"), "--save-detailed", "--disable-tqdm"],
              prompts=[[1, 2, 3], [FAIL, 1]])
    assert rc == 0
    err = capsys.readouterr().err
    assert "no spec_decode_* numbers: GET /metrics answered HTTP 404" in err
    (path,) = (tmp_path / "res").iterdir()
    assert path.name.startswith("openai-infqps-concurrency2-m-") and path.suffix == ".json"
    doc = json.loads(path.read_text())
    assert not any(key.startswith("spec_decode_") and key != "spec_decode_unavailable" for key in doc)
    assert not any(key.startswith("spec_decode_") for a in doc["arms"].values() for key in a)
    assert doc["spec_decode_unavailable"] == "GET /metrics answered HTTP 404"
    assert doc["completed"] == 2 and doc["failed"] == 2 and doc["request_goodput"] is None
    # --save-detailed: vLLM's per-request lists, in request order (failed: 0 / "" / the error)
    assert doc["input_lens"] == [3, 2, 3, 2] and doc["output_lens"] == [4, 0, 4, 0]
    assert doc["generated_texts"][0] == "abcd" and doc["generated_texts"][1] == ""
    assert doc["errors"][0] == "" and doc["errors"][1].startswith("HTTP 503")
    assert doc["ttfts"][1] == 0.0 and doc["ttfts"][0] >= TTFT_S and len(doc["itls"]) == 4

    # --result-filename inside --result-dir; --output-json is the same as --save-result --result-filename
    state.metrics_on = True
    assert main(["--url", url, "--model", "m", "--num-prompts", "2", "--save-result", "--result-dir",
                 str(tmp_path / "d"), "--result-filename", "x.json", "--disable-tqdm"], prompts=[[1, 2]]) == 0
    assert (tmp_path / "d" / "x.json").is_file()
    assert main(["--url", url, "--model", "m", "--num-prompts", "2", "--output-json", str(tmp_path / "o.json"),
                 "--disable-tqdm"], prompts=[[1, 2]]) == 0
    assert json.loads((tmp_path / "o.json").read_text())["completed"] == 2
    assert main(["--url", url, "--model", "m", "--output-json", "a.json", "--result-filename", "b.json"],
                prompts=[[1]]) == 2
    # without --save-result, vLLM writes nothing (and we say so)
    capsys.readouterr()
    assert main(["--url", url, "--model", "m", "--num-prompts", "1", "--result-dir", str(tmp_path / "none"),
                 "--disable-tqdm"], prompts=[[1, 2]]) == 0
    assert not (tmp_path / "none").exists() and "without --save-result" in capsys.readouterr().err


def test_e2e_all_failed_exit_1(server, capsys):
    url, _ = server
    rc = main(["--url", url, "--model", "m", "--num-prompts", "3", "--disable-tqdm"], prompts=[[FAIL]])
    assert rc == 1
    assert "every measured request failed" in capsys.readouterr().err


def test_forced_arm_sessions_and_concurrency(server):
    url, state = server
    res = _run(url, prompts=OK_PROMPTS, num_prompts=8, arm="sparsespec-l", sessions=2, session_prefix="s",
               max_concurrency=2)
    assert all(r.arm == "sparsespec-l" and r.success for r in res.records)
    assert all(c["x_arm"] == "sparsespec-l" for c in state.calls)
    assert {c["session"] for c in state.calls} == {"s-s0", "s-s1"}
    assert state.max_inflight <= 2
    assert len(res.records) == 8 and res.not_sent == 0 and not res.timed_out
    # 8 requests, 2 at a time, each >= TTFT + ITL: at least 4 rounds
    assert res.duration_s >= 4 * (TTFT_S + ITL_S) - 0.01


def test_warmups_reach_every_arm_the_server_lists(server):
    from cluster.serve.loadtest import check_reachable

    url, state = server

    async def arms():
        async with httpx.AsyncClient(trust_env=False, timeout=30) as c:
            return await check_reachable(c, url, model="m")

    listed = asyncio.run(arms())
    assert listed == ["ar", "sparsespec-l"]
    state.calls.clear()
    res = _run(url, prompts=OK_PROMPTS, num_prompts=2, num_warmups=4, warmup_arms=listed)
    warm = state.calls[:4]
    assert [c["x_arm"] for c in warm] == ["ar", "sparsespec-l", "ar", "sparsespec-l"]
    assert all(c["x_arm"] is None for c in state.calls[4:])  # measured requests go through the split
    # warm-ups say so, for the endpoint's stored rows (Store.serve_requests leaves them out)
    assert [c["warmup"] for c in state.calls] == ["1"] * 4 + [None] * 2
    assert len(res.warmups) == 4 and len(res.records) == 2


def test_fresh_sessions_and_poisson_rate(server):
    url, state = server
    res = _run(url, prompts=OK_PROMPTS, num_prompts=6, request_rate=20.0, seed=3, session_prefix="p")
    assert [c["session"] for c in state.calls] == [f"p-{i}" for i in range(6)]
    starts = [r.start_s for r in res.records]
    expected = np.concatenate([[0.0], np.cumsum(poisson_gaps(20.0, 6, 3)[:-1])])
    assert np.all(np.asarray(starts) >= expected - 0.005)
    assert np.all(np.asarray(starts) <= expected + 0.2)


def test_total_timeout_cancels_in_flight(server):
    url, _ = server
    t0 = time.perf_counter()
    res = _run(url, prompts=[[HANG, 1]], num_prompts=3, timeout_s=0.5, request_timeout_s=60)
    elapsed = time.perf_counter() - t0
    assert elapsed < 5
    assert res.timed_out
    assert len(res.records) == 3 and not any(r.success for r in res.records)
    assert all(r.error.startswith("cancelled") for r in res.records)
    assert 0.4 <= res.duration_s < 3
    m = summarize(res.records, res.duration_s)
    assert m["completed"] == 0 and m["failed"] == 3 and m["failure_reasons"] == {"cancelled": 3}


def test_total_timeout_stops_sending(server):
    url, state = server
    res = _run(url, prompts=OK_PROMPTS, num_prompts=50, request_rate=4.0, seed=0, timeout_s=0.6)
    assert res.not_sent > 0 and res.timed_out
    assert len(res.records) + res.not_sent == 50
    assert len(state.calls) == len(res.records)


def test_request_timeout(server):
    url, _ = server
    res = _run(url, prompts=[[HANG]], num_prompts=2, request_timeout_s=0.3)
    assert [r.success for r in res.records] == [False, False]
    assert all(r.error.startswith("timeout") for r in res.records)
    assert not res.timed_out


def test_run_load_accepts_prompt_objects(server):
    url, state = server
    res = _run(url, prompts=[Prompt((5, 6, 7), 9, task="qasper", sample_id="x1")], num_prompts=2,
               session_prefix="o")
    assert all(c["body"]["max_tokens"] == 9 and c["body"]["prompt"] == [5, 6, 7] for c in state.calls)
    assert [r.task for r in res.records] == ["qasper", "qasper"]
    assert all(r.prompt_len == 3 and r.prompt_tokens == 3 for r in res.records)


# ----------------------------------------------------------------------------- registry prompts


def test_load_prompts_from_registry():
    """Real RULER prompts with SmolLM2's tokenizer (about 4 s, so not marked slow; like the evals
    tests it uses the provisioned model's tokenizer)."""
    from cluster.serve.loadtest import load_prompts

    ps = load_prompts("smollm2-135m", "ruler", num_prompts=4, context_length=1024,
                      tasks=["niah_single_1", "niah_single_2"])
    assert len(ps) == 4
    assert [p.task for p in ps] == ["niah_single_1", "niah_single_2", "niah_single_1", "niah_single_2"]
    for p in ps:
        assert isinstance(p.prompt, tuple) and all(isinstance(t, int) for t in p.prompt)
        assert 0 < len(p.prompt) and len(p.prompt) + p.max_tokens <= 1024
    capped = load_prompts("smollm2-135m", "ruler", num_prompts=2, context_length=1024,
                          tasks=["niah_single_1"], max_tokens=16)
    assert all(p.max_tokens == 16 for p in capped)

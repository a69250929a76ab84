"""A seeded result store whose numbers are known by hand (for the query, report and dashboard tests).

Benchmark ``ruler``, task ``niah``, model ``m``: one run per cell (context 1024/2048 x batch 1/2),
methods ``ar``, ``sparsespec-l`` (k auto) and ``ngram`` (k 3), two samples per cell (batch 1: two
batches of one; batch 2: one batch of two). Every row decodes 10 tokens (11 output tokens).
ar's batch TPOT is 0.1 s; a method's is 0.1 / SPEEDUP[...]; at (2048, 1) sparsespec-l's two
batches run 1.0x and 1.5x (median 1.25, total-time speedup 2.0 / (1.0 + 1/1.5) = 1.2).

- sparsespec-l: 4 steps x k=2, 6 of 8 drafts accepted (alpha 0.75, tau 2.5, mean k 2), 8 draft
  forwards; draft_s = 0.12 D, verify_s = 0.6 D, other_s = 0.28 D of its decode seconds D, so
  gamma = (0.12 D / 8) / (0.6 D / 4) = 0.1 and the ledger S = (1.5 + 1) / (0.2 + 1) = 2.0833;
  histogram 2 steps accepting 2, 2 accepting 1 (position 1: 4/4, position 2: 2/4).
- ngram: 5 steps x k=3, 1 accepted each (alpha 1/3, tau 2), no draft forwards (gamma None);
  at (2048, 2) sample s1 is not lossless (lossless rate 0.5 there).
- Fixed-k runs (task ``niah_k``, context 2048, batch 1, one sample, 20 decoded tokens) of
  sparsespec-l with k = 1, 2, 4, 8: FIXED_K[k] = (steps, accepted); drafted = k * steps; a verify
  costs 0.1 s, a draft forward 0.015 s (gamma 0.15), other 0.01 s per step; ar: 20 steps.
- A sampling run (``longbench``/``qasper``, temperature 0.7, context 1024, batch 1, ar + ngram):
  ngram scores 0.1 lower on both samples; no conclusive losslessness.
- A run in progress with one failed shard and no results.
- Serve requests (experiment ``exp1``): arms ``ar`` (TPOT 0.1 s) and ``spec`` (TPOT 0.08 s), 6
  each, plus one 503 refused at the router and one 499 on ``spec``.
"""
from __future__ import annotations

import datetime as dt
from typing import Any

from cluster.results.store import open_store

MODEL = "m"
CONTEXTS = (1024, 2048)
BATCHES = (1, 2)
#: (method, context, batch) -> speedup per batch (one value per batch of the cell)
SPEEDUP = {
    ("sparsespec-l", 1024, 1): (0.8, 0.8), ("sparsespec-l", 1024, 2): (1.05,),
    ("sparsespec-l", 2048, 1): (1.0, 1.5), ("sparsespec-l", 2048, 2): (1.6,),
    **{("ngram", L, B): (0.9,) * (2 // B) for L in CONTEXTS for B in BATCHES},
}
FIXED_K = {1: (11, 9), 2: (8, 12), 4: (7, 13), 8: (6, 14)}
PEAK_MEM = {"ar": 1000, "sparsespec-l": 1050, "ngram": 1000}
KV_BYTES = 100
HOST = {
    "provenance": {"git": {"commit": "abc1234"}, "packages": {"torch": "2.13.0+cpu", "sparsespec": "0.1.0"},
                   "sweep": {"name": "seed"}},
    "devices": {"devices": {"cpu (2 cores on vm)": 1}},
}


def _stats(method: str, decode_s: float, *, batch_key: str, batch_wall_s: float, k: Any) -> dict[str, Any]:
    D = decode_s
    base = {"method": method, "num_prompt_tokens": 100, "num_output_tokens": 11, "num_emitted": 10,
            "prefill_s": 0.5, "ttft_s": 0.5, "decode_s": D, "total_s": 0.5 + D, "kv_bytes": KV_BYTES,
            "peak_mem_bytes": PEAK_MEM[method], "batch_key": batch_key, "batch_wall_s": batch_wall_s,
            "batch_prefill_s": 0.5, "itl_p50_s": D / 10, "itl_p99_s": D / 2}
    if method == "ar":
        return {**base, "k": None, "num_steps": 10, "num_drafting_steps": 0, "num_drafted": 0, "num_accepted": 0,
                "num_draft_forwards": 0, "accept_hist": {}, "draft_s": 0.0, "verify_s": 0.9 * D,
                "other_s": 0.1 * D, "itl_p95_s": 0.12 * D}
    if method == "sparsespec-l":
        return {**base, "k": k, "num_steps": 4, "num_drafting_steps": 4, "num_drafted": 8, "num_accepted": 6,
                "num_draft_forwards": 8, "accept_hist": {"2:1": 2, "2:2": 2},
                "step_trace": [[2, 2], [2, 1], [2, 2], [2, 1]], "draft_s": 0.12 * D, "verify_s": 0.6 * D,
                "other_s": 0.28 * D, "itl_p95_s": 0.25 * D}
    return {**base, "k": k, "num_steps": 5, "num_drafting_steps": 5, "num_drafted": 15, "num_accepted": 5,
            "num_draft_forwards": 0, "accept_hist": {"3:1": 5}, "step_trace": [[3, 1]] * 5, "draft_s": 0.0,
            "verify_s": 0.8 * D, "other_s": 0.2 * D, "itl_p95_s": 0.25 * D}


def _row(run_id: str, benchmark: str, task: str, method: str, sample: str, score: float, stats: dict,
         lossless: bool | None) -> dict[str, Any]:
    return dict(run_id=run_id, benchmark=benchmark, task=task, model=MODEL, method=method, sample_id=sample,
                prediction=f"{method}:{sample}", token_ids=[1, 2, 3], score=score, stats=stats,
                lossless=lossless, first_divergence=None, num_input_tokens_raw=100, num_input_tokens=100,
                references=["gold"])


def _store_run(store, run_id: str, benchmark: str, methods: list[str], config: dict, shards: dict[str, list]) -> None:
    store.start_run(run_id, benchmark=benchmark, model=MODEL, methods=methods, config=config, host=HOST)
    for key, rows in shards.items():
        store.start_shard(run_id, key, task=rows[0]["task"], sample_ids=sorted({r["sample_id"] for r in rows}),
                          worker={"pid": 1, "hostname": "vm"})
        store.complete_shard(run_id, key, rows, wall_s=3.0)
    store.finish_run(run_id)


def _config(benchmark: str, L: int, B: int, methods: dict[str, dict], temperature: float = 0.0) -> dict:
    return {"benchmark": benchmark, "context_length": L, "batch_size": B, "methods": list(methods),
            "method_options": methods, "sampling": {"temperature": temperature}}


def seed(url: str) -> dict[str, Any]:
    """Write the seeded runs into the store at ``url``; returns the run ids by role."""
    ids: dict[str, Any] = {"cells": {}, "fixed_k": {}}
    with open_store(url) as store:
        for L in CONTEXTS:
            for B in BATCHES:
                run_id = f"ruler-L{L}-B{B}"
                ids["cells"][(L, B)] = run_id
                shards: dict[str, list] = {}
                samples = ["s0", "s1"]
                batches = [samples[i:i + B] for i in range(0, 2, B)]
                for bi, batch in enumerate(batches):
                    bkey = f"{run_id}/niah/{bi}"
                    rows = []
                    for method in ("ar", "sparsespec-l", "ngram"):
                        tpot = 0.1 if method == "ar" else 0.1 / SPEEDUP[(method, L, B)][bi]
                        wall_decode = tpot * 10 * len(batch)
                        for s in batch:
                            st = _stats(method, wall_decode, batch_key=bkey, batch_wall_s=0.5 + wall_decode,
                                        k={"ar": None, "sparsespec-l": "auto", "ngram": 3}[method])
                            lossless = None if method == "ar" else not (method == "ngram" and (L, B) == (2048, 2)
                                                                          and s == "s1")
                            rows.append(_row(run_id, "ruler", "niah", method, s, 1.0 if s == "s0" else 0.0,
                                             st, lossless))
                    shards[bkey] = rows
                _store_run(store, run_id, "ruler", ["ar", "sparsespec-l", "ngram"],
                           _config("ruler", L, B, {"ar": {}, "sparsespec-l": {"k": "auto"}, "ngram": {"k": 3}}),
                           shards)
        for k, (steps, accepted) in FIXED_K.items():
            run_id = f"ruler-k{k}"
            ids["fixed_k"][k] = run_id
            bkey = f"{run_id}/niah_k/0"
            ar_dec = 20 * 0.1 + 20 * 0.01
            ar = {"method": "ar", "k": None, "num_prompt_tokens": 100, "num_output_tokens": 21, "num_steps": 20,
                  "num_emitted": 20, "num_drafted": 0, "num_accepted": 0, "num_draft_forwards": 0,
                  "num_drafting_steps": 0, "accept_hist": {}, "prefill_s": 0.5, "ttft_s": 0.5, "draft_s": 0.0,
                  "verify_s": 2.0, "other_s": 0.2, "decode_s": ar_dec, "total_s": 0.5 + ar_dec,
                  "batch_key": bkey, "batch_wall_s": 0.5 + ar_dec, "batch_prefill_s": 0.5}
            dec = 0.015 * k * steps + 0.1 * steps + 0.01 * steps
            sp = {**ar, "method": "sparsespec-l", "k": k, "num_steps": steps, "num_drafting_steps": steps,
                  "num_drafted": k * steps, "num_accepted": accepted, "num_draft_forwards": k * steps,
                  "accept_hist": {}, "draft_s": 0.015 * k * steps, "verify_s": 0.1 * steps,
                  "other_s": 0.01 * steps, "decode_s": dec, "total_s": 0.5 + dec, "batch_wall_s": 0.5 + dec}
            rows = [_row(run_id, "ruler", "niah_k", "ar", "s0", 1.0, ar, None),
                    _row(run_id, "ruler", "niah_k", "sparsespec-l", "s0", 1.0, sp, True)]
            _store_run(store, run_id, "ruler", ["ar", "sparsespec-l"],
                       _config("ruler", 2048, 1, {"ar": {}, "sparsespec-l": {"k": k}}), {bkey: rows})
        # sampling run: longbench qasper at temperature 0.7
        run_id = "longbench-sampling"
        ids["sampling"] = run_id
        shards = {}
        for i, s in enumerate(("q0", "q1")):
            bkey = f"{run_id}/qasper/{i}"
            ar_score = 0.6 if s == "q0" else 0.4
            rows = [_row(run_id, "longbench", "qasper", "ar", s, ar_score,
                         _stats("ar", 1.0, batch_key=bkey, batch_wall_s=1.5, k=None), None),
                    _row(run_id, "longbench", "qasper", "ngram", s, ar_score - 0.1,
                         _stats("ngram", 1.0 / 1.2, batch_key=bkey, batch_wall_s=0.5 + 1.0 / 1.2, k=3), None)]
            shards[bkey] = rows
        _store_run(store, run_id, "longbench", ["ar", "ngram"],
                   _config("longbench", 1024, 1, {"ar": {}, "ngram": {"k": 3}}, temperature=0.7), shards)
        # a run in progress with a failed shard
        run_id = "ruler-running"
        ids["running"] = run_id
        store.start_run(run_id, benchmark="ruler", model=MODEL, methods=["ar", "sparsespec-l"],
                        config=_config("ruler", 4096, 1, {"ar": {}, "sparsespec-l": {}}), host=HOST)
        store.start_shard(run_id, f"{run_id}/niah/0", task="niah", sample_ids=["s0"], worker={"pid": 2})
        store.fail_shard(run_id, f"{run_id}/niah/0", "worker died: ActorDiedError", final=True)
        store.start_shard(run_id, f"{run_id}/niah/1", task="niah", sample_ids=["s1"], worker={"pid": 3})
        store.record_event(run_id, "worker died", shard=f"{run_id}/niah/0")
        # Serve A/B requests
        t0 = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.timezone.utc)
        reqs = []
        for i in range(12):
            arm = "ar" if i % 2 == 0 else "spec"
            tpot = 0.1 if arm == "ar" else 0.08
            st = {"num_output_tokens": 11, "num_drafted": 0 if arm == "ar" else 8,
                  "num_accepted": 0 if arm == "ar" else 6, "num_drafting_steps": 0 if arm == "ar" else 4,
                  "itl_p95_s": 2 * tpot, "itl_p99_s": 3 * tpot}
            reqs.append(dict(request_id=f"r{i}", experiment="exp1", model=MODEL, arm=arm,
                             method="ar" if arm == "ar" else "sparsespec-l", session=f"u{i}",
                             endpoint="completions", stream=False, status=200, finish_reason="length",
                             prompt_tokens=100, output_tokens=11, max_tokens=11, temperature=0.0,
                             queue_s=0.0, ttft_s=0.2, e2el_s=0.2 + 10 * tpot, stats=st,
                             created_at=t0 + dt.timedelta(seconds=30 * i)))
        reqs.append(dict(request_id="r-refused", experiment="exp1", model=MODEL, arm=None, method=None,
                         endpoint="completions", stream=False, status=503, error="overloaded",
                         created_at=t0 + dt.timedelta(seconds=5)))
        reqs.append(dict(request_id="r-gone", experiment="exp1", model=MODEL, arm="spec", method="sparsespec-l",
                         endpoint="completions", stream=True, status=499, error="client disconnected",
                         output_tokens=3, created_at=t0 + dt.timedelta(seconds=200)))
        store.add_serve_requests(reqs)
    return ids


#: The quantisation x speculation seed (``seed_quantized``): per (target, method) the batch TPOT
#: in seconds, the same for both batches; ar's fp TPOT is 0.1, so quantisation alone is 1.6x,
#: speculation alone 1.25x, and speculation on the int8 target 1.2x over its own ar = 1.92x.
Q_TPOT = {("none", "ar"): 0.1, ("none", "sparsespec-l"): 0.08,
          ("int8", "ar"): 0.0625, ("int8", "sparsespec-l"): 0.0625 / 1.2}
#: (target, sample) -> (score, token ids): the int8 target loses sample s1 (score 0, other tokens).
Q_OUT = {("none", "s0"): (1.0, [1, 2, 3]), ("none", "s1"): (1.0, [4, 5, 6]),
         ("int8", "s0"): (1.0, [1, 2, 3]), ("int8", "s1"): (0.0, [4, 5, 7])}


def seed_quantized(url: str) -> dict[str, str]:
    """Two runs of one cell (ruler/niah_q, context 2048, batch 1, samples s0 and s1 in two
    batches), methods ar and sparsespec-l (k 2), on the full-precision and the int8 target."""
    ids = {}
    with open_store(url) as store:
        for q in ("none", "int8"):
            run_id = f"ruler-q-{q}"
            ids[q] = run_id
            shards = {}
            for bi, s in enumerate(("s0", "s1")):
                bkey = f"{run_id}/niah_q/{bi}"
                rows = []
                for method in ("ar", "sparsespec-l"):
                    dec = Q_TPOT[(q, method)] * 10
                    st = _stats(method, dec, batch_key=bkey, batch_wall_s=0.5 + dec, k=None if method == "ar" else 2)
                    score, tokens = Q_OUT[(q, s)]
                    row = _row(run_id, "ruler", "niah_q", method, s, score, st, None if method == "ar" else True)
                    rows.append({**row, "token_ids": tokens})
                shards[bkey] = rows
            config = _config("ruler", 2048, 1, {"ar": {}, "sparsespec-l": {"k": 2}})
            if q != "none":
                config["quantize"] = q
            _store_run(store, run_id, "ruler", ["ar", "sparsespec-l"], config, shards)
    return ids

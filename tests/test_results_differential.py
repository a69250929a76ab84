"""Every view of one store gives the same number for every cell: the CLI report (``--json``), the
leaderboard CSV and the dashboard's tables, on random stores (several methods, fixed and auto k,
int8 drafts and int8 targets, batch sizes, static batches and queues, cells whose ar is missing, runs
pooled).

The views group differently (the report and the dashboard's cell table per task, the leaderboard
and the speedup map with tasks pooled), so each is compared with ``cluster.results.aggregate.cell_table``
at its own grouping, and the per-task views with each other cell by cell."""
from __future__ import annotations

import csv
import io
import json
import math

import numpy as np
import pytest

from cluster.results import aggregate as cq
from cluster.results import report
from cluster.results.store import open_store
from dashboard import queries as dq

METHODS = ("ngram", "sparsespec-l", "magicdec-streaming")
NUMBERS = ("speedup", "alpha", "tau", "mean_k", "gamma", "lossless_rate", "score")


def _stats(rng, method, k, int8_draft, bkey, wall, n_out):
    dec = float(rng.uniform(0.5, 2.0))
    st = {"method": method, "num_prompt_tokens": 100, "num_output_tokens": n_out, "prefill_s": 0.3, "ttft_s": 0.3,
          "decode_s": dec, "total_s": 0.3 + dec, "batch_key": bkey, "batch_wall_s": wall, "batch_prefill_s": 0.3}
    if method == "ar":
        return {**st, "k": None, "num_steps": n_out - 1, "num_emitted": n_out - 1, "num_drafted": 0,
                "num_accepted": 0, "num_draft_forwards": 0, "accept_hist": {}, "draft_s": 0.0,
                "verify_s": 0.9 * dec, "other_s": 0.1 * dec}
    steps = int(rng.integers(1, max(2, n_out)))
    kk = int(rng.integers(1, 6)) if k == "auto" else k
    drafted = kk * steps
    accepted = int(rng.integers(0, drafted + 1))
    st.update(k=k, num_steps=steps, num_emitted=accepted + steps, num_drafted=drafted, num_accepted=accepted,
              num_draft_forwards=0 if method == "ngram" else drafted, accept_hist={f"{kk}:0": steps},
              draft_s=0.0 if method == "ngram" else 0.2 * dec, verify_s=0.6 * dec, other_s=0.2 * dec)
    if int8_draft:
        st["draft_weight_bytes"] = 1000
    return st


def random_store(url: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    with open_store(url) as store:
        for ri in range(int(rng.integers(3, 7))):
            L = int(rng.choice([1024, 2048]))
            B = int(rng.choice([1, 2, 4]))
            Q = int(rng.choice([1, 1, 2]))  # static batches, or queues of 2 batches through B slots
            quantize = str(rng.choice(["none", "int8"]))
            variants = [("ar", None, False)] if rng.random() > 0.25 else []  # some runs lack ar
            for _ in range(int(rng.integers(1, 4))):
                m = str(rng.choice(METHODS))
                k = "auto" if rng.random() < 0.4 else int(rng.choice([2, 4]))
                variants.append((m, k, m != "ngram" and rng.random() < 0.3))
            variants = list({v[0]: v for v in variants}.values())  # a run holds each method once
            run_id = f"run{ri}"
            config = {"benchmark": "bench", "context_length": L, "batch_size": B, "quantize": quantize,
                      "methods": sorted({v[0] for v in variants}), "sampling": {"temperature": 0.0},
                      # runs of one cell may differ in a method's other options: never pooled
                      "method_options": {m: ({} if m == "ar" else {"k": k, "budget_frac": float(rng.choice([0.1, 0.2]))})
                                         for m, k, _ in variants}}
            if Q > 1:
                config["queue_depth"] = Q
            store.start_run(run_id, benchmark="bench", model="m", methods=config["methods"], config=config)
            tasks = ["t1", "t2"][: int(rng.integers(1, 3))]
            for task in tasks:
                samples = [f"s{i}" for i in range(int(rng.integers(1, 2 * B * Q + 1)))]
                for bi in range(0, len(samples), B * Q):
                    batch = samples[bi:bi + B * Q]
                    rows = []
                    for m, k, int8 in variants:
                        bkey = f"{run_id}/{task}/{bi}"
                        wall = 0.3 + float(rng.uniform(0.5, 3.0))
                        for s in batch:
                            if m != "ar" and rng.random() < 0.1:
                                continue  # a method row missing
                            n_out = int(rng.integers(1, 20))
                            st = _stats(rng, m, k, int8, bkey, wall, n_out)  # one batch, decoded by every method
                            lossless = None if m == "ar" else (None if rng.random() < 0.2 else bool(rng.random() < 0.8))
                            rows.append(dict(run_id=run_id, benchmark="bench", task=task, model="m", method=m,
                                             sample_id=s, prediction="p", token_ids=[1], score=float(rng.random()),
                                             stats=st, lossless=lossless, first_divergence=None,
                                             num_input_tokens_raw=100, num_input_tokens=100, references=["x"]))
                    key = f"{run_id}/{task}/{bi}"
                    store.start_shard(run_id, key, task=task, sample_ids=batch, worker={"pid": 1})
                    store.complete_shard(run_id, key, rows, wall_s=1.0)
            store.finish_run(run_id)


def _same(a, b) -> bool:
    if a is None or (isinstance(a, float) and math.isnan(a)) or a == "":
        return b is None or (isinstance(b, float) and math.isnan(b)) or b == ""
    if b is None or b == "" or (isinstance(b, float) and math.isnan(b)):
        return False
    if isinstance(a, (int, float)) or isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)
    return str(a) == str(b)


def _k(v):
    """A key as every view spells it (the dashboard's frames carry k as text and None as NaN)."""
    return None if v is None or (isinstance(v, float) and math.isnan(v)) or v in ("", "None") else str(v)


@pytest.mark.parametrize("seed", range(6))
def test_every_view_gives_the_same_number_per_cell(tmp_path, capsys, seed):
    url = f"sqlite:///{tmp_path}/r.db"
    random_store(url, seed)
    with open_store(url, create=False) as store:
        runs = store.runs()
        rows = cq.with_run_fields(store.results(), runs)

    # the CLI report (--json) against the dashboard's cell table: the same cells, the same numbers
    assert report.main(["--db", url, "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)
    cells = dq.cells_frame(rows).to_dict("records")

    def cell_id(r):
        return tuple(_k(r[k]) for k in cq.CELL_KEYS)

    assert len(cli) == len(cells) and len({cell_id(r) for r in cli}) == len(cli)
    by_cell = {cell_id(c): c for c in cells}
    assert set(by_cell) == {cell_id(r) for r in cli}
    for r in cli:
        c = by_cell[cell_id(r)]
        for name in NUMBERS:
            assert _same(r[name], c[name]), (cell_id(r), name, r[name], c[name])
        assert r["n"] == c["n"]
    # fixed and auto k of one method are never pooled, nor runs with different other options
    assert {(r["method"], _k(r["k"]), _k(r["options"])) for r in cli if r["method"] != "ar"} == \
        {(c["method"], _k(c["k"]), _k(c["options"])) for c in cells if c["method"] != "ar"}
    assert {_k(r["options"]) for r in cli if r["method"] == "ar"} <= {None}

    # the leaderboard CSV (tasks pooled per setting) against cell_table at its grouping and the
    # dashboard's ledger page (per task) against the report
    lb_rows, env = report.leaderboard_rows(url)
    text = report.format_leaderboard_csv(lb_rows, env)
    csv_rows = list(csv.DictReader(line for line in io.StringIO(text) if not line.startswith("#")))
    settings = cq.cell_table(rows, by=cq.SETTING_KEYS)
    by_setting = {(str(s["benchmark"]), str(s["model"]), str(s["context_length"]), str(s["batch_size"]),
                   str(s["queue_depth"]), s["variant"]): s for s in settings}
    assert len(csv_rows) == len(settings)
    for r in csv_rows:
        s = by_setting[(r["benchmark"], r["model"], r["context_length"], r["batch_size"], r["queue_depth"],
                        r["variant"])]
        for name in ("speedup", "speedup_total", "alpha", "tau", "mean_k", "gamma", "lossless_rate", "score", "n"):
            assert _same(r[name] if r[name] != "" else None, s[name]), (r["variant"], name, r[name], s[name])

    led = dq.ledger_page_frame(rows).to_dict("records")
    rep_by_variant = {(r["task"], r["context_length"], r["batch_size"], r["queue_depth"], r["variant"]): r
                      for r in cli}
    assert len(rep_by_variant) == len(cli)
    for row in led:
        r = rep_by_variant[(row["task"], row["context_length"], row["batch_size"], row["queue_depth"],
                            row["variant"])]
        for name in ("speedup", "alpha", "tau", "mean_k", "gamma"):
            assert _same(row[name], r[name]), (row["variant"], name)

    # the speedup map (tasks pooled per model, target, context, batch, variant)
    smap = dq.speedup_map(rows).to_dict("records")
    want = {tuple(_k(c[k]) for k in dq.MAP_KEYS): c for c in cq.cell_table(rows, by=dq.MAP_KEYS)}
    assert len(smap) == len(want)
    for m in smap:
        c = want[tuple(_k(m[k]) for k in dq.MAP_KEYS)]
        for name in ("speedup", "alpha", "lossless_rate"):
            assert _same(m[name], c[name])


def test_a_cell_without_its_ar_has_no_speedup_and_no_lossless_rate(tmp_path, capsys):
    for seed in range(20):  # find a store with a run lacking ar
        url = f"sqlite:///{tmp_path}/r{seed}.db"
        random_store(url, seed)
        with open_store(url, create=False) as store:
            rows = store.results()
        cells = cq.cell_table(rows)
        setting = [k for k in cq.CELL_KEYS if k not in ("method", "k", "draft_weights", "options")]
        ars = {tuple(c[k] for k in setting) for c in cells if c["method"] == "ar"}
        orphans = [c for c in cells if c["method"] != "ar" and tuple(c[k] for k in setting) not in ars]
        if orphans:
            assert all(c["speedup"] is None and c["lossless_rate"] is None for c in orphans)
            return
    pytest.fail("no random store had a cell without ar")

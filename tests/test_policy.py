"""cluster.results.policy (issue 27 item 3): the crossover map as a speculation policy built from a
synthetic store (the fastest lossless, conclusively faster cell wins; lossy, unproven,
inconclusive and thin cells never do), its bucket lookup, the policy file's validation, the vLLM
``--speculative-config`` fragment (keys checked against vLLM's own ``SpeculativeConfig`` where
the peers environment is installed), and ``python -m cluster.results.report --policy`` (the Serve
``policy`` arm: tests/test_serve_policy.py)."""
import json
import math
from pathlib import Path

import pytest

from cluster.peers.engine import peers_venv
from cluster.results.policy import (VLLM_SPECULATIVE_KEYS, PolicyError, SpeculationPolicy, bucket_of,
                            build_policy, vllm_fragment, vllm_speculative_keys)

# vLLM's speculative config in the peers environment ($SPARSESPEC_PEERS_VENV, else .venv-peers: make peers)
VLLM_SOURCE = peers_venv() / "lib" / "python3.11" / "site-packages" / "vllm" / "config" / "speculative.py"
MODEL = "m"


# ---------------------------------------------------------------- synthetic rows
def _cell(ctx, B, method, k, speedups, *, lossless=True, run=None, ar_tpot=0.01, tokens=33):
    """Rows of one method cell and its run's ar rows: one batch of B samples per entry of
    ``speedups`` (the batch's TPOT_ar / TPOT_method)."""
    run = run or f"{method}-{k}-{ctx}-{B}"
    rows = []
    for i, s in enumerate(speedups):
        for m, tpot in (("ar", ar_tpot), (method, ar_tpot / s)):
            for j in range(B):
                st = {"batch_key": f"t/{i}", "batch_wall_s": tpot * B * (tokens - 1), "batch_prefill_s": 0.0,
                      "num_output_tokens": tokens, "decode_s": tpot * (tokens - 1), "total_s": tpot * tokens}
                if m != "ar":
                    st.update(k=k, num_drafted=10, num_accepted=8, num_steps=20, num_drafting_steps=5,
                              num_emitted=tokens - 1)
                rows.append({"run_id": run, "benchmark": "speed", "task": "t", "model": MODEL, "quantize": "none",
                             "context_length": ctx, "batch_size": B, "method": m, "sample_id": f"{i}-{j}",
                             "score": None, "stats": st, "lossless": None if m == "ar" else lossless})
    return rows


FAST = [1.45, 1.5, 1.55, 1.5, 1.48, 1.52]


def _entry(policy, ctx, B):
    return next(e for e in policy.entries(MODEL) if (e.context_length, e.batch_size) == (ctx, B))


def test_fastest_lossless_conclusive_cell_wins_and_lossy_or_unproven_never_do():
    rows = (_cell(8192, 4, "sparsespec-l", 2, FAST)
            + _cell(8192, 4, "sparsespec-l", 4, [2.0, 2.1, 1.9, 2.0, 2.05, 1.95], lossless=False)  # faster, lossy
            + _cell(8192, 4, "ngram", 3, [2.5] * 6, lossless=None)  # faster, losslessness never shown
            + _cell(8192, 4, "sparsespec-l", "auto", [1.2, 1.25, 1.22, 1.18, 1.2, 1.21]))  # lossless, slower
    e = _entry(build_policy(rows), 8192, 4)
    assert (e.status, e.method, e.k, e.variant) == ("speculate", "sparsespec-l", 2, "sparsespec-l k=2")
    assert e.speedup == pytest.approx(1.5) and e.n_pairs == 6 and 1.0 < e.ci_low <= e.speedup <= e.ci_high
    why = {c.variant: c.rejected for c in e.candidates}
    assert why["sparsespec-l k=4"].startswith("lossy") and why["ngram k=3"].startswith("losslessness not shown")
    assert why["sparsespec-l k=2"] is None and why["sparsespec-l"] is None  # eligible, but slower
    # without the winner, the slower lossless controller is chosen: k="auto" is a cell of its own
    rows = [r for r in rows if not r["run_id"].startswith("sparsespec-l-2-")]
    e = _entry(build_policy(rows), 8192, 4)
    assert (e.method, e.k) == ("sparsespec-l", "auto") and e.speedup == pytest.approx(1.205)


def test_inconclusive_too_few_pairs_and_slower_cells_are_off():
    rows = (_cell(1024, 1, "sparsespec-l", 2, [0.8, 1.7, 0.85, 1.6, 1.3, 0.9])  # median 1.1, interval reaches 1
            + _cell(1024, 4, "sparsespec-l", 2, [1.5, 1.6, 1.55])  # fast but 3 pairs
            + _cell(8192, 1, "sparsespec-l", 2, [0.7, 0.72, 0.69, 0.71, 0.7]))  # slower than ar
    p = build_policy(rows)
    inc, thin, slow = _entry(p, 1024, 1), _entry(p, 1024, 4), _entry(p, 8192, 1)
    assert (inc.status, inc.method, inc.k, inc.speedup) == ("off", "ar", 0, 1.0)
    assert "inconclusive" in inc.reason and inc.candidates[0].ci_low <= 1.0 < inc.candidates[0].speedup
    assert (thin.status, thin.k) == ("insufficient_pairs", 0) and "too few pairs (3 < 5)" in thin.reason
    assert (slow.status, slow.k) == ("off", 0) and "slower than ar: median 0.7" in slow.reason
    # a stricter --min-pairs turns a decided cell into "not enough pairs"
    p = build_policy(_cell(8192, 4, "sparsespec-l", 2, FAST), min_pairs=7)
    assert _entry(p, 8192, 4).status == "insufficient_pairs" and p.min_pairs == 7


def test_a_bucket_measured_as_static_batches_and_as_queues_is_decided_by_the_queues():
    """The policy arm is served with continuous batching: where a bucket has both, the queued
    runs (queue_depth > 1) decide it, never pooled with the static batches."""
    static = _cell(8192, 4, "sparsespec-l", 2, [0.9, 0.92, 0.88, 0.91, 0.9])
    queued = _cell(8192, 4, "sparsespec-l", 2, FAST, run="queued")
    for r in queued:
        r["queue_depth"] = 2
    e = _entry(build_policy(static + queued), 8192, 4)
    assert (e.status, e.k, e.n_pairs) == ("speculate", 2, 6) and e.speedup == pytest.approx(1.5)
    assert _entry(build_policy(static), 8192, 4).status == "off"


def test_quantised_targets_are_left_out_and_an_empty_store_is_an_error():
    rows = _cell(8192, 4, "sparsespec-l", 2, FAST)
    for r in rows:
        r["quantize"] = "int8"
    with pytest.raises(PolicyError, match="no full-precision results"):
        build_policy(rows)


@pytest.mark.parametrize("value, expect", [(1, 1024), (1024, 1024), (2896, 1024), (2897, 8192), (8192, 8192),
                                           (100000, 8192)])
def test_context_bucket_edges_are_geometric_means(value, expect):
    assert math.sqrt(1024 * 8192) == pytest.approx(2896.31)
    assert bucket_of(value, [8192, 1024]) == expect


def test_batch_buckets_an_edge_goes_up_and_missing_cells_fall_back_to_the_nearest():
    assert [bucket_of(b, [1, 4]) for b in (1, 2, 3, 4, 9)] == [1, 4, 4, 4, 4]  # edge 2 belongs to 4
    assert [bucket_of(b, [1, 4, 16]) for b in (7, 8, 9)] == [4, 16, 16]  # edge 8
    with pytest.raises(PolicyError):
        bucket_of(3, [])
    rows = (_cell(1024, 1, "sparsespec-l", 2, [0.7] * 5) + _cell(1024, 4, "sparsespec-l", 2, [0.7] * 5)
            + _cell(8192, 1, "sparsespec-l", 2, FAST))
    p = build_policy(rows)
    assert p.lookup(MODEL, 8000 + 32, 4).context_length == 8192  # no (8192, 4) cell: its nearest batch
    assert p.lookup(MODEL, 8032, 4).k == 2 and p.lookup(MODEL, 1000 + 32, 4).k == 0
    assert (p.lookup(MODEL, 2900, 1).context_length, p.lookup(MODEL, 2800, 1).context_length) == (8192, 1024)
    with pytest.raises(PolicyError, match="no entries for model 'other'"):
        p.lookup("other", 100, 1)
    with pytest.raises(PolicyError, match=">= 1"):
        p.lookup(MODEL, 0, 1)


# ---------------------------------------------------------------- the file
def _policy_dict(entries):
    return {"version": 1, "models": {MODEL: entries}}


def _e(ctx, B, method="ar", k=0, status=None, **kw):
    return {"context_length": ctx, "batch_size": B, "status": status or ("off" if k == 0 else "speculate"),
            "method": method, "k": k, "variant": method if k == 0 else f"{method} k={k}", "reason": "test", **kw}


def test_policy_file_round_trip(tmp_path):
    p = build_policy(_cell(8192, 4, "sparsespec-l", 2, FAST) + _cell(1024, 4, "sparsespec-l", 2, [0.6] * 5),
                     source="sqlite:///x.db")
    f = tmp_path / "policy.json"
    f.write_text(p.dumps())
    q = SpeculationPolicy.load(f)
    assert q == p and q.lookup(MODEL, 8192, 4).k == 2 and q.source == "sqlite:///x.db"
    with pytest.raises(Exception):  # frozen
        q.min_pairs = 1


@pytest.mark.parametrize("text, needle", [
    ("{not json", "not valid JSON"),
    (json.dumps({"version": 1, "models": {}}), "at least one model"),
    (json.dumps({"version": 2, "models": {MODEL: [_e(1024, 1)]}}), "version"),
    (json.dumps(_policy_dict([_e(1024, 1, "sparsespec-l", 0)])), "k=0 means method 'ar'"),
    (json.dumps(_policy_dict([_e(1024, 1, "ar", 2)])), "k=0 means method 'ar'"),
    (json.dumps(_policy_dict([_e(1024, 1, "sparsespec-x", 2)])), "unknown method 'sparsespec-x'"),
    (json.dumps(_policy_dict([_e(1024, 1, "sparsespec-l", -1)])), "k must be >= 0"),
    (json.dumps(_policy_dict([_e(1024, 1, "sparsespec-l", 2, status="off")])), "needs k=0"),
    (json.dumps(_policy_dict([_e(1024, 1), _e(1024, 1)])), "listed twice"),
    (json.dumps(_policy_dict([{**_e(1024, 1), "surprise": 1}])), "surprise"),
    (json.dumps(_policy_dict([{k: v for k, v in _e(1024, 1).items() if k != "batch_size"}])), "batch_size"),
])
def test_a_malformed_policy_file_is_a_clear_error(tmp_path, text, needle):
    f = tmp_path / "bad.json"
    f.write_text(text)
    with pytest.raises(PolicyError, match=needle) as err:
        SpeculationPolicy.load(f)
    assert str(f) in str(err.value)


def test_a_missing_policy_file_is_a_clear_error(tmp_path):
    with pytest.raises(PolicyError, match="cannot read policy file"):
        SpeculationPolicy.load(tmp_path / "nope.json")


# ---------------------------------------------------------------- vLLM
def _vllm_source() -> Path | None:
    return VLLM_SOURCE if VLLM_SOURCE.exists() else None


def test_recorded_vllm_keys_are_speculative_config_fields_of_the_installed_vllm():
    src = _vllm_source()
    if src is None:
        pytest.skip("vLLM (the peers environment, .venv-peers) is not installed")
    fields = vllm_speculative_keys(src)
    assert {"num_speculative_tokens", "method", "num_speculative_tokens_per_batch_size",
            "max_model_len"} <= fields
    assert VLLM_SPECULATIVE_KEYS == fields  # a vLLM upgrade that renames a key fails here


def _policy(entries):
    return SpeculationPolicy.model_validate(_policy_dict(entries))


def _keys_ok(frag):
    cfg = frag["speculative_config"]
    allowed = vllm_speculative_keys(_vllm_source()) if _vllm_source() else VLLM_SPECULATIVE_KEYS
    assert set(cfg) <= allowed, set(cfg) - allowed
    assert frag["cli"] == f"--speculative-config '{json.dumps(cfg, separators=(',', ':'))}'"


def test_vllm_fragment_k_per_batch_size_is_exact():
    frag = vllm_fragment(_policy([_e(1024, 1, "sparsespec-l", 2), _e(1024, 4), _e(8192, 1, "sparsespec-l", 2),
                                  _e(8192, 4)]), max_num_seqs=64)
    _keys_ok(frag)
    cfg = frag["speculative_config"]
    assert cfg["num_speculative_tokens"] == 2 and "method" not in cfg  # vLLM has no sparsespec-l
    assert cfg["num_speculative_tokens_per_batch_size"] == [[1, 1, 2], [2, 64, 0]]
    assert not frag["exact"] and any("no sparsespec-l" in n for n in frag["notes"])


def test_vllm_fragment_a_short_context_cutoff_and_an_inexpressible_map():
    # speculate below 2896 tokens, not above: the draft's max_model_len
    frag = vllm_fragment(_policy([_e(1024, 1, "ngram", 3), _e(8192, 1)]))
    _keys_ok(frag)
    assert frag["speculative_config"] == {"method": "ngram", "max_model_len": 2896, "num_speculative_tokens": 3}
    assert frag["exact"]
    # speculate only at long contexts (the usual crossover): vLLM cannot, and the notes say where
    frag = vllm_fragment(_policy([_e(1024, 1), _e(1024, 4), _e(8192, 1, "ngram", 3), _e(8192, 4, "ngram", 3)]))
    _keys_ok(frag)
    assert frag["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3}
    assert not frag["exact"]
    assert [n for n in frag["notes"] if n.startswith("ctx 1024")] == [
        "ctx 1024, batch 1: the map says k=0, the fragment k=3 (vLLM sets k by batch size only, and its length "
        "cutoff only turns speculation off above a length, not below)",
        "ctx 1024, batch 4: the map says k=0, the fragment k=3 (vLLM sets k by batch size only, and its length "
        "cutoff only turns speculation off above a length, not below)"]


def test_vllm_fragment_never_speculating_and_auto_k():
    frag = vllm_fragment(_policy([_e(1024, 1), _e(8192, 1)]))
    assert frag["speculative_config"] is None and frag["cli"] == "" and "never speculates" in frag["notes"][0]
    p = build_policy(_cell(8192, 1, "sparsespec-l", "auto", FAST))
    frag = vllm_fragment(p)
    _keys_ok(frag)
    assert frag["speculative_config"]["num_speculative_tokens"] == 2  # the cell's mean k: 10 drafted / 5 steps
    assert any("k='auto'" in n for n in frag["notes"])
    with pytest.raises(PolicyError, match="no entries for model"):
        vllm_fragment(p, "other")


# ---------------------------------------------------------------- the CLI
def _store(url, rows):
    from cluster.results.store import open_store

    with open_store(url) as store:
        for run in sorted({r["run_id"] for r in rows}):
            rs = [r for r in rows if r["run_id"] == run]
            cfg = {"context_length": rs[0]["context_length"], "batch_size": rs[0]["batch_size"],
                   "sampling": {"temperature": 0.0}}
            store.start_run(run, benchmark="speed", model=MODEL, methods=sorted({r["method"] for r in rs}),
                            config=cfg, host={})
            keep = ("run_id", "benchmark", "task", "model", "method", "sample_id", "score", "stats", "lossless")
            clean = [{k: r[k] for k in keep} | {"prediction": "", "token_ids": [1]} for r in rs]
            store.start_shard(run, f"{run}/0", task="t", sample_ids=sorted({r["sample_id"] for r in rs}), worker={})
            store.complete_shard(run, f"{run}/0", clean, wall_s=1.0)
            store.finish_run(run)


def test_report_policy_cli_writes_the_policy_and_the_vllm_fragment(tmp_path, capsys):
    from cluster.results.report import main

    url = f"sqlite:///{tmp_path}/p.db"
    _store(url, _cell(8192, 4, "sparsespec-l", 2, FAST) + _cell(1024, 4, "sparsespec-l", 2, [0.6] * 5)
           + _cell(1024, 1, "sparsespec-l", 2, [1.4, 1.5]))
    pol, frag = tmp_path / "out" / "policy.json", tmp_path / "out" / "vllm.json"
    assert main(["--policy", "--db", url, "--policy-out", str(pol), "--vllm-out", str(frag)]) == 0
    out = capsys.readouterr().out
    assert "insufficient_pairs" in out and "sparsespec-l k=2" in out and "--speculative-config" in out
    p = SpeculationPolicy.load(pol)
    assert [(e.context_length, e.batch_size, e.k) for e in p.entries(MODEL)] == [(1024, 1, 0), (1024, 4, 0),
                                                                                 (8192, 4, 2)]
    assert json.loads(frag.read_text())[MODEL]["speculative_config"]["num_speculative_tokens"] == 2
    assert main(["--policy", "--db", url, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"policy", "vllm"} and data["policy"]["min_pairs"] == 5
    with pytest.raises(SystemExit):
        main(["--db", url, "--policy-out", str(pol)])  # needs --policy
    with pytest.raises(SystemExit):
        main(["--policy", "--db", url, "--min-pairs", "2"])  # no interval below 5 pairs
    assert main(["--policy", "--db", f"sqlite:///{tmp_path}/missing.db"]) != 0

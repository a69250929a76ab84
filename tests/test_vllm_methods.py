"""vLLM's methods as sweep methods (``vllm:ar``, ``vllm:ngram``, ...; issue 29): options, the
persistent runner's protocol (against a fake runner process), the mapping of vLLM's answer to our
counts, the worker's rows, the oracle verdict of ``vllm:ar`` and the engines table.

The end-to-end check with vLLM itself (``test_vllm_ar_tokens_equal_ours``) needs ``.venv-peers``
(``make peers``) and is skipped without it."""
from __future__ import annotations

import importlib.util
import json
import sys
import textwrap
from pathlib import Path

import pytest

import cluster.peers as peers
from cluster.results.aggregate import engine_ar, engine_of, engines_table
from cluster.peers import engine as ve
from cluster.peers import methods as vmethods
from cluster.sweep.coordinator import lossless_check
from sparsespec.stats import derive, pool


# ------------------------------------------------------------------ options
def test_vllm_options_are_its_defaults_overlaid_and_validated():
    assert vmethods.resolve_vllm_options("vllm:ar", None) == {}
    assert vmethods.resolve_vllm_options("vllm:ngram", {"num_speculative_tokens": 2}) == {
        "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    for method, opts, match in [
        ("vllm:ar", {"num_speculative_tokens": 2}, "takes no options"),
        ("vllm:ngram", {"k": 2}, "unknown speculative_config key"),
        ("vllm:ngram", {"num_speculative_tokens": 0}, "integer >= 1"),
        ("vllm:ngram", {"num_speculative_tokens": True}, "integer >= 1"),
        ("vllm:draft-model", {}, "needs `model`"),
        ("vllm:medusa", {}, "unknown vLLM method"),
    ]:
        with pytest.raises(ValueError, match=match):
            vmethods.resolve_vllm_options(method, opts)


def test_speculative_config_names_vllms_method_and_resolves_a_preset(tmp_path):
    assert ve.speculative_config("vllm:ar", {}) is None
    assert ve.speculative_config("vllm:ngram", vmethods.resolve_vllm_options("vllm:ngram", None)) == {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    spec = ve.speculative_config("vllm:draft-model", {"model": "tiny", "num_speculative_tokens": 3},
                                 lambda name: tmp_path / name)
    assert spec == {"method": "draft_model", "model": str(tmp_path / "tiny"), "num_speculative_tokens": 3}
    # a local folder is passed as it is
    folder = tmp_path / "head"
    folder.mkdir()
    spec = ve.speculative_config("vllm:eagle3", {"model": str(folder)}, lambda name: 1 / 0)
    assert spec["model"] == str(folder) and spec["method"] == "eagle3"


def test_sweep_spec_accepts_vllm_methods_and_rejects_unknown_ones():
    from cluster.sweep.schema import SpecError, check_method_sets, check_methods, parse_spec

    base = {"name": "t", "models": ["smollm2-135m"], "benchmarks": [{"name": "speed"}]}
    spec = parse_spec({**base, "methods": {"vllm:ar": {}, "vllm:ngram": [{}, {"num_speculative_tokens": 2}]}})
    resolved = check_methods(spec)
    assert resolved["vllm:ngram"]["num_speculative_tokens"] == 4 and resolved["vllm:ar"] == {}
    sets = check_method_sets(spec)
    assert sets[1] == {"ar": {}, "vllm:ngram": {"num_speculative_tokens": 2, "prompt_lookup_min": 1,
                                                 "prompt_lookup_max": 4}}
    with pytest.raises(SpecError, match="did you mean 'vllm:ngram'"):
        check_methods(parse_spec({**base, "methods": {"vllm:ngrm": {}}}))
    with pytest.raises(SpecError, match="unknown speculative_config key"):
        check_methods(parse_spec({**base, "methods": {"vllm:ngram": {"k": 4}}}))


# ------------------------------------------------------------------ vLLM's answer -> our counts
ANSWER = {
    "token_ids": [[5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 8, 9, 10, 11, 12, 13]],
    "times": [{"scheduled_s": 0.0, "first_s": 1.5, "last_s": 1.9, "n": 9},
              {"scheduled_s": 0.1, "first_s": 1.6, "last_s": 2.3, "n": 9}],
    "wall_s": 2.4,
    # vLLM's RequestSpecDecodeMetrics.to_dict(): 3 verify steps, 5 of 9 drafts accepted
    "per_request": [{"num_spec_steps": 3, "num_draft_tokens": 9, "num_accepted_draft_tokens": 5,
                     "mean_acceptance_length": 1 + 5 / 3, "draft_acceptance_rate": 5 / 9},
                    None],
}


def test_rows_stats_give_vllms_acceptance_rate_and_length_through_derive():
    a, b = ve.rows_stats(ANSWER, [100, 120])
    assert a["num_prompt_tokens"] == 100 and a["num_output_tokens"] == 9
    assert a["prefill_s"] == pytest.approx(1.5) and a["decode_s"] == pytest.approx(0.4)
    assert b["prefill_s"] == pytest.approx(1.5) and b["total_s"] == pytest.approx(2.2)
    assert b["ttft_s"] == pytest.approx(1.6) and b["decode_s"] == pytest.approx(0.7)
    d = derive(a)
    assert d["alpha"] == pytest.approx(ANSWER["per_request"][0]["draft_acceptance_rate"])
    # 8 decoded tokens = 3 drafting steps accepting 5 + ... : steps = 8 - 5 = 3 (each emits 1 + accepted)
    assert a["num_steps"] == 3 and d["tau"] == pytest.approx(8 / 3)
    assert d["mean_k"] == pytest.approx(3.0) and d["gamma"] is None
    assert "num_drafted" not in b and b["num_steps"] == 8 and derive(b)["tau"] == 1.0
    assert derive(pool([a, b]))["alpha"] == pytest.approx(5 / 9)


def test_batch_times_span_from_the_last_first_token_to_the_last_token():
    wall, prefill = ve.batch_times(ANSWER)
    assert wall == pytest.approx(2.3) and prefill == pytest.approx(1.6)


# ------------------------------------------------------------------ the persistent runner
def fake_venv(tmp_path: Path, monkeypatch, body: str) -> None:
    """A peers venv whose python ignores the runner and runs ``body`` (argv: runner, --serve, config)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f"#!{sys.executable}\nimport json, os, sys, time\ncfg = json.load(open(sys.argv[3]))\n"
                      + textwrap.dedent(body))
    python.chmod(0o755)
    monkeypatch.setenv(peers.VENV_ENV, str(venv))


ECHO = """
print("vLLM chatter on stdout goes nowhere near the protocol", file=sys.stderr)
print(json.dumps({"ready": True, "startup_s": 0.1, "vllm_version": "fake", "config": cfg}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    if req["prompts"][0][0] == 0:
        print(json.dumps({"error": "ValueError: bad batch"}), flush=True)
        continue
    n = [p["max_tokens"] for p in req["params"]]
    print(json.dumps({"token_ids": [[7] * k for k in n], "finish_reasons": ["length"] * len(n),
                      "times": [{"scheduled_s": 0.0, "first_s": 0.5, "last_s": 1.0, "n": k} for k in n],
                      "wall_s": 1.0, "per_request": [None] * len(n)}), flush=True)
"""


def test_peer_starts_answers_batches_survives_a_rejected_one_and_closes(tmp_path, monkeypatch):
    fake_venv(tmp_path, monkeypatch, ECHO)
    peer = ve.VllmPeer({"model": "m", "max_num_seqs": 2}, log_path=tmp_path / "log")
    ready = peer.start(timeout_s=30)
    assert ready["config"] == {"model": "m", "max_num_seqs": 2}
    ans = peer.generate([[1, 2], [3]], [{"max_tokens": 3}, {"max_tokens": 2}], timeout_s=30)
    assert ans["token_ids"] == [[7, 7, 7], [7, 7]]
    with pytest.raises(ve.PeerError, match="rejected the batch: ValueError: bad batch"):
        peer.generate([[0]], [{"max_tokens": 1}], timeout_s=30)
    assert peer.generate([[1]], [{"max_tokens": 1}], timeout_s=30)["token_ids"] == [[7]]  # still serving
    proc = peer.proc
    peer.close()
    assert proc.poll() is not None and peer.proc is None
    assert "vLLM chatter" in (tmp_path / "log").read_text()


@pytest.mark.parametrize("body,match", [
    ('print(json.dumps({"error": "OSError: no model"}), flush=True)\n', "did not start: OSError: no model"),
    ('print("not json", flush=True)\n', "malformed answer"),
    ('print("dying words", file=sys.stderr); sys.exit(3)\n', r"exited \(status 3\) during start-up: dying words"),
    ("time.sleep(30)\n", "no answer to start-up within 1 s"),
])
def test_peer_start_failures_are_one_line_errors(tmp_path, monkeypatch, body, match):
    fake_venv(tmp_path, monkeypatch, body)
    peer = ve.VllmPeer({"model": "m"}, log_path=tmp_path / "log")
    with pytest.raises(ve.PeerError, match=match):
        peer.start(timeout_s=1)
    assert peer.proc is None  # nothing left running


def test_peer_that_dies_mid_batch_is_an_error_and_leaves_nothing(tmp_path, monkeypatch):
    fake_venv(tmp_path, monkeypatch, """
print(json.dumps({"ready": True}), flush=True)
sys.stdin.readline()
os._exit(9)
""")
    peer = ve.VllmPeer({"model": "m"}, log_path=tmp_path / "log")
    peer.start(timeout_s=30)
    with pytest.raises(ve.PeerError, match=r"exited \(status 9\) during a batch"):
        peer.generate([[1]], [{"max_tokens": 1}], timeout_s=30)
    assert peer.proc is None


def test_peer_batch_error_names_the_engine_cores_exception(tmp_path, monkeypatch):
    # vLLM's EngineDeadError says "see stack trace (above)": the exception above it is in the log
    fake_venv(tmp_path, monkeypatch, """
print(json.dumps({"ready": True}), flush=True)
sys.stdin.readline()
print("(EngineCore pid=7) RuntimeError: shm broadcast timed out", file=sys.stderr, flush=True)
print(json.dumps({"error": "EngineDeadError: EngineCore encountered an issue. See stack trace (above)"}), flush=True)
sys.stdin.readline()
""")
    peer = ve.VllmPeer({"model": "m"}, log_path=tmp_path / "log")
    peer.start(timeout_s=30)
    with pytest.raises(ve.PeerError, match=r"rejected the batch: EngineDeadError: .*\(runner log: RuntimeError: shm "):
        peer.generate([[1]], [{"max_tokens": 1}], timeout_s=30)
    peer.close()


def test_peer_errors_quote_no_cause_from_an_earlier_engine_in_the_same_log(tmp_path, monkeypatch):
    fake_venv(tmp_path, monkeypatch, ECHO)
    (tmp_path / "log").write_text("RuntimeError: an earlier engine's\n")
    peer = ve.VllmPeer({"model": "m"}, log_path=tmp_path / "log")
    peer.start(timeout_s=30)
    with pytest.raises(ve.PeerError) as err:
        peer.generate([[0]], [{"max_tokens": 1}], timeout_s=30)
    assert str(err.value) == "vLLM rejected the batch: ValueError: bad batch"
    peer.close()


def test_peer_without_the_venv_says_make_peers(tmp_path, monkeypatch):
    monkeypatch.setenv(peers.VENV_ENV, str(tmp_path / "absent"))
    with pytest.raises(ve.PeerError, match="run make peers"):
        ve.VllmPeer({"model": "m"}).start()


def load_runner():
    spec = importlib.util.spec_from_file_location("vllm_runner_serve_test", peers.RUNNER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_runner_serve_config_and_batch_checks(tmp_path):
    runner = load_runner()
    cfg = runner.parse_engine_config({"model": str(tmp_path), "speculative_config": {"method": "ngram"},
                                      "max_num_seqs": 4, "threads": 1})
    assert cfg["speculative_config"] == {"method": "ngram"} and cfg["max_num_seqs"] == 4 and cfg["threads"] == 1
    assert cfg["dtype"] == "float32"  # the one-shot request's defaults
    for raw, match in [({"model": str(tmp_path), "prompts": [[1]]}, "unknown engine config fields: prompts"),
                       ({"model": str(tmp_path), "speculative_config": {}}, "non-empty object or null"),
                       ({"model": str(tmp_path), "max_num_seqs": 0}, "max_num_seqs"),
                       ({"model": str(tmp_path / "absent")}, "local folder")]:
        with pytest.raises(runner.RequestError, match=match):
            runner.parse_engine_config(raw)
    prompts, params = runner.parse_batch({"prompts": [[1, 2]], "params": [{"max_tokens": 3, "stop": ["\n"]}]})
    assert prompts == [[1, 2]] and params[0]["stop"] == ["\n"] and params[0]["temperature"] == 0.0
    for raw, match in [({"prompts": [[1]]}, "exactly prompts and params"),
                       ({"prompts": [[1]], "params": []}, "one object per prompt"),
                       ({"prompts": [[1]], "params": [{}]}, "max_tokens"),
                       ({"prompts": [[1]], "params": [{"max_tokens": 2, "min_tokens": 3}]}, "min_tokens"),
                       ({"prompts": [[1]], "params": [{"max_tokens": 2, "stop": [""]}]}, "stop"),
                       ({"prompts": [[1]], "params": [{"max_tokens": 2, "n": 2}]}, "unknown fields n")]:
        with pytest.raises(runner.RequestError, match=match):
            runner.parse_batch(raw)


# ------------------------------------------------------------------ verdicts and the engines table
def test_vllm_ar_agreeing_with_ours_is_a_pass_not_inconclusive():
    assert lossless_check([1, 2, 3], [1, 2, 3], {}, 0.0) == (None, None)  # drafted nothing: inconclusive
    assert lossless_check([1, 2, 3], [1, 2, 3], {}, 0.0, oracle=True) == (True, None)
    assert lossless_check([1, 2, 3], [1, 2, 4], {}, 0.0, oracle=True) == (False, 2)
    assert lossless_check([1, 2, 3], [1, 2, 3], {}, 0.7, oracle=True) == (None, None)


def _row(method, batch, tpot, *, k=None, lossless=None, drafted=0, accepted=0):
    out = 9
    stats = {"batch_key": f"r/b{batch}", "num_output_tokens": out, "batch_wall_s": 1.0 + tpot * (out - 1),
             "batch_prefill_s": 1.0, "num_steps": out - 1 - accepted, "num_emitted": out - 1,
             "num_drafted": drafted, "num_accepted": accepted, "num_drafting_steps": 2 if drafted else 0}
    if k is not None:
        stats["k"] = k
    return {"run_id": "r", "benchmark": "speed", "task": "t", "model": "m", "context_length": 1024,
            "batch_size": 1, "method": method, "sample_id": str(batch), "stats": stats, "lossless": lossless,
            "score": None}


def test_engines_table_pairs_each_method_with_our_ar_its_own_ar_and_the_fastest():
    assert engine_of("vllm:ngram") == "vllm" and engine_of("ngram") == "sparsespec"
    assert engine_ar("vllm:ngram") == "vllm:ar" and engine_ar("sparsespec-l") == "ar"
    rows = []
    for b in range(3):  # vLLM's ar is 1.25x faster than ours; its ngram 2x its own ar; our ngram 1.6x ours
        rows += [_row("ar", b, 0.020), _row("vllm:ar", b, 0.016, lossless=True),
                 _row("vllm:ngram", b, 0.008, k=4, lossless=b != 2, drafted=8, accepted=4),
                 _row("ngram", b, 0.0125, k=4, lossless=True, drafted=8, accepted=4)]
    t = {r["method"]: r for r in engines_table(rows)}
    assert set(t) == {"ar", "vllm:ar", "vllm:ngram", "ngram"}
    assert t["vllm:ar"]["speedup"] == pytest.approx(1.25) and t["vllm:ar"]["speedup_own_ar"] == 1.0
    assert t["vllm:ar"]["lossless_rate"] == 1.0 and t["vllm:ar"]["engine"] == "vllm"
    assert t["vllm:ngram"]["speedup"] == pytest.approx(2.5)
    assert t["vllm:ngram"]["speedup_own_ar"] == pytest.approx(2.0)
    assert all(r["fastest_ar"] == "vllm:ar" for r in t.values())
    assert t["ngram"]["speedup_fastest_ar"] == pytest.approx(0.016 / 0.0125)
    assert t["ngram"]["speedup_own_ar"] == pytest.approx(1.6) == t["ngram"]["speedup"]
    assert t["ar"]["speedup_fastest_ar"] == pytest.approx(0.8)
    assert t["vllm:ngram"]["lossless_rate"] == pytest.approx(2 / 3)
    assert t["vllm:ngram"]["alpha"] == pytest.approx(0.5) and t["vllm:ngram"]["tau"] == pytest.approx(8 / 4)
    # our ar fastest: the reference stays ours
    slow = [dict(r, stats={**r["stats"], "batch_wall_s": 1.0 + 0.030 * 8}) if r["method"] == "vllm:ar" else r
            for r in rows]
    t = {r["method"]: r for r in engines_table(slow)}
    assert t["vllm:ngram"]["fastest_ar"] == "ar" and t["vllm:ngram"]["speedup_own_ar"] == pytest.approx(3.75)


def test_engines_report_prints_the_table(tmp_path, capsys):
    from cluster.results.report import format_engines

    rows = []
    for b in range(2):
        rows += [_row("ar", b, 0.020), _row("vllm:ar", b, 0.016, lossless=True)]
    text = format_engines(engines_table(rows))
    assert "| vs own ar" in text.splitlines()[0] or "vs own ar" in text.splitlines()[0]
    assert "16.00" in text and "1.250" in text


# ------------------------------------------------------------------ the worker
class FakePeer:
    """Stands in for VllmPeer in the worker: answers greedy 'tokens' = the prompt's last id + i."""

    started: list[dict] = []

    def __init__(self, config):
        self.config = dict(config)
        self.ready = None
        self.batches = []

    def start(self):
        FakePeer.started.append(self.config)
        self.ready = {"ready": True, "vllm_version": "fake"}
        return self.ready

    def generate(self, prompts, params):
        self.batches.append((prompts, params))
        n = [p["max_tokens"] for p in params]
        return {"token_ids": [[p[-1] + i for i in range(k)] for p, k in zip(prompts, n)],
                "times": [{"scheduled_s": 0.0, "first_s": 0.25, "last_s": 0.25 + 0.01 * (k - 1), "n": k} for k in n],
                "wall_s": 1.0, "finish_reasons": ["length"] * len(n),
                "per_request": [{"num_spec_steps": 1, "num_draft_tokens": 4, "num_accepted_draft_tokens": 2}] * len(n)}

    def close(self):
        pass


def test_worker_runs_vllm_methods_on_the_same_batch_with_our_row_fields(tmp_path, monkeypatch):
    from cluster.sweep import worker as w
    from cluster.sweep.plan import Shard
    from evals.base import Sample
    from tests.helpers import tiny_model_like

    folder = tiny_model_like(tmp_path / "tiny")
    monkeypatch.setattr(ve, "VllmPeer", FakePeer)
    FakePeer.started = []
    worker = w.EngineWorker(str(folder), threads=1)
    samples = tuple(Sample(benchmark="speed", task="t", sample_id=str(i), prompt_ids=tuple(range(10 + i, 40 + i)),
                           references=(), max_new_tokens=6, num_input_tokens_raw=30, num_input_tokens=30,
                           meta={"ignore_eos": True}) for i in range(2))
    opts = {"vllm:ngram": vmethods.resolve_vllm_options("vllm:ngram", None), "vllm:ar": {}, "ar": {}}
    for batch_index in (0, 1):
        shard = Shard(run_id="r", key=f"r/{batch_index}", benchmark="speed", model=str(folder), task="t",
                      samples=samples, methods=("ar", "vllm:ar", "vllm:ngram"), method_options=opts,
                      sampling={"temperature": 0.0}, batch_index=batch_index, sample_offset=0)
        first = "vllm:" if shard.rotation % 2 else "ar"  # consecutive batches: one of each
        out = worker.run_shard(shard)
        assert out["unavailable"] == {}
        rows = out["rows"]
        assert {(r["method"], r["sample_id"]) for r in rows} == {(m, s) for m in ("ar", "vllm:ar", "vllm:ngram")
                                                                 for s in ("0", "1")}
        earliest = min(rows, key=lambda r: r["stats"]["order_in_batch"])
        assert earliest["method"].startswith(first)  # vLLM after ours on even batches, before on odd
        v = [r for r in rows if r["method"] == "vllm:ngram"]
        assert [r["token_ids"] for r in v] == [[39 + i + j for j in range(6)] for i in range(2)]
        st = v[0]["stats"]
        assert st["k"] == 4 and st["num_drafted"] == 4 and st["num_accepted"] == 2 and st["engine"] == "vllm"
        assert st["batch_wall_s"] == pytest.approx(0.30) and st["batch_prefill_s"] == pytest.approx(0.25)
        assert st["schedule"] == "run" and st["batch_size"] == 2
        assert "k" not in [r for r in rows if r["method"] == "vllm:ar"][0]["stats"]
    # one engine per (method, options), started once, for the whole batch, prefilled in one step
    assert len(FakePeer.started) == 2
    cfg = FakePeer.started[0]
    assert cfg["max_num_seqs"] == 4 and cfg["engine_kwargs"]["max_num_batched_tokens"] >= 2 * (31 + 6)
    assert {json.dumps(c["speculative_config"]) for c in FakePeer.started} == {
        "null", json.dumps(ve.speculative_config("vllm:ngram", opts["vllm:ngram"]))}
    worker.close()


def test_worker_reports_a_vllm_method_it_cannot_start_as_unavailable(tmp_path, monkeypatch):
    from cluster.sweep import worker as w
    from cluster.sweep.plan import Shard
    from evals.base import Sample
    from tests.helpers import tiny_model_like

    class Broken(FakePeer):
        def start(self):
            raise ve.PeerError("no .venv-peers: run make peers")

    folder = tiny_model_like(tmp_path / "tiny")
    monkeypatch.setattr(ve, "VllmPeer", Broken)
    worker = w.EngineWorker(str(folder), threads=1)
    samples = (Sample(benchmark="speed", task="t", sample_id="0", prompt_ids=tuple(range(10, 40)), references=(),
                      max_new_tokens=4, num_input_tokens_raw=30, num_input_tokens=30, meta={"ignore_eos": True}),)
    shard = Shard(run_id="r", key="r/0", benchmark="speed", model=str(folder), task="t", samples=samples,
                  methods=("ar", "vllm:ar"), method_options={"ar": {}, "vllm:ar": {}}, sampling={"temperature": 0.0},
                  batch_index=0, sample_offset=0)
    out = worker.run_shard(shard)
    assert "run make peers" in out["unavailable"]["vllm:ar"]
    assert {r["method"] for r in out["rows"]} == {"ar"}


# ------------------------------------------------------------------ with vLLM itself
@pytest.mark.slow
@pytest.mark.skipif(peers.peers_python() is None, reason="no .venv-peers (make peers): vLLM is not installed")
def test_vllm_ar_tokens_equal_ours(tmp_path):
    """Our fp32 greedy AR against vLLM's on book prompts: an independent implementation of the
    same checkpoint (a divergence here is a bug in one of the two model codes, or a near tie)."""
    from sparsespec.provision import resolve_model
    from tests.helpers import BOOK, book_prompt, real_engine

    engine = real_engine()
    prompts = [book_prompt(engine.tokenizer, off, 300, "What happens next?") for off in (2000, 9000)]
    ours = engine.generate(prompts, method="ar", max_new_tokens=12, ignore_eos=True)
    assert BOOK.exists()
    peer = ve.VllmPeer({"model": str(resolve_model("smollm2-135m")), "threads": 2, "max_num_seqs": 2,
                        "max_model_len": 2048}, log_path=tmp_path / "vllm.log")
    try:
        peer.start()
        ans = peer.generate(prompts, [{"max_tokens": 12, "min_tokens": 12, "ignore_eos": True}] * 2)
    finally:
        peer.close()
    assert ans["token_ids"] == [o.token_ids for o in ours]


def test_vllm_methods_warm_each_engine_and_batch_size_once_and_restart_only_when_outgrown(tmp_path, monkeypatch):
    from tests.helpers import write_tiny_llama

    folder = write_tiny_llama(tmp_path / "m", vocab_size=300)
    made = []

    class Recording(FakePeer):
        def __init__(self, config):
            super().__init__(config)
            made.append(self)

    monkeypatch.setattr(ve, "VllmPeer", Recording)
    vm = ve.VllmMethods(folder, "float32", 2, 1024, lambda ids: "x", warmup_tokens=3, warmup_prompt_tokens=5)
    opts = vmethods.resolve_vllm_options("vllm:ngram", None)
    prompts = [list(range(20, 40)), list(range(50, 60))]
    params = [{"max_tokens": 6, "min_tokens": 6, "ignore_eos": True}] * 2
    for _ in range(2):
        outs, wall, prefill = vm.run("vllm:ngram", opts, prompts, params)
    assert len(made) == 1 and len(made[0].batches) == 3  # one warm-up, two timed
    warm_prompts, warm_params = made[0].batches[0]
    assert warm_prompts == [list(range(35, 40)), list(range(55, 60))]
    assert [q["max_tokens"] for q in warm_params] == [3, 3] and [q["min_tokens"] for q in warm_params] == [3, 3]
    assert made[0].batches[1] == (prompts, params)
    cfg = made[0].config
    assert cfg["max_num_seqs"] == 4 and cfg["engine_kwargs"]["max_num_batched_tokens"] == 4096
    assert cfg["speculative_config"]["method"] == "ngram" and cfg["max_model_len"] == 1024
    assert cfg["kv_cache_gib"] == 1 and cfg["threads"] == 2 and cfg["model"] == str(folder)
    assert outs[0]["stats"]["k"] == 4 and outs[0]["text"] == "x" and wall == pytest.approx(0.30)
    vm.run("vllm:ngram", opts, prompts * 3, params * 3)  # 6 rows: a larger engine
    assert len(made) == 2 and made[1].config["max_num_seqs"] == 6 and len(made[1].batches) == 2
    vm.run("vllm:ngram", opts, prompts, params)  # the larger engine serves the small batch too (warmed for it)
    assert len(made) == 2 and len(made[1].batches) == 4
    long = [list(range(3, 2503))] * 2  # 2 x (2500 + 6) tokens: more than 4096 in one step
    vm.run("vllm:ngram", opts, long, params)
    assert len(made) == 3 and made[2].config["engine_kwargs"]["max_num_batched_tokens"] == 8192
    assert made[2].config["max_num_seqs"] == 4  # sized for this batch, not the largest one seen
    vm.close()
    assert vm.peers == {}


def _shard(folder, methods, samples, **kw):
    from cluster.sweep.plan import Shard

    return Shard(run_id="r", key="r/0", benchmark="speed", model=str(folder), task="t", samples=samples,
                 methods=methods, method_options={m: {} for m in methods}, sampling={"temperature": 0.0},
                 batch_index=0, sample_offset=0, **kw)


def _samples():
    from evals.base import Sample

    return (Sample(benchmark="speed", task="t", sample_id="0", prompt_ids=tuple(range(10, 40)), references=(),
                   max_new_tokens=4, num_input_tokens_raw=30, num_input_tokens=30, meta={"ignore_eos": True}),)


def test_result_rows_mark_vllm_ar_agreeing_with_our_ar_as_a_pass():
    from cluster.sweep.coordinator import result_rows

    shard = _shard("m", ("ar", "vllm:ar", "vllm:ngram"), _samples())
    outs = [{"sample_id": "0", "method": m, "token_ids": toks, "text": "", "stats": st}
            for m, toks, st in (("ar", [1, 2, 3], {}), ("vllm:ar", [1, 2, 3], {}),
                                ("vllm:ngram", [1, 2, 3], {"num_drafted": 0}))]
    rows = {r["method"]: r for r in result_rows(shard, outs, lambda sample, text: None)}
    assert rows["vllm:ar"]["lossless"] is True and rows["vllm:ar"]["first_divergence"] is None
    assert rows["vllm:ngram"]["lossless"] is None  # drafted nothing: inconclusive, as for ours


def test_worker_on_a_quantised_target_leaves_vllm_methods_out(tmp_path, monkeypatch):
    from cluster.sweep import worker as w
    from tests.helpers import tiny_model_like

    folder = tiny_model_like(tmp_path / "tiny")
    monkeypatch.setattr(ve, "VllmPeer", FakePeer)
    FakePeer.started = []
    worker = w.EngineWorker(str(folder), threads=1, quantize="int8")
    out = worker.run_shard(_shard(folder, ("ar", "vllm:ar"), _samples(), quantize="int8"))
    assert "quantised (int8)" in out["unavailable"]["vllm:ar"] and FakePeer.started == []
    assert {r["method"] for r in out["rows"]} == {"ar"}


def _alive(pid: int) -> bool:
    """A zombie (killed, not yet reaped by whoever adopted it) is dead."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _fake_vllm(tmp_path) -> dict:
    """A stand-in ``vllm`` package whose ``LLM`` starts a child process (as vLLM's engine core
    does), writes its pid to ``<model>/child.pid`` and, with ``FAKE_VLLM_SLOW_START`` set, stays
    in its constructor (a long engine start); the runner's environment."""
    import os

    fake = tmp_path / "site" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(textwrap.dedent('''
        import subprocess, sys
        __version__ = "0.0-fake"
        class SamplingParams:
            def __init__(self, **kw):
                self.kw = kw
        class _Out:
            def __init__(self, n):
                self.token_ids, self.finish_reason, self.text = list(range(n)), "length", ""
        class _Metrics:
            scheduled_ts, first_token_ts, last_token_ts = 10.0, 10.5, 11.0
        class _Res:
            def __init__(self, n):
                self.outputs, self.metrics = [_Out(n)], _Metrics()
        class LLM:
            def __init__(self, **kw):
                import os, time
                self.child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
                open(kw["model"] + "/child.pid", "w").write(str(self.child.pid))
                if os.environ.get("FAKE_VLLM_SLOW_START"):
                    time.sleep(600)
            def get_metrics(self):
                return []
            def generate(self, prompts, params, use_tqdm=False):
                return [_Res(p.kw["max_tokens"]) for p in params]
        '''))
    (fake / "inputs.py").write_text("class TokensPrompt(dict):\n    pass\n")
    model = tmp_path / "model"
    model.mkdir()
    cfg = tmp_path / "engine.json"
    cfg.write_text(json.dumps({"model": str(model), "threads": 1}))
    return {"model": model, "cfg": cfg, "env": {**os.environ, "PYTHONPATH": str(tmp_path / "site")}}


@pytest.mark.parametrize("how", ["stdin closed", "runner killed"])
def test_runner_takes_vllms_processes_with_it_when_its_stdin_closes(tmp_path, how):
    """The real runner in serve mode, over a stand-in ``vllm``: closing the runner's stdin (the
    worker is done or died) or killing the runner outright ends vLLM's child process too, and a
    batch before that is answered on the protocol stream."""
    import os
    import signal
    import subprocess
    import time

    fv = _fake_vllm(tmp_path)
    model, cfg, env = fv["model"], fv["cfg"], fv["env"]
    proc = subprocess.Popen([sys.executable, str(peers.RUNNER), "--serve", str(cfg)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                            start_new_session=True)
    try:
        ready = json.loads(proc.stdout.readline())
        assert ready["ready"] and ready["vllm_version"] == "0.0-fake"
        proc.stdin.write(json.dumps({"prompts": [[1, 2]], "params": [{"max_tokens": 3}]}) + "\n")
        proc.stdin.flush()
        answer = json.loads(proc.stdout.readline())
        assert answer["token_ids"] == [[0, 1, 2]] and answer["times"][0]["first_s"] == pytest.approx(0.5)
        child = int((model / "child.pid").read_text())
        assert Path(f"/proc/{child}").exists()  # alive while the runner serves
        if how == "stdin closed":  # the worker is done, or died with its pipe
            proc.stdin.close()
        else:  # as Ray ends a dead actor's child processes: SIGKILL, no chance to clean up
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        for _ in range(200):
            if not _alive(child):
                break
            time.sleep(0.05)
        else:
            pytest.fail("vLLM's stand-in engine process outlived its runner")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_runner_and_vllm_end_when_the_worker_dies_during_the_engine_start(tmp_path):
    """A worker killed (for memory, say) while vLLM's engine is still starting: the runner is not
    reading its stdin yet, so only its watchdog can see the caller go (the runner re-parented);
    runner and engine process end within seconds."""
    import os
    import signal
    import subprocess
    import time

    fv = _fake_vllm(tmp_path)
    env = {**fv["env"], "FAKE_VLLM_SLOW_START": "1"}
    caller = subprocess.Popen(  # stands in for the sweep worker: starts the runner as VllmPeer does, then hangs
        [sys.executable, "-c", "import subprocess, sys, time\n"
         f"p = subprocess.Popen([sys.executable, {str(peers.RUNNER)!r}, '--serve', {str(fv['cfg'])!r}],"
         " stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)\n"
         "print(p.pid, flush=True)\ntime.sleep(600)\n"], stdout=subprocess.PIPE, text=True, env=env)
    runner = int(caller.stdout.readline())
    try:
        pid_file = fv["model"] / "child.pid"
        for _ in range(200):  # the engine has started its child and sits in its start
            if pid_file.exists() and pid_file.read_text():
                break
            time.sleep(0.05)
        child = int(pid_file.read_text())
        time.sleep(1.0)
        assert _alive(runner) and _alive(child)  # nothing ends them while their caller lives
        caller.kill()
        caller.wait(timeout=10)
        for _ in range(200):
            if not _alive(runner) and not _alive(child):
                break
            time.sleep(0.05)
        else:
            pytest.fail("the runner or vLLM's engine process outlived the worker that started it")
    finally:
        caller.kill()
        try:
            os.killpg(runner, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_engines_report_cli_says_what_is_missing(tmp_path, capsys):
    from cluster.results.report import main
    from cluster.results.store import open_store

    url = f"sqlite:///{tmp_path}/empty.db"
    with open_store(url):
        pass
    assert main(["--engines", "--db", url]) == 1
    assert "no results" in capsys.readouterr().err
    assert main(["--engines", "--db", f"sqlite:///{tmp_path}/absent.db"]) != 0
    with pytest.raises(SystemExit):
        main(["--engines", "--policy", "--db", url])

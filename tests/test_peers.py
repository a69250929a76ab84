"""The peer-engine launcher (cluster.peers), without vLLM: a fake peers python stands in for
.venv-peers, so these run (never skip) whether or not `make peers` was run."""

import ast
import importlib.util
import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

import cluster.peers as peers

REQUEST = {"model": "/nowhere", "prompts": [[1, 2, 3]], "max_tokens": 4, "method": "ar"}


def fake_venv(tmp_path: Path, monkeypatch, body: str) -> Path:
    """A venv folder whose bin/python is a Python script (argv: runner, request, result)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(
        f"#!{sys.executable}\nimport json, os, sys, time\n"
        "runner, req_path, out_path = sys.argv[1:4]\n" + textwrap.dedent(body)
    )
    python.chmod(0o755)
    monkeypatch.setenv(peers.VENV_ENV, str(venv))
    return python


def test_missing_venv_is_an_error_row(tmp_path, monkeypatch):
    monkeypatch.setenv(peers.VENV_ENV, str(tmp_path / "absent"))
    assert peers.peers_python() is None
    row = peers.run_vllm(REQUEST, timeout_s=5)
    assert list(row) == ["error"]
    assert "make peers" in row["error"]


def test_default_venv_is_the_repo_root_one(monkeypatch):
    monkeypatch.delenv(peers.VENV_ENV, raising=False)
    assert peers.peers_venv() == peers.REPO_ROOT / ".venv-peers"
    python = peers.peers_python()
    assert python is None or python == peers.REPO_ROOT / ".venv-peers" / "bin" / "python"


def test_canned_result_is_parsed_and_gets_the_request(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/should/not/leak")
    python = fake_venv(tmp_path, monkeypatch, """
        req = json.load(open(req_path))
        out = {"engine": "fake", "request": req, "runner": runner,
               "pythonpath": os.environ.get("PYTHONPATH"), "token_ids": [[5, 6, 7, 8]]}
        json.dump(out, open(out_path, "w"))
    """)
    assert peers.peers_python() == python
    row = peers.run_vllm(REQUEST, timeout_s=30)
    assert row["engine"] == "fake"
    assert row["request"] == REQUEST
    assert row["runner"] == str(peers.RUNNER)
    assert row["pythonpath"] is None
    assert row["token_ids"] == [[5, 6, 7, 8]]


def test_runner_error_row_is_passed_on(tmp_path, monkeypatch):
    fake_venv(tmp_path, monkeypatch, """
        json.dump({"error": "RuntimeError: no CPU left\\nsecond line"}, open(out_path, "w"))
        sys.exit(1)
    """)
    assert peers.run_vllm(REQUEST, timeout_s=30) == {"error": "RuntimeError: no CPU left"}


def test_crash_without_result_quotes_the_last_log_line(tmp_path, monkeypatch):
    fake_venv(tmp_path, monkeypatch, """
        print("starting", flush=True)
        print("ImportError: libfoo.so missing", file=sys.stderr)
        sys.exit(3)
    """)
    log = tmp_path / "runner.log"
    row = peers.run_vllm(REQUEST, timeout_s=30, log_path=log)
    assert list(row) == ["error"]
    assert "status 3" in row["error"] and "ImportError: libfoo.so missing" in row["error"]
    assert "starting" in log.read_text()


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", ""])
def test_malformed_output_is_an_error_row(tmp_path, monkeypatch, text):
    fake_venv(tmp_path, monkeypatch, f"open(out_path, 'w').write({text!r})\n")
    row = peers.run_vllm(REQUEST, timeout_s=30)
    assert list(row) == ["error"]
    assert row["error"].startswith("malformed output")


def test_result_with_nonzero_status_is_an_error_row(tmp_path, monkeypatch):
    fake_venv(tmp_path, monkeypatch, """
        json.dump({"engine": "fake"}, open(out_path, "w"))
        sys.exit(2)
    """)
    row = peers.run_vllm(REQUEST, timeout_s=30)
    assert list(row) == ["error"] and "status 2" in row["error"]


def test_timeout_kills_the_runner_and_its_children(tmp_path, monkeypatch):
    pid_file = tmp_path / "child.pid"
    fake_venv(tmp_path, monkeypatch, f"""
        import subprocess
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open({str(pid_file)!r}, "w").write(str(child.pid))
        time.sleep(60)
    """)
    t0 = time.monotonic()
    row = peers.run_vllm(REQUEST, timeout_s=1.5)
    assert time.monotonic() - t0 < 20
    assert list(row) == ["error"] and "timed out" in row["error"]
    child = int(pid_file.read_text())
    for _ in range(50):  # SIGKILLed; gone once its parent (init) reaps it
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"child {child} of the runner survived the timeout")


def test_unserialisable_request_is_an_error_row(tmp_path, monkeypatch):
    fake_venv(tmp_path, monkeypatch, "raise SystemExit('must not run')\n")
    row = peers.run_vllm({"model": object()}, timeout_s=5)
    assert list(row) == ["error"] and "JSON" in row["error"]


# --- the runner itself, as far as it goes without vLLM ----------------------------------------


def load_runner():
    spec = importlib.util.spec_from_file_location("vllm_runner_under_test", peers.RUNNER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_runner_imports_only_stdlib_and_the_peer_packages():
    tree = ast.parse(peers.RUNNER.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "no relative imports: the runner runs as a script"
            names.add(node.module.split(".")[0])
    foreign = names - set(sys.stdlib_module_names) - {"__future__", "vllm", "torch", "transformers"}
    assert not foreign, foreign
    top_level = {
        alias.name.split(".")[0]
        for node in tree.body
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module)])
    }
    assert top_level <= set(sys.stdlib_module_names) | {"__future__"}, "heavy imports only inside run()"


def test_runner_rejects_bad_requests_with_an_error_row(tmp_path):
    runner = load_runner()
    cases = [
        ({"prompts": [[1]], "max_tokens": 4}, "lacks model"),
        ({**REQUEST, "model": str(tmp_path), "method": "eagle"}, "method must be"),
        ({**REQUEST, "model": str(tmp_path), "max_tokens": 1}, "max_tokens must be"),
        ({**REQUEST, "model": str(tmp_path), "prompts": [[]]}, "prompts must be"),
        ({**REQUEST, "model": str(tmp_path), "temperature": 0.7}, "unknown request fields: temperature"),
        (REQUEST, "model must be a local folder"),
        ({"model": str(tmp_path), "max_tokens": 4}, "exactly one of prompts and cases"),
        ({**REQUEST, "model": str(tmp_path), "cases": [{"prompts": [[1]]}]}, "exactly one of prompts and cases"),
        ({"model": str(tmp_path), "max_tokens": 4, "cases": []}, "cases must be a non-empty list"),
        ({"model": str(tmp_path), "max_tokens": 4, "cases": [{"label": "x"}]}, "cases[0] must be an object"),
        ({"model": str(tmp_path), "max_tokens": 4, "cases": [{"prompts": [[]]}]}, "cases[0].prompts must be"),
    ]
    for i, (request, expected) in enumerate(cases):
        req_path, out_path = tmp_path / f"req{i}.json", tmp_path / f"out{i}.json"
        req_path.write_text(json.dumps(request))
        assert runner.main(["runner", str(req_path), str(out_path)]) == 1
        row = json.loads(out_path.read_text())
        assert list(row) == ["error"] and expected in row["error"], (request, row)
        assert "\n" not in row["error"]


def test_runner_thread_env_binds_the_first_allowed_cpus(tmp_path):
    runner = load_runner()
    req = runner.parse_request({**REQUEST, "model": str(tmp_path), "threads": 1})
    env = runner.thread_env(req)
    first = min(os.sched_getaffinity(0))
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(first)
    assert env["OMP_NUM_THREADS"] == "1"  # frontend and engine core; vLLM sets the worker's
    assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == "1"
    # a batch's prefill is one engine step: vLLM's 300 s default killed a 4 x 8K one on a 2-core CPU
    assert int(env["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"]) >= 3600
    every = runner.thread_env(runner.parse_request({**REQUEST, "model": str(tmp_path)}))
    assert runner.cpu_ids(every["VLLM_CPU_OMP_THREADS_BIND"]) == sorted(os.sched_getaffinity(0))
    assert runner.cpu_ids("0-2,5") == [0, 1, 2, 5]
    too_many = runner.parse_request({**REQUEST, "model": str(tmp_path), "threads": 4096})
    with pytest.raises(runner.RequestError, match="may use only"):
        runner.thread_env(too_many)


# ---------------------------------------------------------------- the comparison (cluster.peers.compare)
def test_decode_span_starts_when_every_row_has_its_first_token():
    from cluster.peers.compare import decode_span

    # two rows, AR: row 0 prefilled at 1.0 s, row 1 at 1.2 s; 5 more tokens each, 10 ms apart
    rows = [[(1.0, 1)] + [(1.2 + 0.01 * i, 1) for i in range(1, 6)],
            [(1.2, 1)] + [(1.2 + 0.01 * i, 1) for i in range(1, 6)]]
    s = decode_span(rows)
    assert s["decode_ms_per_step"] == pytest.approx(10.0) and s["positions"] == 5
    assert s["ttft_s"] == pytest.approx(1.2) and s["first_emit_spread_s"] == pytest.approx(0.2)
    # vLLM's form: only the first and the last token times; a speculative first round of 3 tokens
    assert decode_span([[(0.5, 1), (0.9, 7)]])["decode_ms_per_step"] == pytest.approx(400 / 7)
    assert decode_span([[(0.5, 3), (0.6, 2), (0.8, 3)]])["decode_ms_per_step"] == pytest.approx(300 / 5)
    one = decode_span([[(0.5, 1)]])
    assert one["decode_ms_per_step"] is None and "no decode step" in one["note"]
    for bad in ([], [[]], [[(0.5, 0)]], [[(0.5, 1), (0.4, 1)]]):
        with pytest.raises(ValueError):
            decode_span(bad)


def test_decode_timing_takes_the_best_rep_after_a_warm_up():
    from cluster.peers.compare import decode_timing

    calls = []
    steps_ms = iter([99.0, 12.0, 10.0, 11.0])  # the warm-up is slowest and is not timed

    def run(m):  # 50 ms of "prefill" (not in the span) + a per-token step
        calls.append(m)
        step = next(steps_ms) / 1e3
        return [[7] * m], [[(0.05, 1)] + [(0.05 + step * i, 1) for i in range(1, m)]]

    t = decode_timing(run, 6, reps=3)
    assert calls == [6, 6, 6, 6]
    assert t["decode_ms_per_step"] == pytest.approx(10.0) and t["ttft_s"] == pytest.approx(0.05)
    assert t["token_ids"] == [[7] * 6] and t["deterministic"] and t["reps"] == 3
    with pytest.raises(ValueError):
        decode_timing(run, 1, 1)


def test_clock_streamer_counts_greedy_steps_and_assisted_rounds():
    import torch

    from cluster.peers.compare import _ClockStreamer

    c = _ClockStreamer(2)
    c.put(torch.zeros(2, 9, dtype=torch.long))  # the prompt: not an emission
    c.put(torch.tensor([5, 6]))  # a greedy step: one token per row
    c.put(torch.tensor([7, 8]))
    c.end()
    assert [[n for _, n in row] for row in c.emissions] == [[1, 1], [1, 1]]
    a = _ClockStreamer(1)
    a.put(torch.zeros(1, 9, dtype=torch.long))
    a.put(torch.tensor([[1, 2, 3]]))  # an assisted round: 3 accepted tokens
    a.put(torch.tensor([[4]]))
    assert [n for _, n in a.emissions[0]] == [3, 1]
    t = [t for t, _ in a.emissions[0]]
    assert 0 <= t[0] <= t[1]


def test_vllm_emissions_come_from_its_engine_core_token_times(tmp_path):
    from types import SimpleNamespace as NS

    runner = load_runner()

    def out(sched, first, last, n):
        return NS(metrics=NS(scheduled_ts=sched, first_token_ts=first, last_token_ts=last),
                  outputs=[NS(token_ids=list(range(n)))])

    rows, spread = runner.emissions_of([out(100.0, 101.0, 102.0, 8), out(100.5, 101.0, 102.5, 8)])
    assert rows == [[[1.0, 1], [2.0, 7]], [[1.0, 1], [2.5, 7]]] and spread == 0.0
    with pytest.raises(RuntimeError, match="no token timestamps"):
        runner.emissions_of([NS(metrics=None, outputs=[NS(token_ids=[1, 2])])])
    from cluster.peers.compare import decode_span

    assert decode_span(rows)["decode_ms_per_step"] == pytest.approx(1500 / 7)


def test_compare_tokens_checks_every_row_against_our_ar_in_its_cell():
    from cluster.peers.compare import compare_tokens

    rows = [{"method": "sparsespec:ar", "context_len": 1, "batch_size": 2, "decode_ms_per_step": 10.0,
             "token_ids": [[1, 2, 3, 9], [4, 5, 6, 9]]},
            {"method": "vllm:ar", "context_len": 1, "batch_size": 2, "decode_ms_per_step": 20.0,
             "token_ids": [[1, 2, 3, 0], [4, 5, 6, 1]]},  # the last token is not compared (EOS masking)
            {"method": "vllm:ngram", "context_len": 1, "batch_size": 2, "decode_ms_per_step": 5.0,
             "token_ids": [[1, 2, 3, 9], [4, 7, 6, 9]]},
            {"method": "transformers:prompt-lookup", "context_len": 1, "batch_size": 2, "error": "batch size 1 only"}]
    compare_tokens(rows, n=4)
    assert [r.get("same_tokens_as_ours") for r in rows] == [True, True, False, None]
    assert [r.get("over_ours_ar") for r in rows] == [1.0, 2.0, 0.5, None]
    assert not any("token_ids" in r for r in rows)


def test_vllm_peer_without_the_venv_is_one_error_row_per_cell(tmp_path, monkeypatch):
    from cluster.peers.compare import vllm_peer

    monkeypatch.setenv("SPARSESPEC_PEERS_VENV", str(tmp_path / "absent"))
    no_config = vllm_peer(tmp_path, "float32", 2, {(512, 1): [[1, 2]]}, 8, 1, 4, timeout_s=5)
    assert len(no_config) == 2 and all("cannot size vLLM's KV cache" in r["error"] for r in no_config)
    (tmp_path / "config.json").write_text('{"num_attention_heads": 4, "hidden_size": 64, "num_hidden_layers": 2}')
    rows = vllm_peer(tmp_path, "float32", 2, {(512, 1): [[1, 2]], (512, 4): [[1, 2]] * 4}, 8, 1, 4, timeout_s=5)
    assert [(r["method"], r["batch_size"]) for r in rows] == [("vllm:ar", 1), ("vllm:ar", 4), ("vllm:ngram", 1),
                                                              ("vllm:ngram", 4)]
    assert all("make peers" in r["error"] for r in rows)


def test_kv_cache_gib_follows_the_models_attention_shape(tmp_path):
    import json

    from cluster.peers.compare import kv_cache_gib

    # SmolLM2-135M: 30 layers x 3 KV heads x 64 x 2 x 4 bytes = 46,080 bytes per fp32 token
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 9, "hidden_size": 576,
                                                      "num_hidden_layers": 30, "num_key_value_heads": 3}))
    assert kv_cache_gib(tmp_path, "float32", 4 * 8224) == 3  # 1.41 GiB x 2 headroom
    assert kv_cache_gib(tmp_path, "bfloat16", 4 * 8224) == 2
    assert kv_cache_gib(tmp_path, "float32", 10) == 1
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 576}))
    with pytest.raises(ValueError, match="attention shape"):
        kv_cache_gib(tmp_path, "float32", 10)


def test_vllm_cli_answers_vllms_version_as_vllms_platform_check_does():
    """``cluster/peers/vllm_cli.py``: ``version("vllm")`` falls back to ``vllm-cpu`` + "+cpu" (so
    the CPU platform stays detected), other names and a missing alias still raise."""
    import importlib.metadata as md

    from cluster.peers.vllm_cli import patched_version

    installed = {"vllm-cpu": "0.32.0", "torch": "2.13.0"}

    def real(name):
        if name not in installed:
            raise md.PackageNotFoundError(name)
        return installed[name]

    version = patched_version(real)
    assert version("vllm") == "0.32.0+cpu" and version("torch") == "2.13.0"
    with pytest.raises(md.PackageNotFoundError):
        version("numpy")
    installed["vllm"] = "0.33.0"  # a real vllm distribution wins
    assert version("vllm") == "0.33.0"
    del installed["vllm"], installed["vllm-cpu"]
    with pytest.raises(md.PackageNotFoundError):
        version("vllm")


ENGINE_DIED = """
    print("(EngineCore pid=7) ERROR 12-07 01:18:20 [core.py:1] EngineCore encountered a fatal error.", file=sys.stderr)
    print("(EngineCore pid=7) Traceback (most recent call last):", file=sys.stderr)
    print("(EngineCore pid=7) ERROR 12-07 01:35:41 [core.py:1512]     raise TimeoutError", file=sys.stderr)
    print("(EngineCore pid=7) ERROR 12-07 01:35:41 [core.py:1512] TimeoutError: RPC call to execute_model timed out.",
          file=sys.stderr)
    print("vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above)",
          file=sys.stderr)
"""


def test_engine_death_quotes_the_root_cause_from_the_log(tmp_path, monkeypatch):
    # vLLM's front end says only "see stack trace (above)"; the engine core's exception is in the log
    # (the lines as vllm-cpu 0.32.0 printed them when a 4 x 8K prefill outlasted its 300 s step timeout)
    fake_venv(tmp_path, monkeypatch, ENGINE_DIED + """
    json.dump({"error": "EngineDeadError: EngineCore encountered an issue. See stack trace (above)"},
              open(out_path, "w"))
    sys.exit(1)
    """)
    row = peers.run_vllm(REQUEST, timeout_s=30)
    assert row == {"error": "EngineDeadError: EngineCore encountered an issue. See stack trace (above) "
                            "(runner log: TimeoutError: RPC call to execute_model timed out.)"}


def test_a_failed_case_gets_the_root_cause_and_the_others_stay(tmp_path, monkeypatch):
    fake_venv(tmp_path, monkeypatch, ENGINE_DIED + """
    json.dump({"cases": [{"label": "1024/1", "token_ids": [[1]]},
                         {"label": "8192/4", "error": "EngineDeadError: EngineCore encountered an issue."}]},
              open(out_path, "w"))
    """)
    cases = peers.run_vllm(REQUEST, timeout_s=30)["cases"]
    assert cases[0] == {"label": "1024/1", "token_ids": [[1]]}
    assert cases[1]["error"].endswith("(runner log: TimeoutError: RPC call to execute_model timed out.)")


def test_root_cause_is_empty_without_another_exception(tmp_path):
    from cluster.peers.engine import root_cause, with_cause

    log = tmp_path / "log"
    log.write_text("INFO starting\nValueError: bad prompt\n")
    assert root_cause(log, "ValueError: bad prompt") == ""  # the error itself is not its own cause
    assert with_cause("ValueError: bad prompt", log) == "ValueError: bad prompt"
    assert with_cause("RuntimeError: x", tmp_path / "missing") == "RuntimeError: x"
    assert with_cause("RuntimeError: x", None) == "RuntimeError: x"
    log.write_text("(EngineCore pid=3) KeyboardInterrupt\nINFO shutting down\n")
    assert root_cause(log, "EngineDeadError: died") == "KeyboardInterrupt"

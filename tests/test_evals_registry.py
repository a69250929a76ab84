"""evals.registry: one Benchmark protocol for the four benchmarks -- the registry, options,
preflight checks, the context-length contract of build_samples, determinism, pickling, and the
entry scripts over cluster.sweep.cli (CPU, real SmolLM2 tokenizer)."""
from __future__ import annotations

import argparse
import importlib
import json
import pickle
import sys
import types
from pathlib import Path

import pytest

from evals import hub
from evals.base import Sample
from evals.registry import BENCHMARKS, Benchmark, get_benchmark

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
HOTPOT = ROOT / "tests" / "data" / "ruler_hotpotqa_tiny.json"
WINDOW = 8192
NAMES = ("longbench", "longbench_v2", "infinitebench", "ruler")
#: The flags the cluster CLI defines for every benchmark: never a benchmark option.
SHARED_FLAGS = ("--model", "--methods", "--tasks", "--num-samples", "--max-new-tokens", "--context-length", "--db",
                "--dtype", "--k", "--method-options", "--temperature", "--ray-address", "--num-workers", "--threads",
                "--log-level")

#: A small, quick selection per benchmark on the shared data: (tasks, num_samples, options).
CASES = {
    "longbench": (["trec", "gov_report", "hotpotqa"], 2, {"data_dir": str(SHARED / "longbench_v1")}),
    "longbench_v2": (None, 3, {"data_dir": str(SHARED / "longbench_v2")}),
    "infinitebench": (None, 2, {"data_dir": str(SHARED / "infinitebench"), "no_hub": True}),
    "ruler": (["niah_single_1", "vt", "qa_2"], 2, {"qa2_data": str(HOTPOT)}),
}


@pytest.fixture(scope="session")
def tok():
    from sparsespec import load_tokenizer

    return load_tokenizer("smollm2-135m")


def _build(tok, name, *, window=WINDOW, context_length=None, **kw):
    tasks, num, options = CASES[name]
    args = {"tasks": tasks, "num_samples": num, "options": options, **kw}
    return get_benchmark(name).build_samples(tok, window=window, context_length=context_length, **args)


@pytest.fixture(autouse=True)
def _need_shared_data():
    if not SHARED.is_dir():
        pytest.skip(f"no shared data at {SHARED}")


@pytest.fixture()
def offline_hub(monkeypatch):
    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(hub, "LOADER", offline)
    monkeypatch.setattr(hub, "DOWNLOADER", offline)


# ------------------------------------------------------------------ the registry


def test_registry_names_and_protocol():
    assert set(NAMES) <= set(BENCHMARKS)  # (+ "speed", the fixed-length speed samples)
    for name in BENCHMARKS:
        b = get_benchmark(name)
        assert b is BENCHMARKS[name] and b.name == name and isinstance(b, Benchmark)
        assert isinstance(b.tasks, tuple) and all(isinstance(t, str) for t in b.tasks)
        assert isinstance(b.default_tasks, tuple) and set(b.default_tasks) <= set(b.tasks)
        assert isinstance(b.generated, bool)
    ruler, lb = get_benchmark("ruler"), get_benchmark("longbench")
    assert ruler.generated and ruler.default_context_length == 4096 and len(ruler.tasks) == 13
    assert ruler.default_tasks == ("niah_single_1", "niah_single_2", "niah_single_3")
    assert not lb.generated and lb.default_context_length is None
    assert len(lb.tasks) == 34 and "hotpotqa_e" in lb.tasks and "lsht" in lb.tasks
    assert get_benchmark("longbench_v2").tasks == get_benchmark("longbench_v2").default_tasks == ("longbench_v2",)
    assert len(get_benchmark("infinitebench").tasks) == 12
    for name in ("longbench_v2", "infinitebench"):
        assert not get_benchmark(name).generated and get_benchmark(name).default_context_length is None


def test_unknown_benchmark_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown benchmark 'rular'; did you mean 'ruler'\? \(known: longbench, "):
        get_benchmark("rular")
    with pytest.raises(ValueError, match="known: longbench, longbench_v2, infinitebench, ruler"):
        get_benchmark("mmlu")


def test_data_dependent_default_tasks(monkeypatch):
    monkeypatch.setenv("SPARSESPEC_DATA_DIR", str(SHARED))
    lb, ib = get_benchmark("longbench"), get_benchmark("infinitebench")
    assert len(lb.default_tasks) == 11 and lb.default_tasks[0] == "qasper"
    assert ib.default_tasks == ("passkey",)
    monkeypatch.setenv("SPARSESPEC_DATA_DIR", "/nonexistent/data")
    assert lb.default_tasks == () and ib.default_tasks == ()
    assert lb.resolve_tasks(None, {"data_dir": str(SHARED / "longbench_v1")})[:2] == ("qasper", "multifieldqa_en")
    assert lb.resolve_tasks(["trec", "trec"], {}) == ("trec",)
    assert get_benchmark("ruler").resolve_tasks(["all"]) == get_benchmark("ruler").tasks


def test_pickling_benchmarks_scorers_and_samples(tok):
    for name in BENCHMARKS:
        assert pickle.loads(pickle.dumps(get_benchmark(name))) is get_benchmark(name)
    for name in NAMES:
        b = get_benchmark(name)
        score = pickle.loads(pickle.dumps(b.score_sample))
        one_task = {"longbench": ["trec"], "ruler": ["niah_single_1"]}.get(name)
        (s,) = _build(tok, name, context_length=1024, num_samples=1, tasks=one_task)
        assert pickle.loads(pickle.dumps(s)) == s
        assert score(s, s.references[0]) == b.score_sample(s, s.references[0])


# ------------------------------------------------------------------ options


def test_options_are_add_arguments_dests_with_the_same_defaults():
    for name in BENCHMARKS:
        b = get_benchmark(name)
        parser = argparse.ArgumentParser()
        for flag in SHARED_FLAGS:  # as the cluster CLI defines them: no conflict with add_arguments
            parser.add_argument(flag)
        b.add_arguments(parser)
        parsed = vars(parser.parse_args([]))
        shared = {f.lstrip("-").replace("-", "_") for f in SHARED_FLAGS}
        assert {k: v for k, v in parsed.items() if k not in shared} == b.option_defaults(), name
        assert not shared & set(b.option_defaults()), name
        json.dumps(b.option_defaults())
    assert get_benchmark("ruler").option_defaults()["seed"] == 42
    assert get_benchmark("infinitebench").option_defaults()["prompt_set"] == "yarn_mistral"


def test_unknown_option_keys_are_errors(tok):
    for name in NAMES:
        b = get_benchmark(name)
        with pytest.raises(ValueError, match=rf"{name}: unknown option 'data_dri'"):
            b.check(tasks=None, options={"data_dri": "x"})
        with pytest.raises(ValueError, match=rf"{name}: unknown option 'context_length'"):
            b.build_samples(tok, window=WINDOW, options={"context_length": 1024})
    with pytest.raises(ValueError, match="did you mean 'data_dir'"):
        get_benchmark("longbench").check(tasks=None, options={"data_dri": "x"})
    with pytest.raises(ValueError, match="did you mean 'haystack'"):
        get_benchmark("ruler").check(tasks=None, options={"haystak": "x"})


# ------------------------------------------------------------------ preflight checks


def test_check_unknown_tasks_with_a_suggestion():
    for name, bad, good in (("longbench", "hotpot_qa", "hotpotqa"), ("longbench_v2", "longbench_v", "longbench_v2"),
                            ("infinitebench", "passkeys", "passkey"), ("ruler", "niah_single1", "niah_single_1")):
        with pytest.raises(ValueError, match=rf"unknown .*task '{bad}'; did you mean '{good}'"):
            get_benchmark(name).check(tasks=[bad], options=CASES[name][2])


def test_check_passes_on_the_shared_data():
    for name in NAMES:
        tasks, _, options = CASES[name]
        get_benchmark(name).check(tasks=tasks, options=options)


def test_check_fails_fast_on_a_missing_data_folder(tmp_path, offline_hub):
    missing = str(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="LongBench data folder not found"):
        get_benchmark("longbench").check(tasks=None, options={"data_dir": missing})
    with pytest.raises(FileNotFoundError, match="no LongBench file for task 'trec'"):
        get_benchmark("longbench").check(tasks=["trec"], options={"data_dir": missing})
    with pytest.raises(FileNotFoundError, match="no LongBench v2 file"):
        get_benchmark("longbench_v2").check(tasks=None, options={"data_dir": missing})
    with pytest.raises(FileNotFoundError, match="InfiniteBench data folder not found"):
        get_benchmark("infinitebench").check(tasks=None, options={"data_dir": missing})
    with pytest.raises(FileNotFoundError, match="no InfiniteBench file for task 'passkey'"):
        get_benchmark("infinitebench").check(tasks=["passkey"], options={"data_dir": missing, "no_hub": True})
    with pytest.raises(FileNotFoundError, match="--haystack"):
        get_benchmark("ruler").check(tasks=["niah_single_2"], options={"haystack": missing})
    with pytest.raises(FileNotFoundError, match="qa_2 needs a HotpotQA-format JSON file"):
        get_benchmark("ruler").check(tasks=["qa_2"], options={})


def test_check_rejects_bad_option_values():
    with pytest.raises(ValueError, match="--max-length must be >= 2"):
        get_benchmark("longbench").check(tasks=None, options={**CASES["longbench"][2], "max_length": 1})
    with pytest.raises(ValueError, match="--max-length must be an integer"):
        get_benchmark("longbench_v2").check(tasks=None, options={**CASES["longbench_v2"][2], "max_length": "512"})


# ------------------------------------------------------------------ build_samples: the context-length contract


@pytest.mark.parametrize("name", NAMES)
def test_context_length_caps_prompt_plus_budget(tok, name):
    for L in (1024, 2048):
        samples = _build(tok, name, context_length=L)
        assert samples and all(isinstance(s, Sample) and s.benchmark == name for s in samples)
        for s in samples:
            total = len(s.prompt_ids) + s.max_new_tokens
            assert total <= L, (s.task, s.sample_id, total)
            assert s.num_input_tokens == len(s.prompt_ids)
            if name == "ruler":  # generated at L: as tight as one haystack unit (see test_evals_ruler)
                assert L - 64 <= total and s.meta["context_length"] == L and s.meta["total_tokens"] == total
            elif s.meta["truncated"]:  # truncated to L: the official cut, a few seam tokens at most
                assert total >= L - 8, (s.task, s.sample_id, total)
        ids = [(s.task, s.sample_id) for s in samples]
        assert len(set(ids)) == len(ids)


@pytest.mark.parametrize("name", ("longbench", "longbench_v2", "infinitebench"))
def test_natural_data_context_length_is_a_window_cap(tok, name):
    """Natural data at L inside a bigger window == the same data with a window of L (the old
    max_context), and L = None == L = window."""
    assert _build(tok, name, window=WINDOW, context_length=2048) == _build(tok, name, window=2048)
    assert _build(tok, name, window=WINDOW) == _build(tok, name, window=WINDOW, context_length=WINDOW)
    # the max_length option still caps the prompt, below L
    capped = _build(tok, name, context_length=2048, options={**CASES[name][2], "max_length": 600})
    assert all(s.meta["max_length"] <= 600 and len(s.prompt_ids) <= 600 + s.meta["template_overhead"] + 4
               for s in capped)


def test_ruler_default_context_length(tok):
    (s,) = _build(tok, "ruler", tasks=["niah_single_1"], num_samples=1)
    assert s.meta["context_length"] == 4096 and s.sample_id == "ctx4096-seed42-0"


@pytest.mark.parametrize("name", NAMES)
def test_build_samples_is_deterministic(tok, name):
    a = _build(tok, name, context_length=1024)
    b = _build(tok, name, context_length=1024)
    assert a == b and [s.prompt_ids for s in a] == [s.prompt_ids for s in b]


@pytest.mark.parametrize("name", NAMES)
def test_context_length_above_the_window_is_an_error(tok, name):
    with pytest.raises(ValueError, match="exceeds the model window"):
        _build(tok, name, window=2048, context_length=4096)


@pytest.mark.parametrize("name", NAMES)
def test_unknown_tasks_are_errors(tok, name):
    with pytest.raises(ValueError, match="unknown .*task 'nope'"):
        _build(tok, name, tasks=["nope"])


def test_max_new_tokens_overrides_the_budget(tok):
    for name in NAMES:
        samples = _build(tok, name, context_length=1024, max_new_tokens=7)
        assert samples and all(s.max_new_tokens == 7 for s in samples), name


# ------------------------------------------------------------------ the entry scripts


def _fake_cluster_cli(monkeypatch, tokenizer, calls):
    """A stand-in for cluster.sweep.cli.benchmark_main with the contract it is written against: shared
    flags + the benchmark's add_arguments, check, then build_samples with the parsed options."""
    from evals.registry import get_benchmark as get

    def benchmark_main(name, argv):
        b = get(name)
        parser = argparse.ArgumentParser(prog=name)
        parser.add_argument("--tasks", type=lambda t: t.split(","))
        parser.add_argument("--num-samples", type=int)
        parser.add_argument("--max-new-tokens", type=int)
        parser.add_argument("--context-length", type=int)
        b.add_arguments(parser)
        args = vars(parser.parse_args(argv))
        options = {k: args[k] for k in b.option_defaults()}
        try:
            b.check(tasks=args["tasks"], options=options)
        except (ValueError, FileNotFoundError) as e:
            calls.append(("error", str(e)))
            return 2
        samples = b.build_samples(tokenizer, window=WINDOW, context_length=args["context_length"],
                                  tasks=args["tasks"], num_samples=args["num_samples"],
                                  max_new_tokens=args["max_new_tokens"], options=options)
        calls.append((name, samples))
        return 0

    cli = types.ModuleType("cluster.sweep.cli")
    cli.benchmark_main = benchmark_main
    monkeypatch.setitem(sys.modules, "cluster.sweep.cli", cli)


def test_entry_scripts_hand_over_to_cluster_cli(monkeypatch, tok):
    calls: list = []
    _fake_cluster_cli(monkeypatch, tok, calls)
    lb_dir = str(SHARED / "longbench_v1")
    assert importlib.import_module("evals.longbench").main(
        ["--tasks", "triviaqa", "--num-samples", "1", "--data-dir", lb_dir, "--max-length", "300"]) == 0
    name, (s,) = calls.pop()
    assert name == "longbench" and s.task == "triviaqa" and s.meta["max_length"] == 300
    assert importlib.import_module("evals.ruler").main(
        ["--tasks", "niah_single_1", "--num-samples", "1", "--context-length", "1024", "--seed", "5"]) == 0
    name, (s,) = calls.pop()
    assert name == "ruler" and s.meta["seed"] == 5 and s.meta["context_length"] == 1024
    assert importlib.import_module("evals.infinitebench").main(
        ["--num-samples", "1", "--data-dir", str(SHARED / "infinitebench"), "--no-hub", "--context-length", "1024"]) == 0
    name, (s,) = calls.pop()
    assert name == "infinitebench" and len(s.prompt_ids) + s.max_new_tokens <= 1024
    assert importlib.import_module("evals.longbench_v2").main(["--tasks", "nope"]) == 2
    assert calls.pop() == ("error", "unknown LongBench v2 task 'nope' (known: longbench_v2)")
    own = argparse.ArgumentParser()  # RULER's old --context-length is the shared flag now: no own copy
    get_benchmark("ruler").add_arguments(own)
    assert "--context-length" not in own._option_string_actions  # noqa: SLF001


@pytest.mark.parametrize("name", NAMES)
def test_entry_scripts_run_as_scripts(name):
    import subprocess

    out = subprocess.run([sys.executable, str(ROOT / "evals" / f"{name}.py"), "--help"], cwd=ROOT / "evals",
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--context-length" in out.stdout
    for flag in get_benchmark(name).option_defaults():
        assert "--" + flag.replace("_", "-") in out.stdout

"""CLI plumbing shared by the benchmark scripts (sparsespec replaced by a stub module)."""
import sys
import types

import pytest

from cluster import jobs
from cluster.fake import fake_engine_factory
from cluster.store import DEFAULT_DB_URL, open_store
from evals.base import Sample


@pytest.fixture
def fake_sparsespec(monkeypatch):
    """A stand-in for the engine package: METHODS, load_tokenizer, model_max_context."""
    mod = types.ModuleType("sparsespec")
    mod.METHODS = {"ar": object, "sparsespec-l": object}
    mod.load_tokenizer = lambda name: {"tokenizer_for": name}
    mod.model_max_context = lambda name: 2048
    mod.resolve_method_options = lambda method, options: {"k": "auto", **options}
    monkeypatch.setitem(sys.modules, "sparsespec", mod)
    return mod


def build_samples(tokenizer, args, max_context):
    assert tokenizer == {"tokenizer_for": args.model} and max_context == 2048
    tasks = args.tasks or ["default_task"]
    return [Sample(benchmark="toy", task=t, sample_id=str(i), prompt_ids=(1, 2, 3 + i), references=("x",),
                   max_new_tokens=32, num_input_tokens_raw=3, num_input_tokens=3)
            for t in tasks for i in range(args.num_samples or 2)]


def score_sample(sample, prediction):
    return 0.5


def test_parser_defaults_and_types():
    p = jobs.common_parser("toy")
    a = p.parse_args([])
    assert (a.model, a.methods, a.tasks, a.num_samples, a.max_new_tokens) == (
        "smollm2-135m", ["sparsespec-l"], None, None, None)
    assert (a.db, a.dtype, a.k, a.temperature, a.ray_address, a.num_workers, a.threads) == (
        DEFAULT_DB_URL, "float32", None, 0.0, None, None, None)
    a = p.parse_args(["--methods", "ar, sparsespec-l", "--tasks", "a,b", "--k", "4", "--num-samples", "3",
                      "--dtype", "bfloat16", "--temperature", "0.7", "--num-workers", "2"])
    assert a.methods == ["ar", "sparsespec-l"] and a.tasks == ["a", "b"] and a.k == 4 and a.num_samples == 3
    assert a.dtype == "bfloat16" and a.temperature == 0.7 and a.num_workers == 2


@pytest.mark.parametrize("argv", [["--k", "0"], ["--num-samples", "x"], ["--dtype", "int8"],
                                  ["--temperature", "-1"], ["--methods", ","]])
def test_parser_rejects_bad_values(argv, capsys):
    with pytest.raises(SystemExit):
        jobs.common_parser("toy").parse_args(argv)


def test_unknown_method_lists_the_registry(fake_sparsespec, tmp_path, capsys):
    args = jobs.common_parser("toy").parse_args(["--methods", "sparsespec-l,medusa", "--db",
                                                 f"sqlite:///{tmp_path}/x.db"])
    assert jobs.run("toy", args, build_samples, score_sample) == 2
    err = capsys.readouterr().err
    assert "medusa" in err and "sparsespec-l" in err and "ar" in err
    assert not (tmp_path / "x.db").exists()


def test_run_end_to_end_with_fake_engine(ray_session, fake_sparsespec, tmp_path, capsys):
    db = f"sqlite:///{tmp_path}/jobs.db"
    args = jobs.common_parser("toy").parse_args(
        ["--db", db, "--tasks", "qa,sum", "--num-samples", "2", "--max-new-tokens", "5", "--k", "3",
         "--ray-address", "ignored-when-ray-is-up"])
    assert jobs.run("toy", args, build_samples, score_sample, engine_factory=fake_engine_factory) == 0
    out = capsys.readouterr().out
    assert "score (x100)" in out and "sparsespec-l" in out and "qa" in out and "sum" in out
    with open_store(db) as st:
        (run,) = st.runs()
        rows = st.results(run["run_id"])
    assert run["run_id"] in out
    assert run["config"]["config"]["max_new_tokens"] == 5 and "db" not in run["config"]["config"]
    assert len(rows) == 2 * 2 * 2
    assert all(r["stats"]["num_output_tokens"] == 5 for r in rows)  # --max-new-tokens override
    assert {r["stats"]["k"] for r in rows if r["method"] == "sparsespec-l"} == {3}  # --k -> method_options
    assert {r["score"] for r in rows} == {0.5}


def test_method_options_flag_is_validated(fake_sparsespec, tmp_path, capsys):
    p = jobs.common_parser("toy")
    a = p.parse_args(["--method-options", '{"sparsespec-l": {"budget_frac": 0.2}}'])
    assert a.method_options == {"sparsespec-l": {"budget_frac": 0.2}}
    with pytest.raises(SystemExit):
        p.parse_args(["--method-options", "[1, 2]"])
    with pytest.raises(SystemExit):
        p.parse_args(["--method-options", "{not json"])
    args = p.parse_args(["--methods", "sparsespec-l", "--method-options", '{"ngram": {"ngram_max": 3}}',
                         "--db", f"sqlite:///{tmp_path}/x.db"])
    assert jobs.run("toy", args, build_samples, score_sample) == 2
    assert "not in --methods" in capsys.readouterr().err

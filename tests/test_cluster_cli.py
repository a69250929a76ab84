"""The benchmark scripts' CLI: flags -> the equivalent one-benchmark sweep spec."""
import pytest
import yaml

from cluster.sweep import cli
from cluster.sweep.schema import parse_spec
from cluster.sweep.worker import sampling_params
from evals.base import Sample


def _spec(name, argv):
    args = cli.build_parser(name).parse_args(argv)
    return parse_spec(cli.spec_from_args(name, args))


def test_defaults_are_the_demo_model_sparsespec_and_batch_one():
    s = _spec("ruler", [])
    assert s.models == ("smollm2-135m",) and list(s.methods) == ["ar", "sparsespec-l"]
    assert s.batch_sizes == (1,) and s.context_lengths == (None,)
    (b,) = s.benchmarks
    assert b.name == "ruler" and b.tasks is None and set(b.options) >= {"seed", "haystack"}


def test_flags_map_onto_the_spec():
    s = _spec("longbench", ["--model", "m1", "--methods", "sparsespec-l,ngram", "--k", "4",
                            "--method-options", '{"ngram": {"ngram_max": 3}}', "--tasks", "hotpotqa",
                            "--num-samples", "2", "--batch-size", "1,4", "--context-length", "2048,default",
                            "--max-length", "1500", "--temperature", "0.7", "--threads", "1", "--db", "sqlite:///x.db"])
    assert s.methods == {"ar": {}, "sparsespec-l": {"k": 4}, "ngram": {"k": 4, "ngram_max": 3}}
    assert s.batch_sizes == (1, 4) and s.context_lengths == (2048, None)
    (b,) = s.benchmarks
    assert b.tasks == ("hotpotqa",) and b.num_samples == 2 and b.options["max_length"] == 1500
    assert s.sampling.temperature == 0.7 and s.workers.threads == 1 and s.db == "sqlite:///x.db"


def test_method_options_for_a_method_not_run_is_an_error(capsys):
    assert cli.benchmark_main("ruler", ["--method-options", '{"ngram": {"k": 2}}', "--print-spec"]) == 2
    assert "not in --methods" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--k", "-1"], ["--batch-size", "x"], ["--method-options", "[1]"]])
def test_bad_flags_exit_2(argv):
    with pytest.raises(SystemExit) as e:
        cli.build_parser("ruler").parse_args(argv)
    assert e.value.code == 2


def test_print_spec_round_trips(capsys):
    assert cli.benchmark_main("ruler", ["--tasks", "niah_single_1", "--print-spec"]) == 0
    data = yaml.safe_load(capsys.readouterr().out)
    assert parse_spec(data).benchmarks[0].tasks == ("niah_single_1",)


def test_unknown_benchmark_is_a_clear_error(capsys):
    assert cli.benchmark_main("rulerr", []) == 2
    assert "did you mean 'ruler'" in capsys.readouterr().err


def test_the_samples_stopping_rule_reaches_the_engine():
    s = Sample(benchmark="b", task="t", sample_id="0", prompt_ids=(1, 2), references=("x",), max_new_tokens=9,
               num_input_tokens_raw=2, num_input_tokens=2,
               meta={"stop": ["\n"], "stop_token_ids": [7], "min_new_tokens": 2})
    p = sampling_params(s, {"temperature": 0.5, "top_p": 0.9, "top_k": 3}, row_seed=11)
    assert (p.max_new_tokens, p.stop, p.stop_token_ids, p.min_new_tokens) == (9, ("\n",), (7,), 2)
    assert (p.temperature, p.top_p, p.top_k, p.seed) == (0.5, 0.9, 3, 11)
    assert sampling_params(s, {}, None, max_new_tokens=3).max_new_tokens == 3

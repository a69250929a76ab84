"""The ``speed`` benchmark: fixed-length windows of a real book for speed runs (no quality score)."""
from __future__ import annotations

import argparse
import pickle

import pytest

from evals.benchmarks import speed
from evals.registry import BENCHMARKS, Benchmark, get_benchmark
from helpers import SHARED_DATA


class CharTokenizer:
    """One token per character (ids = code points): exact, fast and easy to check by hand."""

    def __call__(self, text, add_special_tokens=True):
        ids = [ord(c) for c in text]
        return {"input_ids": ([1] + ids) if add_special_tokens else ids}


@pytest.fixture(scope="module")
def smol_tokenizer():
    from transformers import AutoTokenizer

    from sparsespec.provision import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))


def test_registered_with_the_protocol():
    b = get_benchmark("speed")
    assert "speed" in BENCHMARKS and isinstance(b, Benchmark) and b is speed.benchmark
    assert b.tasks == b.default_tasks == ("fixed",) and b.generated is True
    assert b.default_context_length == 1024
    assert pickle.loads(pickle.dumps(b)) is b
    assert pickle.loads(pickle.dumps(b.score_sample)).__self__ is b
    p = argparse.ArgumentParser()
    b.add_arguments(p)
    assert vars(p.parse_args([])) == b.option_defaults() == {"text": None, "skip_tokens": 1000}
    assert vars(p.parse_args(["--text", "x.txt", "--skip-tokens", "0"])) == {"text": "x.txt", "skip_tokens": 0}
    assert speed.default_text() == SHARED_DATA / "public_domain_books" / "2701-0.txt"


def test_windows_are_consecutive_exact_length_and_ignore_eos():
    text = speed.default_text().read_text(encoding="utf-8-sig")
    samples = speed.benchmark.build_samples(CharTokenizer(), window=4096, context_length=300, max_new_tokens=20)
    assert [s.sample_id for s in samples] == ["L300-0", "L300-1", "L300-2", "L300-3"]  # 4 by default
    P = 300 - 20
    for i, s in enumerate(samples):
        assert (s.benchmark, s.task, s.max_new_tokens) == ("speed", "fixed", 20)
        assert len(s.prompt_ids) == s.num_input_tokens == s.num_input_tokens_raw == P
        assert s.meta == {"ignore_eos": True} and s.references == ()
        # window i of the text after the 1000 skipped tokens (characters, for this tokenizer)
        assert "".join(map(chr, s.prompt_ids)) == text[1000 + i * P: 1000 + (i + 1) * P]


def test_defaults_determinism_and_the_same_start_at_every_length(smol_tokenizer):
    b = speed.benchmark
    default = b.build_samples(smol_tokenizer, window=8192)
    assert len(default) == 4 and all(len(s.prompt_ids) == 1024 - 64 and s.max_new_tokens == 64 for s in default)
    assert [s.sample_id for s in default] == [f"L1024-{i}" for i in range(4)]
    again = b.build_samples(smol_tokenizer, window=8192, context_length=1024)
    assert [s.prompt_ids for s in again] == [s.prompt_ids for s in default]
    short = b.build_samples(smol_tokenizer, window=8192, context_length=512, num_samples=2, max_new_tokens=16)
    assert [len(s.prompt_ids) for s in short] == [496, 496]
    # sample 0 starts at the same token at every length; sample 1 follows sample 0
    assert default[0].prompt_ids[:496] == short[0].prompt_ids
    long = b.build_samples(smol_tokenizer, window=8192, context_length=1008, num_samples=1, max_new_tokens=16)
    assert long[0].prompt_ids == short[0].prompt_ids + short[1].prompt_ids
    # real prose, decodable
    assert "whale" in smol_tokenizer.decode(list(default[0].prompt_ids) + list(default[1].prompt_ids)).lower()


def test_a_short_text_is_repeated_and_skip_tokens_applies(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("abcdefghij")
    samples = speed.benchmark.build_samples(CharTokenizer(), window=100, context_length=30, num_samples=2,
                                            max_new_tokens=5, options={"text": str(f), "skip_tokens": 3})
    got = ["".join(map(chr, s.prompt_ids)) for s in samples]
    stream = "abcdefghij" * 10
    assert got == [stream[3:28], stream[28:53]]


@pytest.mark.parametrize("kwargs, err, needle", [
    ({"context_length": 5000}, ValueError, "exceeds the model window"),
    ({"context_length": 64, "max_new_tokens": 64}, ValueError, "leaves no prompt"),
    ({"tasks": ["fixd"]}, ValueError, "did you mean 'fixed'"),
    ({"options": {"txt": "x"}}, ValueError, "did you mean 'text'"),
    ({"options": {"text": "/no/such/book.txt"}}, FileNotFoundError, "--text FILE"),
    ({"options": {"skip_tokens": -1}}, ValueError, "skip_tokens"),
])
def test_bad_arguments_raise_one_clear_error(kwargs, err, needle):
    with pytest.raises(err, match=needle):
        speed.benchmark.build_samples(CharTokenizer(), window=4096, **kwargs)


def test_check_is_a_fast_preflight():
    b = speed.benchmark
    b.check(tasks=None, options={})
    b.check(tasks=["fixed"], options={"text": str(speed.default_text())})
    with pytest.raises(FileNotFoundError, match="not found"):
        b.check(tasks=None, options={"text": "/no/such/book.txt"})
    with pytest.raises(ValueError, match="unknown task"):
        b.check(tasks=["qa"], options={})
    assert b.resolve_tasks(None) == ("fixed",)


def test_no_quality_score_and_no_official_prediction_format():
    b = speed.benchmark
    (s,) = b.build_samples(CharTokenizer(), window=4096, context_length=200, num_samples=1)
    assert b.score_sample(s, "anything at all") is None
    with pytest.raises(ValueError, match="no official prediction format"):
        b.score_predictions("fixed", [{"pred": "x"}])


def test_the_coordinator_and_the_report_accept_none_scores(smol_tokenizer, tmp_path):
    """A speed shard goes through the planner, ``result_rows`` and the report with score None."""
    from cluster.sweep.coordinator import result_rows
    from cluster.sweep.plan import plan_shards
    from cluster.results.report import compute_report
    from cluster.sweep.schema import parse_spec
    from cluster.sweep.run import plan

    spec = parse_spec({"name": "s", "models": ["smollm2-135m"], "methods": {"sparsespec-l": {"k": 2}},
                       "batch_sizes": [2], "context_lengths": [256],
                       "benchmarks": [{"name": "speed", "num_samples": 2}], "sampling": {"max_new_tokens": 8},
                       "db": f"sqlite:///{tmp_path}/x.db"})
    cells, shards = plan(spec, tokenizer_info=lambda m: (smol_tokenizer, 8192))
    assert [s.key for s in shards] == [f"{cells[0].run_id}/fixed/0"]
    assert plan(spec, tokenizer_info=lambda m: (smol_tokenizer, 8192))[1][0].key == shards[0].key
    (shard,) = plan_shards(cells[0])
    assert all(len(x.prompt_ids) == 248 and x.meta["ignore_eos"] for x in shard.samples)
    outs = [{"sample_id": x.sample_id, "task": "fixed", "method": m, "token_ids": [5, 6, 7], "text": "x",
             "stats": {"num_drafted": 2, "num_accepted": 2, "num_steps": 1, "num_emitted": 3, "num_output_tokens": 3,
                       "batch_wall_s": 1.0 if m == "ar" else 0.5, "batch_prefill_s": 0.1}}
            for x in shard.samples for m in shard.methods]
    rows = result_rows(shard, outs, get_benchmark("speed").score_sample)
    assert all(r["score"] is None for r in rows)
    for r in rows:
        r.update(context_length=256, batch_size=2)
    rep = {r["method"]: r for r in compute_report(rows)}
    assert rep["ar"]["score"] is None and rep["sparsespec-l"]["score"] is None
    assert rep["sparsespec-l"]["lossless_rate"] == 1.0
    assert rep["sparsespec-l"]["speedup"] == pytest.approx((1.0 - 0.1) / (0.5 - 0.1))

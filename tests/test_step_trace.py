"""The per-step acceptance trace (``stats["step_trace"]``) on a tiny random-weight model: one
``(k, accepted)`` per verify step, consistent with the request's own counters; empty for AR."""
from __future__ import annotations

import json

import pytest
import torch

from sparsespec import Engine, SamplingParams
from sparsespec.model import Transformer
from sparsespec.stats import derive, pool
from tests.helpers import own_options, write_tiny_llama

V = 48
SPARSE = {"k": 3, "min_budget": 40, "max_budget": 40, "n_sink": 4, "n_recent": 8, "window": 8}
FULL = {"min_budget": 4096, "max_budget": 4096, "n_sink": 4, "n_recent": 8, "window": 8}  # index = everything


class ByteTok:
    def decode(self, ids, skip_special_tokens=True):
        return "".join("abc"[int(i) % 3] for i in ids)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = write_tiny_llama(tmp_path_factory.mktemp("tiny") / "m", vocab_size=V, hidden=32, intermediate=64,
                              layers=2, max_pos=1024, seed=0, scale=0.5, embed_scale=1.0, eos_token_id=V + 7)
    model = Transformer.from_folder(folder)
    model.source_folder = None
    return Engine(model, ByteTok(), "tiny")


def _prompt(n, seed):
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _check(stats):
    trace = stats["step_trace"]
    assert isinstance(trace, list) and all(isinstance(e, list) and len(e) == 2 for e in trace)
    assert len(trace) == stats["num_steps"]
    assert sum(k for k, _ in trace) == stats["num_drafted"]
    assert sum(a for _, a in trace) == stats["num_accepted"]
    assert sum(1 for k, _ in trace if k > 0) == stats["num_drafting_steps"]
    assert all(0 <= a <= k for k, a in trace)
    hist = {}
    for k, a in trace:
        if k:
            hist[f"{k}:{a}"] = hist.get(f"{k}:{a}", 0) + 1
    assert hist == stats["accept_hist"]  # the histogram is the trace's counts
    json.dumps(trace)  # JSON-friendly


@pytest.mark.parametrize("method", ["sparsespec-l", "ngram"])
def test_trace_has_one_entry_per_verify_step(engine, method):
    prompts = [_prompt(150 + 31 * i, i) for i in range(3)]
    core = engine.core(method, own_options(method, SPARSE), max_num_seqs=2, max_model_len=400)  # 3 requests, 2 slots: rows join
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, SamplingParams(max_new_tokens=14 + 3 * i, ignore_eos=True))
    finals = {}
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finished:
                finals[out.request_id] = out.output.stats
    assert set(finals) == {"r0", "r1", "r2"}
    for st in finals.values():
        assert st["num_steps"] > 0
        _check(st)
    if method == "sparsespec-l":
        assert sum(st["num_drafted"] for st in finals.values()) > 0, "drafted nothing"
    # pooling and deriving read only the summed keys
    pooled = pool(finals.values())
    assert "step_trace" not in pooled
    assert derive(pooled)["tau"] > 0


def test_trace_counts_only_drafts_before_a_stop(engine):
    """Full index (every draft accepted): a 12-token budget with k=8 is two steps, 8:8 then 1:1
    (the last step may draft only up to the budget)."""
    out = engine.generate([_prompt(150, 6)], method="sparsespec-l", method_options={**FULL, "k": 8},
                          max_new_tokens=12, ignore_eos=True)[0]
    assert out.stats["step_trace"] == [[8, 8], [1, 1]]
    _check(out.stats)


def test_ar_has_no_trace(engine):
    out = engine.generate([_prompt(120, 3)], method="ar", max_new_tokens=6, ignore_eos=True)[0]
    assert out.stats["num_steps"] == 5 and out.stats["step_trace"] == []

"""Fast engine tests on tiny random-weight models, each against an independent oracle.

Oracles: standalone greedy AR decoding (continuous batching, losslessness); a fresh dense forward
over the committed sequence (the importance window and the index); the self-draft over the full
index, which *is* the target, so every draft must be accepted (exact counts around stops, and
alpha = 1 when sampling only if q is the processed distribution); distributions enumerated from
the model with a temperature / top-k / top-p written out here (sampling at the speculative
positions); a byte-level tokenizer (stream deltas around split UTF-8 characters).
"""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from sparsespec import METHODS, Engine, SamplingParams
from sparsespec.kv.cache import KVCache
from sparsespec.kv.index import build_index
from sparsespec.model import Transformer, prefill_chunks
from tests.helpers import eagle3_head, own_options, write_tiny_llama

V = 48
SPARSE = {"k": 3, "min_budget": 40, "max_budget": 40, "n_sink": 4, "n_recent": 8, "window": 8}
FULL = {"min_budget": 4096, "max_budget": 4096, "n_sink": 4, "n_recent": 8, "window": 8}  # index = everything
BYTES = {0: b"\xc3", 1: b"\xa9", 2: b"a"}  # id % 3 -> byte: "\xc3\xa9" is "é", split over two tokens


class ByteTok:
    """A byte-level tokenizer: id -> one byte (``BYTES[id % 3]``), decoded as UTF-8 with
    replacement characters, as a BPE tokenizer's byte fallback decodes a split character."""

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(BYTES[int(i) % 3] for i in ids).decode("utf-8", errors="replace")


def _model(folder, seed=0, vocab=V, max_pos=1024, scale=0.5, layers=2):
    return Transformer.from_folder(write_tiny_llama(folder, vocab_size=vocab, hidden=32, intermediate=64, layers=layers,
                                                    max_pos=max_pos, seed=seed, scale=scale, embed_scale=1.0,
                                                    eos_token_id=vocab + 7))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = _model(tmp_path_factory.mktemp("tiny") / "m")
    model.source_folder = None
    return Engine(model, ByteTok(), "tiny")


def _prompt(n, seed):
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _ar(engine, prompt, n, **kw):
    return engine.generate([prompt], method="ar", max_new_tokens=n, **kw)[0]


def _drain(core):
    """Run a core to completion; {request_id: [RequestOutput, ...]}."""
    got = {}
    while core.has_unfinished_requests():
        for out in core.step():
            got.setdefault(out.request_id, []).append(out)
    return got


# ------------------------------------------------------------------ continuous batching
def test_requests_join_a_running_batch_and_match_standalone_ar(engine):
    prompts = {f"r{i}": _prompt(150 + 37 * i, i) for i in range(5)}
    n_new = {"r0": 20, "r1": 9, "r2": 14, "r3": 18, "r4": 11}
    ref = {r: _ar(engine, p, n_new[r], ignore_eos=True).token_ids for r, p in prompts.items()}
    core = engine.core("sparsespec-l", SPARSE, max_num_seqs=2, max_model_len=400)
    params = {r: SamplingParams(max_new_tokens=n_new[r], ignore_eos=True) for r in prompts}
    core.add_request("r0", prompts["r0"], params["r0"])
    outs = {}
    running_seen = []
    for step in range(200):
        if step == 2:  # r1 and r2 arrive while r0 runs; r2 must wait: the pool has 2 slots
            core.add_request("r1", prompts["r1"], params["r1"])
            core.add_request("r2", prompts["r2"], params["r2"])
        if step == 4:
            core.add_request("r3", prompts["r3"], params["r3"])
            core.add_request("r4", prompts["r4"], params["r4"])
        if step == 6:
            core.abort_request("r3")  # aborted while waiting or running: no output
        for out in core.step():
            outs.setdefault(out.request_id, []).append(out)
        running_seen.append(len(core.running))
        for req in core.running:  # each slot holds exactly its row's committed KV (after compaction too)
            committed = req.prompt + req.out[:-1]
            S = len(committed)
            assert core.cache.lengths[req.slot] == S
            fresh = KVCache(engine.model.cfg, 1, S, engine.model.dtype, engine.model.device)
            engine.model.forward_dense(torch.tensor([committed]), fresh)
            torch.testing.assert_close(core.cache.k[:, req.slot, :, :S], fresh.k[:, 0], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(core.cache.v[:, req.slot, :, :S], fresh.v[:, 0], rtol=1e-4, atol=1e-5)
        if not core.has_unfinished_requests() and step > 6:
            break
    assert max(running_seen) == 2, "the pool never holds more than max_num_seqs rows"
    assert "r3" not in {r for r, o in outs.items() if o[-1].finished}
    for r in ("r0", "r1", "r2", "r4"):
        final = outs[r][-1]
        assert final.finished and final.output.token_ids == ref[r], r
        assert sum((o.new_token_ids for o in outs[r]), []) == ref[r]
    assert sum(outs[r][-1].output.stats["num_drafted"] for r in ("r0", "r1", "r2", "r4")) > 0, "drafted nothing"


@pytest.mark.parametrize("method", [m for m in METHODS if m != "draft-model"])
def test_mixed_sampling_batch_keeps_greedy_rows_identical_to_ar(engine, method):
    prompts = [_prompt(200, 10), _prompt(170, 11), _prompt(120, 12)]
    ref = _ar(engine, prompts[0], 16, ignore_eos=True).token_ids
    opts = own_options(method, SPARSE)
    if method == "eagle3":
        opts["draft_model"] = eagle3_head(engine.model)
    core = engine.core(method, opts, max_num_seqs=3, max_model_len=300)
    core.add_request("g", prompts[0], SamplingParams(max_new_tokens=16, ignore_eos=True))
    core.add_request("s1", prompts[1], SamplingParams(max_new_tokens=12, temperature=0.8, top_k=10, seed=1,
                                                      ignore_eos=True))
    core.add_request("s2", prompts[2], SamplingParams(max_new_tokens=10, temperature=1.3, top_p=0.9, seed=2,
                                                      ignore_eos=True))
    outs = _drain(core)
    assert outs["g"][-1].output.token_ids == ref
    assert len(outs["s1"][-1].output.token_ids) == 12 and len(outs["s2"][-1].output.token_ids) == 10
    # a sampled row is reproducible from its own seed whoever shares the batch
    core2 = engine.core(method, opts, max_num_seqs=1, max_model_len=300)
    core2.add_request("s1", prompts[1], SamplingParams(max_new_tokens=12, temperature=0.8, top_k=10, seed=1,
                                                       ignore_eos=True))
    if method == "ar":
        assert _drain(core2)["s1"][-1].output.token_ids == outs["s1"][-1].output.token_ids


def test_add_request_errors_name_the_request(engine):
    core = engine.core("sparsespec-l", SPARSE, max_num_seqs=1, max_model_len=100)
    with pytest.raises(ValueError, match="'big'.*max_model_len"):
        core.add_request("big", _prompt(95, 0), SamplingParams(max_new_tokens=8))
    with pytest.raises(ValueError, match="'empty'.*empty"):
        core.add_request("empty", [], SamplingParams())
    with pytest.raises(ValueError, match="'oov'.*outside"):
        core.add_request("oov", [V + 1], SamplingParams())
    core.add_request("a", _prompt(10, 0), SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="'a' already exists"):
        core.add_request("a", _prompt(10, 0), SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine.core("ar", max_num_seqs=0)
    with pytest.raises(ValueError, match="unknown method"):
        engine.core("medusa")
    assert core.get_num_unfinished_requests() == 1  # the bad requests were not queued


# ------------------------------------------------------------------ importance window + index
@pytest.mark.parametrize("chunk", [512, 64])
def test_window_and_index_equal_a_fresh_dense_forward(engine, chunk):
    model = engine.model
    prompt = _prompt(230, 3)
    core = engine.core("sparsespec-l", SPARSE, max_num_seqs=1, max_model_len=300)
    core.prefill_chunk = chunk  # chunk boundaries must not change what is recycled
    core.add_request("r", prompt, SamplingParams(max_new_tokens=30, ignore_eos=True))
    drafter = core.drafter
    W = SPARSE["window"]
    for step in range(6):
        core.step()
        if not core.running:
            break
        req = core.running[0]
        committed = req.prompt + req.out[:-1]  # the cache holds all but the pending token
        S = len(committed)
        assert core.cache.lengths[0] == S
        fresh = KVCache(model.cfg, 1, S, model.dtype, model.device)
        _, rows = model.forward_dense(torch.tensor([committed]), fresh, want_rows=W)  # [L, 1, H_kv, W, S]
        want = rows.sum(dim=3)  # [L, 1, H_kv, S]
        got = drafter.window.scores(S, 0)  # the running sum (float64)
        torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-4, atol=1e-6)
        drafter.flush(core.cache.head(1))  # the rebuild waits for the next draft phase
        idx = build_index(want, S, drafter.spec.budget(S), SPARSE["n_sink"], SPARSE["n_recent"])
        assert torch.equal(drafter.index[0], idx)
        assert idx.shape[-1] < S, "the index must be sparse for this test to mean anything"
    assert core.running and core.running[0].stats.num_drafted > 0


def test_verified_rows_commit_alike_through_the_ring_and_as_an_argument(engine):
    """The sparse drafter takes a verify's importance rows two ways, and both commit only each
    row's first ``counts[b]`` queries (pending + accepted): written into its window's ring by
    the forward (``importance_target``, the engine's path) or handed to ``commit``. Oracle: the
    sum of those rows of a plain forward."""
    from sparsespec.drafters.sparse_self import SparseSelfDrafter, SparseSpecLOptions

    model = engine.model
    spec = SparseSpecLOptions(**SPARSE)
    B, P, T = 2, 40, 4
    counts = [2, 4]  # row 0 keeps the pending token and one accepted draft; row 1 all four
    prompt = torch.tensor([_prompt(P, 7), _prompt(P, 8)])
    inp = torch.tensor([_prompt(T, 9), _prompt(T, 10)])
    got = {}
    for via in ("ring", "argument"):
        drafter = SparseSelfDrafter(model, spec, P + T + 1, B, spec.k)
        cache = KVCache(model.cfg, B, P + T + 1, model.dtype, model.device)
        model.prefill(prompt, cache)
        if via == "ring":
            target = drafter.importance_target(B, T, P + T)
            model.forward_dense_features(inp, cache, (), want_rows=T, rows_into=target)
            drafter.commit(cache, None, counts)
        else:
            _, rows = model.forward_dense(inp, cache, want_rows=T)  # [L, B, H_kv, T, S]
            drafter.commit(cache, rows, counts)
            want = torch.stack([rows[:, b, :, : counts[b]].sum(dim=2) for b in range(B)], dim=1)  # [L, B, H_kv, S]
        got[via] = torch.cat([drafter.window.scores(P + T, b) for b in range(B)], dim=1)
    torch.testing.assert_close(got["ring"], got["argument"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["argument"], want.to(got["argument"].dtype), rtol=1e-5, atol=1e-6)


def test_prefill_rows_cover_the_last_w_queries_whatever_the_chunks(engine):
    model = engine.model
    prompt = torch.tensor([_prompt(513, 4)])
    ref_cache = KVCache(model.cfg, 1, 520, model.dtype, model.device)
    ref_logits, ref_rows = model.prefill(prompt, ref_cache, chunk_size=1024, want_rows=16)
    for chunk in (512, 500, 100):
        cache = KVCache(model.cfg, 1, 520, model.dtype, model.device)
        logits, rows = model.prefill(prompt, cache, chunk_size=chunk, want_rows=16)
        assert rows.shape[3] == 16
        torch.testing.assert_close(rows, ref_rows, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert prefill_chunks(513, 512, 16) == [(0, 497), (497, 513)]
    assert prefill_chunks(1024, 512, 16) == [(0, 512), (512, 1024)]
    assert prefill_chunks(10, 512, 16) == [(0, 10)]


def test_snapkv_selection_votes_with_w_prompt_queries(engine):
    prompt = _prompt(513, 5)
    core = engine.core("magicdec-snapkv", own_options("magicdec-snapkv", {**SPARSE, "window": 16}), max_num_seqs=1, max_model_len=600)
    core.add_request("r", prompt, SamplingParams(max_new_tokens=4, ignore_eos=True))
    core.step()
    model = engine.model
    cache = KVCache(model.cfg, 1, 520, model.dtype, model.device)
    _, rows = model.prefill(torch.tensor([prompt]), cache, chunk_size=1024, want_rows=16)
    # SnapKV written out: every one of the W queries votes, max-pooled over neighbouring keys
    budget, w, kern = core.drafter.spec.budget(513), 16, core.drafter.spec.pool_kernel
    votes = rows[0:, 0, :, :, : 513 - w].sum(dim=2).double().numpy()  # [L, H_kv, P - w]
    half = kern // 2
    padded = np.pad(votes, ((0, 0), (0, 0), (half, half)), constant_values=-np.inf)
    pooled = np.max(np.stack([padded[..., i : i + votes.shape[-1]] for i in range(kern)]), axis=0)
    got = core.drafter.selected[0][:, 0].numpy()  # [L, H_kv, N]
    for layer in range(got.shape[0]):
        for h in range(got.shape[1]):
            top = set(np.argsort(-pooled[layer, h], kind="stable")[: budget - w].tolist())
            assert set(got[layer, h, : budget - w].tolist()) == top or np.allclose(
                np.sort(pooled[layer, h][list(top)]), np.sort(pooled[layer, h][got[layer, h, : budget - w]]))
            assert got[layer, h, budget - w :].tolist() == list(range(513 - w, 513))


# ------------------------------------------------------------------ exact accounting
@pytest.mark.parametrize("stop_kind", ["eos", "stop_string", "none"])
def test_counts_around_a_stop_inside_a_block(engine, stop_kind):
    """Full index: the draft is the target, so greedy accepts every draft. A stop at output
    position 3 inside the first 8-token block: 3 drafted, 3 accepted (alpha 1), nothing after."""
    prompt = _prompt(150, 6)
    ref = _ar(engine, prompt, 12, ignore_eos=True).token_ids
    j = next(i for i in range(3, 12) if ref[i] not in ref[:i])  # first output position >= 3 with a new id
    kw: dict = {}
    if stop_kind == "eos":
        kw["eos_token_ids"] = [ref[j]]
    elif stop_kind == "stop_string":
        text = ByteTok().decode(ref[: j + 1])
        kw["stop"] = [text[-1]] if text[-1] not in text[:-1] else None
        if kw["stop"] is None:
            pytest.skip("no stop character unique to the last position")
    else:
        kw["ignore_eos"] = True
    out = engine.generate([prompt], method="sparsespec-l", method_options={**FULL, "k": 8}, max_new_tokens=12, **kw)[0]
    s = out.stats
    if stop_kind == "none":
        assert out.token_ids == ref
        assert (s["num_drafted"], s["num_accepted"], s["num_steps"]) == (8 + 1, 8 + 1, 2)  # 1 + 9 + 2 tokens
        assert s["accept_hist"] == {"8:8": 1, "1:1": 1}
        return
    n = len(out.token_ids) - 1  # tokens committed by decode steps (the first comes from prefill)
    assert out.token_ids == ref[: n + 1] and out.finish_reason == "stop"
    assert n <= 8, "the stop falls inside the first block"
    assert (s["num_drafted"], s["num_accepted"], s["num_emitted"], s["num_steps"]) == (n, n, n, 1)
    assert s["accept_hist"] == {f"{n}:{n}": 1}
    assert s["num_drafting_steps"] == 1


def test_draft_never_exceeds_the_remaining_budget_minus_one(engine):
    prompt = _prompt(160, 7)
    core = engine.core("sparsespec-l", {**SPARSE, "k": 8}, max_num_seqs=2, max_model_len=300)
    seen = []
    propose = core.drafter.propose

    def spy(cache, pending, limits, policies, sampling, history):
        d = propose(cache, pending, limits, policies, sampling, history)
        for b, req in enumerate(core.running):
            seen.append((d.num_draft[b], req.params.max_new_tokens - len(req.out) - 1))
        return d

    core.drafter.propose = spy
    core.add_request("a", prompt, SamplingParams(max_new_tokens=6, ignore_eos=True))
    core.add_request("b", _prompt(120, 8), SamplingParams(max_new_tokens=13, ignore_eos=True))
    outs = _drain(core)
    assert len(outs["a"][-1].output.token_ids) == 6 and len(outs["b"][-1].output.token_ids) == 13
    assert seen and max(n for n, _ in seen) > 0
    assert all(n <= budget for n, budget in seen), seen


def test_a_round_that_drafts_nothing_is_an_ar_step(engine, monkeypatch):
    """k = 0 for every row (here: the budget's last tokens) runs the AR forward, without importance
    rows, and leaves the window as it was; drafting rounds record their k + 1 rows; output = AR's."""
    prompt = _prompt(160, 13)
    ref = _ar(engine, prompt, 9, ignore_eos=True).token_ids
    core = engine.core("sparsespec-l", SPARSE, max_num_seqs=1, max_model_len=300)
    calls, commits = [], []
    forward = core.model.forward_dense_features

    def spy(ids, cache, *args, **kw):
        calls.append((ids.shape[1], kw.get("want_rows")))
        return forward(ids, cache, *args, **kw)

    commit_row = core.drafter.window.commit_row

    def spy_commit(b, n, width):
        commits.append(n)
        return commit_row(b, n, width)

    monkeypatch.setattr(core.model, "forward_dense_features", spy)
    monkeypatch.setattr(core.drafter.window, "commit_row", spy_commit)
    core.add_request("r", prompt, SamplingParams(max_new_tokens=9, ignore_eos=True))
    out = _drain(core)["r"][-1].output.token_ids
    assert out == ref
    assert calls[0] == (len(prompt), SPARSE["window"])  # the prefill
    rounds = calls[1:]
    assert (1, 0) in rounds, rounds  # the budget's last round drafts nothing: an AR step
    assert all(w == (T if T > 1 else 0) for T, w in rounds), rounds
    drafting = [T for T, _ in rounds if T > 1]
    assert drafting and len(commits) == len(drafting)  # only drafting rounds touch the window


def test_draft_time_kv_bytes_and_controller_are_per_row(engine):
    prompts = [_prompt(100, 9), _prompt(100, 10)]
    # the second row has max_new_tokens=2: one step with budget 0, it never drafts
    core = engine.core("sparsespec-l", {**SPARSE, "k": "auto"}, max_num_seqs=2, max_model_len=200)
    core.add_request("long", prompts[0], SamplingParams(max_new_tokens=20, ignore_eos=True))
    core.add_request("short", prompts[1], SamplingParams(max_new_tokens=2, ignore_eos=True))
    outs = _drain(core)
    long_s, short_s = outs["long"][-1].output.stats, outs["short"][-1].output.stats
    assert short_s["num_drafted"] == 0 and short_s["draft_s"] == 0.0 and short_s["num_draft_forwards"] == 0
    assert long_s["num_drafted"] > 0 and long_s["draft_s"] > 0 and long_s["index_s"] > 0
    assert short_s["verify_s"] > 0 and short_s["num_steps"] == 1
    assert long_s["controller_s"] > short_s["controller_s"]
    alone = engine.core("sparsespec-l", {**SPARSE, "k": "auto"}, max_num_seqs=1, max_model_len=200)
    # kv_bytes: one slot's dense KV plus its drafter state, whatever the pool size
    assert long_s["kv_bytes"] == short_s["kv_bytes"] == alone.slot_bytes
    cfg = engine.model.cfg
    dense = 2 * cfg.num_layers * cfg.num_kv_heads * core.cache.capacity * cfg.head_dim * 4
    assert dense < long_s["kv_bytes"] < 3 * dense


# ------------------------------------------------------------------ sampling
def _processed(logits: np.ndarray, t: float, top_k: int, top_p: float) -> np.ndarray:
    """Temperature, then top-k, then top-p (HF/vLLM semantics), written out independently."""
    z = logits / t
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros_like(p, dtype=bool)
    keep[order[:top_k]] = True
    pk = np.where(keep, p, 0.0)
    pk /= pk.sum()
    cum = 0.0
    nucleus = np.zeros_like(keep)
    for i in order:
        if not keep[i]:
            continue
        if cum < top_p - 1e-6 or not nucleus.any():
            nucleus[i] = True
        cum += pk[i]
    out = np.where(nucleus, pk, 0.0)
    return out / out.sum()


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    model = _model(tmp_path_factory.mktemp("small") / "m", seed=1, vocab=12, scale=0.6)
    model.source_folder = None
    return Engine(model, ByteTok(), "small")


def _marginals(model, prompt, t, top_k, top_p, depth):
    def next_p(ids):
        cache = KVCache(model.cfg, 1, len(ids) + 1, model.dtype, "cpu")
        logits, _ = model.forward_dense(torch.tensor([ids]), cache, logits_for="last")
        return _processed(logits[0, -1].double().numpy(), t, top_k, top_p)

    dists = [next_p(prompt)]
    paths = {(x,): dists[0][x] for x in range(12) if dists[0][x] > 0}
    for _ in range(depth - 1):
        nxt, marg = {}, np.zeros(12)
        for path, w in paths.items():
            p = next_p(prompt + list(path))
            marg += w * p
            for x in np.flatnonzero(p):
                nxt[path + (int(x),)] = w * p[x]
        dists.append(marg)
        paths = nxt
    return dists


def assert_follows_marginals(outs, model, prompt, t, top_k, top_p, depth=3, tol=0.045):
    """Oracle: at each of the first ``depth`` positions the sampled tokens' frequencies are within
    ``tol`` total variation of the exact processed marginals of ``model`` (``_marginals``), and
    no token outside top-k / top-p appears."""
    rows = len(outs)
    for pos, p in enumerate(_marginals(model, prompt, t, top_k, top_p, depth)):
        counts = np.bincount([o.token_ids[pos] for o in outs], minlength=len(p))
        tv = 0.5 * np.abs(counts / rows - p).sum()
        assert tv < tol, f"position {pos}: total variation {tv:.3f}"
        assert counts[p == 0].sum() == 0, f"position {pos}: a token outside top-k/top-p was emitted"


def test_sampling_at_speculative_positions_follows_the_processed_target(small):
    t, top_k, top_p, rows = 0.7, 6, 0.85, 3000
    prompt = torch.randint(0, 12, (120,), generator=torch.Generator().manual_seed(5)).tolist()
    opts = {"k": 3, "min_budget": 30, "max_budget": 30, "n_sink": 2, "n_recent": 4, "window": 4}
    outs = small.generate([prompt] * rows, method="sparsespec-l", method_options=opts, max_new_tokens=3,
                          temperature=t, top_k=top_k, top_p=top_p, seed=3, ignore_eos=True)
    drafted = sum(o.stats["num_drafted"] for o in outs)
    accepted = sum(o.stats["num_accepted"] for o in outs)
    assert drafted > 0 and accepted < drafted, "rejections must happen for the recovery path to be tested"
    assert_follows_marginals(outs, small.model, prompt, t, top_k, top_p)


def test_full_index_accepts_every_sampled_draft(small):
    """q == p exactly when the index holds everything, so min(1, p/q) = 1: alpha must be 1
    (fails if q is not the same processed distribution as p)."""
    prompt = torch.randint(0, 12, (60,), generator=torch.Generator().manual_seed(6)).tolist()
    outs = small.generate([prompt] * 20, method="sparsespec-l", method_options={**FULL, "k": 4}, max_new_tokens=9,
                          temperature=0.6, top_k=5, top_p=0.8, seed=4, ignore_eos=True)
    drafted = sum(o.stats["num_drafted"] for o in outs)
    assert drafted == 20 * (4 + 2) and sum(o.stats["num_accepted"] for o in outs) == drafted


def test_draft_model_sampling_with_every_row_retired(engine, tmp_path):
    draft = write_tiny_llama(tmp_path / "draft", vocab_size=V, hidden=32, intermediate=64, max_pos=64, seed=9)
    prompts = [_prompt(80, 11), _prompt(90, 12)]  # longer than the draft model's 64-token window
    outs = engine.generate(prompts, method="draft-model", method_options={"draft_model": str(draft), "k": 3},
                           max_new_tokens=6, temperature=0.9, seed=1, ignore_eos=True)
    assert [len(o.token_ids) for o in outs] == [6, 6]
    assert all(o.stats["num_drafted"] == 0 for o in outs)


# ------------------------------------------------------------------ controller
def test_controller_k_follows_measured_costs(engine, monkeypatch):
    """Every dense forward (calibration, verify) made to cost 10 ms on a virtual clock that only
    the injected costs advance (so the machine's load cannot move the result): with drafts that
    cost nothing and all pass (full index), long drafts pay; with drafts at 20 ms a token they do
    not."""
    prompt = _prompt(200, 13)
    dense = engine.model.forward_dense_features
    now = [0.0]
    monkeypatch.setattr(engine, "clock", lambda: now[0])

    def slow_dense(*args, **kwargs):
        now[0] += 0.01
        return dense(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward_dense_features", slow_dense)

    def mean_k(delay_per_token: float) -> float:
        engine.__dict__.pop("_controller_state", None)  # what earlier cores measured: not this test's costs
        engine.__dict__.pop("_calibration", None)
        core = engine.core("sparsespec-l", {**FULL, "k": "auto", "max_k": 8}, max_num_seqs=1, max_model_len=300)
        propose = core.drafter.propose

        def slow(cache, pending, limits, policies, sampling, history):
            d = propose(cache, pending, limits, policies, sampling, history)
            now[0] += delay_per_token * d.token_ids.shape[1]
            return d

        core.drafter.propose = slow
        core.add_request("r", prompt, SamplingParams(max_new_tokens=48, ignore_eos=True))
        s = _drain(core)["r"][-1].output.stats
        return s["num_drafted"] / s["num_steps"]

    cheap, dear = mean_k(0.0005), mean_k(0.02)
    engine.__dict__.pop("_controller_state", None)  # learned on the virtual clock: not for later tests
    engine.__dict__.pop("_calibration", None)
    assert cheap >= 4.0, cheap  # q == p: every draft passes, long drafts pay while they are cheap
    assert dear < 0.5 * cheap, (cheap, dear)


def test_cost_controller_sees_each_rows_output_so_far_and_keeps_finished_lengths(engine):
    """The controller's probe horizon (``CostAwareController.residual``) needs each row's tokens
    emitted so far at every plan and each finished request's length, handed to later cores."""
    engine.__dict__.pop("_controller_state", None)
    core = engine.core("sparsespec-l", {**FULL, "k": "auto"}, max_num_seqs=1, max_model_len=200)
    seen, plan = [], core.controller.plan

    def spy(policies, limits, lengths, index_sizes, remaining=None, generated=None):
        seen.append((list(generated), list(remaining)))
        return plan(policies, limits, lengths, index_sizes, remaining, generated)

    core.controller.plan = spy
    core.add_request("r", _prompt(60, 5), SamplingParams(max_new_tokens=12, ignore_eos=True))
    out = _drain(core)["r"][-1].output
    try:
        assert len(out.token_ids) == 12 and seen
        # the prefill emitted one token; every plan sees what the row holds, budget + held = 11
        assert seen[0] == ([1], [10]) and all(g[0] + r[0] == 11 for g, r in seen)
        assert [g[0] for g, _ in seen] == sorted({g[0] for g, _ in seen})  # one plan per step, rising
        assert list(core.controller.finished_lengths) == [12]
        assert engine.__dict__["_controller_state"][core._controller_key]["lengths"] == [12]
    finally:
        engine.__dict__.pop("_controller_state", None)


# ------------------------------------------------------------------ streaming text
@pytest.mark.parametrize("stop", [None, ["aa"]])
def test_stream_deltas_concatenate_to_the_final_text(engine, stop):
    prompts = [_prompt(60 + 10 * i, 20 + i) for i in range(4)]
    finals, deltas = {}, {i: [] for i in range(4)}
    for ev in engine.stream(prompts, method="sparsespec-l", method_options=SPARSE, max_new_tokens=40, stop=stop,
                            ignore_eos=stop is None):
        deltas[ev.row].append(ev.text)
        if ev.finished:
            finals[ev.row] = ev.output.text
    for i in range(4):
        assert "".join(deltas[i]) == finals[i], i
    assert any("é" in t for t in finals.values()), "no character was split across tokens"
    if stop:
        assert all("aa" not in t for t in finals.values())


def test_entropy_controller_rows_read_the_rounds_measured_costs(engine):
    """k="auto" with the entropy controller: each round's measured draft and verify seconds go
    into the core's shared ``StepCosts`` (C_d, C_v per verify width), the costs every row's
    policy weighs; before any round it holds only its unitless prior."""
    core = engine.core("sparsespec-l", {**FULL, "k": "auto", "controller": "entropy", "max_k": 4},
                       max_num_seqs=2, max_model_len=200)
    assert not core.costs.measured and core.costs.draft() == core.costs.init_cost_ratio
    for i in range(2):
        core.add_request(str(i), _prompt(60, 30 + i), SamplingParams(max_new_tokens=12, ignore_eos=True))
    outs = _drain(core)
    stats = [o[-1].output.stats for o in outs.values()]
    assert sum(s["num_drafted"] for s in stats) > 0  # a run that drafted nothing measures no draft
    st = core.costs.state()
    assert core.costs.measured and 0.0 < st["cost_draft_s"] < max(s["draft_s"] for s in stats)
    widths = {int(w) for w in st["cost_verify_s"]}
    assert widths and widths <= set(range(1, 6)) and all(c > 0.0 for c in st["cost_verify_s"].values())


def test_draft_entropies_are_the_draft_distributions_entropy(engine):
    """Full index: the first draft of a step is predicted from the target's own distribution
    at the pending token, so its entropy equals that of a fresh dense forward."""
    prompt = _prompt(90, 14)
    core = engine.core("sparsespec-l", {**FULL, "k": 3}, max_num_seqs=1, max_model_len=200)
    seen = []
    propose = core.drafter.propose

    def spy(cache, pending, limits, policies, sampling, history):
        d = propose(cache, pending, limits, policies, sampling, history)
        seen.append((list(history[0]), d.entropies[0, 0].item()))
        return d

    core.drafter.propose = spy
    core.add_request("r", prompt, SamplingParams(max_new_tokens=10, ignore_eos=True))
    _drain(core)
    assert seen
    model = engine.model
    for hist, ent in seen:
        cache = KVCache(model.cfg, 1, len(hist), model.dtype, model.device)
        logits, _ = model.forward_dense(torch.tensor([hist]), cache, logits_for="last")
        logp = torch.log_softmax(logits[0, -1].double(), -1)
        assert ent == pytest.approx(float(-(logp.exp() * logp).sum()), rel=1e-4, abs=1e-5)


def test_draft_model_cache_is_rolled_back_to_the_committed_tokens(engine, tmp_path):
    """A different (random) draft model: rejections happen; after each step the draft cache
    must hold exactly the KV of the committed tokens (a fresh draft prefill), never a rejected one."""
    folder = write_tiny_llama(tmp_path / "d", vocab_size=V, hidden=32, intermediate=64, max_pos=1024, seed=4,
                              scale=0.5, embed_scale=1.0)
    prompts = [_prompt(70, 15), _prompt(50, 16)]
    ref = [_ar(engine, p, 14, ignore_eos=True).token_ids for p in prompts]
    core = engine.core("draft-model", {"draft_model": str(folder), "k": 3}, max_num_seqs=2, max_model_len=200)
    for i, p in enumerate(prompts):
        core.add_request(str(i), p, SamplingParams(max_new_tokens=14, ignore_eos=True))
    dm, done = core.drafter, {}
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finished:
                done[out.request_id] = out.output
        for req in core.running:
            n = dm.dcache.lengths[req.slot]
            committed = req.prompt + req.out[:-1]
            assert n <= len(committed)
            if n:
                fresh = KVCache(dm.draft.cfg, 1, n, dm.draft.dtype, "cpu")
                dm.draft.forward_dense(torch.tensor([committed[:n]]), fresh)
                torch.testing.assert_close(dm.dcache.k[:, req.slot, :, :n], fresh.k[:, 0], rtol=1e-4, atol=1e-5)
    assert [done[str(i)].token_ids for i in range(2)] == ref
    drafted = sum(done[str(i)].stats["num_drafted"] for i in range(2))
    accepted = sum(done[str(i)].stats["num_accepted"] for i in range(2))
    assert drafted > 0 and accepted < drafted, "the draft model must be rejected sometimes"


def test_own_clock_times_requests_by_the_cores_own_steps(engine):
    """Two cores stepped in turn with a pause between steps (another core's step, on a shared
    device): the own-clock core's ttft / decode / total seconds leave the pauses out, the wall
    core's include them, and both decode the same tokens."""
    prompt = _prompt(60, 11)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    cores = {own: engine.core("ar", max_num_seqs=1, own_clock=own) for own in (False, True)}
    for c in cores.values():
        c.add_request("r", prompt, params)
    pause, steps, final = 0.05, 0, {}
    while any(c.has_unfinished_requests() for c in cores.values()):
        for own, c in cores.items():
            if c.has_unfinished_requests():
                for out in c.step():
                    if out.finished:
                        final[own] = out.output
            time.sleep(pause)
        steps += 1
    wall, mine = final[False].stats, final[True].stats
    assert final[False].token_ids == final[True].token_ids
    # the wall core waited through every pause after its arrival (the first step's included)
    assert wall["total_s"] >= (steps - 1) * pause
    assert mine["total_s"] < wall["total_s"] - (steps - 2) * pause
    busy = cores[True].step_clock.busy_s  # the core's own steps; total_s ends at its last emission
    assert busy - 0.02 < mine["total_s"] <= busy
    assert mine["ttft_s"] == pytest.approx(mine["prefill_s"], abs=0.02)  # no pause before the first step counted
    assert mine["decode_s"] < wall["decode_s"]
    assert cores[False].step_clock is None


def test_step_in_turn_rotates_and_steps_only_cores_with_work():
    """step_in_turn: round r starts at core r % n, a finished core is skipped, and each yield
    carries that core's outputs and its step's seconds on the given clock."""
    from sparsespec.engine import step_in_turn

    class Fake:
        def __init__(self, name, steps):
            self.name, self.left = name, steps

        def has_unfinished_requests(self):
            return self.left > 0

        def step(self):
            self.left -= 1
            now[0] += 1.0 if self.name == "a" else 2.0
            return [self.name]

    now = [0.0]
    cores = [Fake("a", 3), Fake("b", 1), Fake("c", 2)]
    got = [(i, outs, s) for i, outs, s in step_in_turn(cores, lambda: now[0])]
    assert [i for i, _, _ in got] == [0, 1, 2, 2, 0, 0]  # rounds: a b c | (b done) c a | a
    assert all(outs == [cores[i].name] for i, outs, _ in got)
    assert [s for _, _, s in got] == [1.0, 2.0, 2.0, 2.0, 1.0, 1.0]


# ------------------------------------------------------------------ chunked prefill
def _chunked_core(engine, method, chunked, **kw):
    from sparsespec.engine import EngineCore

    opts = None if method == "ar" else SPARSE
    return EngineCore(engine, method, opts, max_num_seqs=2, max_model_len=600, prefill_chunk=64,
                      enable_chunked_prefill=chunked, **kw)


def _schedule(core, prompts, n_new, on_step=None):
    """r0 alone, then r1 (long) and r2 arrive at step 2; r2 waits for a slot. Per step: the
    outputs and which request was being prefilled after it."""
    outs, trace = {}, []
    core.add_request("r0", prompts["r0"], SamplingParams(max_new_tokens=n_new["r0"], ignore_eos=True))
    for step in range(400):
        if step == 2:
            for r in ("r1", "r2"):
                core.add_request(r, prompts[r], SamplingParams(max_new_tokens=n_new[r], ignore_eos=True))
        got = core.step()
        for out in got:
            outs.setdefault(out.request_id, []).append(out)
        trace.append(({o.request_id for o in got}, core.prefilling.req.request_id if core.prefilling else None))
        if on_step is not None:
            on_step(core)
        if not core.has_unfinished_requests():
            break
    return outs, trace


@pytest.mark.parametrize("method", ["ar", "sparsespec-l"])
def test_chunked_prefill_interleaves_decode_and_gives_the_same_tokens(engine, method):
    prompts = {"r0": _prompt(100, 10), "r1": _prompt(330, 11), "r2": _prompt(140, 12)}
    # ar: r0 leaves while r1 is staged (r1's KV then moves down a slot); sparsespec-l: r0 outlives it
    n_new = {"r0": 5 if method == "ar" else 14, "r1": 12, "r2": 10}
    ref, ref_trace = _schedule(_chunked_core(engine, method, False), prompts, n_new)
    assert all(p is None for _, p in ref_trace), "without chunked prefill a prompt is prefilled whole in its step"

    def kv_is_the_committed_sequence(core):  # every slot holds exactly its row's committed KV
        for req in core.running:
            committed = req.prompt + req.out[:-1]
            S = len(committed)
            assert core.cache.lengths[req.slot] == S
            fresh = KVCache(engine.model.cfg, 1, S, engine.model.dtype, engine.model.device)
            engine.model.prefill(torch.tensor([committed]), fresh, chunk_size=64)
            torch.testing.assert_close(core.cache.k[:, req.slot, :, :S], fresh.k[:, 0], rtol=1e-4, atol=1e-5)

    core = _chunked_core(engine, method, True)
    outs, trace = _schedule(core, prompts, n_new, on_step=kv_is_the_committed_sequence)
    for r in prompts:
        assert outs[r][-1].finished
        assert outs[r][-1].output.token_ids == ref[r][-1].output.token_ids, r
    staged = [i for i, (_, p) in enumerate(trace) if p == "r1"]
    n_chunks = len(prefill_chunks(330, 64, min(core.drafter.want_rows_prefill, 330)))
    # one chunk per step while r0 decodes (r0 gets tokens in each of those steps); once nothing
    # decodes, the remaining chunks run back to back
    assert staged[0] == 2 and staged == list(range(2, 2 + len(staged))) and 2 <= len(staged) <= n_chunks - 1
    assert all("r0" in trace[i][0] for i in staged), "r0 decoded while r1 prefilled"
    if method == "ar":  # r0 leaves at step 3 (2 tokens in step 0, then 1 a step), r1 is in at step 4
        assert staged == [2, 3] and outs["r0"][-1].finished and "r1" in trace[4][0]
        assert "r1" not in set().union(*(t for t, _ in trace[:4]))
    st = outs["r1"][-1].output.stats
    assert 0 < st["prefill_s"] < st["ttft_s"]  # its own chunks, not the decode steps between them


def test_a_staged_request_can_be_aborted_and_its_slot_reused(engine):
    core = _chunked_core(engine, "ar", True)
    core.add_request("a", _prompt(80, 1), SamplingParams(max_new_tokens=30, ignore_eos=True))
    core.step()
    core.add_request("b", _prompt(400, 2), SamplingParams(max_new_tokens=5, ignore_eos=True))
    core.step()
    assert core.prefilling is not None and core.prefilling.req.request_id == "b"
    assert core.get_num_unfinished_requests() == 2
    core.abort_request("b")
    assert core.prefilling is None and core.get_num_unfinished_requests() == 1
    core.add_request("b", _prompt(120, 3), SamplingParams(max_new_tokens=5, ignore_eos=True))  # the id is free again
    got = _drain(core)
    assert got["b"][-1].output.token_ids == _ar(engine, _prompt(120, 3), 5, ignore_eos=True).token_ids
    assert got["a"][-1].output.token_ids == _ar(engine, _prompt(80, 1), 30, ignore_eos=True).token_ids
    from sparsespec.engine import EngineCore

    with pytest.raises(ValueError, match="prefill_chunk"):
        EngineCore(engine, "ar", None, prefill_chunk=0)

"""``draft-model``'s catch-up on a tiny model (fast): the committed tokens a draft cache lacks after
steps that drafted nothing, fed in one padded forward over the batch or row by row, against a
fresh greedy decode of each row's history."""
import functools

import pytest
import torch

from tests.test_draft_model import _fresh_greedy, _sharp_tiny_model, _tiny_llama


@pytest.mark.parametrize("extra, capacity, padded", [
    ((5, 1, 9), 100, True),    # two of three rows lag (by 6 and 10 tokens): one padded forward
    ((4, 4, 4), 100, True),    # every row lags alike (k auto declined 4 steps)
    ((5, 1, 1), 100, False),   # one row lags: its own prefill
    ((30, 2, 3), 64, False),   # the padding of the longest catch-up would overflow row 2's cache
])
def test_draft_catch_up_is_one_padded_forward_where_rows_lag(tmp_path, monkeypatch, extra, capacity, padded):
    """Rows whose draft cache lacks several committed tokens catch up before drafting: in one
    forward over the batch (padded) where at least half lag and the padding fits, else row by
    row. Either way the drafts equal a fresh greedy decode of each row's history (the oracle),
    and no row's cache is left short or long."""
    from sparsespec.adaptive import FixedK
    from sparsespec.config import SamplingParams
    from sparsespec.drafters.draft_model import DraftModelDrafter, DraftModelOptions
    from sparsespec.kv.cache import KVCache
    from sparsespec.sampling import BatchSampling

    folder = _tiny_llama(tmp_path / "t", seed=2)
    model = _sharp_tiny_model(folder)
    V = model.cfg.vocab_size
    fresh_greedy = functools.partial(_fresh_greedy, model)

    g = torch.Generator().manual_seed(3)
    lens = (20, 33, 12) if capacity == 100 else (20, 33, 56)
    hist = [torch.randint(0, V, (n,), generator=g).tolist() for n in lens]
    k, sp = 2, SamplingParams(max_new_tokens=64)
    drafter = DraftModelDrafter(model, DraftModelOptions(k=k, draft_model=str(folder)), capacity=capacity,
                                batch_size=3, max_k=k)
    target = KVCache(model.cfg, 3, capacity, model.dtype, "cpu")
    for b, h in enumerate(hist):
        drafter.prefill_row(b, target, None, h[:-1])
        target.lengths[b] = len(h) - 1
    for h, e in zip(hist, extra):  # steps without a propose: committed tokens the draft never saw
        h.extend(torch.randint(0, V, (e,), generator=g).tolist())
    target.lengths = [len(h) - 1 for h in hist]
    drafter.commit(target, None, list(extra))

    calls = {"prefill": 0, "wide": 0}
    prefill, forward = model.prefill, model.forward_dense

    def spy_prefill(*a, **kw):
        calls["prefill"] += 1
        return prefill(*a, **kw)

    def spy_forward(ids, *a, **kw):
        calls["wide"] += ids.shape[1] > 2  # a catch-up, not a feed of <= 2 tokens or a draft step
        return forward(ids, *a, **kw)

    monkeypatch.setattr(model, "prefill", spy_prefill)
    monkeypatch.setattr(model, "forward_dense", spy_forward)
    pending = torch.tensor([[h[-1]] for h in hist])
    d = drafter.propose(target, pending, [k] * 3, [FixedK(k)] * 3, BatchSampling([sp] * 3, [None] * 3), hist)
    monkeypatch.undo()
    lagging = sum(e + 1 > 2 for e in extra)
    assert calls == ({"prefill": 0, "wide": 1} if padded else {"prefill": lagging, "wide": 0})
    for b, h in enumerate(hist):
        assert d.token_ids[b].tolist() == fresh_greedy(h, k), b
    assert drafter.dcache.lengths[:3] == [len(h) + k - 1 for h in hist]  # every token fed, drafts included

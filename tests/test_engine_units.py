"""Fast unit tests: sparse index invariants, greedy verification, KV rollback, registry, config."""
import pytest
import torch

from sparsespec.config import ModelConfig
from sparsespec.drafters.sparse_self import SparseSpecLOptions
from sparsespec.kv.cache import KVCache
from sparsespec.kv.index import ImportanceWindow, build_index
from sparsespec.registry import DRAFTERS
from sparsespec.rejection import greedy_verify


def _check_index(idx, length, budget, n_sink, n_recent):
    assert idx.shape[-1] == budget
    assert bool((idx[..., 1:] > idx[..., :-1]).all()), "sorted and unique"
    assert int(idx.min()) >= 0 and int(idx.max()) < length
    for p in list(range(n_sink)) + list(range(length - n_recent, length)):
        assert bool((idx == p).any(-1).all()), f"position {p} missing"


def test_index_keeps_sinks_recent_and_top_scores():
    L, B, H, S = 2, 1, 3, 100
    scores = torch.rand(L, B, H, S)
    scores[0, 0, 1, 50] = 10.0  # a strong middle key for one head
    idx = build_index(scores, S, budget=20, n_sink=4, n_recent=8)
    _check_index(idx, S, 20, 4, 8)
    assert bool((idx[0, 0, 1] == 50).any())
    middle = scores[..., 4:92]
    expected = torch.topk(middle, 8, dim=-1).indices + 4
    assert torch.equal(torch.sort(expected, -1).values, idx[..., 4:12])


def test_index_is_recallable_from_fresh_scores():
    S = 64
    window = ImportanceWindow(1, 1, 1, window=4, capacity=S, device="cpu")
    rows = torch.zeros(1, 1, 1, 4, S)
    rows[..., 30] = 1.0
    window.push(rows)
    assert bool((build_index(window.scores(S), S, 10, 2, 4) == 30).any())
    later = torch.zeros(1, 1, 1, 4, S)
    later[..., 40] = 1.0
    window.push(later)  # 4 new rows push the old ones out of the W=4 window
    idx = build_index(window.scores(S), S, 10, 2, 4)
    assert not bool((idx == 30).any()) and bool((idx == 40).any())
    again = torch.zeros(1, 1, 1, 2, S)
    again[..., 30] = 5.0
    window.push(again)  # the dense cache kept position 30, so it comes back
    assert bool((build_index(window.scores(S), S, 10, 2, 4) == 30).any())


def test_importance_window_keeps_last_w_rows_across_pushes():
    w = ImportanceWindow(1, 1, 1, window=16, capacity=10, device="cpu")
    for step in range(5):  # 5 pushes of 9 rows, each row marking its step
        w.push(torch.full((1, 1, 1, 9, 10), float(step)))
    # the last 16 rows: 9 from step 4 and 7 from step 3
    assert w.scores(10)[0, 0, 0, 0].item() == pytest.approx(9 * 4 + 7 * 3)


def test_budget_is_full_context_when_short():
    idx = build_index(torch.rand(1, 1, 2, 50), 50, budget=50, n_sink=4, n_recent=8)
    assert torch.equal(idx[0, 0, 0], torch.arange(50))


def test_spec_budget_floor_fraction_cap():
    spec = SparseSpecLOptions(budget_frac=0.1, min_budget=128, max_budget=1000, n_sink=4, n_recent=32)
    assert spec.budget(100) == 100  # shorter than the floor: everything
    assert spec.budget(1000) == 128  # floor
    assert spec.budget(4096) == 410  # ceil(10 %)
    assert spec.budget(50000) == 1000  # cap


def test_greedy_verify_accept_all_reject_first_reject_last_k0():
    V = 5
    def logits_for(ids):
        return torch.nn.functional.one_hot(torch.tensor(ids), V).float()
    v = greedy_verify(torch.tensor([1, 2, 3]), logits_for([1, 2, 3, 4]))
    assert (v.num_accepted, v.token_ids, v.bonus) == (3, [1, 2, 3, 4], True)
    v = greedy_verify(torch.tensor([1, 2, 3]), logits_for([0, 2, 3, 4]))
    assert (v.num_accepted, v.token_ids, v.bonus) == (0, [0], False)
    v = greedy_verify(torch.tensor([1, 2, 3]), logits_for([1, 2, 0, 4]))
    assert (v.num_accepted, v.token_ids, v.bonus) == (2, [1, 2, 0], False)
    # a later match after a mismatch is not accepted (leading run only)
    v = greedy_verify(torch.tensor([1, 2, 3]), logits_for([1, 0, 3, 4]))
    assert (v.num_accepted, v.token_ids) == (1, [1, 0])
    v = greedy_verify(torch.zeros(0, dtype=torch.long), logits_for([4]))
    assert (v.num_accepted, v.token_ids, v.bonus) == (0, [4], True)
    with pytest.raises(ValueError):
        greedy_verify(torch.tensor([1]), logits_for([1]))


def test_kv_rollback_is_a_length_change():
    cfg = ModelConfig("llama", 16, 8, 16, 2, 2, 1, 4, 64, 1e-6, 10000.0)
    c = KVCache(cfg, 2, 10, torch.float32, "cpu")
    c.lengths = [7, 4]
    ptr = c.k.data_ptr()
    c.rollback([3, 4])
    assert c.lengths == [3, 4] and c.k.data_ptr() == ptr
    with pytest.raises(ValueError):
        c.rollback([5, 4])  # cannot grow by rollback
    with pytest.raises(ValueError, match="overflow"):
        c.reserve(7)
    c.k[:, 1] = 1.0
    c.select([1])  # a finished row leaves the batch
    assert c.lengths == [4] and c.batch_size == 1 and float(c.k.min()) == 1.0


def test_registry_unknown_name_suggests():
    assert "sparsespec-l" in DRAFTERS
    with pytest.raises(ValueError, match="did you mean 'sparsespec-l'"):
        DRAFTERS.get("sparsespec_l")


def test_model_config_validation():
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig("gpt2", 16, 8, 16, 2, 2, 1, 4, 64, 1e-6, 10000.0)
    with pytest.raises(ValueError, match="multiple"):
        ModelConfig("llama", 16, 8, 16, 2, 3, 2, 4, 64, 1e-6, 10000.0)


def test_layering_engine_and_evals_import_no_service_libraries():
    import subprocess
    import sys

    code = (
        "import sys, sparsespec, evals, evals.ruler, evals.longbench, evals.metrics;"
        "bad = [m for m in ('ray', 'sqlalchemy', 'streamlit') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    # evals does not import the engine either
    code2 = "import sys, evals, evals.ruler, evals.longbench; assert 'sparsespec' not in sys.modules"
    subprocess.run([sys.executable, "-c", code2], check=True)


def test_resolve_method_options_fills_defaults_and_validates():
    from sparsespec import resolve_method_options

    full = resolve_method_options("sparsespec-l", {})
    assert full["k"] == "auto" and full["budget_frac"] == 0.1 and full["window"] == 16
    assert resolve_method_options("sparsespec-l", {"k": 4})["k"] == 4
    assert resolve_method_options("ar", None) == {}
    with pytest.raises(ValueError, match="unknown method"):
        resolve_method_options("medusa", {})
    with pytest.raises(ValueError, match="unknown method_options"):
        resolve_method_options("sparsespec-l", {"kk": 1})

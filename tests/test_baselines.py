"""Method-specific tests of the baselines: StreamingLLM window positions, SnapKV selection on
crafted attention, n-gram proposals on hand-made sequences."""
import pytest
import torch

from sparsespec.drafters.ngram import ngram_propose
from sparsespec.drafters.sparse_self import snapkv_select, streaming_index


def test_streaming_window_positions_after_many_slides():
    lead = (2, 1, 3)
    for length in range(200, 2000, 97):  # the window slides as the context grows
        idx = streaming_index(length, budget=100, n_sink=4, lead=lead, device="cpu")
        assert idx.shape == (*lead, 100)
        expected = list(range(4)) + list(range(length - 96, length))
        assert idx[1, 0, 2].tolist() == expected
    # context shorter than sink + window: full attention
    assert streaming_index(60, budget=100, n_sink=4, lead=lead, device="cpu")[0, 0, 0].tolist() == list(range(60))


def test_snapkv_picks_the_known_top_positions_with_pooling():
    L, B, H, W, P = 1, 1, 2, 4, 200
    rows = torch.full((L, B, H, W, P), 1e-4)
    rows[0, 0, 0, :, 50] = 1.0  # head 0: one strong key
    rows[0, 0, 0, :, 120] = 0.5
    rows[0, 0, 1, :, 10] = 1.0  # head 1: a different strong key
    idx = snapkv_select(rows, P, budget=4 + 7, window=4, kernel=7)
    head0 = idx[0, 0, 0].tolist()
    assert head0[-4:] == [196, 197, 198, 199]  # the observation window is always kept
    # max-pooling with kernel 7 spreads key 50's vote over 47..53: those 7 win the 7 slots
    assert head0[:7] == list(range(47, 54))
    assert idx[0, 0, 1, :7].tolist() == list(range(7, 14))
    # without pooling the two peaks are both selected
    idx1 = snapkv_select(rows, P, budget=4 + 2, window=4, kernel=1)
    assert idx1[0, 0, 0, :2].tolist() == [50, 120]
    # short prompt: everything
    assert snapkv_select(rows, 8, budget=16, window=4, kernel=7)[0, 0, 0].tolist() == list(range(8))


@pytest.mark.parametrize(
    "tokens, k, expected",
    [
        ([1, 2, 3, 4, 9, 1, 2, 3], 3, [4, 9, 1]),  # match at the end: the trigram 1 2 3 occurred before
        ([5, 6, 7, 8], 3, []),  # no earlier occurrence of any suffix n-gram
        ([1, 2, 7, 8, 1, 2, 5, 6, 1, 2], 2, [5, 6]),  # several matches: the most recent wins
        ([3, 3, 3, 3], 4, [3]),  # overlaps the current position: read as far as the sequence goes
        ([1, 2, 1, 2, 1, 2], 4, [1, 2]),
        ([4, 1, 2, 9, 1, 2], 0, []),  # k = 0
    ],
)
def test_ngram_proposals(tokens, k, expected):
    assert ngram_propose(tokens, k, n_min=1, n_max=3) == expected


def test_ngram_prefers_the_longest_suffix():
    # the bigram "7 1" last occurred at the start (-> 2), the unigram "1" more recently (-> 3)
    tokens = [7, 1, 2, 5, 1, 3, 7, 1]
    assert ngram_propose(tokens, 1, n_min=1, n_max=2) == [2]
    assert ngram_propose(tokens, 1, n_min=1, n_max=1) == [3]

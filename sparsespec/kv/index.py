"""Sparse KV index for self-speculative drafting (SparseSpec-L).

The draft forward attends, per layer and per KV head, to ``N`` cached positions: the first
``n_sink`` (attention sinks), the last ``n_recent``, and the top ``N - n_sink - n_recent`` of the
rest by importance. Importance of a key = attention probability it received from the last ``W``
committed query positions, summed over the query heads of its KV group (GQA). The probabilities
are recycled from the forwards that already computed full attention (prefill's last chunk and
every verification); since attention is causal, an old query's row never changes as keys are
appended, so a ring of the last ``W`` rows is exact. The index is rebuilt from scratch after every
verification; the dense cache is never pruned, so a key dropped once can come back (recallable).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowsTarget:
    """Where a forward writes its importance rows (``Transformer.forward_dense_features(rows_into=)``):
    query ``w`` of batch row ``b`` goes to ``ring[:, b, :, slots[b, w], :S]`` (``S`` = the forward's
    longest row, zero past each row's own keys). ``ring`` ``[L, B, H_kv, R, S_max]`` float32,
    ``slots`` ``[B, W]`` int64 (CPU)."""

    ring: torch.Tensor
    slots: torch.Tensor


class ImportanceWindow:
    """Ring buffer, per row, of the attention rows of the last ``W`` committed query positions,
    with their running sum.

    ``rows``: ``[L, B, H_kv, W + spare, S_max]`` float32, a committed slot holding the attention
    probability (summed over the query heads of each KV head) that one query gave to every key;
    zero past that query's own position. The ``spare`` slots past a row's last committed one are
    where a verify forward writes its rows directly (``target``): the forward does not know yet
    which of its queries will be committed, so it never writes over the W committed rows, and
    ``commit`` then only moves the head (no copy). ``total``: ``[L, B, H_kv, S_max]`` float64, the
    sum of a row's committed slots, kept as a running sum: a commit adds the new rows and subtracts
    the ones they evict (float32 sums of those rows into a float64 total; re-summed from the slots
    every ``exact_every`` committed rows, so rounding never accumulates past ~1e-7 relative), so a
    rebuild reads one row of scores instead of re-summing W rows of the whole context. Rows of the
    batch advance independently (ragged acceptance).
    """

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, window: int, capacity: int, device,
                 spare: int = 0):
        self.slots = window + spare
        self.rows = torch.zeros(num_layers, batch_size, num_kv_heads, self.slots, capacity, device=device)
        self.total = torch.zeros(num_layers, batch_size, num_kv_heads, capacity, dtype=torch.float64, device=device)
        self.window = window
        self.spare = spare
        self.count = [0] * batch_size  # rows committed so far, per batch row
        self._next = [0] * batch_size  # the ring slot after the last committed row
        self._width = [0] * batch_size  # columns of the row's slots that may be non-zero
        self._since_exact = [0] * batch_size  # rows committed since the running sum was last re-summed
        self.exact_every = 8 * window

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size() + self.total.numel() * self.total.element_size()

    def _runs(self, first: int, n: int) -> list[tuple[int, int]]:
        """Slots ``first .. first + n - 1`` (mod ring size) as at most two contiguous ``(start, len)`` runs."""
        runs, done = [], 0
        while done < n:
            start = (first + done) % self.slots
            m = min(n - done, self.slots - start)
            runs.append((start, m))
            done += m
        return runs

    def target(self, batch: int, num_rows: int) -> RowsTarget:
        """Where the next forward writes ``num_rows`` query rows of batch rows ``0 .. batch-1``: the
        slots after each row's last committed one (they hold no committed row).

        Raises:
            ValueError: more rows than spare slots.
        """
        if num_rows > self.spare:
            raise ValueError(f"{num_rows} rows do not fit the window's {self.spare} spare slots")
        slots = torch.tensor([[(self._next[b] + t) % self.slots for t in range(num_rows)] for b in range(batch)],
                             dtype=torch.int64)
        return RowsTarget(self.rows[:, :batch], slots)

    def commit_row(self, b: int, count: int, width: int) -> None:
        """The first ``count`` rows written at ``target``'s slots of batch row ``b`` (``width``
        columns wide, zero past the row's keys) become its newest committed rows."""
        if count == 0:
            return
        keep = min(count, self.window)  # rows added and evicted by the same commit need not be summed
        wide = max(self._width[b], width)
        self._evict(b, keep, wide)
        self._add(b, (self._next[b] + count - keep) % self.slots, keep, wide)
        self._advance(b, count, wide)

    def _evict(self, b: int, incoming: int, wide: int) -> None:
        """Subtract the oldest committed rows that ``incoming`` new ones push out of the window."""
        held = min(self.count[b], self.window)
        n = max(0, held + incoming - self.window)
        tot = self.total[:, b, :, :wide]  # [L, H_kv, wide] float64
        # (float32 sums of <= W rows into the float64 total: 40x faster than summing in float64)
        for start, m in self._runs((self._next[b] - held) % self.slots, n):
            tot -= self.rows[:, b, :, start : start + m, :wide].sum(dim=2)

    def _add(self, b: int, first: int, n: int, wide: int) -> None:
        tot = self.total[:, b, :, :wide]
        for start, m in self._runs(first, n):
            tot += self.rows[:, b, :, start : start + m, :wide].sum(dim=2)

    def _advance(self, b: int, count: int, wide: int) -> None:
        self._width[b] = wide
        self._next[b] = (self._next[b] + count) % self.slots
        self.count[b] += count
        self._since_exact[b] += count
        if self._since_exact[b] >= self.exact_every:  # bound the add/subtract rounding: re-sum now and then
            held = min(self.count[b], self.window)
            self.total[:, b, :, :wide].zero_()
            self._add(b, (self._next[b] - held) % self.slots, held, wide)
            self._since_exact[b] = 0

    def push(self, new_rows: torch.Tensor, counts: list[int] | None = None) -> None:
        """Append query rows ``[L, B, H_kv, T, S]`` (oldest first); keeps the last ``W`` per row.

        ``counts[b]``: how many of the T rows are committed for batch row ``b`` (the first ones);
        default all T.
        """
        counts = [new_rows.shape[3]] * new_rows.shape[1] if counts is None else counts
        for b, t in enumerate(counts):
            self.push_row(b, new_rows[:, b, :, :t])

    def push_row(self, b: int, new_rows: torch.Tensor) -> None:
        """Append query rows ``[L, H_kv, T, S]`` (oldest first) to batch row ``b`` only: copied
        into the slots after its last committed one, then committed. The rows they evict are
        subtracted first (without spare slots the copy lands on them)."""
        T, S = new_rows.shape[2], new_rows.shape[3]
        if T > self.window:
            new_rows, T = new_rows[:, :, T - self.window :], self.window
        if T == 0:
            return
        wide = max(self._width[b], S)
        self._evict(b, T, wide)
        done = 0
        for start, n in self._runs(self._next[b], T):
            dst = self.rows[:, b, :, start : start + n, :wide]
            dst[..., :S] = new_rows[:, :, done : done + n]
            if wide > S:
                dst[..., S:] = 0.0
            done += n
        self._add(b, self._next[b], T, wide)
        self._advance(b, T, wide)

    def scores(self, length: int, b: int | None = None) -> torch.Tensor:
        """Importance of the first ``length`` keys: ``[L, B, H_kv, length]`` float64 (or
        ``[L, 1, H_kv, length]`` for row b): the running sum of the window's rows."""
        tot = self.total if b is None else self.total[:, b : b + 1]
        return tot[..., :length]

    def move(self, src: int, dst: int) -> None:
        """Copy row ``src``'s window into row ``dst`` (pool compaction)."""
        if src == dst:
            return
        self.rows[:, dst] = self.rows[:, src]
        self.total[:, dst] = self.total[:, src]
        self.count[dst], self._next[dst], self._width[dst] = self.count[src], self._next[src], self._width[src]
        self._since_exact[dst] = self._since_exact[src]

    def reset(self, b: int) -> None:
        """Empty row ``b``'s window (a new request takes the slot)."""
        w = self._width[b]  # nothing past it was ever written
        self.rows[:, b, :, :, :w] = 0.0
        self.total[:, b, :, :w] = 0.0
        self.count[b], self._next[b], self._width[b], self._since_exact[b] = 0, 0, 0, 0

    def select(self, keep: list[int]) -> None:
        idx = torch.tensor(keep, dtype=torch.long, device=self.rows.device)
        self.rows = self.rows.index_select(1, idx)
        self.total = self.total.index_select(1, idx)
        self.count = [self.count[b] for b in keep]
        self._next = [self._next[b] for b in keep]
        self._width = [self._width[b] for b in keep]
        self._since_exact = [self._since_exact[b] for b in keep]


def build_index(scores: torch.Tensor, length: int, budget: int, n_sink: int, n_recent: int,
                kernel: bool = False) -> torch.Tensor:
    """Positions the draft attends to.

    Args:
        scores: ``[L, B, H_kv, length]`` float32 importance of each cached key.
        length: number of cached positions S.
        budget: index size N (``<= length``).
        n_sink, n_recent: positions always kept at the start and the end.
        kernel: use our CPU kernel (``sparsespec.kernels.cpu.build_index``, a radix select: 3.7x
            faster than topk + sort on the AMD EPYC at 30 layers x 3 heads x 6K keys) when the
            scores are float64 on the CPU and it is built. The same positions, except that of
            keys tied at the cut it keeps the earliest (topk keeps any).

    Returns:
        ``[L, B, H_kv, N]`` int64, sorted ascending, unique, in ``[0, length)``. When
        ``budget >= length`` every position is kept.
    """
    lead = scores.shape[:-1]
    device = scores.device
    if budget >= length:
        return torch.arange(length, device=device).expand(*lead, length).contiguous()
    n_sink = min(n_sink, budget)
    n_recent = min(n_recent, budget - n_sink)
    if kernel and scores.device.type == "cpu" and scores.dtype == torch.float64 and scores.dim() == 4:
        from sparsespec.kernels import cpu

        if cpu.available() and scores.stride(-1) == 1:
            return torch.stack([cpu.build_index(scores[:, b], length, budget, n_sink, n_recent)
                                for b in range(scores.shape[1])], dim=1)  # [L, B, H_kv, N]
    n_top = budget - n_sink - n_recent
    sink = torch.arange(n_sink, device=device).expand(*lead, n_sink)
    recent = torch.arange(length - n_recent, length, device=device).expand(*lead, n_recent)
    middle = scores[..., n_sink : length - n_recent]  # [L, B, H_kv, S - sink - recent]
    top = torch.topk(middle, n_top, dim=-1, sorted=False).indices + n_sink
    top, _ = torch.sort(top, dim=-1)
    return torch.cat([sink, top, recent], dim=-1)  # [L, B, H_kv, N]

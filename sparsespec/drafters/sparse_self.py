"""Self-speculative drafters: the target model drafts for itself over a sparse view of its own KV.

All of them attend, per layer and KV head, to ``N`` positions of the dense cache (the *index*).
On the PyTorch path the index is gathered into a compact buffer once per step. With Triton on
CUDA the draft kernel gathers the indexed positions itself and the drafter only hands it the
padded index (no KV copy). With our CPU kernels, ``sparsespec-l`` and ``magicdec-streaming`` keep
each row's indexed K and V in a compact buffer across rebuilds (``CompactDraftKV``: a rebuild
copies only the positions that entered the index, and every draft step streams contiguous rows);
``SPARSESPEC_DRAFT_COMPACT=0`` has the kernel read them in place. The draft tokens of the step append their own
KV to a small buffer, so the dense cache is never touched by the draft. Keys keep the RoPE of their
true positions and draft queries use true positions. They differ only in how the index is chosen:

* ``sparsespec-l`` (ours): sink + recent + top positions by attention mass recycled from the last
  W committed queries of full attention; rebuilt after every verification (recallable).
* ``magicdec-streaming``: StreamingLLM (Xiao et al. 2024) as used by MagicDec (Sadhukhan et al.
  2024): ``n_sink`` first positions + a sliding window of the most recent ones, same budget.
* ``magicdec-snapkv``: SnapKV (Li et al. 2024) as used by MagicDec: positions selected once at
  prefill from the observation window's attention (max-pooled over positions), plus the
  observation window and every token generated since; the selection is permanent.
"""
from __future__ import annotations

import math
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from sparsespec.config import SpecOptions, check_int
from sparsespec.drafters.base import Draft, self_draft_loop
from sparsespec.kv.cache import KVCache
from sparsespec.kv.index import ImportanceWindow, RowsTarget, build_index
from sparsespec.sampling import BatchSampling
from sparsespec.model import DraftKV, Transformer
from sparsespec.registry import DRAFTERS


#: ``0`` turns the compact draft KV off (the draft kernel then reads the indexed rows of the dense
#: cache in place): for measuring one against the other
ENV_COMPACT = "SPARSESPEC_DRAFT_COMPACT"


def compact_draft_kv_enabled() -> bool:
    """Whether the indexed drafters keep a compact draft KV where our CPU kernels run
    (``SPARSESPEC_DRAFT_COMPACT``, default on)."""
    return os.environ.get(ENV_COMPACT, "1").strip().lower() not in ("0", "false", "off", "no")


class CompactDraftKV:
    """Each batch row's indexed keys and values, copied out of the dense cache and kept across
    rebuilds of its index (our CPU kernels).

    The draft kernel reads N rows per (layer, KV head) at every draft step. Read in place they are
    N scattered 256-byte rows of K and of V, whose rate is bound by how many cache misses a core
    keeps in flight (about half the streaming rate on the AMD EPYC of ``benchmarks/RESULTS.md``);
    copied here they stream. A rebuild of the index copies only the positions that entered it
    (``cpu.compact_update``: about a tenth per round of ``sparsespec-l`` on book text), so the copy
    costs a fraction of one draft step while every step of the round reads contiguous rows. The
    rows are in no particular order (attention over them is the same sum in another order, and only
    the draft reads them): ``slots`` is the kernel's index over them, ``0 .. N - 1``.

    Memory: ``2 x L x B x H_kv x N_max x D`` elements (``N_max``: the largest index, a
    ``budget_frac`` share of the cache), plus int32 bookkeeping.
    """

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, n_max: int, head_dim: int,
                 dtype: torch.dtype):
        L, B, H, N = num_layers, batch_size, num_kv_heads, max(1, n_max)
        self.k = torch.zeros(L, B, H, N, head_dim, dtype=dtype)  # [L, B, H_kv, N_max, D]
        self.v = torch.zeros_like(self.k)
        self.pos = torch.zeros(B, L, H, N, dtype=torch.int32)  # per row: positions held, ascending
        self.slot = torch.zeros_like(self.pos)  # ... and the compact slot of each
        self.slots = torch.arange(N, dtype=torch.int32).expand(L, B, H, N).contiguous()  # [L, B, H_kv, N_max]
        self.n = [0] * B  # positions held per row
        self.built_from: list[torch.Tensor | None] = [None] * B  # the index tensor each row was built from
        self.copied = 0  # rows copied in all (a statistic)

    def refresh(self, b: int, index: torch.Tensor, cache: KVCache) -> None:
        """Row ``b``'s compact KV for ``index`` ``[L, 1, H_kv, N]`` (int64, ascending), read from
        ``cache``; nothing to do when ``index`` is the one it was built from."""
        if self.built_from[b] is index:
            return
        from sparsespec.kernels import cpu

        idx = index[:, 0]
        if idx.dtype != torch.int64 or idx.stride(-1) != 1:
            idx = idx.to(torch.int64).contiguous()
        try:
            self.copied += cpu.compact_update(idx, self.pos[b], self.slot[b], self.n[b], cache.k[:, b], cache.v[:, b],
                                              self.k[:, b], self.v[:, b])
        except RuntimeError:
            self.forget(b)
            raise
        self.n[b] = int(idx.shape[-1])
        self.built_from[b] = index

    def forget(self, b: int) -> None:
        """Row ``b`` holds a new request: its next refresh copies every indexed row."""
        self.n[b], self.built_from[b] = 0, None

    def move(self, src: int, dst: int) -> None:
        """Row ``src``'s compact KV and state to row ``dst`` (the engine moved its request)."""
        n = max(1, self.n[src])
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.pos[dst, ..., :n] = self.pos[src, ..., :n]
        self.slot[dst, ..., :n] = self.slot[src, ..., :n]
        self.n[dst], self.built_from[dst] = self.n[src], self.built_from[src]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.pos, self.slot, self.slots))


@dataclass(frozen=True)
class SelfSpecOptions(SpecOptions):
    """What the self-speculative methods share: the index budget and the draft's weights.

    Attributes:
        budget_frac: index size N as a fraction of the context, in (0, 1] (SparseSpec-L: 0.1).
        min_budget / max_budget: floor and cap of N in tokens (per layer and KV head).
        draft_weights: the linear weights the draft forward reads: ``"target"`` (the model's own)
            or ``"int8"`` (a weight-only int8 copy made once at load, ``sparsespec.quant``).
            Verification always reads the target's weights, so outputs are unchanged; only q and
            the draft's cost move.
    """

    budget_frac: float = 0.1
    min_budget: int = 128
    max_budget: int = 8192
    draft_weights: str = "target"

    def __post_init__(self) -> None:
        super().__post_init__()
        from sparsespec.quant import DRAFT_WEIGHTS

        f = self.budget_frac
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 < f <= 1.0:
            raise ValueError(f"budget_frac must be in (0, 1], got {f!r}")
        check_int("min_budget", self.min_budget, 1)
        check_int("max_budget", self.max_budget, 1)
        if self.max_budget < self.min_budget:
            raise ValueError(f"max_budget ({self.max_budget}) must be >= min_budget ({self.min_budget})")
        if self.draft_weights not in DRAFT_WEIGHTS:
            raise ValueError(f"draft_weights must be one of {DRAFT_WEIGHTS}, got {self.draft_weights!r}")

    def budget(self, context_len: int) -> int:
        """Index size N for a context of ``context_len`` tokens (capped at the context)."""
        n = max(self.min_budget, min(self.max_budget, math.ceil(self.budget_frac * context_len)))
        return min(n, context_len)


@dataclass(frozen=True)
class SparseSpecLOptions(SelfSpecOptions):
    """``sparsespec-l``'s options (``SelfSpecOptions`` plus):

    Attributes:
        n_sink: first positions always kept (attention sinks), >= 0.
        n_recent: last positions always kept, >= 1 (``n_sink + n_recent <= min_budget``).
        window: W, the number of most recent query positions whose attention mass scores a key.
    """

    n_sink: int = 4
    n_recent: int = 32
    window: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("n_sink", self.n_sink, 0)
        check_int("n_recent", self.n_recent, 1)
        check_int("window", self.window, 1)
        if self.min_budget < self.n_sink + self.n_recent:
            raise ValueError(
                f"min_budget ({self.min_budget}) must be >= n_sink + n_recent ({self.n_sink + self.n_recent})")


@dataclass(frozen=True)
class StreamingOptions(SelfSpecOptions):
    """``magicdec-streaming``'s options (``SelfSpecOptions`` plus):

    Attributes:
        n_sink: first positions always kept (attention sinks), >= 0 and < ``min_budget`` (the
            rest of the budget is the sliding window of the most recent positions).
    """

    n_sink: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("n_sink", self.n_sink, 0)
        if self.min_budget <= self.n_sink:
            raise ValueError(f"min_budget ({self.min_budget}) must be > n_sink ({self.n_sink})")


@dataclass(frozen=True)
class SnapKVOptions(SelfSpecOptions):
    """``magicdec-snapkv``'s options (``SelfSpecOptions`` plus):

    Attributes:
        window: SnapKV's observation window (the last prompt positions whose attention votes).
        pool_kernel: the 1-D max-pooling kernel over key positions (odd; 1 = no pooling).
    """

    window: int = 16
    pool_kernel: int = 7

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("window", self.window, 1)
        check_int("pool_kernel", self.pool_kernel, 1)
        if self.pool_kernel % 2 == 0:
            raise ValueError(f"pool_kernel must be a positive odd integer, got {self.pool_kernel!r}")


class _IndexedSelfDrafter(ABC):
    """Shared machinery; subclasses set ``want_rows`` and implement ``_rebuild``."""

    want_rows = 0
    want_rows_prefill = 0
    want_hidden = ()
    options: type[SelfSpecOptions] = SelfSpecOptions
    #: a draft forward's cost relative to a dense forward over the N keys it reads (the cost
    #: controller's prior until measured): the same weights, the same layers
    draft_cost_prior = 1.0
    #: keep the indexed KV in a compact buffer across rebuilds where our CPU kernels run the draft
    #: (``CompactDraftKV``); off for drafters whose index grows with every generated token
    compact_kv = True

    def __init__(self, model: Transformer, spec: SelfSpecOptions, capacity: int, batch_size: int, max_k: int):
        cfg = model.cfg
        self.model, self.spec = model, spec
        self.weights = model.draft_weights(spec.draft_weights)  # None: the target's own
        self.n_max = self._max_index(capacity)
        # Triton and our CPU kernels: the draft kernel gathers from the dense cache; keep only the padded index
        self.gather_in_kernel = model.attention_in_kernel
        slots = max_k + 1 if self.gather_in_kernel else self.n_max + max_k + 1
        shape = (cfg.num_layers, batch_size, cfg.num_kv_heads, slots, cfg.head_dim)
        self.dkv = DraftKV(
            torch.zeros(shape, dtype=model.dtype, device=model.device),  # [L, B, H_kv, (N_max +) K + 1, D]
            torch.zeros(shape, dtype=model.dtype, device=model.device),
            0,
        )
        self.index: list[torch.Tensor | None] = [None] * batch_size  # per slot [L, 1, H_kv, N_b] int64
        self.compact: CompactDraftKV | None = None
        if self.gather_in_kernel and self.compact_kv and model.attention_backend() == "ss" and compact_draft_kv_enabled():
            self.compact = CompactDraftKV(cfg.num_layers, batch_size, cfg.num_kv_heads, self.n_max, cfg.head_dim,
                                          model.dtype)
        self.index_buf = None  # [L, B, H_kv, N_max] int32, the rows' indices padded (read in place)
        if self.gather_in_kernel and self.compact is None:
            self.index_buf = torch.zeros(cfg.num_layers, batch_size, cfg.num_kv_heads, max(1, self.n_max),
                                         dtype=torch.int32, device=model.device)

    def _max_index(self, capacity: int) -> int:
        return self.spec.budget(capacity)

    @abstractmethod
    def _rebuild(self, cache: KVCache, b: int) -> None:
        """Set ``self.index[b]`` for row ``b``'s current cache length."""

    def prefill_row(self, b: int, cache: KVCache, rows: torch.Tensor | None, prompt: Sequence[int] = ()) -> None:
        self._forget(b)
        self._rebuild(cache, b)
        self._refresh(cache, [b])  # this row only: the pool's other slots may be free or staged

    def commit(self, cache: KVCache, rows: torch.Tensor | None, counts: Sequence[int]) -> None:
        for b in range(cache.batch_size):
            self._rebuild(cache, b)
        self._refresh(cache)

    def move(self, src: int, dst: int) -> None:
        self.index[dst] = self.index[src]  # the PyTorch path's compact buffers are refilled at every propose
        if self.compact is not None:
            self.compact.move(src, dst)

    def flush(self, cache: KVCache) -> None:
        """Bring every running row's index (and its compact KV) up to date (a no-op unless
        rebuilds are deferred)."""
        self._refresh(cache)

    def _forget(self, b: int) -> None:
        """Slot ``b`` holds a new request: nothing of its compact KV may be kept."""
        if self.compact is not None:
            self.compact.forget(b)

    def _refresh(self, cache: KVCache, rows: Sequence[int] | None = None) -> None:
        """The compact KV of every row of ``cache`` (the running rows), or of ``rows``, built from
        its current index (rows whose index did not change since: nothing to do)."""
        if self.compact is not None:
            for b in range(cache.batch_size) if rows is None else rows:
                if self.index[b] is not None:
                    self.compact.refresh(b, self.index[b], cache)

    def propose(self, cache: KVCache, pending: torch.Tensor, limits: Sequence[int], policies: Sequence,
                sampling: BatchSampling, history: Sequence[Sequence[int]] = ()) -> Draft:
        B = cache.batch_size
        self.flush(cache)
        sizes = self.index_sizes()[:B]
        n = max(sizes)
        D = cache.k.shape[-1]
        dkv = DraftKV(self.dkv.k[:, :B], self.dkv.v[:, :B], 0)  # the running rows' slots
        if self.compact is not None:  # the kernel streams each row's compact KV (slots 0 .. N_b - 1)
            self._refresh(cache)
            dkv.index, dkv.source = self.compact.slots[:, :B, :, :n], self.compact
        elif self.gather_in_kernel:  # hand the kernel the padded index; it reads the dense cache in place
            for b in range(B):
                self.index_buf[:, b, :, : sizes[b]] = self.index[b][:, 0]
            dkv.index, dkv.source = self.index_buf[:, :B, :, :n], cache  # [L, B, H_kv, N]
        else:
            for b in range(B):  # gather each row's index into the compact buffer
                idx = self.index[b]
                gather_idx = idx.unsqueeze(-1).expand(*idx.shape, D)  # [L, 1, H_kv, N_b, D]
                dkv.k[:, b : b + 1, :, : sizes[b]] = torch.gather(cache.k[:, b : b + 1], 3, gather_idx)
                dkv.v[:, b : b + 1, :, : sizes[b]] = torch.gather(cache.v[:, b : b + 1], 3, gather_idx)
        dkv.length = dkv.n_index = n
        n_valid_dtype = torch.int32 if self.gather_in_kernel else torch.int64
        dkv.n_valid = None if min(sizes) == n else torch.tensor(sizes, dtype=n_valid_dtype, device=pending.device)
        starts = torch.tensor(cache.lengths, device=pending.device)  # [B] position of each pending token
        return self_draft_loop(self.model, dkv, pending, starts, limits, policies, sampling, self.weights)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the draft's own weight copy (0 when it reads the target's)."""
        return 0 if self.weights is None else self.weights.nbytes

    def index_sizes(self) -> list[int]:
        return [0 if idx is None else int(idx.shape[-1]) for idx in self.index]

    @property
    def nbytes(self) -> int:
        """Reserved bytes: each slot's index at its largest (``n_max`` int64 positions per layer
        and KV head), the padded kernel index, and the compact draft KV."""
        L, B, H = self.dkv.k.shape[:3]
        idx = L * B * H * self.n_max * 8
        if self.index_buf is not None:
            idx += self.index_buf.numel() * self.index_buf.element_size()
        compact = 0 if self.compact is None else self.compact.nbytes
        return idx + 2 * self.dkv.k.numel() * self.dkv.k.element_size() + compact


@DRAFTERS.register("sparsespec-l")
class SparseSelfDrafter(_IndexedSelfDrafter):
    """SparseSpec-L: recallable index from recycled verification attention."""

    options = SparseSpecLOptions

    def __init__(self, model: Transformer, spec: SelfSpecOptions, capacity: int, batch_size: int, max_k: int):
        super().__init__(model, spec, capacity, batch_size, max_k)
        cfg = model.cfg
        self.want_rows = self.want_rows_prefill = spec.window
        # spare slots for a verify's k + 1 rows: the forward writes them into the ring directly
        self.window = ImportanceWindow(cfg.num_layers, batch_size, cfg.num_kv_heads, spec.window, capacity, model.device,
                                       spare=max_k + 1)
        self._target: tuple[RowsTarget, int] | None = None  # the pending verify's rows (ring slots, width)

        self.stale: list[int | None] = [None] * batch_size  # per slot: the length to rebuild at (None: fresh)

    def _rebuild(self, cache: KVCache, b: int) -> None:
        S = cache.lengths[b]
        scores = self.window.scores(S, b)  # [L, 1, H_kv, S] running sum of the window
        self.index[b] = build_index(scores, S, self.spec.budget(S), self.spec.n_sink, self.spec.n_recent,
                                    kernel=self.gather_in_kernel)
        self.stale[b] = None

    def prefill_row(self, b: int, cache: KVCache, rows: torch.Tensor | None, prompt: Sequence[int] = ()) -> None:
        self.window.reset(b)
        if rows is not None:
            self.window.push_row(b, rows[:, 0])
        self._forget(b)
        self._rebuild(cache, b)
        self._refresh(cache, [b])  # this row only: the pool's other slots may be free or staged

    def importance_target(self, batch: int, num_rows: int, width: int) -> RowsTarget:
        """Where the next verify forward writes its ``num_rows`` query rows (``width`` columns):
        the window's spare slots of running rows ``0 .. batch-1``; ``commit`` then commits the
        accepted ones in place (no rows buffer, no copy)."""
        target = self.window.target(batch, num_rows)
        self._target = (target, width)
        return target

    def commit(self, cache: KVCache, rows: torch.Tensor | None, counts: Sequence[int]) -> None:
        """Commit the verified rows into the window now (those ``importance_target`` placed, or
        ``rows`` pushed); the top-K rebuild waits for the next draft phase (``flush``), so a step
        that drafts nothing (``k = 0``) pays no rebuild."""
        if rows is not None:
            self.window.push(rows, list(counts))
        elif self._target is not None:
            _, width = self._target
            for b, n in enumerate(counts):
                self.window.commit_row(b, n, width)
        self._target = None
        for b in range(cache.batch_size):
            self.stale[b] = cache.lengths[b]

    def flush(self, cache: KVCache) -> None:
        for b in range(cache.batch_size):
            if self.stale[b] is not None:
                if self.stale[b] != cache.lengths[b]:
                    raise RuntimeError(f"slot {b}: cache length {cache.lengths[b]} changed since commit "
                                       f"({self.stale[b]}) without a commit")
                self._rebuild(cache, b)
        self._refresh(cache)

    def index_sizes(self) -> list[int]:
        """Per slot: the size its index has (or will have at the deferred rebuild)."""
        return [self.spec.budget(st) if st is not None else (0 if idx is None else int(idx.shape[-1]))
                for st, idx in zip(self.stale, self.index)]

    def move(self, src: int, dst: int) -> None:
        super().move(src, dst)
        self.window.move(src, dst)
        self.stale[dst] = self.stale[src]

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.window.nbytes


def streaming_index(length: int, budget: int, n_sink: int, lead: tuple[int, ...], device) -> torch.Tensor:
    """StreamingLLM positions: the first ``n_sink`` and the last ``budget - n_sink`` (``[*lead, N]``)."""
    if budget >= length:
        pos = torch.arange(length, device=device)
    else:
        n_sink = min(n_sink, budget)
        pos = torch.cat([torch.arange(n_sink, device=device), torch.arange(length - (budget - n_sink), length, device=device)])
    return pos.expand(*lead, pos.numel()).contiguous()


@DRAFTERS.register("magicdec-streaming")
class StreamingDrafter(_IndexedSelfDrafter):
    """MagicDec with a StreamingLLM draft: attention sinks + a sliding window, same budget."""

    options = StreamingOptions

    def _rebuild(self, cache: KVCache, b: int) -> None:
        S = cache.lengths[b]
        cfg = self.model.cfg
        self.index[b] = streaming_index(S, self.spec.budget(S), self.spec.n_sink, (cfg.num_layers, 1, cfg.num_kv_heads),
                                        cache.k.device)


def snapkv_select(rows: torch.Tensor, length: int, budget: int, window: int, kernel: int) -> torch.Tensor:
    """SnapKV selection (Li et al. 2024) from the observation window's attention.

    Args:
        rows: ``[L, B, H_kv, W, S]`` float32 attention of the last W prompt queries (summed over
            the query heads of each KV head), S >= ``length``.
        length: prompt length P. budget: total positions kept N (window included).
        window: observation window w (the last w prompt positions, always kept).
        kernel: max-pooling kernel over key positions (odd; clusters neighbouring tokens).

    Returns:
        ``[L, B, H_kv, N]`` int64 sorted positions: the top ``N - w`` prefix positions by pooled
        vote, then ``[P - w, P)``. Everything when ``budget >= length``.
    """
    L, B, H = rows.shape[:3]
    if budget >= length:
        return torch.arange(length, device=rows.device).expand(L, B, H, length).contiguous()
    w = min(window, budget, length)
    votes = rows[..., : length - w].sum(dim=3)  # [L, B, H_kv, P - w]
    if kernel > 1:
        votes = F.max_pool1d(votes.reshape(L * B * H, 1, -1), kernel, stride=1, padding=kernel // 2).view(L, B, H, -1)
    top = torch.topk(votes, budget - w, dim=-1).indices
    top, _ = torch.sort(top, dim=-1)
    obs = torch.arange(length - w, length, device=rows.device).expand(L, B, H, w)
    return torch.cat([top, obs], dim=-1)


@DRAFTERS.register("magicdec-snapkv")
class SnapKVDrafter(_IndexedSelfDrafter):
    """MagicDec with a SnapKV draft: a one-shot, permanent prefill selection plus all later tokens."""

    options = SnapKVOptions
    want_rows = 0  # verification attention is not used: the selection is never revisited
    compact_kv = False  # its index is the prompt's selection plus every later token: a compact copy would grow to the cache

    def __init__(self, model: Transformer, spec: SelfSpecOptions, capacity: int, batch_size: int, max_k: int):
        super().__init__(model, spec, capacity, batch_size, max_k)
        self.want_rows_prefill = spec.window
        self.selected: list[torch.Tensor | None] = [None] * batch_size  # [L, 1, H_kv, N_sel] prompt positions
        self.prompt_len = [0] * batch_size

    def _max_index(self, capacity: int) -> int:
        return capacity  # the prompt selection plus every generated token

    def prefill_row(self, b: int, cache: KVCache, rows: torch.Tensor | None, prompt: Sequence[int] = ()) -> None:
        P = cache.lengths[b]
        self.prompt_len[b] = P
        if rows is None:  # no observation window (cannot happen with want_rows_prefill >= 1)
            rows = torch.zeros(self.model.cfg.num_layers, 1, self.model.cfg.num_kv_heads, 1, P, device=cache.k.device)
        self.selected[b] = snapkv_select(rows, P, self.spec.budget(P), self.spec.window, self.spec.pool_kernel)
        self._rebuild(cache, b)

    def _rebuild(self, cache: KVCache, b: int) -> None:
        S, P = cache.lengths[b], self.prompt_len[b]
        sel = self.selected[b]
        since = torch.arange(P, S, device=cache.k.device).expand(*sel.shape[:3], S - P)
        self.index[b] = torch.cat([sel, since], dim=-1)

    def move(self, src: int, dst: int) -> None:
        super().move(src, dst)
        self.selected[dst], self.prompt_len[dst] = self.selected[src], self.prompt_len[src]

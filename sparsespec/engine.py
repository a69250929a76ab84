"""The decoding engine: one step loop for every method, with continuous batching.

``EngineCore`` follows vLLM's ``LLMEngine`` convention (``add_request`` / ``step`` /
``abort_request`` / ``has_unfinished_requests``). Each ``step`` runs, as named phases::

    admit + prefill new rows (chunked) -> plan (per-row k) -> propose -> verify -> accept
        -> commit (cache rollback) -> index (window push + rebuild) -> record

over the rows running in a preallocated pool of ``max_num_seqs`` slots; finished and aborted rows
leave between steps and waiting requests take their slots. ``ar`` is the registered null
drafter (it drafts nothing, so a step verifies only the pending token). ``Engine.generate`` and
``Engine.stream`` are thin wrappers over a core.
"""
from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

import sparsespec.drafters  # noqa: F401  (registers the drafters)
from sparsespec.adaptive import CostAwareController, StepCosts, policy_for
from sparsespec.config import MethodOptions, SamplingParams, SpecOptions
from sparsespec.drafters.base import Draft, empty_draft
from sparsespec.kv.cache import KVCache
from sparsespec.kv.index import RowsTarget
from sparsespec.model import Transformer, prefill_chunks
from sparsespec.provision import resolve_model
from sparsespec.registry import AR, DRAFTERS
from sparsespec.rejection import greedy_verify_batch, rejection_sample
from sparsespec.sampling import BatchSampling, make_generator
from sparsespec.stats import Clock, RunStats, StepClock

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def methods() -> list[str]:
    """Every method key (``"ar"``, the null drafter, first; then the registered drafters)."""
    return DRAFTERS.keys()


def options_class(method: str) -> type[MethodOptions]:
    """The options dataclass ``method``'s drafter declares (``MethodOptions`` itself for ``ar``:
    none). Raises ValueError for an unknown method (with the list and a suggestion)."""
    return DRAFTERS.get(method).options


def parse_method_options(method: str, options: dict[str, Any] | None = None) -> MethodOptions:
    """``method``'s validated options object (its drafter's ``options`` class).

    Raises:
        ValueError: unknown method, an option ``method`` does not take (listing those it takes),
            or an invalid value (naming the method and the option).
    """
    return options_class(method).from_options(method, options)


def resolve_method_options(method: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The full, validated options of ``method`` as a plain dict: only that method's own options,
    defaults filled in (``{}`` for ``"ar"``). A run id hashes this per method of the run
    (``cluster.sweep.plan``), so another method's options never move it.

    Raises:
        ValueError: as ``parse_method_options``.
    """
    return parse_method_options(method, options).resolved()


@dataclass
class GenerationOutput:
    """Result of one request.

    Attributes:
        token_ids: generated token ids (an EOS token that ended generation is included; tokens
            after a stop are not).
        text: ``token_ids`` decoded with special tokens skipped, cut before a stop string.
        stats: raw counts and seconds (keys in the README; ratios from ``sparsespec.stats.derive``).
        finish_reason: ``"stop"`` (EOS, stop id or stop string), ``"length"``
            (``max_new_tokens``) or ``"abort"``.
    """

    token_ids: list[int]
    text: str
    stats: dict[str, Any]
    finish_reason: str


@dataclass
class RequestOutput:
    """What one request got in one ``EngineCore.step``.

    ``new_token_ids``: tokens committed in this step; ``text``: the new text (a delta: the deltas
    of a request concatenate to its final text; a partial multi-byte character or a possible
    stop-string prefix is held back until it resolves); ``finished``: the request is done and
    ``output`` holds its ``GenerationOutput``.
    """

    request_id: str
    new_token_ids: list[int]
    text: str
    finished: bool = False
    output: GenerationOutput | None = None


@dataclass
class StreamEvent:
    """``Engine.stream``'s event: a ``RequestOutput`` keyed by the prompt's index ``row``."""

    row: int
    token_ids: list[int]
    text: str
    finished: bool = False
    output: GenerationOutput | None = None


@dataclass
class _Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival_s: float
    stats: RunStats
    policy: Any
    generator: torch.Generator | None
    slot: int = -1
    out: list[int] = field(default_factory=list)
    decoded: str = ""  # text of ``out`` (before any stop cut)
    text: str = ""  # final text so far (cut before a stop string)
    emitted: str = ""  # text already streamed
    finish_reason: str | None = None
    controller_s: float = 0.0  # this row's share of the batch controller's decisions
    max_k: int | None = None  # this row's cap on draft tokens per round (0: it never drafts)


@dataclass
class _Prefill:
    """A request being prefilled, chunk by chunk, in the slot past the running rows (it joins
    them when its last chunk is done). ``bounds``: its chunks (``sparsespec.model.prefill_chunks``);
    ``seconds``: its own prefill time so far (its chunks, not the steps between them)."""

    req: _Request
    prompt: torch.Tensor  # [1, P]
    bounds: list[tuple[int, int]]
    want_rows: int
    done: int = 0
    seconds: float = 0.0
    logits: torch.Tensor | None = None  # [1, 1, V] of the last chunk
    rows: torch.Tensor | None = None  # [L, 1, H_kv, W, P]
    feats: list[torch.Tensor] = field(default_factory=list)  # [1, chunk, n E] each (eagle3)


@dataclass
class _Step:
    """What the phases of one decode step hand each other (B running rows)."""

    rows: list[_Request]
    cache: KVCache  # the pool's view of the B running slots
    sampling: BatchSampling
    limits: list[int]
    index_sizes: list[int]
    draft: Draft | None = None
    logits: torch.Tensor | None = None  # [B, K+1, V]
    importance: torch.Tensor | None = None  # [L, B, H_kv, K+1, S]
    hidden: torch.Tensor | None = None  # [B, K+1, n E]: features of the drafter's want_hidden layers
    accepted: list[int] = field(default_factory=list)
    out_ids: list[list[int]] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    index_s: float = 0.0


class EngineCore:
    """Continuous batching over one method; see the module docstring.

    Args:
        engine: the loaded ``Engine`` (model + tokenizer).
        method: ``"ar"`` or a registered drafter key (``sparsespec.METHODS``).
        method_options: the method's options (its drafter's ``options`` dataclass, see
            ``resolve_method_options``), e.g. ``{"k": 4}``, ``{"k": "auto"}``; none for ``"ar"``.
        max_num_seqs: slots of the preallocated KV pool (rows decoded together); further
            requests wait in a FIFO queue until a slot frees.
        max_model_len: positions per slot (prompt + generated tokens must fit); default the
            model's window.
        prefill_chunk: prefill chunk size in tokens (attention memory O(chunk x prompt)).
        enable_chunked_prefill: while rows are decoding, a step prefills at most one chunk of
            a waiting request before its decode round (vLLM's chunked prefill), so a long prompt
            that arrives delays the running rows by a chunk per step instead of by its whole
            prefill; when nothing is decoding, prompts are prefilled whole. Off: every step
            first prefills the waiting requests that fit, whole (a batch's rows then start
            decoding together, as the sweeps' paired batches want). Either way each prompt
            goes through the same chunks, so its KV and first token are the same.
        own_clock: time requests on the core's own clock (``sparsespec.stats.StepClock``: the
            time between this core's steps is left out), for a caller that steps several cores
            in turn on one device; ``step_clock.busy_s`` is then the core's own wall time.

    Raises:
        ValueError: unknown method or option, ``max_num_seqs < 1``, ``max_model_len`` outside
            ``[1, engine.max_context]``.
    """

    def __init__(self, engine: Engine, method: str = "sparsespec-l", method_options: dict[str, Any] | None = None,
                 max_num_seqs: int = 8, max_model_len: int | None = None, prefill_chunk: int = 512,
                 own_clock: bool = False, enable_chunked_prefill: bool = False):
        drafter_cls = DRAFTERS.get(method)
        if not isinstance(max_num_seqs, int) or isinstance(max_num_seqs, bool) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {max_num_seqs!r}")
        window = engine.max_context if max_model_len is None else max_model_len
        if not isinstance(window, int) or not 1 <= window <= engine.max_context:
            raise ValueError(f"max_model_len must be an integer in [1, {engine.max_context}], got {max_model_len!r}")
        self.engine, self.model, self.tokenizer = engine, engine.model, engine.tokenizer
        self.method = method
        spec = drafter_cls.options.from_options(method, method_options)
        self.spec: SpecOptions | None = spec if isinstance(spec, SpecOptions) else None  # None: ar
        self.k_max = 0 if self.spec is None else self.spec.k_limit
        if not isinstance(prefill_chunk, int) or isinstance(prefill_chunk, bool) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be an integer >= 1, got {prefill_chunk!r}")
        self.max_num_seqs, self.max_model_len, self.prefill_chunk = max_num_seqs, window, prefill_chunk
        self.enable_chunked_prefill = bool(enable_chunked_prefill)
        m = self.model
        # a row shorter than the batch's draft is padded to it in the verify forward: room for K+1 more
        capacity = window + self.k_max + 1
        self.cache = KVCache(m.cfg, max_num_seqs, capacity, m.dtype, m.device)  # [L, slots, H_kv, S_max, D]
        self.drafter = drafter_cls(m, spec, capacity, max_num_seqs, self.k_max)
        self.want_hidden = tuple(getattr(self.drafter, "want_hidden", ()))  # layer ids whose outputs it reads
        describe = getattr(self.drafter, "provenance", None)  # what it drafts with, into every request's stats
        self.drafter_provenance = describe() if callable(describe) else None
        self.costs = StepCosts()  # measured round costs, shared by the rows' controllers
        self.clock = engine.clock
        # k="auto" with the cost controller: one decision per step for the batch, from costs
        # calibrated now (a few timed forwards) and refined on every round
        self.controller: CostAwareController | None = None
        if self.spec is not None and self.spec.k == "auto" and self.spec.controller == "cost":
            self.controller = CostAwareController(self.k_max, draft_ratio=float(getattr(drafter_cls, "draft_cost_prior", 1.0)))
            self._calibrate()
            learned = engine.__dict__.setdefault("_controller_state", {}).get(self._controller_key)
            if learned:
                self.controller.load(learned)
        # own_clock: request timestamps count only this core's steps (stats.StepClock), for
        # schedules that step several cores in turn on one device; calibration above used the wall
        self.step_clock = StepClock(engine.clock) if own_clock else None
        if self.step_clock is not None:
            self.clock = self.step_clock
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []  # running[slot]
        self.prefilling: _Prefill | None = None  # in slot >= len(running) until its last chunk
        self._ids: set[str] = set()
        self.num_steps = 0
        self.num_rounds = 0  # steps that ran a decode round (the rest only prefilled)

    # ------------------------------------------------------------------ calibration
    @property
    def _controller_key(self) -> tuple:
        """Cores of one engine share controller measurements per method, draft settings, slots
        and capacity bucket (a draft forward's cost relative to a dense one moves with the batch:
        weight-bound at one row, not at eight)."""
        spec = dataclasses.asdict(self.spec) if self.spec is not None else {}
        bucket = 1 << max(0, self.cache.capacity - 1).bit_length()
        return (self.method, tuple(sorted((k, str(v)) for k, v in spec.items())), self.max_num_seqs, bucket)

    def _calibrate(self) -> None:
        """The cost controller's starting point: a few timed dense forwards of this core's shapes
        (``max_num_seqs`` rows, widths 1, 2 and ``k_max + 1``, a short context and the longest
        the core holds, and one row), with the importance rows the drafter asks for (none at width
        1: a round that drafts nothing is an AR step), on the pool's own buffers (no request is
        running; lengths are restored). Measured once per engine, method, batch and capacity
        bucket (powers of two)."""
        bucket = 1 << max(0, self.cache.capacity - 1).bit_length()  # capacities up to the next power of two
        key = (self.method, self.max_num_seqs, self.k_max, self.drafter.want_rows, bucket)
        memo = self.engine.__dict__.setdefault("_calibration", {})
        if key not in memo:
            Bm, kw = self.max_num_seqs, self.k_max + 1
            # the longest context this core holds (the cost's per-key terms are measured where they
            # matter, not extrapolated from short contexts) and a short one
            s_hi = max(1, self.cache.capacity - kw - 1)
            s_lo = max(1, min(256, s_hi // 8))
            points = sorted({(Bm, 1, s_lo), (Bm, 2, s_lo), (Bm, kw, s_lo), (Bm, 1, s_hi), (Bm, kw, s_hi), (1, 1, s_hi)})
            dev = self.model.device
            # touch the pool first: a fresh allocation reads as the OS's shared zero page, which
            # would time the KV reads as free (the per-key terms would come out far too small)
            self.cache.k[:, :Bm, :, : s_hi + kw].fill_(1e-3)
            self.cache.v[:, :Bm, :, : s_hi + kw].fill_(1e-3)
            measured = []
            cfg = self.model.cfg
            for B, w, S in points:
                ids = torch.zeros(B, w, dtype=torch.long, device=dev)
                # the importance rows go where a verify's go (a target written in place, as the
                # drafter's window ring is): a buffer made once per point, so only the first call
                # pays its pages, and the drafter's own ring is left untouched
                target = None  # (a width-1 forward is a k = 0 round: an AR step, no rows)
                if w > 1 and self.drafter.want_rows and hasattr(self.drafter, "importance_target"):
                    target = RowsTarget(torch.empty(cfg.num_layers, B, cfg.num_kv_heads, w, S + w, device=dev),
                                        torch.arange(w).repeat(B, 1))
                times = []
                for _ in range(2):  # the first call of a shape pays one-off kernel setup: keep the faster
                    view = self.cache.head(B)
                    view.lengths = [S] * B
                    t0 = self.clock()
                    want = self.drafter.want_rows and w if w > 1 else 0
                    self.model.forward_dense_features(ids, view, want_rows=want, rows_into=target)
                    times.append(self.clock() - t0)
                measured.append((B, w, S, min(times)))
            memo[key] = measured
        for B, w, S, dt in memo[key]:
            self.controller.verify_cost.observe(B, w, S, dt, calibration=True)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    max_k: int | None = None) -> None:
        """Queue a request; it joins the running batch at the next step with a free slot.

        ``prompt``: a string (tokenised as given, no chat template) or token ids. ``params``
        default ``SamplingParams()``; ``eos_token_ids=None`` means the model's EOS ids.
        ``max_k``: this request's cap on draft tokens per round, below the method's own (0: the
        row never drafts and is decoded as ``ar`` inside the batch; a step where no row drafts is
        an AR step); None: no cap. Its stats' ``k`` is the capped k.

        Raises:
            ValueError: naming the request: duplicate id, empty prompt, ids outside the
                vocabulary, prompt + ``max_new_tokens`` over ``max_model_len``, ``max_k`` not an
                integer >= 0.
        """
        request_id = str(request_id)
        if request_id in self._ids:
            raise ValueError(f"request {request_id!r} already exists")
        if max_k is not None and (not isinstance(max_k, int) or isinstance(max_k, bool) or max_k < 0):
            raise ValueError(f"request {request_id!r}: max_k must be an integer >= 0 or None, got {max_k!r}")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"request {request_id!r}: params must be a SamplingParams, got {type(params).__name__}")
        if params.eos_token_ids is None:
            params = dataclasses.replace(params, eos_token_ids=tuple(self.model.cfg.eos_token_ids))
        ids = self.engine._encode(prompt, f"request {request_id!r}")
        if len(ids) + params.max_new_tokens > self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: {len(ids)} prompt tokens + max_new_tokens={params.max_new_tokens} exceed "
                f"the window of {self.max_model_len} tokens (max_model_len); shorten it"
            )
        k = 0 if self.spec is None else self.spec.k
        if max_k is not None and self.spec is not None and k != "auto":
            k = min(int(k), max_k)  # a fixed k capped is that fixed k; "auto" capped stays "auto" (+ max_k)
        stats = RunStats(method=self.method, k=k, num_prompt_tokens=len(ids),
                         max_k=max_k if self.spec is not None and k == "auto" else None,
                         drafter=self.drafter_provenance)
        policy = self.controller.policy() if self.controller is not None else policy_for(self.spec, self.costs)
        req = _Request(request_id, ids, params, self.clock(), stats, policy, make_generator(params.seed, self.model.device),
                       max_k=max_k)
        self._ids.add(request_id)
        self.waiting.append(req)

    def abort_request(self, request_id: str) -> None:
        """Drop a waiting or running request (no output is produced for it); unknown ids are ignored."""
        request_id = str(request_id)
        for req in list(self.waiting):
            if req.request_id == request_id:
                self.waiting.remove(req)
                self._ids.discard(request_id)
                return
        if self.prefilling is not None and self.prefilling.req.request_id == request_id:
            self.cache.lengths[self.prefilling.req.slot] = 0
            self.prefilling = None
            self._ids.discard(request_id)
            return
        for req in self.running:
            if req.request_id == request_id:
                req.finish_reason = "abort"
                self._release(req)
                return

    def set_max_k(self, request_id: str, max_k: int | None) -> None:
        """Change a queued or running request's cap on draft tokens per round (``add_request``'s
        ``max_k``) from the next round on: a serving policy that decides round by round. Its
        stats' ``k`` keeps the admission value; each round's own k is in its step trace.

        Raises:
            ValueError: ``max_k`` not an integer >= 0 or None.
            KeyError: no such unfinished request.
        """
        request_id = str(request_id)
        if max_k is not None and (not isinstance(max_k, int) or isinstance(max_k, bool) or max_k < 0):
            raise ValueError(f"request {request_id!r}: max_k must be an integer >= 0 or None, got {max_k!r}")
        staged = [self.prefilling.req] if self.prefilling is not None else []
        for req in [*self.running, *staged, *self.waiting]:
            if req.request_id == request_id:
                req.max_k = max_k
                return
        raise KeyError(f"no unfinished request {request_id!r}")

    def round_rows(self) -> list[tuple[str, int]]:
        """``(request id, context tokens)`` of the rows the next step's round decodes (the running
        rows; a request whose prefill ends in that step joins them): context = prompt tokens +
        ``max_new_tokens``, the definition of a sweep cell's context length."""
        return [(r.request_id, len(r.prompt) + r.params.max_new_tokens) for r in self.running]

    def prefill_pending(self) -> bool:
        """Whether the next step prefills (a chunk of a request being admitted, or a waiting
        request with a free slot), so that its round carries that cost too."""
        return self.prefilling is not None or bool(self.waiting and len(self.running) < self.max_num_seqs)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running) + (self.prefilling is not None)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Admit and prefill waiting requests into free slots, then one speculative round for
        every running row. Returns the outputs of every request that got tokens."""
        if self.step_clock is not None:
            self.step_clock.resume()
        try:
            outputs = self._prefill_new()
            if self.running:
                self.num_rounds += 1
                outputs += self._decode_round()
        finally:
            if self.step_clock is not None:
                self.step_clock.pause()
        self.num_steps += 1
        return outputs

    # phase: admit + prefill ----------------------------------------------------
    def _prefill_new(self) -> list[RequestOutput]:
        """Prefill waiting requests into free slots, chunk by chunk; with chunked prefill and
        rows decoding, at most one chunk this step."""
        outputs: list[RequestOutput] = []
        chunks = 0
        while not (self.enable_chunked_prefill and self.running and chunks >= 1):
            if self.prefilling is None:
                if not self.waiting or len(self.running) >= self.max_num_seqs:
                    break
                self.prefilling = self._start_prefill(self.waiting.popleft())
            pf = self.prefilling
            self._prefill_chunk(pf)
            chunks += 1
            if pf.done == len(pf.bounds):
                self.prefilling = None
                self._finish_prefill(pf, outputs)
        for req in [r for r in self.running if r.finish_reason is not None]:
            self._finalize(req, outputs)
        return outputs

    def _start_prefill(self, req: _Request) -> _Prefill:
        """Stage ``req`` in the first slot past the running rows."""
        req.slot = len(self.running)
        self.cache.lengths[req.slot] = 0
        P = len(req.prompt)
        want = min(self.drafter.want_rows_prefill, P)
        prompt = torch.tensor([req.prompt], dtype=torch.long, device=self.model.device)  # [1, P]
        return _Prefill(req, prompt, prefill_chunks(P, self.prefill_chunk, want), want)

    def _prefill_chunk(self, pf: _Prefill) -> None:
        """The next chunk of ``pf`` into its slot (``Transformer.prefill_features``, one chunk)."""
        t0 = self.clock()
        s, e = pf.bounds[pf.done]
        last = pf.done == len(pf.bounds) - 1
        view = self.cache.row(pf.req.slot)
        logits, rows, feats = self.model.forward_dense_features(
            pf.prompt[:, s:e], view, self.want_hidden, want_rows=pf.want_rows if last else 0,
            logits_for="last")  # [1, 1, V], [L, 1, H_kv, W, P] on the last chunk
        self.cache.lengths[pf.req.slot] = view.lengths[0]
        if self.want_hidden:
            pf.feats.append(feats)  # [1, e - s, n E]
        if last:
            pf.logits, pf.rows = logits, rows
        pf.done += 1
        pf.seconds += self.clock() - t0

    def _finish_prefill(self, pf: _Prefill, outputs: list[RequestOutput]) -> None:
        """The prompt is in: the request joins the running rows (its KV moved down if rows left
        while it was staged), gets its first token, and the drafter prefills its state."""
        t0 = self.clock()
        req = pf.req
        slot = len(self.running)
        if req.slot != slot:
            self.cache.move(req.slot, slot)
            self.cache.lengths[req.slot] = 0
            req.slot = slot
        self.running.append(req)
        logits = _min_tokens_mask(pf.logits[:, -1][:, None], [req], [0])[:, 0]
        first = int(BatchSampling([req.params], [req.generator]).sample(logits)[0])  # SYNC: first token
        extra = {"hidden": torch.cat(pf.feats, dim=1)} if self.want_hidden else {}  # [1, P, n E] (eagle3)
        self.drafter.prefill_row(req.slot, self.cache, pf.rows, req.prompt, **extra)  # a draft model's prefill: TTFT
        now = self.clock()
        req.stats.prefill_s = pf.seconds + (now - t0)
        req.stats.ttft_s = now - req.arrival_s
        req.stats.emit_times.append(req.stats.ttft_s)
        kept, _ = self._append(req, [first])
        outputs.append(self._output(req, kept))

    # phase: plan -----------------------------------------------------------------
    def _plan(self) -> _Step:
        rows = list(self.running)
        B = len(rows)
        budgets = [r.params.max_new_tokens - len(r.out) - 1 for r in rows]  # never draft past the budget
        limits = [max(0, min(r.policy.start_step(b), b)) for r, b in zip(rows, budgets)]
        index_sizes = self.drafter.index_sizes()[:B]
        cache = self.cache.head(B)
        if self.controller is not None:  # one decision for the batch (k = 0 included), no sync
            c0 = self.controller.overhead_s
            limits = self.controller.plan([r.policy for r in rows], limits, cache.lengths, index_sizes, budgets,
                                          [len(r.out) for r in rows])
            for r in rows:
                r.controller_s += self.controller.overhead_s - c0
        limits = [lim if r.max_k is None else min(lim, r.max_k) for lim, r in zip(limits, rows)]  # per-row caps
        return _Step(rows, cache, BatchSampling([r.params for r in rows], [r.generator for r in rows]),
                     limits, index_sizes)

    # phase: propose ----------------------------------------------------------------
    def _propose(self, st: _Step, pending: torch.Tensor) -> None:
        t0 = self.clock()
        if max(st.limits) > 0:
            history = [r.prompt + r.out for r in st.rows]
            policies = [r.policy for r in st.rows]
            st.draft = self.drafter.propose(st.cache, pending, st.limits, policies, st.sampling, history)  # [B, K]
        else:
            st.draft = empty_draft(pending)
        st.draft_s = self.clock() - t0

    # phase: verify + accept -----------------------------------------------------------
    def _verify(self, st: _Step, pending: torch.Tensor) -> None:
        t0 = self.clock()
        draft = st.draft
        inp = torch.cat([pending, draft.token_ids], dim=1)  # [B, K + 1]
        # A round that drafts nothing (k = 0 for every row) is an AR step: no importance rows, so
        # declining to draft costs what AR costs (the window keeps the last W queries of the
        # rounds that drafted; the index is rebuilt from it when drafting resumes).
        want = self.drafter.want_rows and inp.shape[1] if draft.token_ids.shape[1] else 0
        target = None  # the drafter's importance window takes the rows in place where it can
        if want and hasattr(self.drafter, "importance_target"):
            target = self.drafter.importance_target(len(st.rows), want, max(st.cache.lengths) + inp.shape[1])
        logits, st.importance, st.hidden = self.model.forward_dense_features(
            inp, st.cache, self.want_hidden, want_rows=want, rows_into=target)  # [B, K+1, V], rows or None, features
        logits = _min_tokens_mask(logits, st.rows, [len(r.out) for r in st.rows])
        n_draft = torch.tensor(draft.num_draft, device=inp.device)  # [B]
        if st.sampling.all_greedy:
            out_ids, n_acc = greedy_verify_batch(draft.token_ids, logits, n_draft)
        else:
            p = st.sampling.probs(logits)  # [B, K+1, V]
            q = draft.q_probs if draft.q_probs is not None else p[:, :0]  # [B, K, V]
            out_ids, n_acc = rejection_sample(draft.token_ids, q, p, n_draft, st.sampling.generators)
        st.accepted = n_acc.tolist()  # SYNC: one per verify step
        st.out_ids = out_ids.tolist()
        st.verify_s = self.clock() - t0

    # phase: commit (cache) + index -------------------------------------------------------
    def _commit_cache(self, st: _Step, base: list[int]) -> None:
        st.cache.rollback([base[b] + 1 + a for b, a in enumerate(st.accepted)])  # pending + accepted stay
        self.cache.lengths[: len(st.rows)] = st.cache.lengths
        t0 = self.clock()
        extra = {"hidden": st.hidden} if self.want_hidden else {}
        self.drafter.commit(st.cache, st.importance, [a + 1 for a in st.accepted], **extra)  # window push + rebuild
        st.index_s = self.clock() - t0

    # phase: record ---------------------------------------------------------------------
    def _record(self, st: _Step, base: list[int]) -> list[tuple[_Request, int]]:
        draft = st.draft
        K = draft.token_ids.shape[1]
        ents = draft.entropies.tolist() if K else [[] for _ in st.rows]
        events = []
        for b, req in enumerate(st.rows):
            nd, a = draft.num_draft[b], st.accepted[b]
            if nd:
                req.policy.update(ents[b][:nd], a)  # the target judged all nd drafts
            kept, stopped = self._append(req, st.out_ids[b][: a + 1])
            s = req.stats
            s.num_steps += 1
            s.num_emitted += kept
            s.verify_s += st.verify_s
            s.index_s += st.index_s
            n_counted = a_counted = 0
            if nd:
                # drafts after a stop inside the committed block are neither drafted nor accepted
                n_counted = min(nd, kept) if stopped else nd
                a_counted = min(a, kept)
                s.num_drafting_steps += 1
                s.num_drafted += n_counted
                s.num_accepted += a_counted
                s.num_draft_forwards += K
                s.draft_s += st.draft_s
                s.accept_hist[(n_counted, a_counted)] += 1
                if st.index_sizes[b]:  # methods without a KV index (n-gram) report no budget
                    s.budget_tokens_sum += st.index_sizes[b]
                    s.context_tokens_sum += base[b]
                # entropy vs acceptance labels: accepted run = 1, first rejection = 0
                for i in range(min(n_counted, a_counted + 1)):
                    s.draft_entropies.append(ents[b][i])
                    s.draft_labels.append(1 if i < a_counted else 0)
            if s.method != AR:  # the per-step trace (AR rows keep it empty: nothing to store)
                s.step_trace.append((n_counted, a_counted))
            events.append((req, kept))
        return events

    def _decode_round(self) -> list[RequestOutput]:
        t0 = self.clock()
        st = self._plan()
        base = list(st.cache.lengths)
        pending = torch.tensor([[r.out[-1]] for r in st.rows], dtype=torch.long, device=self.model.device)  # [B, 1]
        self._propose(st, pending)
        self._verify(st, pending)
        self._commit_cache(st, base)
        events = self._record(st, base)
        now = self.clock()
        other_s = (now - t0) - st.draft_s - st.verify_s
        K = st.draft.token_ids.shape[1]
        self.costs.observe(st.draft_s / K if K else 0.0, st.verify_s, K + 1, other_s)
        if self.controller is not None:
            B = len(st.rows)
            self.controller.observe_round(B, sum(base) / B, sum(st.index_sizes) / B, K, st.draft_s, st.verify_s, other_s)
        outputs = []
        for req, kept in events:
            req.stats.other_s += other_s
            req.stats.emit_times.extend([now - req.arrival_s] * kept)
            req.stats.controller_s = req.policy.overhead_s + req.controller_s
            outputs.append(self._output(req, kept))
        for req in [r for r in st.rows if r.finish_reason is not None]:
            self._finalize(req, outputs)
        return outputs

    # ------------------------------------------------------------------ rows
    def _append(self, req: _Request, tokens: list[int]) -> tuple[int, bool]:
        """Append ``tokens`` to ``req`` up to the first stop; returns (kept, stopped)."""
        p = req.params
        stop_ids = p.stop_ids
        kept = 0
        for tok in tokens:
            kept += 1
            req.out.append(tok)
            if not p.ignore_eos and tok in stop_ids:
                req.finish_reason = "stop"
                break
            if p.stop and not p.ignore_eos:
                full = self.tokenizer.decode(req.out, skip_special_tokens=True)
                window_start = max(0, len(req.decoded) - max(len(s) for s in p.stop))
                hits = [i for s in p.stop if (i := full.find(s, window_start)) >= 0]
                req.decoded = full
                if hits:
                    req.text = full[: min(hits)]
                    req.finish_reason = "stop"
                    return kept, True
            if len(req.out) >= p.max_new_tokens:
                req.finish_reason = "length"
                break
        req.decoded = self.tokenizer.decode(req.out, skip_special_tokens=True)
        req.text = req.decoded
        return kept, req.finish_reason == "stop"

    def _output(self, req: _Request, kept: int) -> RequestOutput:
        """The step's output of ``req``: its new tokens and the text delta that is safe to stream."""
        if req.finish_reason is not None:
            target = req.text
        else:
            target = req.text.rstrip("\ufffd")  # a multi-byte character split across tokens
            if req.params.stop and not req.params.ignore_eos:  # a stop string may still cut this tail
                target = target[: max(len(req.emitted), len(target) - (max(len(s) for s in req.params.stop) - 1))]
        delta = ""
        if target.startswith(req.emitted):
            delta = target[len(req.emitted):]
            req.emitted = target
        elif req.finish_reason is not None:  # the decoded text changed under the stream (rare)
            common = len(_common_prefix(req.emitted, target))
            delta, req.emitted = target[common:], target
        return RequestOutput(req.request_id, req.out[len(req.out) - kept:], delta, req.finish_reason is not None)

    def _finalize(self, req: _Request, outputs: list[RequestOutput]) -> None:
        s = req.stats
        s.total_s = s.emit_times[-1] if s.emit_times else 0.0
        s.kv_bytes = self.slot_bytes
        s.draft_weight_bytes = int(getattr(self.drafter, "weight_bytes", 0))
        s.controller_s = req.policy.overhead_s + req.controller_s
        if self.controller is not None:  # what later cores of this engine start from
            self.controller.row_finished(req.policy, len(req.out))
            self.engine.__dict__.setdefault("_controller_state", {})[self._controller_key] = self.controller.export()
        final = GenerationOutput(list(req.out), req.text, s.to_dict(len(req.out), self.model.device),
                                 req.finish_reason)
        for o in outputs:
            if o.request_id == req.request_id:
                o.output = final
        self._release(req)

    def _release(self, req: _Request) -> None:
        """Free ``req``'s slot: the last running row moves into it (the running rows stay in
        slots ``0 .. B-1``)."""
        slot, last = req.slot, len(self.running) - 1
        if slot != last:
            moved = self.running[last]
            self.cache.move(last, slot)
            self.drafter.move(last, slot)
            self.running[slot], moved.slot = moved, slot
        self.running.pop()
        self._ids.discard(req.request_id)
        req.slot = -1

    @property
    def slot_bytes(self) -> int:
        """Bytes one slot reserves: its dense KV plus its share of the drafter's state."""
        return (self.cache.nbytes + self.drafter.nbytes) // self.max_num_seqs


def step_in_turn(cores: Sequence[Any], clock: Any) -> Iterator[tuple[int, list[RequestOutput], float]]:
    """Step several cores on one device in turn until all are done: round r steps every core
    that has work, starting from core ``r % len(cores)`` (the order rotates every round, so no
    core always runs right after another's step). Yields ``(core index, its step's outputs, the
    step's wall seconds on clock)``. The paired comparison of methods on a shared, noisy machine:
    a slow moment lands on every core alike (give the cores ``own_clock=True`` so their requests'
    times leave the other cores' steps out)."""
    n, turn = len(cores), 0
    while any(c.has_unfinished_requests() for c in cores):
        r = turn % n
        for i in list(range(r, n)) + list(range(r)):
            if cores[i].has_unfinished_requests():
                t0 = clock()
                outs = cores[i].step()
                yield i, outs, clock() - t0
        turn += 1


def _common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return a[:n]


def _min_tokens_mask(logits: torch.Tensor, rows: Sequence[_Request], num_out: list[int]) -> torch.Tensor:
    """Mask each row's stop ids in ``logits`` ``[B, T, V]`` where position ``j`` would be output
    token ``num_out[b] + j < min_new_tokens`` (returns ``logits`` itself when nothing is masked)."""
    masked_rows = [(b, r) for b, r in enumerate(rows)
                   if r.params.min_new_tokens > num_out[b] and r.params.stop_ids]
    if not masked_rows:
        return logits
    logits = logits.clone()
    for b, r in masked_rows:
        n = max(0, min(logits.shape[1], r.params.min_new_tokens - num_out[b]))
        logits[b, :n, torch.tensor(r.params.stop_ids, device=logits.device)] = float("-inf")
    return logits


def _row_seed(seed: int | None, i: int) -> int | None:
    """Row ``i``'s seed of a ``generate(seed=...)`` batch (independent streams per row)."""
    if seed is None:
        return None
    return int(np.random.SeedSequence([int(seed), i]).generate_state(1, dtype=np.uint64)[0])


class Engine:
    """A loaded target model plus its tokenizer; see ``core``, ``generate`` and ``stream``."""

    def __init__(self, model: Transformer, tokenizer, name: str = "model"):
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.clock = Clock(model.device)

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path, dtype: str = "float32", device: str = "cpu",
                        quantize: str = "none") -> Engine:
        """Load a preset (e.g. ``"smollm2-135m"``) or a local Hugging Face folder; ``quantize="int8"``
        quantises the target's linear weights once loaded (``Engine.quantize``).

        Raises:
            ValueError: unknown dtype or quantize.
            sparsespec.provision.ModelNotAvailableError: the model cannot be provisioned offline.
        """
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        from transformers import AutoTokenizer

        folder = resolve_model(name_or_path)
        model = Transformer.from_folder(folder, dtype=_DTYPES[dtype], device=device).quantize_(quantize)
        return cls(model, AutoTokenizer.from_pretrained(folder), name=str(name_or_path))

    def quantize(self, kind: str) -> Engine:
        """Quantise the target's linear weights in place (``kind``: ``"int8"``; ``"none"`` is a
        no-op): a new model, whose ``ar`` is the reference of its speculation. Returns self.

        Raises:
            ValueError: unknown kind, or quantised already with another kind.
        """
        self.model.quantize_(kind)
        return self

    @property
    def max_context(self) -> int:
        """The model's window in tokens: prompt + generated tokens must fit in it."""
        return self.model.cfg.max_position_embeddings

    def core(self, method: str = "sparsespec-l", method_options: dict[str, Any] | None = None,
             max_num_seqs: int = 8, max_model_len: int | None = None, own_clock: bool = False,
             enable_chunked_prefill: bool = False) -> EngineCore:
        """A continuous-batching core for ``method`` (see ``EngineCore``)."""
        return EngineCore(self, method, method_options, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                          own_clock=own_clock, enable_chunked_prefill=enable_chunked_prefill)

    # ------------------------------------------------------------------ batch API
    def generate(self, prompts, method: str = "sparsespec-l", method_options: dict[str, Any] | None = None,
                 max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int | None = None, stop: Sequence[str] | None = None,
                 eos_token_ids: Sequence[int] | None = None, ignore_eos: bool = False,
                 truncate_prompt: bool = False, stop_token_ids: Sequence[int] | None = None,
                 min_new_tokens: int = 0) -> list[GenerationOutput]:
        """Decode every prompt with ``method`` (all prompts join one core at once).

        Args:
            prompts: strings (tokenised as given, no chat template) or lists of token ids.
            method: ``"ar"`` or a registered drafter key (``sparsespec.METHODS``).
            method_options: the method's options (``resolve_method_options``), e.g. ``{"k": 4}``,
                ``{"k": "auto"}``.
            max_new_tokens: generated-token cap per prompt (>= 1).
            temperature, top_p, top_k: sampling (applied identically to p and q); 0 = greedy.
            seed: seeds sampling: row ``i`` gets its own stream derived from ``(seed, i)``.
            stop: strings that end a row (cut from the text).
            eos_token_ids: ids that end a row (default: the model's EOS ids).
            ignore_eos: generate exactly ``max_new_tokens`` tokens (speed runs).
            stop_token_ids: ids that end a row like EOS (vLLM's ``stop_token_ids``).
            min_new_tokens: EOS and stop token ids cannot end a row before this many tokens:
                their target logits are masked there (vLLM's ``min_tokens``); drafts are
                verified against the masked target, so every method stays identical to AR.
            truncate_prompt: keep only the last ``max_context - max_new_tokens`` prompt tokens
                of a prompt that does not fit (default: such a prompt is an error).

        Returns:
            One ``GenerationOutput`` per prompt, in order.

        Raises:
            ValueError: naming the parameter: unknown method or option, invalid sampling value,
                an empty prompt, token ids outside the vocabulary, prompt + max_new_tokens over
                the model's window.
        """
        outputs: list[GenerationOutput | None] = [None] * len(prompts) if isinstance(prompts, Sequence) else []
        for ev in self.stream(prompts, method, method_options, max_new_tokens, temperature, top_p, top_k, seed,
                              stop, eos_token_ids, ignore_eos, truncate_prompt, stop_token_ids, min_new_tokens):
            if ev.finished:
                outputs[ev.row] = ev.output
        return outputs  # type: ignore[return-value]

    def stream(self, prompts, method: str = "sparsespec-l", method_options: dict[str, Any] | None = None,
               max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
               seed: int | None = None, stop: Sequence[str] | None = None,
               eos_token_ids: Sequence[int] | None = None, ignore_eos: bool = False,
               truncate_prompt: bool = False, stop_token_ids: Sequence[int] | None = None,
               min_new_tokens: int = 0) -> Iterator[StreamEvent]:
        """Same arguments as ``generate``; yields a ``StreamEvent`` per row each time tokens are
        committed (never anything after a stop). Arguments are validated before the first yield."""
        DRAFTERS.get(method)
        sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            seed=seed, stop=tuple([stop] if isinstance(stop, str) else (stop or ())),
                            eos_token_ids=None if eos_token_ids is None else tuple(eos_token_ids),
                            ignore_eos=ignore_eos, min_new_tokens=min_new_tokens,
                            stop_token_ids=tuple(stop_token_ids or ()))
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
            raise ValueError("prompts must be a non-empty list of strings or of token-id lists")
        encoded = [self._encode(p, f"prompts[{i}]", sp.max_new_tokens if truncate_prompt else None)
                   for i, p in enumerate(prompts)]
        for i, ids in enumerate(encoded):
            if len(ids) + sp.max_new_tokens > self.max_context:
                raise ValueError(
                    f"prompts[{i}]: {len(ids)} prompt tokens + max_new_tokens={sp.max_new_tokens} exceed the "
                    f"model's context window of {self.max_context} tokens; shorten it or pass truncate_prompt=True"
                )
        window = max(len(p) for p in encoded) + sp.max_new_tokens
        core = EngineCore(self, method, None if method == AR else method_options, max_num_seqs=len(encoded),
                          max_model_len=window)
        for i, ids in enumerate(encoded):
            core.add_request(str(i), ids, dataclasses.replace(sp, seed=_row_seed(seed, i)))
        return self._drive(core)

    @staticmethod
    def _drive(core: EngineCore) -> Iterator[StreamEvent]:
        while core.has_unfinished_requests():
            for out in core.step():
                yield StreamEvent(int(out.request_id), out.new_token_ids, out.text, out.finished, out.output)

    def _encode(self, prompt, name: str, truncate_for: int | None = None) -> list[int]:
        """Token ids of a string or id-list prompt (``name`` in errors); ``truncate_for``: keep
        the last ``max_context - truncate_for`` ids of a prompt that would not fit."""
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt, add_special_tokens=True).input_ids
        else:
            try:
                ids = [int(t) for t in prompt]
            except (TypeError, ValueError):
                raise ValueError(f"{name} must be a string or a list of int token ids") from None
        V = self.model.cfg.vocab_size
        if not ids:
            raise ValueError(f"{name} is empty")
        if min(ids) < 0 or max(ids) >= V:
            raise ValueError(f"{name} has token ids outside [0, {V})")
        if truncate_for is not None and len(ids) + truncate_for > self.max_context and truncate_for < self.max_context:
            ids = ids[len(ids) + truncate_for - self.max_context :]  # keep the end (the question)
        return ids

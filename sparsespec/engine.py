"""The decoding engine: one loop for every method, batched over ragged rows.

    prefill (per row, chunked) -> [propose -> verify -> accept -> commit]*     (AR: no drafter)

``stream`` is the loop (a generator of per-row commits); ``generate`` collects it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

import sparsespec.drafters  # noqa: F401  (registers the drafters)
from sparsespec.adaptive import EntropyAdaptive, FixedK
from sparsespec.config import SamplingParams, SpecConfig
from sparsespec.kv.cache import KVCache
from sparsespec.model import Transformer
from sparsespec.provision import resolve_model
from sparsespec.registry import DRAFTERS
from sparsespec.rejection import greedy_verify_batch, rejection_sample
from sparsespec.sampling import logits_to_probs, make_generator, sample
from sparsespec.stats import Clock, RunStats

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def methods() -> list[str]:
    """Every method key accepted by ``Engine.generate`` (``"ar"`` plus the registered drafters)."""
    return ["ar", *DRAFTERS.keys()]


def resolve_method_options(method: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The full, validated option dict of ``method`` (defaults filled in; ``{}`` for ``"ar"``).

    Raises:
        ValueError: unknown method or invalid option.
    """
    if method not in methods():
        DRAFTERS.get(method)
    if method == "ar":
        return {}
    import dataclasses

    return dataclasses.asdict(SpecConfig.from_options(options))


@dataclass
class GenerationOutput:
    """Result of one prompt.

    Attributes:
        token_ids: generated token ids (an EOS token that ended generation is included; tokens
            after a stop are not).
        text: ``token_ids`` decoded with special tokens skipped, cut before a stop string.
        stats: raw counts and seconds (keys in the README).
        finish_reason: ``"stop"`` (EOS or stop string) or ``"length"`` (``max_new_tokens``).
    """

    token_ids: list[int]
    text: str
    stats: dict[str, Any]
    finish_reason: str


@dataclass
class StreamEvent:
    """Tokens committed for one row in one step (what a streaming client receives).

    ``token_ids``: the new tokens; ``text``: the new text (stop strings already cut);
    ``finished``: the row is done, ``output`` then holds its final ``GenerationOutput``.
    """

    row: int
    token_ids: list[int]
    text: str
    finished: bool = False
    output: GenerationOutput | None = None


@dataclass
class _Row:
    index: int
    prompt: list[int]
    stats: RunStats
    out: list[int] = field(default_factory=list)
    text: str = ""  # emitted text so far
    finish_reason: str | None = None
    stopped_text: str | None = None


class Engine:
    """A loaded target model plus its tokenizer; see ``generate`` and ``stream``."""

    def __init__(self, model: Transformer, tokenizer, name: str = "model"):
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.clock = Clock(model.device)

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path, dtype: str = "float32", device: str = "cpu") -> Engine:
        """Load a preset (e.g. ``"smollm2-135m"``) or a local Hugging Face folder.

        Raises:
            ValueError: unknown dtype.
            sparsespec.provision.ModelNotAvailableError: the model cannot be provisioned offline.
        """
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        from transformers import AutoTokenizer

        folder = resolve_model(name_or_path)
        model = Transformer.from_folder(folder, dtype=_DTYPES[dtype], device=device)
        return cls(model, AutoTokenizer.from_pretrained(folder), name=str(name_or_path))

    @property
    def max_context(self) -> int:
        """The model's window in tokens: prompt + generated tokens must fit in it."""
        return self.model.cfg.max_position_embeddings

    # ------------------------------------------------------------------ public API
    def generate(self, prompts, method: str = "sparsespec-l", method_options: dict[str, Any] | None = None,
                 max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int | None = None, stop: Sequence[str] | None = None,
                 eos_token_ids: Sequence[int] | None = None, ignore_eos: bool = False,
                 truncate_prompt: bool = False, stop_token_ids: Sequence[int] | None = None,
                 min_new_tokens: int = 0) -> list[GenerationOutput]:
        """Decode every prompt (one batch of ragged rows) with ``method``.

        Args:
            prompts: strings (tokenised as given, no chat template) or lists of token ids.
            method: ``"ar"`` or a registered drafter key (``sparsespec.METHODS``).
            method_options: ``SpecConfig`` fields, e.g. ``{"k": 4}``, ``{"k": "auto"}``.
            max_new_tokens: generated-token cap per prompt (>= 1).
            temperature, top_p, top_k: sampling (applied identically to p and q); 0 = greedy.
            seed: seeds sampling (same seed and batch, same output).
            stop: strings that end a row (cut from the text).
            eos_token_ids: ids that end a row (default: the model's EOS ids).
            ignore_eos: generate exactly ``max_new_tokens`` tokens (speed runs).
            stop_token_ids: ids that end a row like EOS, added to ``eos_token_ids`` (vLLM's
                ``stop_token_ids``; e.g. LongBench samsum's newline id).
            min_new_tokens: EOS and stop token ids cannot end a row before this many tokens:
                their target logits are masked at those positions (vLLM's ``min_tokens``).
                Drafts are not masked: verification against the masked target keeps the output
                exactly that of AR decoding with the same mask.
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
        if method not in methods():
            DRAFTERS.get(method)  # raises with the list and a suggestion
        spec = SpecConfig.from_options(method_options)
        eos = list(self.model.cfg.eos_token_ids if eos_token_ids is None else eos_token_ids)
        eos += [t for t in (stop_token_ids or ()) if t not in eos]
        if isinstance(stop, str):
            stop = [stop]
        sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            seed=seed, stop=tuple(stop or ()), eos_token_ids=tuple(eos), ignore_eos=ignore_eos,
                            min_new_tokens=min_new_tokens)
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
            raise ValueError("prompts must be a non-empty list of strings or of token-id lists")
        encoded = [self._encode(p, i, sp, truncate_prompt) for i, p in enumerate(prompts)]
        return self._loop(encoded, method, spec, sp)

    def _encode(self, prompt, i: int, sp: SamplingParams, truncate: bool = False) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt, add_special_tokens=True).input_ids
        else:
            try:
                ids = [int(t) for t in prompt]
            except (TypeError, ValueError):
                raise ValueError(f"prompts[{i}] must be a string or a list of int token ids") from None
        V = self.model.cfg.vocab_size
        if not ids:
            raise ValueError(f"prompts[{i}] is empty")
        if min(ids) < 0 or max(ids) >= V:
            raise ValueError(f"prompts[{i}] has token ids outside [0, {V})")
        if len(ids) + sp.max_new_tokens > self.max_context and truncate and sp.max_new_tokens < self.max_context:
            ids = ids[len(ids) + sp.max_new_tokens - self.max_context :]  # keep the end (the question)
        if len(ids) + sp.max_new_tokens > self.max_context:
            raise ValueError(
                f"prompts[{i}]: {len(ids)} prompt tokens + max_new_tokens={sp.max_new_tokens} exceed the "
                f"model's context window of {self.max_context} tokens; shorten it or pass truncate_prompt=True"
            )
        return ids

    # ------------------------------------------------------------------ the loop
    def _loop(self, prompts: list[list[int]], method: str, spec: SpecConfig, sp: SamplingParams) -> Iterator[StreamEvent]:
        model, now = self.model, self.clock
        dev = model.device
        k_max = 0 if method == "ar" else spec.k_limit
        policy = FixedK(max(1, k_max)) if method == "ar" or spec.k != "auto" else EntropyAdaptive(candidates=_candidates(spec.max_k))
        gen = make_generator(sp.seed, dev)
        rows = [_Row(i, p, RunStats(method=method, k=spec.k if method != "ar" else 0, num_prompt_tokens=len(p)))
                for i, p in enumerate(prompts)]
        capacity = max(len(p) for p in prompts) + sp.max_new_tokens + k_max + 1
        cache = KVCache(model.cfg, len(rows), capacity, model.dtype, dev)
        drafter = None if method == "ar" else DRAFTERS.get(method)(model, spec, capacity, len(rows), k_max)
        want = drafter.want_rows if drafter else 0  # attention rows from every verification
        want_prefill = getattr(drafter, "want_rows_prefill", want)  # ... and from the prompt's last queries

        t_start = now()
        for b, row in enumerate(rows):  # prefill row by row (compute-bound; no padding waste)
            t0 = now()
            view = cache.row(b)
            prompt = torch.tensor([row.prompt], dtype=torch.long, device=dev)  # [1, P]
            logits, imp = model.prefill(prompt, view, want_rows=min(want_prefill, len(row.prompt)))  # [1, V]
            cache.lengths[b] = view.lengths[0]
            first = self._pick(self._min_tokens_mask(logits[:, None], [0], sp)[:, 0], sp, gen)[0]  # SYNC: first token
            if drafter is not None:  # the drafter's own prefill (e.g. a draft model) is part of TTFT
                drafter.prefill_row(b, cache, imp, row.prompt)
            row.stats.prefill_s = now() - t0
            row.stats.ttft_s = now() - t_start
            row.stats.emit_times.append(row.stats.ttft_s)
            yield self._finish(row, self._commit(row, [first], sp), self._kv_bytes(cache, drafter))
        active = [r for r in rows if r.finish_reason is None]
        self._drop_finished(rows, active, cache, drafter)

        while active:
            B = len(active)
            pending = torch.tensor([[r.out[-1]] for r in active], dtype=torch.long, device=dev)  # [B, 1]
            budgets = [sp.max_new_tokens - len(r.out) - 1 for r in active]  # never draft past the budget
            k_step = policy.start_step(max(budgets)) if drafter is not None else 0
            base = list(cache.lengths)
            index_sizes = drafter.index_sizes() if drafter is not None else [0] * B
            if k_step > 0:
                td = now()
                history = [r.prompt + r.out for r in active]
                draft = drafter.propose(cache, pending, k_step, budgets, policy, sp, gen, history)  # [B, K]
                drafts, num_draft = draft.token_ids, draft.num_draft
                t1 = now()
                draft_s = t1 - td
            else:
                draft, drafts, num_draft = None, pending[:, :0], [0] * B
                t1, draft_s = now(), 0.0
            inp = torch.cat([pending, drafts], dim=1)  # [B, K + 1]
            logits, imp = model.forward_dense(inp, cache, want_rows=want and inp.shape[1])  # [B, K+1, V]
            logits = self._min_tokens_mask(logits, [len(r.out) for r in active], sp)
            n_draft_t = torch.tensor(num_draft, device=dev)
            if sp.temperature == 0:
                out_ids, n_acc = greedy_verify_batch(drafts, logits, n_draft_t)
            else:
                p = logits_to_probs(logits, sp.temperature, sp.top_k, sp.top_p)  # [B, K+1, V]
                q = draft.q_probs if draft is not None else p[:, :0]
                out_ids, n_acc = rejection_sample(drafts, q, p, n_draft_t, gen)
            accepted = n_acc.tolist()  # SYNC: one per verify step
            out_rows = out_ids.tolist()
            t2 = now()
            cache.rollback([base[b] + 1 + a for b, a in enumerate(accepted)])  # pending + accepted drafts stay
            if drafter is not None:
                drafter.commit(cache, imp, [a + 1 for a in accepted])
            ents = draft.entropies.tolist() if draft is not None else [[]] * B
            verify_s = t2 - t1
            n_fwd = draft.token_ids.shape[1] if draft is not None else 0
            for b, row in enumerate(active):
                nd, a = num_draft[b], accepted[b]
                if nd:
                    policy.update(ents[b][:nd], a)
                ev = self._commit(row, out_rows[b][: a + 1], sp)
                kept = len(ev.token_ids)
                st = row.stats
                st.num_steps += 1
                st.num_emitted += kept
                st.emit_times.extend([now() - t_start] * kept)
                st.draft_s += draft_s
                st.verify_s += verify_s
                if nd:
                    st.num_drafted += nd
                    st.num_draft_forwards += n_fwd
                    st.num_accepted += min(a, kept)
                    st.accept_hist[(nd, min(a, kept))] += 1
                    if index_sizes[b]:  # methods without a KV index (n-gram) report no budget
                        st.budget_tokens_sum += index_sizes[b]
                        st.context_tokens_sum += base[b]
                    # entropy vs acceptance labels: accepted run = 1, first rejection = 0
                    for i in range(min(nd, a + 1)):
                        st.draft_entropies.append(ents[b][i])
                        st.draft_labels.append(1 if i < a else 0)
                yield self._finish(row, ev, self._kv_bytes(cache, drafter))
            if n_fwd:
                policy.observe_costs(draft_s / n_fwd, verify_s)
            for row in active:
                row.stats.controller_s = policy.overhead_s
            still = [r for r in active if r.finish_reason is None]
            if len(still) < len(active):
                self._drop_finished(active, still, cache, drafter)
            active = still

    @staticmethod
    def _min_tokens_mask(logits: torch.Tensor, num_out: list[int], sp: SamplingParams) -> torch.Tensor:
        """Mask the stop ids in ``logits`` ``[B, T, V]`` where position ``j`` of row ``b`` would be
        output token ``num_out[b] + j < sp.min_new_tokens`` (a no-op copy-free pass otherwise)."""
        if sp.min_new_tokens == 0 or min(num_out) >= sp.min_new_tokens or not sp.eos_token_ids:
            return logits
        logits = logits.clone()
        ids = torch.tensor(sp.eos_token_ids, device=logits.device)
        for b, n in enumerate(num_out):
            masked = max(0, min(logits.shape[1], sp.min_new_tokens - n))
            if masked:
                logits[b, :masked, ids] = float("-inf")
        return logits

    def _pick(self, logits: torch.Tensor, sp: SamplingParams, gen) -> list[int]:
        """First token from prefill logits ``[B, V]``."""
        if sp.temperature == 0:
            return logits.argmax(dim=-1).tolist()
        return sample(logits_to_probs(logits, sp.temperature, sp.top_k, sp.top_p), gen).tolist()

    @staticmethod
    def _kv_bytes(cache: KVCache, drafter) -> int:
        return cache.nbytes + (drafter.nbytes if drafter is not None else 0)

    @staticmethod
    def _drop_finished(before: list[_Row], after: list[_Row], cache: KVCache, drafter) -> None:
        if len(after) == len(before) or not after:
            return
        keep = [i for i, r in enumerate(before) if r.finish_reason is None]
        cache.select(keep)
        if drafter is not None:
            drafter.select(keep)

    def _commit(self, row: _Row, tokens: list[int], sp: SamplingParams) -> StreamEvent:
        """Append ``tokens`` to ``row``, cutting at the first stop; returns the stream event."""
        kept: list[int] = []
        text_before = row.text
        for tok in tokens:
            kept.append(tok)
            row.out.append(tok)
            if not sp.ignore_eos and tok in sp.eos_token_ids:
                row.finish_reason = "stop"
                break
            if sp.stop and not sp.ignore_eos:
                full = self.tokenizer.decode(row.out, skip_special_tokens=True)
                window_start = max(0, len(row.text) - max(len(s) for s in sp.stop))
                hits = [i for s in sp.stop if (i := full.find(s, window_start)) >= 0]
                if hits:
                    row.stopped_text = full[: min(hits)]
                    row.finish_reason = "stop"
                    break
                row.text = full
            if len(row.out) >= sp.max_new_tokens:
                row.finish_reason = "length"
                break
        if row.stopped_text is not None:
            row.text = row.stopped_text
        else:
            row.text = self.tokenizer.decode(row.out, skip_special_tokens=True)
        delta = row.text[len(text_before):] if row.text.startswith(text_before) else row.text
        return StreamEvent(row.index, kept, delta, finished=row.finish_reason is not None)

    def _finish(self, row: _Row, ev: StreamEvent, kv_bytes: int) -> StreamEvent:
        """Attach the final output to a row's last event (after its counters are updated)."""
        if ev.finished:
            row.stats.total_s = row.stats.emit_times[-1] if row.stats.emit_times else 0.0
            row.stats.kv_bytes = kv_bytes
            ev.output = GenerationOutput(list(row.out), row.text, row.stats.to_dict(len(row.out), self.model.device),
                                         row.finish_reason)
        return ev


def _candidates(max_k: int) -> tuple[int, ...]:
    base = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
    return tuple(sorted({c for c in base if c <= max_k} | {max_k}))

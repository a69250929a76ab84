"""The decoding engine: one loop for every method.

    prefill -> [propose -> verify -> accept -> commit]*      (AR: no drafter, a plain decode step)

Batch size 1 per request in this version: ``generate`` runs its prompts one after another.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

import sparsespec.drafters  # noqa: F401  (registers the drafters)
from sparsespec.config import SamplingParams, SpecConfig
from sparsespec.kv.cache import KVCache
from sparsespec.model import Transformer
from sparsespec.provision import resolve_model
from sparsespec.registry import DRAFTERS
from sparsespec.rejection import greedy_verify
from sparsespec.stats import Clock, RunStats

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def methods() -> list[str]:
    """Every method key accepted by ``Engine.generate`` (``"ar"`` plus the registered drafters)."""
    return ["ar", *DRAFTERS.keys()]


@dataclass
class GenerationOutput:
    """Result of one prompt.

    Attributes:
        token_ids: generated token ids (the EOS token is included when it ended generation).
        text: ``token_ids`` decoded with special tokens skipped.
        stats: raw counts and seconds (keys in the README / docs/CONTRACTS.md).
        finish_reason: ``"stop"`` (EOS) or ``"length"`` (``max_new_tokens``).
    """

    token_ids: list[int]
    text: str
    stats: dict[str, Any]
    finish_reason: str


class Engine:
    """A loaded target model plus its tokenizer; see ``generate``."""

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
    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        method: str = "sparsespec-l",
        method_options: dict[str, Any] | None = None,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        eos_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
    ) -> list[GenerationOutput]:
        """Decode every prompt with ``method`` (greedy).

        Args:
            prompts: strings (tokenised as-is, no chat template) or lists of token ids.
            method: ``"ar"`` or a registered drafter key (``sparsespec.METHODS``).
            method_options: ``SpecConfig`` fields, e.g. ``{"k": 4, "budget_frac": 0.1}``.
            max_new_tokens: generated-token cap per prompt (>= 1).
            temperature: 0.0 (greedy) only in this version.
            eos_token_ids: ids that end generation (default: the model's EOS ids).
            ignore_eos: generate exactly ``max_new_tokens`` tokens (speed runs).

        Raises:
            ValueError: unknown method or option, invalid sampling parameter, an empty prompt,
                token ids outside the vocabulary, or prompt + max_new_tokens over the window.
        """
        if method not in methods():
            DRAFTERS.get(method)  # raises with the list and a suggestion
        spec = SpecConfig.from_options(method_options)
        eos = tuple(self.model.cfg.eos_token_ids if eos_token_ids is None else eos_token_ids)
        sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, eos_token_ids=eos, ignore_eos=ignore_eos)
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise ValueError("prompts must be a list of strings or a list of token-id lists")
        encoded = [self._encode(p, i, sp) for i, p in enumerate(prompts)]
        return [self._generate_one(ids, method, spec, sp) for ids in encoded]

    def _encode(self, prompt, i: int, sp: SamplingParams) -> list[int]:
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
        if len(ids) + sp.max_new_tokens > self.max_context:
            raise ValueError(
                f"prompts[{i}]: {len(ids)} prompt tokens + max_new_tokens={sp.max_new_tokens} exceed the "
                f"model's context window of {self.max_context} tokens; truncate the prompt"
            )
        return ids

    # ------------------------------------------------------------------ the loop
    def _generate_one(self, ids: list[int], method: str, spec: SpecConfig, sp: SamplingParams) -> GenerationOutput:
        model, now = self.model, self.clock
        k = 0 if method == "ar" else spec.k
        st = RunStats(method=method, k=k, num_prompt_tokens=len(ids))
        cache = KVCache(model.cfg, 1, len(ids) + sp.max_new_tokens + k + 1, model.dtype, model.device)
        drafter = None if method == "ar" else DRAFTERS.get(method)(model, spec, cache.capacity)
        want = drafter.want_rows if drafter else 0

        t_start = now()
        prompt = torch.tensor([ids], dtype=torch.long, device=model.device)  # [1, P]
        logits, rows = model.prefill(prompt, cache, want_rows=want)  # [1, V], [L, 1, H_kv, W, P]
        out = [int(logits[0].argmax())]  # SYNC: first token
        st.prefill_s = now() - t_start
        st.emit_times.append(st.prefill_s)
        done = self._stop_at(out, 0, sp)
        if drafter is not None and not done:
            drafter.prefill(cache, rows)

        while not done:
            t0 = now()
            pending = torch.tensor([[out[-1]]], dtype=torch.long, device=model.device)  # [1, 1]
            k_step = min(k, sp.max_new_tokens - len(out) - 1)  # never draft past the budget
            if k_step > 0:
                index_size = drafter.index_size()  # the index this draft attended to
                draft = drafter.propose(cache, pending, k_step)  # [1, K]
                st.draft_s += (t1 := now()) - t0
                inp = torch.cat([pending, draft], dim=1)  # [1, K + 1]
            else:
                draft, t1, inp = pending[:, :0], t0, pending
            base = cache.length
            logits, rows = model.forward_dense(inp, cache, want_rows=want and inp.shape[1])  # [1, K+1, V]
            verdict = greedy_verify(draft[0], logits[0])
            st.verify_s += (t2 := now()) - t1
            a = verdict.num_accepted
            cache.rollback(base + 1 + a)  # keep the pending token and the accepted drafts
            if drafter is not None:
                drafter.commit(cache, rows[:, :, :, : a + 1, : cache.length])
            n_before = len(out)
            out.extend(verdict.token_ids)
            done = self._stop_at(out, n_before, sp)
            kept = len(out) - n_before
            st.num_steps += 1
            st.num_emitted += kept
            st.emit_times.extend([now() - t_start] * kept)
            if k_step > 0:
                st.num_drafted += k_step
                st.num_draft_forwards += k_step
                st.num_accepted += min(a, kept)
                st.accept_hist[(k_step, min(a, kept))] += 1
                st.budget_tokens_sum += index_size
                st.context_tokens_sum += base

        st.total_s = now() - t_start
        st.kv_bytes = cache.nbytes + (drafter.nbytes if drafter else 0)
        text = self.tokenizer.decode(out, skip_special_tokens=True)
        reason = "stop" if (not sp.ignore_eos and out[-1] in sp.eos_token_ids) else "length"
        return GenerationOutput(out, text, st.to_dict(len(out), model.device), reason)

    @staticmethod
    def _stop_at(out: list[int], start: int, sp: SamplingParams) -> bool:
        """Truncate ``out`` in place at the first stop at or after ``start``; True when finished."""
        if not sp.ignore_eos:
            for i in range(start, len(out)):
                if out[i] in sp.eos_token_ids:
                    del out[i + 1 :]
                    return True
        if len(out) >= sp.max_new_tokens:
            del out[sp.max_new_tokens :]
            return True
        return False

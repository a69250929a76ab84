"""A deterministic stand-in for ``sparsespec.Engine`` (plumbing tests and dry runs only).

It honours the documented ``Engine.generate`` contract (``docs/CONTRACTS.md``): same arguments,
outputs with ``token_ids``, ``text`` and ``stats`` carrying the documented raw keys. It does no
maths: tokens are a hash of the prompt, so every method emits the same tokens as ``ar`` (lossless)
unless told otherwise, and times are synthetic (nothing sleeps), so runs are instant and
reproducible. Numbers it produces mean nothing about any real method.

Fault injection through ``method_options`` (used by the coordinator tests):

``{"diverge_at": i}``          flip output token ``i`` (a lossy method)
``{"accept": a}``             acceptance per drafted token (default 0.5)
``{"die_once_marker": path}`` kill the worker process (``os._exit``) unless ``path`` exists;
                              create it first, so the retry succeeds
``{"die_always": True}``      kill the worker process on every call
``{"raise": "message"}``      raise RuntimeError(message) (an application error, not a death)

The same deaths can be injected through the constructor (``die_on_token``, ``die_marker``), which
does not change the run id (engine factories are not part of a run's identity)::

    functools.partial(FakeEngine, die_on_token=999)                    # dies on every prompt holding 999
    functools.partial(FakeEngine, die_on_token=999, die_marker=path)   # ... only the first time
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FAKE_METHODS = ("ar", "sparsespec-l")


@dataclass
class FakeOutput:
    token_ids: list[int]
    text: str
    stats: dict[str, Any] = field(default_factory=dict)


class FakeEngine:
    """Deterministic engine double: ``generate`` returns token ids derived from the prompt."""

    max_context = 8192

    def __init__(self, model: str = "fake", dtype: str = "float32", *, vocab_size: int = 997,
                 ar_step_s: float = 0.02, verify_step_s: float = 0.022, draft_step_s: float = 0.004,
                 eos_token_id: int | None = None, die_on_token: int | None = None,
                 die_marker: str | os.PathLike[str] | None = None) -> None:
        self.model = model
        self.dtype = dtype
        self.vocab_size = vocab_size
        self.ar_step_s = ar_step_s
        self.verify_step_s = verify_step_s
        self.draft_step_s = draft_step_s
        self.eos_token_id = eos_token_id
        self.die_on_token = die_on_token
        self.die_marker = die_marker
        self.calls: list[dict[str, Any]] = []

    @classmethod
    def from_pretrained(cls, model: str, dtype: str = "float32", **kwargs: Any) -> FakeEngine:
        return cls(model, dtype, **kwargs)

    # ------------------------------------------------------------------ API
    def generate(self, prompts: list[list[int]] | list[str], method: str = "ar",
                 method_options: dict[str, Any] | None = None, max_new_tokens: int = 64,
                 temperature: float = 0.0, stop: list[str] | None = None, stop_token_ids: list[int] | None = None,
                 min_new_tokens: int = 0) -> list[FakeOutput]:
        opts = dict(method_options or {})
        self.calls.append({"method": method, "method_options": opts, "max_new_tokens": max_new_tokens,
                           "temperature": temperature, "num_prompts": len(prompts), "stop": stop,
                           "stop_token_ids": stop_token_ids, "min_new_tokens": min_new_tokens})
        if self.die_on_token is not None and any(
                not isinstance(p, str) and self.die_on_token in p for p in prompts):
            self._maybe_fail({"die_once_marker": self.die_marker} if self.die_marker else {"die_always": True})
        self._maybe_fail(opts)
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        outs = []
        for prompt in prompts:
            ids = [ord(c) for c in prompt] if isinstance(prompt, str) else [int(t) for t in prompt]
            tokens = self._tokens(ids, max_new_tokens)
            d = opts.get("diverge_at")
            if d is not None and method != "ar" and 0 <= int(d) < len(tokens):
                tokens[int(d)] = (tokens[int(d)] + 1) % self.vocab_size
            outs.append(FakeOutput(tokens, self.decode(tokens), self._stats(method, opts, len(ids), len(tokens))))
        return outs

    def decode(self, token_ids: list[int]) -> str:
        return " ".join(f"t{t}" for t in token_ids)

    # ------------------------------------------------------------ internals
    @staticmethod
    def _maybe_fail(opts: dict[str, Any]) -> None:
        marker = opts.get("die_once_marker")
        if marker is not None:
            p = Path(marker)
            if not p.exists():
                p.write_text(f"killed pid {os.getpid()}\n")
                os._exit(17)
        if opts.get("die_always"):
            os._exit(17)
        if opts.get("raise"):
            raise RuntimeError(str(opts["raise"]))

    def _tokens(self, ids: list[int], n: int) -> list[int]:
        h = 0
        for t in ids:
            h = (h * 1_000_003 + t + 1) % 2_147_483_647
        out = []
        for i in range(n):
            h = (h * 48_271 + 11 + i) % 2_147_483_647
            tok = h % self.vocab_size
            if self.eos_token_id is not None and tok == self.eos_token_id:
                tok = (tok + 1) % self.vocab_size
            out.append(tok)
        return out

    def _stats(self, method: str, opts: dict[str, Any], num_prompt: int, num_out: int) -> dict[str, Any]:
        prefill_s = 1e-4 * num_prompt
        remaining = num_out - 1  # the first token comes from prefill
        if method == "ar":
            steps = remaining
            decode_s = steps * self.ar_step_s
            st = dict(k=0, num_steps=steps, num_emitted=steps, num_drafted=0, num_accepted=0,
                      num_draft_forwards=0, accept_hist={}, draft_s=0.0, verify_s=decode_s,
                      other_s=0.0, budget_tokens_sum=0, context_tokens_sum=0, budget_frac=0.0)
        else:
            k = int(opts.get("k", 4))
            acc = min(k, max(0, round(float(opts.get("accept", 0.5)) * k)))
            steps = drafted = accepted = emitted = 0
            hist: dict[str, int] = {}
            while emitted < remaining:
                steps += 1
                drafted += k
                a = min(acc, remaining - emitted - 1)
                accepted += a
                emitted += a + 1
                key = f"{k}:{a}"
                hist[key] = hist.get(key, 0) + 1
            draft_s = drafted * self.draft_step_s
            verify_s = steps * self.verify_step_s
            decode_s = draft_s + verify_s
            ctx = steps * (num_prompt + num_out)
            st = dict(k=k, num_steps=steps, num_emitted=emitted, num_drafted=drafted, num_accepted=accepted,
                      num_draft_forwards=drafted, accept_hist=hist, draft_s=draft_s, verify_s=verify_s,
                      other_s=0.0, budget_tokens_sum=ctx // 10, context_tokens_sum=ctx,
                      budget_frac=(ctx // 10) / ctx if ctx else 0.0)
        st.update(method=method, num_prompt_tokens=num_prompt, num_output_tokens=num_out,
                  prefill_s=prefill_s, decode_s=decode_s, total_s=prefill_s + decode_s,
                  itl_p50_s=self.ar_step_s, itl_p95_s=self.ar_step_s, itl_p99_s=self.ar_step_s,
                  kv_bytes=num_prompt * 1024, peak_mem_bytes=num_prompt * 4096)
        return st


def fake_engine_factory(model: str, dtype: str) -> FakeEngine:
    """Engine factory for ``run_benchmark(engine_factory=...)`` / ``EngineWorker``."""
    return FakeEngine.from_pretrained(model, dtype=dtype)

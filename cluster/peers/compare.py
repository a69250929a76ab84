"""Our engine beside external engines, on the same prompts, model, dtype and threads, timed alike.

For every cell (context length, batch size) and every engine's plain decoding (``ar``) and prompt
lookup (``ngram``; transformers: ``prompt_lookup_num_tokens``, batch 1 only; vLLM: its ``ngram``
speculative config):

* decode milliseconds per step from each engine's own token times, so no prefill enters it: every
  engine reports, per row, when it committed each group of tokens (ours: ``Engine.stream``'s events;
  transformers: a streamer's ``put`` calls; vLLM: each request's ``first_token_ts`` and
  ``last_token_ts``). Decode runs from the moment every row has its first emission to the last
  emission of any row, over the output positions after the first emission (:func:`decode_span`);
  the best of ``reps`` generates, after one untimed warm-up per engine and method (vLLM: per
  cell, which also fills its prefix cache). For plain decoding this is vLLM's
  TPOT; for a speculative method it is the time per output token;
* the greedy tokens, compared with our ``ar``'s on the first ``N - 1`` (end-of-sequence masked as
  ``min_new_tokens`` / ``min_tokens`` do, so every engine generates the same length);
* where an engine cannot run a cell, a row that says why, in one line.

Rows (``kind="peer"``) go into ``cluster.speed.measure``'s result and store, keyed by
``method = "<engine>:<method>"`` (``sparsespec:ar``, ``transformers:prompt-lookup``, ``vllm:ngram``).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from cluster.peers.engine import kv_cache_gib

#: the external engines this module can time (``--peers``)
PEERS = ("transformers", "vllm")

#: one row's emissions: ``(seconds since the generate call began, tokens committed then)``, in order
Emissions = Sequence[tuple[float, int]]


def decode_span(emissions: Sequence[Emissions]) -> dict[str, Any]:
    """Decode time of one batched generate from its rows' emission times.

    Args:
        emissions: per row, ``(t_s, tokens)`` pairs in time order, ``t_s`` in seconds since the
            generate call began (an engine that only knows a row's first and last token times gives
            two pairs: ``(t_first, 1), (t_last, n - 1)``).

    Returns:
        ``decode_ms_per_step``: ``(max_r t_last_r - max_r t_first_r) / positions * 1e3``, where
        ``positions`` = the most tokens any row committed after its first emission (``None``, with a
        ``note``, when that is 0: nothing was decoded); ``ttft_s``: ``max_r t_first_r`` (the batch's
        prefill, queueing included); ``first_emit_spread_s``: ``max_r t_first_r - min_r t_first_r``
        (0 when every row was prefilled in one step; otherwise early rows decoded while later ones
        were still prefilling, and the decode window starts at the last).

    Raises:
        ValueError: no rows, a row with no emission, a non-positive token count or times that go back.
    """
    if not emissions:
        raise ValueError("decode_span needs at least one row")
    for i, row in enumerate(emissions):
        if not row:
            raise ValueError(f"row {i} has no emission")
        if any(n < 1 for _, n in row) or any(b[0] < a[0] for a, b in zip(row, row[1:])):
            raise ValueError(f"row {i}: token counts must be >= 1 and times must not go back: {list(row)[:4]}")
    firsts = [row[0][0] for row in emissions]
    start, end = max(firsts), max(row[-1][0] for row in emissions)
    positions = max(sum(n for _, n in row[1:]) for row in emissions)
    out: dict[str, Any] = {"ttft_s": start, "first_emit_spread_s": start - min(firsts), "positions": positions}
    if positions < 1 or end <= start:
        out["decode_ms_per_step"] = None
        out["note"] = "no decode step after the first emission"
    else:
        out["decode_ms_per_step"] = (end - start) / positions * 1e3
    return out


def best_span(spans: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The best of several reps' :func:`decode_span` results: the one with the smallest
    ``decode_ms_per_step`` (the first when none has one), with the smallest ``ttft_s`` of all."""
    if not spans:
        raise ValueError("best_span needs at least one rep")
    timed = [s for s in spans if s["decode_ms_per_step"] is not None]
    best = dict(min(timed, key=lambda s: s["decode_ms_per_step"]) if timed else spans[0])
    best["ttft_s"] = min(s["ttft_s"] for s in spans)
    return best


def decode_timing(run: Callable[[int], tuple[list[list[int]], list[Emissions]]], n: int,
                  reps: int, warmup: bool = True) -> dict[str, Any]:
    """``run(n)`` generates ``n`` tokens for the cell's batch and returns ``(token_ids, emissions)``
    (see :func:`decode_span`); one untimed warm-up (``warmup``; the callers warm each engine and
    method up on its first cell only: a warm-up re-prefills the whole batch, minutes at 8K on CPU,
    and no prefill enters the decode span), then ``reps`` generates. Returns the best rep's
    ``decode_span`` (smallest ``decode_ms_per_step``) with ``reps`` and the token ids of the first
    timed generate; ``deterministic`` says whether every timed generate gave the same tokens."""
    if n < 2 or reps < 1:
        raise ValueError("decode timing needs n >= 2 tokens and reps >= 1")
    if warmup:
        run(n)  # one-off allocation and setup are not timed
    spans, token_sets = [], []
    for _ in range(reps):
        tokens, emissions = run(n)
        token_sets.append(tokens)
        spans.append(decode_span(emissions))
    best = best_span(spans)
    best.update(reps=reps, token_ids=token_sets[0], deterministic=all(t == token_sets[0] for t in token_sets))
    return best


def _row(engine: str, method: str, L: int, B: int, **kw: Any) -> dict[str, Any]:
    return {"kind": "peer", "engine": engine, "method": f"{engine}:{method}", "context_len": L, "batch_size": B, **kw}


def ours(engine, cells: Mapping[tuple[int, int], list[list[int]]], n: int, reps: int, k: int) -> list[dict[str, Any]]:
    """Our ``ar`` and ``ngram`` (``k`` drafts) on every cell ``(L, B) -> prompts``, timed from
    ``Engine.stream``'s events (the time each row's tokens were committed)."""
    rows, first = [], next(iter(cells))
    for (L, B), prompts in cells.items():
        for method, opts in (("ar", None), ("ngram", {"k": k})):
            def run(m, method=method, opts=opts, prompts=prompts):
                tokens: list[list[int]] = [[] for _ in prompts]
                emissions: list[list[tuple[float, int]]] = [[] for _ in prompts]
                t0 = time.perf_counter()
                for ev in engine.stream(prompts, method=method, method_options=opts, max_new_tokens=m,
                                        min_new_tokens=m - 1):
                    if ev.token_ids:
                        emissions[ev.row].append((time.perf_counter() - t0, len(ev.token_ids)))
                        tokens[ev.row].extend(ev.token_ids)
                return tokens, emissions

            rows.append(_row("sparsespec", method, L, B, **decode_timing(run, n, reps, warmup=(L, B) == first)))
    return rows


class _ClockStreamer:
    """A transformers streamer (``BaseStreamer``'s ``put`` / ``end``) that records when each
    group of tokens arrives: ``generate`` puts the prompt first, then ``[B]`` tokens per greedy
    step, or ``[1, n]`` accepted tokens per assisted (prompt lookup) round."""

    def __init__(self, batch: int):
        self.t0 = time.perf_counter()
        self.prompt_seen = False
        self.emissions: list[list[tuple[float, int]]] = [[] for _ in range(batch)]

    def put(self, value) -> None:
        now = time.perf_counter() - self.t0
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        count = int(value.shape[-1]) if value.dim() == 2 else 1
        rows = range(len(self.emissions)) if value.dim() == 1 else range(int(value.shape[0]))
        for r in rows:
            self.emissions[r].append((now, count))

    def end(self) -> None:
        pass


def transformers_peer(folder, dtype: str, cells: Mapping[tuple[int, int], list[list[int]]], n: int, reps: int,
                      k: int) -> list[dict[str, Any]]:
    """transformers' ``generate`` (greedy, SDPA) and its prompt lookup (batch 1 only) on every cell."""
    import torch
    from transformers import AutoModelForCausalLM

    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    try:
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dt, attn_implementation="sdpa").eval()
    except Exception as e:  # noqa: BLE001 - a peer that cannot load is a row, not a failed bench
        return [_row("transformers", m, L, B, error=f"cannot load: {str(e).splitlines()[0][:200]}")
                for (L, B) in cells for m in ("ar", "prompt-lookup")]
    rows, first = [], next(iter(cells))
    for (L, B), prompts in cells.items():
        ids = torch.tensor(prompts)  # equal lengths (the speed benchmark's windows): no padding
        for method, extra in (("ar", {}), ("prompt-lookup", {"prompt_lookup_num_tokens": k})):
            if extra and B > 1:
                rows.append(_row("transformers", method, L, B,
                                 error="transformers' prompt lookup decoding runs batch size 1 only"))
                continue

            def run(m, ids=ids, extra=extra):
                clock = _ClockStreamer(ids.shape[0])
                with torch.inference_mode():
                    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=m, min_new_tokens=m,
                                      do_sample=False, pad_token_id=hf.generation_config.eos_token_id,
                                      streamer=clock, **extra)
                return out[:, ids.shape[1]:].tolist(), clock.emissions

            rows.append(_row("transformers", method, L, B, **decode_timing(run, n, reps, warmup=(L, B) == first)))
    return rows


def vllm_peer(folder, dtype: str, threads: int, cells: Mapping[tuple[int, int], list[list[int]]], n: int, reps: int,
              k: int, timeout_s: float = 3600.0) -> list[dict[str, Any]]:
    """vLLM's CPU build (``make peers``), one engine per method for every cell (its startup is
    ~100 s), through ``cluster.peers.run_vllm``; error rows when it cannot run."""
    from cluster.peers import run_vllm

    rows = []
    max_len = max(len(p[0]) for p in cells.values()) + n + 8
    # vLLM's engine core schedules a request as soon as it arrives, so a batch's rows may get their
    # first tokens a step apart (decode_span starts at the last one). Prefix caching keeps the reps'
    # prefills short (the warm-up caches every prompt): vLLM's ttft_s here is not a cold prefill.
    batched = max(max_len, *(sum(len(x) for x in p) for p in cells.values()))
    try:
        kv_gib = kv_cache_gib(folder, dtype, max(sum(len(x) + n for x in p) for p in cells.values()))
    except (OSError, ValueError) as e:
        return [_row("vllm", m, L, B, error=f"cannot size vLLM's KV cache: {e}"[:300])
                for m in ("ar", "ngram") for (L, B) in cells]
    for method in ("ar", "ngram"):
        req = {"model": str(folder), "dtype": dtype, "threads": threads, "method": method, "k": k,
               "prompt_lookup_min": 1, "prompt_lookup_max": 4, "reps": reps, "warmup": 1, "max_model_len": max_len,
               "prefix_caching": True, "kv_cache_gib": kv_gib, "engine_kwargs": {"max_num_batched_tokens": batched},
               "max_tokens": n, "cases": [{"label": f"{L}/{B}", "prompts": p} for (L, B), p in cells.items()]}
        res = run_vllm(req, timeout_s)
        if "error" in res:
            rows += [_row("vllm", method, L, B, error=res["error"]) for (L, B) in cells]
            continue
        by_label = {c["label"]: c for c in res.get("cases", [])}
        for (L, B) in cells:
            c = by_label.get(f"{L}/{B}")
            if c is None or "error" in c:
                rows.append(_row("vllm", method, L, B, error=(c or {}).get("error", "no result for this cell")))
                continue
            try:
                spans = [decode_span(r["emissions"]) for r in c["reps"]]
            except (KeyError, TypeError, ValueError) as e:
                rows.append(_row("vllm", method, L, B, error=f"malformed timings from the vllm runner: {e}"))
                continue
            rows.append(_row("vllm", method, L, B, **best_span(spans), reps=len(spans), token_ids=c["token_ids"],
                             deterministic=c.get("deterministic"), startup_s=res.get("startup_s"),
                             vllm_version=res.get("vllm_version"),
                             notes=["prefix caching on: ttft_s is a cached prefill", *(c.get("notes") or [])],
                             spec_decode=c.get("spec_decode")))
    return rows


def compare_tokens(rows: Sequence[dict[str, Any]], n: int) -> None:
    """Add ``same_tokens_as_ours`` (every row's first ``n - 1`` greedy tokens against our ``ar``'s
    in the same cell) and ``over_ours_ar`` (the row's ms per step / our ``ar``'s: > 1 means slower
    than our AR) to each row, in place; token ids are then dropped."""
    ref = {(r["context_len"], r["batch_size"]): r for r in rows if r["method"] == "sparsespec:ar" and "token_ids" in r}
    for r in rows:
        mine = ref.get((r["context_len"], r["batch_size"]))
        toks = r.get("token_ids")
        if mine is not None and toks is not None:
            r["same_tokens_as_ours"] = all(a[: n - 1] == b[: n - 1] for a, b in zip(toks, mine["token_ids"]))
            if r.get("decode_ms_per_step") and mine.get("decode_ms_per_step"):
                r["over_ours_ar"] = r["decode_ms_per_step"] / mine["decode_ms_per_step"]
    for r in rows:
        r.pop("token_ids", None)

"""Our engine beside external engines, on the same prompts, model, dtype and threads, timed alike.

For every cell (context length, batch size) and every engine's plain decoding (``ar``) and prompt
lookup (``ngram``; transformers: ``prompt_lookup_num_tokens``, batch 1 only; vLLM: its ``ngram``
speculative config):

* decode milliseconds per step = ``(wall(N tokens) - wall(1 token)) / (N - 1)``, each wall the
  whole batch's generate on the same prompts, ``N`` and ``1`` interleaved, the best of ``reps``
  (the prefill cancels out; the same rule for every engine, so their numbers are comparable);
* the greedy tokens, compared with our ``ar``'s on the first ``N - 1`` (end-of-sequence masked as
  ``min_new_tokens`` / ``min_tokens`` do, so every engine generates the same length);
* where an engine cannot run a cell, a row that says why, in one line.

Rows (``kind="peer"``) go into ``cluster.bench``'s result and store, keyed by
``method = "<engine>:<method>"`` (``sparsespec:ar``, ``transformers:prompt-lookup``, ``vllm:ngram``).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

#: the external engines this module can time (``--peers``)
PEERS = ("transformers", "vllm")


def decode_timing(run: Callable[[int], list[list[int]]], n: int, reps: int) -> dict[str, Any]:
    """``run(tokens)`` generates ``tokens`` tokens for the cell's batch and returns the token ids;
    ``{"decode_ms_per_step", "ttft_s", "token_ids"}`` from interleaved best-of-``reps`` walls."""
    if n < 2 or reps < 1:
        raise ValueError("decode timing needs n >= 2 tokens and reps >= 1")
    best = {1: float("inf"), n: float("inf")}
    tokens = None
    run(n)  # warm-up: one-off allocation and setup are not timed
    for rep in range(reps):
        for m in ((1, n) if rep % 2 == 0 else (n, 1)):
            t0 = time.perf_counter()
            out = run(m)
            best[m] = min(best[m], time.perf_counter() - t0)
            if m == n:
                tokens = out
    out = {"decode_ms_per_step": (best[n] - best[1]) / (n - 1) * 1e3, "ttft_s": best[1], "token_ids": tokens}
    if best[n] <= best[1]:  # the prefill's noise exceeded the decode time: no number, a reason
        out["decode_ms_per_step"] = None
        out["note"] = (f"the {n}-token wall ({best[n]:.3f} s) did not exceed the 1-token wall ({best[1]:.3f} s): "
                       "prefill noise; raise --peer-tokens or --peer-reps")
    return out


def _row(engine: str, method: str, L: int, B: int, **kw: Any) -> dict[str, Any]:
    return {"kind": "peer", "engine": engine, "method": f"{engine}:{method}", "context_len": L, "batch_size": B, **kw}


def ours(engine, cells: Mapping[tuple[int, int], list[list[int]]], n: int, reps: int, k: int) -> list[dict[str, Any]]:
    """Our ``ar`` and ``ngram`` (``k`` drafts) on every cell ``(L, B) -> prompts``."""
    rows = []
    for (L, B), prompts in cells.items():
        for method, opts in (("ar", None), ("ngram", {"k": k})):
            def run(m, method=method, opts=opts, prompts=prompts):
                outs = engine.generate(prompts, method=method, method_options=opts, max_new_tokens=m,
                                       min_new_tokens=m - 1)
                return [list(o.token_ids) for o in outs]

            rows.append(_row("sparsespec", method, L, B, **decode_timing(run, n, reps)))
    return rows


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
    rows = []
    for (L, B), prompts in cells.items():
        ids = torch.tensor(prompts)  # equal lengths (the speed benchmark's windows): no padding
        for method, extra in (("ar", {}), ("prompt-lookup", {"prompt_lookup_num_tokens": k})):
            if extra and B > 1:
                rows.append(_row("transformers", method, L, B,
                                 error="transformers' prompt lookup decoding runs batch size 1 only"))
                continue

            def run(m, ids=ids, extra=extra):
                with torch.inference_mode():
                    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=m, min_new_tokens=m,
                                      do_sample=False, pad_token_id=hf.generation_config.eos_token_id, **extra)
                return out[:, ids.shape[1]:].tolist()

            rows.append(_row("transformers", method, L, B, **decode_timing(run, n, reps)))
    return rows


def vllm_peer(folder, dtype: str, threads: int, cells: Mapping[tuple[int, int], list[list[int]]], n: int, reps: int,
              k: int, timeout_s: float = 3600.0) -> list[dict[str, Any]]:
    """vLLM's CPU build (``make peers``), one engine per method for every cell (its startup is
    ~100 s), through ``cluster.peers.run_vllm``; error rows when it cannot run."""
    from cluster.peers import run_vllm

    rows = []
    max_len = max(len(p[0]) for p in cells.values()) + n + 8
    for method in ("ar", "ngram"):
        req = {"model": str(folder), "dtype": dtype, "threads": threads, "method": method, "k": k,
               "prompt_lookup_min": 1, "prompt_lookup_max": 4, "reps": reps, "warmup": 1, "max_model_len": max_len,
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
            rows.append(_row("vllm", method, L, B, decode_ms_per_step=c["decode_ms_per_step"]["best"],
                             ttft_s=c["ttft_s"]["best"], token_ids=c["token_ids"], startup_s=res.get("startup_s"),
                             vllm_version=res.get("vllm_version"),
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

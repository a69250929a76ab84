"""Paired speed benchmark against the roofline: ``python -m cluster.bench``.

For one model (a preset, a local HF folder, or a random-weight model at a real shape), every
context length and batch size, it measures in one process, after warm-up:

* the machine: memory read bandwidth (a full-buffer reduction over a buffer far larger than the
  caches) and dense GEMM throughput, measured in this run, on this device, with these threads;
* steps (median of ``--reps`` timed calls each): prefill (batch 1), the AR decode step, the
  sparse draft step at the configured budget, the gather of the index into the compact draft KV,
  the verify step for K+1 tokens with and without importance recycling, and the index update
  (push of the committed attention rows + top-K rebuild) and the rebuild alone;
* the roofline of each step: ``bytes / bandwidth`` with bytes = weights read once + the KV the
  step must read (context for AR and verify, index + drafts for the draft step), and the compute
  floor ``flops / GEMM throughput``; each step is reported as a multiple of ``max`` of the two
  (``x_roofline``) and of the memory term alone (``x_mem``);
* end to end (unless ``--steps-only``), fixed-length generation (``ignore_eos``) with ``ar`` and
  every method on the same prompts, interleaved: decode tokens/s, the paired speedup vs ``ar``,
  alpha, tau, mean k, gamma, the ledger ``S = (alpha*k + 1) / (k*gamma + 1)`` from those measured
  numbers, and the prediction from the measured step times;
* ``transformers``' own ``generate`` on the same model and prompt (batch 1) as an outside AR
  reference: its per-token decode time (the gaps between successive logits-processor calls).

Results go to the ``bench`` table of the store (``--db``), to ``--json-out`` and to stdout as
Markdown tables (paste them into ``benchmarks/RESULTS.md`` with the date and command).

    python -m cluster.bench --model smollm2-135m --context-lengths 1024,2048,4096,8192 --batch-sizes 1,4,8
    python -m cluster.bench --shape llama-3.1-8b --random-weights --device cuda --dtype bfloat16 \\
        --context-lengths 16384,32768,65536 --batch-sizes 1 --steps-only --json-out gpu.json

``--ray`` runs each context length as a task on a Ray worker (one GPU each on a GPU cluster),
the way the benchmark scripts fan their shards out.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import logging
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("cluster.bench")

AR = "ar"
DEFAULT_BOOK = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "public_domain_books" / "2701-0.txt"


# --------------------------------------------------------------------------- configuration
@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What to measure. ``k``: draft length of the step timings and (unless ``method_k`` is
    ``"auto"``) of the end-to-end runs; ``budget_frac`` etc. go to every sparse method."""

    model: str = "smollm2-135m"
    shape: str | None = None
    random_weights: bool = False
    device: str = "cpu"
    dtype: str = "float32"
    context_lengths: tuple[int, ...] = (1024, 2048, 4096, 8192)
    batch_sizes: tuple[int, ...] = (1, 4, 8)
    methods: tuple[str, ...] = ("sparsespec-l",)
    k: int = 8
    method_k: int | str = 8
    budget_frac: float = 0.1
    gen_tokens: int = 64
    reps: int = 5
    e2e_reps: int = 2
    warmup: int = 2
    steps_only: bool = False
    hf: bool = True
    hf_tokens: int = 32
    seed: int = 0
    text: str | None = None
    #: end-to-end runs only where batch x context <= this (each call prefills every row; on a CPU
    #: a 8 x 8K prefill alone takes minutes); None = everywhere
    e2e_max_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.random_weights and not self.shape:
            raise ValueError("--random-weights needs --shape (e.g. llama-3.1-8b)")
        if not self.context_lengths or min(self.context_lengths) < 64:
            raise ValueError(f"context lengths must be >= 64, got {self.context_lengths}")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"batch sizes must be >= 1, got {self.batch_sizes}")
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")
        if not 0 < self.budget_frac <= 1:
            raise ValueError(f"budget_frac must be in (0, 1], got {self.budget_frac}")
        if self.reps < 1 or self.warmup < 0 or self.e2e_reps < 1 or self.gen_tokens < 2:
            raise ValueError("reps >= 1, e2e_reps >= 1, warmup >= 0, gen_tokens >= 2")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")


# --------------------------------------------------------------------------- timing helpers
def _sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_call(fn: Callable[[], Any], device, reps: int, warmup: int) -> float:
    """Median wall seconds of ``fn()`` over ``reps`` calls after ``warmup`` untimed ones
    (the device is synchronised before each clock read)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_machine(device: str, dtype, reps: int = 7) -> dict[str, float]:
    """Memory read bandwidth (bytes/s) and GEMM throughput (FLOP/s) on ``device``, now.

    Bandwidth: ``x.sum()`` over a float32 buffer of 1 GiB (CPU) or 4 GiB (GPU), the best of
    ``reps`` (a reduction reads every byte once; the buffer is far larger than any cache).
    GEMM: best of ``reps`` square matmuls in the model's dtype (n = 2048 CPU, 8192 GPU).
    """
    import torch

    cuda = torch.device(device).type == "cuda"
    nbytes = (4 << 30) if cuda else (1 << 30)
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    times = []
    for _ in range(reps + 1):
        _sync(device)
        t0 = time.perf_counter()
        x.sum()
        _sync(device)
        times.append(time.perf_counter() - t0)
    read_bw = nbytes / min(times[1:])
    del x
    n = 8192 if cuda else 2048
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    times = []
    for _ in range(reps + 1):
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        times.append(time.perf_counter() - t0)
    flops = 2 * n**3 / min(times[1:])
    return {"read_bytes_per_s": read_bw, "gemm_flops_per_s": flops}


# --------------------------------------------------------------------------- roofline
def weight_bytes(model) -> int:
    """Bytes every forward must read: all parameters once; an untied input embedding is only
    gathered (a few rows), so it is excluded; a tied one is read in full by the LM head."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.cfg.tie_word_embeddings:
        total -= model.embed.numel() * model.embed.element_size()
    return total


def kv_bytes(cfg, element_size: int, batch: int, positions: float) -> float:
    """Bytes of K and V for ``positions`` cached tokens per row, every layer and KV head."""
    return batch * cfg.num_layers * 2 * cfg.num_kv_heads * positions * cfg.head_dim * element_size


def step_flops(model, batch: int, tokens: int, keys: float) -> float:
    """Matmul FLOPs of one forward: ``tokens`` new tokens per row attending to ``keys`` keys."""
    cfg = model.cfg
    # every 2-D weight once (a tied LM head is the embedding, listed once), minus the input
    # embedding (a lookup), plus the LM head's matmul
    linear = sum(p.numel() for p in model.parameters() if p.dim() == 2) - model.embed.numel()
    if cfg.tie_word_embeddings:
        linear += model.lm_head.numel()
    attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * keys
    return 2.0 * batch * tokens * linear + batch * tokens * attn


def roofline(model, machine: dict[str, float], batch: int, tokens: int, kv_positions: float,
             attn_keys: float | None = None) -> dict[str, float]:
    """Memory and compute floors (seconds) of one step."""
    elt = model.embed.element_size()
    nbytes = weight_bytes(model) + kv_bytes(model.cfg, elt, batch, kv_positions)
    mem_s = nbytes / machine["read_bytes_per_s"]
    comp_s = step_flops(model, batch, tokens, kv_positions if attn_keys is None else attn_keys) / machine["gemm_flops_per_s"]
    return {"bytes": nbytes, "mem_s": mem_s, "compute_s": comp_s, "roofline_s": max(mem_s, comp_s)}


# --------------------------------------------------------------------------- model and prompts
def load_model(cfg: BenchConfig):
    """(Transformer, tokenizer or None, display name)."""
    import torch

    from sparsespec.engine import _DTYPES

    if cfg.dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {cfg.dtype!r}")
    if cfg.random_weights:
        from sparsespec.shapes import random_transformer

        model = random_transformer(cfg.shape, dtype=_DTYPES[cfg.dtype], device=cfg.device, seed=cfg.seed)
        return model, None, f"random:{cfg.shape}"
    from transformers import AutoTokenizer

    from sparsespec.model import Transformer
    from sparsespec.provision import resolve_model

    folder = resolve_model(cfg.model)
    model = Transformer.from_folder(folder, dtype=_DTYPES[cfg.dtype], device=cfg.device)
    torch.manual_seed(cfg.seed)
    return model, AutoTokenizer.from_pretrained(folder), cfg.model


def make_prompts(tokenizer, vocab_size: int, batch: int, length: int, text: str | None, seed: int) -> list[list[int]]:
    """``batch`` different prompts of exactly ``length`` tokens: consecutive windows of a real
    book (the default is a public-domain novel from the shared data) or, without a tokenizer,
    seeded random ids."""
    import torch

    if tokenizer is None:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(3, vocab_size, (batch, length), generator=g).tolist()
    path = Path(text) if text else DEFAULT_BOOK
    if not path.is_file():
        raise FileNotFoundError(f"prompt text {path} not found; pass --text FILE (any long plain-text file)")
    need = batch * length
    text = path.read_text(encoding="utf-8-sig")[: (need + 1000) * 8]  # ~4 chars/token: tokenise what is needed
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if len(ids) < need + 1000:
        reps = (need + 1000) // max(1, len(ids)) + 1
        ids = ids * reps
    start = 1000  # skip the Gutenberg header
    return [ids[start + b * length : start + (b + 1) * length] for b in range(batch)]


# --------------------------------------------------------------------------- step timings
def bench_steps(model, prompts: list[list[int]], cfg: BenchConfig, machine: dict[str, float],
                prefill_s: float | None) -> dict[str, Any]:
    """Time one step of each kind on a cache holding ``prompts`` (all the same length)."""
    import torch

    from sparsespec.adaptive import FixedK
    from sparsespec.config import SamplingParams, SpecConfig
    from sparsespec.drafters.sparse_self import SparseSelfDrafter
    from sparsespec.kv.cache import KVCache
    from sparsespec.sampling import BatchSampling

    dev = model.device
    B, P, K = len(prompts), len(prompts[0]), cfg.k
    spec = SpecConfig.from_options({"k": K, "budget_frac": cfg.budget_frac})
    capacity = P + K + 2
    cache = KVCache(model.cfg, B, capacity, model.dtype, dev)
    # Prefill row 0 only (its time is measured separately at batch 1) and copy it to the other
    # rows: the step timings depend on shapes, not on what the rows hold.
    view = cache.row(0)
    prompt = torch.tensor([prompts[0]], dtype=torch.long, device=dev)
    _, rows = model.prefill(prompt, view, want_rows=spec.window)  # rows [L, 1, H_kv, W, P]
    for b in range(1, B):
        cache.k[:, b].copy_(cache.k[:, 0])
        cache.v[:, b].copy_(cache.v[:, 0])
    cache.lengths = [P] * B
    drafter = SparseSelfDrafter(model, spec, capacity, B, K)
    for b in range(B):
        drafter.prefill_row(b, cache, rows, prompts[b])
    base = list(cache.lengths)
    tok1 = torch.full((B, 1), 42, dtype=torch.long, device=dev)
    tokv = torch.full((B, K + 1), 42, dtype=torch.long, device=dev)
    sp = SamplingParams(max_new_tokens=K + 2)
    sampling = BatchSampling([sp] * B, [None] * B)
    reps, warm = cfg.reps, cfg.warmup

    def ar_step():
        model.forward_dense(tok1, cache, logits_for="all")
        cache.rollback(base)

    def verify_plain():
        model.forward_dense(tokv, cache)
        cache.rollback(base)

    def verify_imp():
        model.forward_dense(tokv, cache, want_rows=K + 1)
        cache.rollback(base)

    _, vrows = model.forward_dense(tokv, cache, want_rows=K + 1)  # [L, B, H_kv, K+1, S]
    cache.rollback(base)
    counts = [K + 1] * B

    def index_update():  # what the engine's commit does after a verify: push rows + rebuild
        drafter.commit(cache, vrows, counts)

    def index_rebuild():
        drafter.commit(cache, None, counts)

    def gather():
        drafter.propose(cache, tok1, [0] * B, [FixedK(0)] * B, sampling)

    def draft_phase():
        drafter.propose(cache, tok1, [K] * B, [FixedK(K)] * B, sampling)

    t = {
        "ar_step_s": time_call(ar_step, dev, reps, warm),
        "verify_s": time_call(verify_plain, dev, reps, warm),
        "verify_importance_s": time_call(verify_imp, dev, reps, warm),
        "index_update_s": time_call(index_update, dev, reps, warm),
        "index_rebuild_s": time_call(index_rebuild, dev, reps, warm),
        "gather_s": time_call(gather, dev, reps, warm),
    }
    phase = time_call(draft_phase, dev, reps, warm)
    t["draft_step_s"] = max(0.0, phase - t["gather_s"]) / K
    n_index = max(drafter.index_sizes())
    out: dict[str, Any] = {"kind": "steps", "context_len": P, "batch_size": B, "k": K,
                           "budget_frac": cfg.budget_frac, "n_index": n_index, "prefill_s": prefill_s, **t}
    roofs = {
        "ar_step": roofline(model, machine, B, 1, P),
        "verify": roofline(model, machine, B, K + 1, P),
        "draft_step": roofline(model, machine, B, 1, n_index + K / 2),
    }
    for name, key in (("ar_step", "ar_step_s"), ("verify", "verify_importance_s"), ("draft_step", "draft_step_s")):
        r = roofs[name]
        out[f"{name}_roofline_s"] = r["roofline_s"]
        out[f"{name}_mem_roofline_s"] = r["mem_s"]
        out[f"{name}_bytes"] = r["bytes"]
        out[f"{name}_x_roofline"] = t[key] / r["roofline_s"]
        out[f"{name}_x_mem"] = t[key] / r["mem_s"]
    if prefill_s is not None:
        r = roofline(model, machine, 1, P, P, attn_keys=P / 2)
        out["prefill_roofline_s"] = r["roofline_s"]
        out["prefill_x_roofline"] = prefill_s / r["roofline_s"]
    out["importance_overhead"] = t["verify_importance_s"] / t["verify_s"] - 1.0
    out["index_update_frac_of_verify"] = t["index_update_s"] / t["verify_importance_s"]
    out["verify_over_ar"] = t["verify_importance_s"] / t["ar_step_s"]
    out["gamma"] = t["draft_step_s"] / t["verify_importance_s"]
    out["gamma_roofline"] = roofs["draft_step"]["roofline_s"] / roofs["verify"]["roofline_s"]
    out["gamma_over_roofline"] = out["gamma"] / out["gamma_roofline"]
    # Best case the roofline allows (alpha = 1): K+1 tokens per cycle of K drafts + 1 verify,
    # against K+1 AR steps, all at their floors.
    cycle_roof = K * roofs["draft_step"]["roofline_s"] + roofs["verify"]["roofline_s"]
    out["roofline_max_speedup"] = (K + 1) * roofs["ar_step"]["roofline_s"] / cycle_roof
    del cache, drafter, vrows, rows
    return out


def time_prefill(model, prompt: list[int], cfg: BenchConfig) -> float:
    """Seconds of one chunked prefill of ``prompt`` at batch 1 (after a short warm-up)."""
    import torch

    from sparsespec.kv.cache import KVCache

    dev = model.device
    warm = KVCache(model.cfg, 1, 600, model.dtype, dev)
    model.prefill(torch.tensor([prompt[:512]], device=dev), warm)
    del warm
    cache = KVCache(model.cfg, 1, len(prompt) + 1, model.dtype, dev)
    ids = torch.tensor([prompt], device=dev)
    _sync(dev)
    t0 = time.perf_counter()
    model.prefill(ids, cache)
    _sync(dev)
    return time.perf_counter() - t0


# --------------------------------------------------------------------------- end to end
def _pooled(outputs) -> dict[str, Any]:
    """Batch-level numbers of one ``generate`` call (rows decode together after the last prefill)."""
    from sparsespec.stats import derive, pool

    st = [o.stats for o in outputs]
    decode_s = max(s["total_s"] for s in st) - max(s["ttft_s"] for s in st)
    n_tok = sum(s["num_output_tokens"] - 1 for s in st)
    fwd = sum(s["num_draft_forwards"] for s in st)
    steps = sum(s["num_steps"] for s in st)
    ratios = derive(pool(st))  # pooled alpha, tau, mean k (every ratio comes from derive)
    # Every row takes part in every batch step (fixed length), so the per-round seconds are the
    # same for all rows: one row's stats give the batch's step times.
    s0 = max(st, key=lambda s: s["ttft_s"])
    return {
        "decode_s": decode_s,
        "decode_tokens_per_s": n_tok / decode_s if decode_s > 0 else None,
        "num_steps": s0["num_steps"],
        "alpha": ratios["alpha"],
        "tau": ratios["tau"],
        "mean_k": ratios["mean_k"],
        "draft_forward_s": s0["draft_s"] / s0["num_draft_forwards"] if s0["num_draft_forwards"] else None,
        "verify_step_s": s0["verify_s"] / s0["num_steps"] if s0["num_steps"] else None,
        "other_step_s": s0["other_s"] / s0["num_steps"] if s0["num_steps"] else None,
        "draft_forwards_per_step": fwd / steps if steps else 0.0,
        "token_ids": [o.token_ids for o in outputs],
    }


def bench_e2e(engine, prompts: list[list[int]], cfg: BenchConfig, steps: dict[str, Any]) -> list[dict[str, Any]]:
    """Fixed-length generation with ar and every method, interleaved ``e2e_reps`` times."""
    from sparsespec.stats import ledger_speedup

    methods = [AR, *[m for m in cfg.methods if m != AR]]
    opts = {"k": cfg.method_k, "budget_frac": cfg.budget_frac}
    per: dict[str, list[dict]] = {m: [] for m in methods}
    # warm-up: one short generation per method (allocator, first-call costs)
    for m in methods:
        engine.generate([p[-256:] for p in prompts], method=m, method_options=None if m == AR else opts,
                        max_new_tokens=4, ignore_eos=True)
    for _ in range(cfg.e2e_reps):
        for m in methods:
            outs = engine.generate(prompts, method=m, method_options=None if m == AR else opts,
                                   max_new_tokens=cfg.gen_tokens, ignore_eos=True)
            per[m].append(_pooled(outs))
    rows = []
    ar_runs = per[AR]
    for m in methods:
        runs = per[m]
        ratios = [a["decode_s"] / r["decode_s"] for a, r in zip(ar_runs, runs) if r["decode_s"] > 0]
        first = runs[0]
        row: dict[str, Any] = {
            "kind": "e2e", "method": m, "context_len": len(prompts[0]), "batch_size": len(prompts),
            "gen_tokens": cfg.gen_tokens, "k": cfg.method_k if m != AR else 0,
            "decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in runs),
            "speedup": statistics.median(ratios) if ratios else None,
            "speedup_runs": ratios,
            "first_row_token_ids": runs[0]["token_ids"][0],
        }
        if m != AR:
            alpha, mean_k = first["alpha"], first["mean_k"]
            gamma = (first["draft_forward_s"] / first["verify_step_s"]
                     if first["draft_forward_s"] is not None and first["verify_step_s"] else None)
            row.update(alpha=alpha, tau=first["tau"], mean_k=mean_k, gamma=gamma,
                       lossless=all(r["token_ids"] == a["token_ids"] for r, a in zip(runs, ar_runs)))
            if alpha is not None and mean_k and gamma is not None:
                row["ledger_speedup"] = ledger_speedup(alpha, mean_k, gamma)
            # Prediction from this run's step times instead of the ledger's assumptions
            # (verify step == AR step, nothing else per step): tau tokens per cycle of
            # draft + verify + everything else, against tau AR steps.
            ar_step = ar_runs[0]["decode_s"] / max(1, ar_runs[0]["num_steps"])
            cyc = (first["draft_forward_s"] or 0.0) * first["draft_forwards_per_step"] + first["verify_step_s"] + \
                (first["other_step_s"] or 0.0)
            row["cycle_predicted_speedup"] = first["tau"] * ar_step / cyc if cyc else None
            row["verify_over_ar_e2e"] = first["verify_step_s"] / ar_step if ar_step else None
            if steps:
                g_roof = steps["gamma_roofline"]
                if alpha is not None and mean_k:
                    # what the roofline allows at this acceptance: drafts and verify at their
                    # floors, tokens per cycle from the measured acceptance
                    cyc_roof = mean_k * steps["draft_step_roofline_s"] + steps["verify_roofline_s"]
                    row["roofline_speedup"] = first["tau"] * steps["ar_step_roofline_s"] / cyc_roof
                    row["ledger_speedup_roofline_gamma"] = ledger_speedup(alpha, mean_k, g_roof)
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- transformers reference
def bench_hf(folder: Path, prompt: list[int], cfg: BenchConfig) -> dict[str, Any]:
    """``transformers`` ``generate`` (greedy, SDPA attention, same dtype) on one prompt: per-token
    decode time = median gap between successive logits-processor calls (the first call follows
    the prefill)."""
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    from sparsespec.engine import _DTYPES

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=_DTYPES[cfg.dtype], attn_implementation="sdpa").to(cfg.device)
    hf.eval()
    stamps: list[float] = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            _sync(cfg.device)
            stamps.append(time.perf_counter())
            return scores

    ids = torch.tensor([prompt], device=cfg.device)
    with torch.inference_mode():
        hf.generate(ids[:, -256:], max_new_tokens=4, min_new_tokens=4, do_sample=False)  # warm-up
        stamps.clear()
        t0 = time.perf_counter()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=cfg.hf_tokens,
                          min_new_tokens=cfg.hf_tokens, do_sample=False, logits_processor=LogitsProcessorList([Stamp()]))
        total = time.perf_counter() - t0
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    res = {
        "kind": "hf", "method": "transformers-generate", "context_len": len(prompt), "batch_size": 1,
        "gen_tokens": cfg.hf_tokens, "hf_step_s": statistics.median(gaps) if gaps else None,
        "hf_ttft_s": stamps[0] - t0 if stamps else None, "hf_total_s": total,
        "hf_token_ids": out[0, len(prompt):].tolist(),
    }
    del hf
    return res


# --------------------------------------------------------------------------- driver
def run_bench(cfg: BenchConfig, *, progress: Callable[[str], None] = log.info) -> dict[str, Any]:
    """Run every measurement of ``cfg``; returns ``{"meta", "machine", "rows"}``."""
    import torch

    from sparsespec.engine import _DTYPES, Engine

    model, tokenizer, name = load_model(cfg)
    window = model.cfg.max_position_embeddings
    too_long = [P for P in cfg.context_lengths if P + cfg.gen_tokens + cfg.k + 2 > window]
    if too_long:  # checked before measuring anything
        raise ValueError(f"context(s) {too_long} + {cfg.gen_tokens} generated + {cfg.k + 2} draft tokens exceed "
                         f"the model's window ({window}); the longest that fits is {window - cfg.gen_tokens - cfg.k - 2}")
    dtype = _DTYPES[cfg.dtype]
    machine = measure_machine(cfg.device, dtype)
    progress(f"machine: read {machine['read_bytes_per_s'] / 1e9:.1f} GB/s, "
             f"GEMM {machine['gemm_flops_per_s'] / 1e9:.0f} GFLOP/s ({cfg.dtype})")
    rows: list[dict[str, Any]] = []
    engine = None
    if not cfg.steps_only:  # random weights: token-id prompts (acceptance on random weights means nothing)
        from sparsespec.shapes import IdTokenizer

        engine = Engine(model, tokenizer if tokenizer is not None else IdTokenizer(), name=name)
    for P in cfg.context_lengths:
        base_prompts = make_prompts(tokenizer, model.cfg.vocab_size, max(cfg.batch_sizes), P, cfg.text, cfg.seed)
        prefill_s = time_prefill(model, base_prompts[0], cfg)
        progress(f"ctx {P}: prefill {prefill_s:.2f} s")
        hf_row = None
        if cfg.hf and tokenizer is not None and not cfg.random_weights and 1 in cfg.batch_sizes:
            hf_row = bench_hf(model.source_folder, base_prompts[0], cfg)
            rows.append(hf_row)
            progress(f"ctx {P}: transformers generate {hf_row['hf_step_s'] * 1e3:.1f} ms/token")
        for B in cfg.batch_sizes:
            prompts = base_prompts[:B]
            steps = bench_steps(model, prompts, cfg, machine, prefill_s if B == 1 else None)
            if hf_row is not None and B == 1:
                steps["hf_step_s"] = hf_row["hf_step_s"]
                steps["hf_over_ar_step"] = hf_row["hf_step_s"] / steps["ar_step_s"]
            rows.append(steps)
            progress(f"ctx {P} B {B}: AR {steps['ar_step_s'] * 1e3:.1f} ms ({steps['ar_step_x_roofline']:.2f}x roofline), "
                     f"verify {steps['verify_importance_s'] * 1e3:.1f} ms, draft {steps['draft_step_s'] * 1e3:.1f} ms, "
                     f"gamma {steps['gamma']:.3f} (roofline {steps['gamma_roofline']:.3f})")
            if engine is not None and (cfg.e2e_max_tokens is None or B * P <= cfg.e2e_max_tokens):
                e2e = bench_e2e(engine, prompts, cfg, steps)
                if hf_row is not None and B == 1:
                    ar = next(r for r in e2e if r["method"] == AR)
                    ar["hf_step_s"] = hf_row["hf_step_s"]
                    ar["hf_over_ar_tpot"] = hf_row["hf_step_s"] * ar["decode_tokens_per_s"]
                    n = min(len(hf_row["hf_token_ids"]), len(ar["first_row_token_ids"]))
                    ar["hf_same_tokens"] = hf_row["hf_token_ids"][:n] == ar["first_row_token_ids"][:n]
                rows.extend(e2e)
                for r in e2e:
                    progress(f"ctx {P} B {B} {r['method']}: {r['decode_tokens_per_s']:.1f} tok/s, "
                             f"speedup {r['speedup']:.3f}")
            if torch.device(cfg.device).type == "cuda":
                torch.cuda.empty_cache()
    meta = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "model": name,
        "config": dataclasses.asdict(cfg),
        "host": platform.node(),
        "machine_desc": _machine_desc(cfg.device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    return {"meta": meta, "machine": machine, "rows": rows}


def _bench_task(cfg_fields: dict[str, Any], threads: int | None) -> dict[str, Any]:
    """One context length in a Ray worker (``run_bench_ray``): its own machine measurement."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    res = run_bench(BenchConfig(**cfg_fields), progress=log.info)
    for r in res["rows"]:  # each worker measured its own device: keep it with its rows
        r["machine"] = dict(res["machine"], desc=res["meta"]["machine_desc"], host=res["meta"]["host"])
    return res


def run_bench_ray(cfg: BenchConfig, *, ray_address: str | None = None, num_workers: int | None = None,
                  threads: int | None = None) -> dict[str, Any]:
    """``run_bench`` fanned out over Ray: one task per context length, each on one worker (one
    GPU when the cluster has GPUs, all of a node's CPUs otherwise, so CPU timings never share
    cores); rows are merged in context order. Failed tasks are retried once."""
    import ray

    from cluster.coordinator import plan_workers, ray_session

    with ray_session(ray_address):
        plan = plan_workers(num_workers, threads)
        task = ray.remote(_bench_task).options(num_gpus=plan.num_gpus, num_cpus=plan.num_cpus, max_retries=1)
        refs = [task.remote({**dataclasses.asdict(cfg), "context_lengths": (P,)}, plan.threads)
                for P in cfg.context_lengths]
        parts = ray.get(refs)
    merged = dict(parts[0])
    merged["meta"] = dict(parts[0]["meta"], config=dataclasses.asdict(cfg), ray_workers=plan.num_workers)
    merged["rows"] = [r for part in parts for r in part["rows"]]
    return merged


def _machine_desc(device: str) -> str:
    import os

    import torch

    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(0)
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} logical CPUs"


# --------------------------------------------------------------------------- output
def _f(v: Any, fmt: str = ".3f") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return format(v, fmt)
    return str(v)


def markdown(result: dict[str, Any]) -> str:
    """The report as Markdown tables (steps, end to end)."""
    m = result["machine"]
    meta = result["meta"]
    lines = [
        f"{meta['date']} · {meta['machine_desc']} · torch {meta['torch']} · {meta['threads']} threads · "
        f"model {meta['model']} ({meta['config']['dtype']})",
        f"measured read bandwidth {m['read_bytes_per_s'] / 1e9:.1f} GB/s, GEMM {m['gemm_flops_per_s'] / 1e9:.0f} GFLOP/s",
        "",
        "| ctx | B | N | prefill s | AR ms (x roof) | verify K+1 ms | +importance | index update ms (of verify) "
        "| rebuild ms | gather ms | draft ms (x roof) | gamma / roofline | transformers ms/token (x ours) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if r["kind"] != "steps":
            continue
        lines.append(
            f"| {r['context_len']} | {r['batch_size']} | {r['n_index']} | {_f(r['prefill_s'], '.2f')} "
            f"| {r['ar_step_s'] * 1e3:.1f} ({r['ar_step_x_roofline']:.2f}x) | {r['verify_s'] * 1e3:.1f} "
            f"| {100 * r['importance_overhead']:+.1f} % | {r['index_update_s'] * 1e3:.2f} "
            f"({100 * r['index_update_frac_of_verify']:.1f} %) | {r['index_rebuild_s'] * 1e3:.2f} "
            f"| {r['gather_s'] * 1e3:.2f} | {r['draft_step_s'] * 1e3:.1f} ({r['draft_step_x_roofline']:.2f}x) "
            f"| {r['gamma']:.3f} / {r['gamma_roofline']:.3f} "
            f"| {_f(r.get('hf_step_s') and r['hf_step_s'] * 1e3, '.1f')} ({_f(r.get('hf_over_ar_step'), '.2f')}x) |"
        )
    e2e = [r for r in result["rows"] if r["kind"] == "e2e"]
    if e2e:
        lines += [
            "",
            "| ctx | B | method | tok/s | speedup (runs) | alpha | tau | mean k | gamma | ledger S | "
            "cycle-predicted S | roofline S | lossless |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in e2e:
            runs = ", ".join(f"{x:.2f}" for x in r.get("speedup_runs") or [])
            lines.append(
                f"| {r['context_len']} | {r['batch_size']} | {r['method']} | {r['decode_tokens_per_s']:.1f} "
                f"| {_f(r['speedup'])} ({runs}) | {_f(r.get('alpha'))} | {_f(r.get('tau'), '.2f')} "
                f"| {_f(r.get('mean_k'), '.2f')} | {_f(r.get('gamma'))} | {_f(r.get('ledger_speedup'))} "
                f"| {_f(r.get('cycle_predicted_speedup'))} | {_f(r.get('roofline_speedup'))} | {_f(r.get('lossless'))} |"
            )
    return "\n".join(lines)


def store_result(db: str, result: dict[str, Any]) -> str:
    """Write the run and its rows to the store; returns the run id."""
    import hashlib

    from cluster.store import open_store

    blob = json.dumps(result["meta"], sort_keys=True, default=str)
    run_id = "bench-" + hashlib.sha256(blob.encode()).hexdigest()[:16]
    cfg = result["meta"]["config"]
    with open_store(db) as store:
        store.start_run(run_id, benchmark="bench", model=result["meta"]["model"],
                        methods=[AR, *cfg["methods"]], config={**cfg, "machine": result["machine"]},
                        host={"host": result["meta"]["host"], "machine": result["meta"]["machine_desc"]})
        store.add_bench_rows(run_id, result["meta"]["model"], cfg["device"], result["rows"])
        store.finish_run(run_id)
    return run_id


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return vals


def _k(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"k must be an integer or 'auto', got {text!r}") from None


def parse_args(argv: Sequence[str] | None = None) -> tuple[BenchConfig, argparse.Namespace]:
    from cluster.store import DEFAULT_DB_URL

    p = argparse.ArgumentParser(prog="python -m cluster.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="model preset or local HF folder")
    p.add_argument("--shape", default=None, help="model shape from sparsespec.shapes (with --random-weights)")
    p.add_argument("--random-weights", action="store_true", help="random weights at --shape (no download)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--context-lengths", type=_ints, default=(1024, 2048, 4096, 8192))
    p.add_argument("--batch-sizes", type=_ints, default=(1, 4, 8))
    p.add_argument("--methods", default="sparsespec-l", help="comma list; ar is always the reference")
    p.add_argument("--k", type=int, default=8, help="draft length of the step timings")
    p.add_argument("--method-k", type=_k, default=None, help="k of the end-to-end runs (default: --k; or 'auto')")
    p.add_argument("--budget-frac", type=float, default=0.1)
    p.add_argument("--gen-tokens", type=int, default=64, help="fixed generation length (ignore_eos)")
    p.add_argument("--reps", type=int, default=5, help="timed calls per step (median)")
    p.add_argument("--e2e-reps", type=int, default=2, help="interleaved end-to-end repetitions")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps-only", action="store_true", help="skip the end-to-end runs")
    p.add_argument("--e2e-max-tokens", type=int, default=None,
                   help="end-to-end runs only where batch x context <= this (prefill of every row is slow on CPU)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers generate reference")
    p.add_argument("--hf-tokens", type=int, default=32)
    p.add_argument("--text", default=None, help="plain-text file for the prompts (default: a shared public-domain book)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--ray", action="store_true",
                   help="fan the context lengths out over Ray workers (one GPU each when there are GPUs)")
    p.add_argument("--ray-address", default=None, help="Ray cluster to join with --ray (default: a local Ray)")
    p.add_argument("--num-workers", type=int, default=None, help="Ray workers with --ray (default: one per GPU, else 1)")
    p.add_argument("--db", default=DEFAULT_DB_URL, help="result store URL ('' to skip)")
    p.add_argument("--json-out", default=None, help="also write the full result as JSON here")
    p.add_argument("--markdown-out", default=None, help="also write the Markdown tables here")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    a = p.parse_args(argv)
    methods = tuple(m.strip() for m in a.methods.split(",") if m.strip() and m.strip() != AR)
    try:
        cfg = BenchConfig(model=a.model, shape=a.shape, random_weights=a.random_weights, device=a.device,
                          dtype=a.dtype, context_lengths=a.context_lengths, batch_sizes=a.batch_sizes,
                          methods=methods, k=a.k, method_k=a.k if a.method_k is None else a.method_k,
                          budget_frac=a.budget_frac, gen_tokens=a.gen_tokens, reps=a.reps, e2e_reps=a.e2e_reps,
                          warmup=a.warmup, steps_only=a.steps_only, hf=not a.no_hf, hf_tokens=a.hf_tokens,
                          seed=a.seed, text=a.text, e2e_max_tokens=a.e2e_max_tokens)
    except ValueError as e:
        p.error(str(e))
    return cfg, a


def main(argv: Sequence[str] | None = None) -> int:
    cfg, a = parse_args(argv)
    logging.basicConfig(level=a.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch

    import sparsespec

    if a.threads:
        torch.set_num_threads(a.threads)
    unknown = [m for m in cfg.methods if m not in sparsespec.METHODS]
    if unknown:
        print(f"error: unknown method(s) {unknown}; available: {sorted(sparsespec.METHODS)}", file=sys.stderr)
        return 2
    if cfg.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    try:
        if a.ray:
            result = run_bench_ray(cfg, ray_address=a.ray_address, num_workers=a.num_workers, threads=a.threads)
        else:
            result = run_bench(cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for r in result["rows"]:  # token ids are for the losslessness check, not the report
        r.pop("hf_token_ids", None)
        r.pop("first_row_token_ids", None)
    md = markdown(result)
    print(md)
    if a.json_out:
        Path(a.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json_out).write_text(json.dumps(result, indent=1, default=str))
    if a.markdown_out:
        Path(a.markdown_out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.markdown_out).write_text(md + "\n")
    if a.db:
        run_id = store_result(a.db, result)
        print(f"\nstored as run {run_id} in {a.db}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

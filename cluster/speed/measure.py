"""Paired speed benchmark against the roofline: ``python -m cluster.speed``.

For one model (a preset, a local HF folder, or a random-weight model at a real shape), every
context length L and batch size B (L = prompt + generated tokens, as in every sweep: the prompts
hold ``L - --gen-tokens`` tokens), it measures, after warm-up:

* the machine: memory read bandwidth (a full-buffer reduction over a buffer far larger than the
  caches) and dense GEMM throughput, measured in this run, on this device, with these threads
  (``sparsespec.roofline.measure_machine``), at the start and after every cell: every row's
  roofline uses the run's best samples (``best_rates``; the samples are kept in the result);
* steps, in this process (median of ``--reps`` timed calls each): prefill (batch 1), the AR
  decode step, the sparse draft step at the configured budget, the gather of the index into the
  compact draft KV, the verify step for K+1 tokens with and without importance recycling, and
  the index update (push of the committed attention rows + top-K rebuild) and the rebuild alone;
* the roofline of each step (``sparsespec.roofline``): ``bytes / bandwidth`` with bytes = weights
  read once + the KV the step must read (context for AR and verify, index + drafts for the draft
  step), and the compute floor ``flops / GEMM throughput``; each step is reported as a multiple
  of ``max`` of the two (``x_roofline``) and of the memory term alone (``x_mem``); the AR,
  verify and draft steps also against the floor at the bandwidth and the GEMM rate (the run's
  fastest GEMM) sampled between their own reps (``{step}_read_beside_bytes_per_s``,
  ``{step}_gemm_beside_flops_per_s``, ``{step}_x_roofline_beside``; ``read_beside_bytes_per_s``,
  ``gemm_beside_flops_per_s`` and their ``_spread``: the median and max / min of the cell's
  samples): a shared host's bandwidth and arithmetic drop for seconds at a time, and a step timed
  in such a drop is slow against the run's best rates by the host's doing, not ours;
* end to end (unless ``--steps-only``; needs a real model with a tokenizer, so never with
  ``--random-weights``): a sweep (``cluster.sweep.run.run_sweep``) of the ``speed`` benchmark
  (``evals.benchmarks.speed``: consecutive windows of a public-domain book, ``ignore_eos``, so
  every method generates exactly ``--gen-tokens``) with ``ar`` and every method, one cell per
  (L, B, repetition), on Ray workers: the same planner, run ids, batches, interleaving, lossless
  check, store and report as any sweep. Its rows here are ``cluster.results.report``'s (speedup = median
  over paired batches of the batch TPOT ratio, alpha, tau, mean k, gamma, lossless rate) with the
  ledger ``S = (alpha*k + 1) / (k*gamma + 1)``, the prediction from the run's own round times,
  and ``sparsespec.roofline.roofline_speedup`` at the measured acceptance, from the step floors
  (roofline S) and from the measured step times (step-predicted S). Rerunning the same command
  resumes the sweep (finished shards are skipped, no result is written twice);
* peers (``cluster.peers.compare``): our ``ar`` and ``ngram`` beside transformers' ``generate`` and
  prompt lookup and vLLM's CPU build (``make peers``) ``ar`` and ``ngram``, on the same prompts,
  model, dtype and threads, every cell's decode milliseconds per step measured the same way for
  every engine, and whether each one's greedy tokens equal our ``ar``'s.

Results go to the store (``--db``: the sweep's runs and results, and the ``bench`` table with
the step, peer and end-to-end rows), to ``--json-out`` and to stdout as Markdown tables
(paste them into ``benchmarks/RESULTS.md`` with the date and command).

    python -m cluster.speed --model smollm2-135m --context-lengths 1024,2048,4096,8192 --batch-sizes 1,4,8
    python -m cluster.speed --shape llama-3.1-8b --random-weights --device cuda --dtype bfloat16 \\
        --context-lengths 16384,32768,65536 --batch-sizes 1 --steps-only --json-out gpu.json

The end-to-end sweep starts a local Ray when none is running, or joins ``--ray-address`` (or
RAY_ADDRESS); ``--ray`` also runs the step timings of each context length as a task on a Ray
worker (one GPU each on a GPU cluster).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import gc
import json
import logging
import platform
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from sparsespec.roofline import (  # noqa: F401 - re-exported for ``from cluster.speed.measure import ...``
    ReadProbe,
    gemm_call,
    _sync,
    kv_bytes,
    machine_desc,
    max_speedup,
    measure_machine,
    draft_weight_bytes,
    roofline,
    roofline_speedup,
    step_flops,
    time_call,
    weight_bytes,
    x_roofline,
)
from sparsespec.registry import AR

log = logging.getLogger("cluster.speed.measure")

SPEED = "speed"  # the registry key of the fixed-length speed benchmark
#: Prompt tokens every context length must leave after the generated ones.
MIN_PROMPT_TOKENS = 64


#: draft lengths the roofline's choice of k ranges over
ROOFLINE_MAX_K = 16


# --------------------------------------------------------------------------- roofline physics
def expected_tokens(alpha: float, k: float) -> float:
    """Tokens a round drafting ``k`` emits at per-token acceptance ``alpha`` (i.i.d.):
    ``(1 - alpha^(k+1)) / (1 - alpha)``, ``k + 1`` at ``alpha = 1``."""
    a = min(max(float(alpha), 0.0), 1.0)
    return float(k) + 1.0 if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def verify_floor_at(verify_by_k: Mapping[str, float], k: float) -> float | None:
    """The verify floor at a (fractional, e.g. mean) draft length ``k``: linear between the
    floors at ``floor(k)`` and ``ceil(k)`` (``verify_by_k``: str(k) -> seconds)."""
    if not verify_by_k or k is None:
        return None
    lo, hi = int(k // 1), int(-(-k // 1))
    if str(lo) not in verify_by_k or str(hi) not in verify_by_k:
        return None
    a, b = verify_by_k[str(lo)], verify_by_k[str(hi)]
    return a + (b - a) * (k - lo)


def roofline_best_k(alpha: float | None, ar_floor_s: float, draft_floor_s: float,
                    verify_by_k: Mapping[str, float]) -> tuple[int, float] | tuple[None, None]:
    """The draft length the compute-aware roofline would choose at acceptance ``alpha``, and its
    speedup: ``argmax_k E(alpha, k) * ar_floor / (k * draft_floor + verify_floor(k))`` over the
    ks in ``verify_by_k`` (``k = 0`` is plain decoding: speedup 1 by definition); ties: the shorter."""
    if alpha is None or not verify_by_k:
        return None, None
    best_k, best = 0, 1.0
    for k in sorted(int(x) for x in verify_by_k):
        if k == 0:
            continue
        s = expected_tokens(alpha, k) * ar_floor_s / (k * draft_floor_s + verify_by_k[str(k)])
        if s > best * (1.0 + 1e-12):
            best_k, best = k, s
    return best_k, best


# --------------------------------------------------------------------------- configuration
@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What to measure. ``k``: draft length of the step timings and (unless ``method_k`` is
    ``"auto"``) of the end-to-end runs; ``budget_frac`` etc. go to every sparse method.
    ``context_lengths``: prompt + generated tokens (``gen_tokens``)."""

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
    #: speed samples of every end-to-end cell (None: the cell's batch size, i.e. one batch per cell)
    e2e_samples: int | None = None
    warmup: int = 2
    steps_only: bool = False
    #: external engines timed beside ours on the same prompts (``cluster.peers.compare``): our ``ar``
    #: and ``ngram`` always, then ``transformers`` (generate, prompt lookup) and ``vllm`` (its CPU
    #: build from ``make peers``: ar and its ngram); () = no peer table
    peers: tuple[str, ...] = ("transformers", "vllm")
    #: tokens generated per peer timing (decode ms/step from each engine's token times)
    peer_tokens: int = 32
    #: the drafts of every engine's prompt lookup / ngram (ours, transformers', vLLM's)
    peer_ngram_k: int = 4
    peer_reps: int = 3
    #: peer cells only where batch x context <= this (each peer timing prefills the batch
    #: reps + 1 times per engine and method); None = every cell
    peer_max_tokens: int | None = None
    seed: int = 0
    text: str | None = None
    #: end-to-end cells only where batch x context <= this (each batch prefills every row; on a
    #: CPU a 8 x 8K prefill alone takes minutes); None = everywhere
    e2e_max_tokens: int | None = None
    #: the self-speculative methods' draft weights in the end-to-end runs (``SelfSpecOptions``);
    #: the step timings always measure the draft step with both the target's and an int8 copy
    draft_weights: str = "target"
    #: the target's own weights (``sparsespec.quant.QUANTIZE``): "int8" times every step, ar
    #: included, on the int8 target (its roofline counts the int8 bytes) and runs the e2e sweep on it
    quantize: str = "none"
    #: print the torch profiler's op table of one step kind (ar, verify, draft, index) at the first
    #: context length and batch size
    profile: str | None = None

    def __post_init__(self) -> None:
        if self.random_weights and not self.shape:
            raise ValueError("--random-weights needs --shape (e.g. llama-3.1-8b)")
        if self.reps < 1 or self.warmup < 0 or self.e2e_reps < 1 or self.gen_tokens < 2:
            raise ValueError("reps >= 1, e2e_reps >= 1, warmup >= 0, gen_tokens >= 2")
        if not self.context_lengths or min(self.context_lengths) < self.gen_tokens + MIN_PROMPT_TOKENS:
            raise ValueError(f"context lengths (prompt + generated tokens) must be >= gen_tokens + "
                             f"{MIN_PROMPT_TOKENS} = {self.gen_tokens + MIN_PROMPT_TOKENS}, got {self.context_lengths}")
        if len(set(self.context_lengths)) != len(self.context_lengths):
            raise ValueError(f"duplicate context lengths in {self.context_lengths}")
        if not self.batch_sizes or min(self.batch_sizes) < 1 or len(set(self.batch_sizes)) != len(self.batch_sizes):
            raise ValueError(f"batch sizes must be distinct and >= 1, got {self.batch_sizes}")
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")
        if not 0 < self.budget_frac <= 1:
            raise ValueError(f"budget_frac must be in (0, 1], got {self.budget_frac}")
        if self.peer_tokens < 2:
            raise ValueError(f"peer_tokens must be >= 2, got {self.peer_tokens}")
        if self.peer_ngram_k < 1 or self.peer_reps < 1:
            raise ValueError(f"peer_ngram_k and peer_reps must be >= 1, got {self.peer_ngram_k}, {self.peer_reps}")
        from cluster.peers.compare import PEERS

        unknown = [p for p in self.peers if p not in PEERS]
        if unknown:
            raise ValueError(f"unknown peer(s) {unknown}; known: {list(PEERS)}")
        if self.e2e_samples is not None and self.e2e_samples < 1:
            raise ValueError(f"e2e_samples must be >= 1, got {self.e2e_samples}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        from sparsespec.quant import DRAFT_WEIGHTS

        if self.draft_weights not in DRAFT_WEIGHTS:
            raise ValueError(f"draft_weights must be one of {DRAFT_WEIGHTS}, got {self.draft_weights!r}")
        from sparsespec.quant import QUANTIZE

        if self.quantize not in QUANTIZE:
            raise ValueError(f"quantize must be one of {QUANTIZE}, got {self.quantize!r}")
        if self.profile not in (None, "ar", "verify", "draft", "index"):
            raise ValueError(f"profile must be ar, verify, draft or index, got {self.profile!r}")

    @property
    def runs_e2e(self) -> bool:
        """End-to-end runs need a real model (a tokenizer for the book's prompts)."""
        return not (self.steps_only or self.random_weights)


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
        return model.quantize_(cfg.quantize), None, f"random:{cfg.shape}"
    from transformers import AutoTokenizer

    from sparsespec.model import Transformer
    from sparsespec.provision import resolve_model

    folder = resolve_model(cfg.model)
    model = Transformer.from_folder(folder, dtype=_DTYPES[cfg.dtype], device=cfg.device).quantize_(cfg.quantize)
    torch.manual_seed(cfg.seed)
    return model, AutoTokenizer.from_pretrained(folder), cfg.model


def _speed_options(cfg: BenchConfig) -> dict[str, Any]:
    return {"text": cfg.text} if cfg.text else {}


def make_prompts(tokenizer, vocab_size: int, window: int, batch: int, context_length: int,
                 cfg: BenchConfig) -> list[list[int]]:
    """``batch`` prompts of exactly ``context_length - gen_tokens`` tokens: the ``speed``
    benchmark's samples (consecutive windows of a real book, the prompts the end-to-end sweep
    decodes) or, without a tokenizer, seeded random ids."""
    P = context_length - cfg.gen_tokens
    if tokenizer is None:
        import torch

        g = torch.Generator().manual_seed(cfg.seed)
        return torch.randint(3, vocab_size, (batch, P), generator=g).tolist()
    from evals.registry import get_benchmark

    samples = get_benchmark(SPEED).build_samples(tokenizer, window=window, context_length=context_length,
                                                 num_samples=batch, max_new_tokens=cfg.gen_tokens,
                                                 options=_speed_options(cfg))
    return [list(s.prompt_ids) for s in samples]


# --------------------------------------------------------------------------- step timings
def bench_steps(model, prompts: list[list[int]], cfg: BenchConfig, machine: dict[str, float],
                prefill_s: float | None, context_length: int | None = None) -> dict[str, Any]:
    """Time one step of each kind on a cache holding ``prompts`` (all the same length);
    ``context_length``: the cell's L (default: the prompt length)."""
    import torch

    from sparsespec.adaptive import FixedK
    from sparsespec.config import SamplingParams
    from sparsespec.drafters.sparse_self import SparseSelfDrafter
    from sparsespec.kv.cache import KVCache
    from sparsespec.sampling import BatchSampling

    dev = model.device
    B, P, K = len(prompts), len(prompts[0]), cfg.k
    spec = SparseSelfDrafter.options.from_options("sparsespec-l", {"k": K, "budget_frac": cfg.budget_frac})
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

    width = P + K + 1  # the verify's longest row: the importance rows' width

    def verify_imp():  # as the engine verifies: its importance rows into the window's spare ring slots
        target = drafter.importance_target(B, K + 1, width)
        model.forward_dense_features(tokv, cache, want_rows=K + 1, rows_into=target)
        cache.rollback(base)

    verify_imp()
    counts = [K + 1] * B

    def index_update():  # what the engine does after a verify: commit the ring slots, then the (deferred) rebuild
        drafter.importance_target(B, K + 1, width)
        drafter.commit(cache, None, counts)
        drafter.flush(cache)

    def index_rebuild():
        drafter.commit(cache, None, counts)
        drafter.flush(cache)

    def gather():
        drafter.propose(cache, tok1, [0] * B, [FixedK(0)] * B, sampling)

    def draft_phase():
        drafter.propose(cache, tok1, [K] * B, [FixedK(K)] * B, sampling)

    # the same drafter state with an int8 copy of the weights for the draft forward
    drafter8 = SparseSelfDrafter(model, dataclasses.replace(spec, draft_weights="int8"), capacity, B, K)
    for b in range(B):
        drafter8.prefill_row(b, cache, rows, prompts[b])

    def draft_phase_int8():
        drafter8.propose(cache, tok1, [K] * B, [FixedK(K)] * B, sampling)

    parts = decompose_step(model, cache, B, K + 1, P, reps, warm)  # the verify's linears / attention alone
    parts_ar = decompose_step(model, cache, B, 1, P, reps, warm)
    # the read bandwidth and the GEMM rate (the run's fastest GEMM) between the reps of the three
    # steps judged against their roofline
    probe = ReadProbe(dev, (1 << 30) if torch.device(dev).type == "cuda" else (256 << 20),
                      gemm=gemm_call(dev, model.dtype, machine.get("gemm_backend", "torch"), machine.get("gemm_n")))
    t = {
        "ar_step_s": time_call(ar_step, dev, reps, warm, between=probe.tagged("ar_step")),
        "verify_s": time_call(verify_plain, dev, reps, warm),
        "verify_importance_s": time_call(verify_imp, dev, reps, warm, between=probe.tagged("verify")),
        "index_update_s": time_call(index_update, dev, reps, warm),
        "index_rebuild_s": time_call(index_rebuild, dev, reps, warm),
        "gather_s": time_call(gather, dev, reps, warm),
    }
    phase = time_call(draft_phase, dev, reps, warm, between=probe.tagged("draft_step"))
    t["draft_step_s"] = max(0.0, phase - t["gather_s"]) / K
    phase8 = time_call(draft_phase_int8, dev, reps, warm)
    t["draft_step_int8_s"] = max(0.0, phase8 - t["gather_s"]) / K
    n_index = max(drafter.index_sizes())
    out: dict[str, Any] = {"kind": "steps", "context_len": P if context_length is None else context_length,
                           "prompt_len": P, "batch_size": B, "k": K, "budget_frac": cfg.budget_frac,
                           "n_index": n_index, "prefill_s": prefill_s, **t,
                           "ar_linears_s": parts_ar["linears_s"], "ar_attention_s": parts_ar["attention_s"],
                           "verify_linears_s": parts["linears_s"], "verify_attention_s": parts["attention_s"],
                           "read_beside_bytes_per_s": probe.median(), "read_beside_spread": probe.spread(),
                           "gemm_beside_flops_per_s": probe.gemm_median(), "gemm_beside_spread": probe.gemm_spread(),
                           **{f"{n}_read_beside_bytes_per_s": probe.median(n)
                              for n in ("ar_step", "verify", "draft_step")},
                           **{f"{n}_gemm_beside_flops_per_s": probe.gemm_median(n)
                              for n in ("ar_step", "verify", "draft_step")}}
    del probe
    out["ar_rest_s"] = t["ar_step_s"] - parts_ar["linears_s"] - parts_ar["attention_s"]
    out["verify_rest_s"] = t["verify_importance_s"] - parts["linears_s"] - parts["attention_s"]
    out["importance_overhead"] = t["verify_importance_s"] / t["verify_s"] - 1.0
    out["index_update_frac_of_verify"] = t["index_update_s"] / t["verify_importance_s"]
    out["verify_over_ar"] = t["verify_importance_s"] / t["ar_step_s"]
    out["gamma"] = t["draft_step_s"] / t["verify_importance_s"]
    out["gamma_int8"] = t["draft_step_int8_s"] / t["verify_importance_s"]
    out["draft_int8_over_target"] = t["draft_step_int8_s"] / t["draft_step_s"] if t["draft_step_s"] else None
    out["draft_weight_int8_bytes"] = drafter8.weight_bytes
    out["_draft_int8_roofline_weight_bytes"] = draft_weight_bytes(model, drafter8.weights)
    # best case (alpha = 1) with every step at its measured time (the floors': add_rooflines)
    out["step_max_speedup"] = max_speedup(K, t["ar_step_s"], t["draft_step_s"], t["verify_importance_s"])
    add_rooflines(out, model, machine)
    del cache, drafter, drafter8, rows
    return out


def add_rooflines(out: dict[str, Any], model, machine: Mapping[str, float]) -> dict[str, Any]:
    """The roofline-derived fields of one ``steps`` row (its measured seconds, shapes and
    ``_draft_int8_roofline_weight_bytes``) at the machine rates ``machine``: each step's floor
    ``max(bytes / read bandwidth, FLOPs / GEMM rate)``, measured / floor, gamma's floor and the
    best-case speedups. ``measure_steps`` calls it again at the end of a run with the best rates
    the run measured, so every row of a run shares one roofline."""
    B, P, K, n_index = out["batch_size"], out["prompt_len"], out["k"], out["n_index"]
    roofs = {
        "ar_step": roofline(model, machine, B, 1, P),
        "verify": roofline(model, machine, B, K + 1, P),
        "draft_step": roofline(model, machine, B, 1, n_index + K / 2),
        "draft_step_int8": roofline(model, machine, B, 1, n_index + K / 2,
                                    weight_nbytes=out["_draft_int8_roofline_weight_bytes"]),
    }
    # the verify's floor at every draft length (its compute floor grows with k + 1 tokens per row)
    out["verify_roofline_s_by_k"] = {str(k): roofline(model, machine, B, k + 1, P)["roofline_s"]
                                     for k in range(0, ROOFLINE_MAX_K + 1)}
    for name, key in (("ar_step", "ar_step_s"), ("verify", "verify_importance_s"), ("draft_step", "draft_step_s"),
                      ("draft_step_int8", "draft_step_int8_s")):
        r = roofs[name]
        out[f"{name}_roofline_s"] = r["roofline_s"]
        out[f"{name}_mem_roofline_s"] = r["mem_s"]
        out[f"{name}_bytes"] = r["bytes"]
        out[f"{name}_x_roofline"] = x_roofline(out[key], r["roofline_s"])
        out[f"{name}_x_mem"] = x_roofline(out[key], r["mem_s"])
    # the same three steps against the floor at the bandwidth and the GEMM rate sampled between their
    # own reps (``{step}_read_beside_bytes_per_s``, ``{step}_gemm_beside_flops_per_s``; a row without
    # the latter: the run's GEMM rate): what is left is ours, not a slow minute of the host's
    for name, key, T, keys in (("ar_step", "ar_step_s", 1, P), ("verify", "verify_importance_s", K + 1, P),
                               ("draft_step", "draft_step_s", 1, n_index + K / 2)):
        beside = out.get(f"{name}_read_beside_bytes_per_s")
        rates = {**machine, "read_bytes_per_s": beside,
                 "gemm_flops_per_s": out.get(f"{name}_gemm_beside_flops_per_s") or machine["gemm_flops_per_s"]}
        floor = roofline(model, rates, B, T, keys)["roofline_s"] if beside else None
        out[f"{name}_x_roofline_beside"] = x_roofline(out[key], floor) if floor else None
    if out.get("prefill_s") is not None:
        r = roofline(model, machine, 1, P, P, attn_keys=P / 2, logit_tokens=1)  # logits for the last position only
        out["prefill_roofline_s"] = r["roofline_s"]
        out["prefill_x_roofline"] = x_roofline(out["prefill_s"], r["roofline_s"])
    out["gamma_roofline"] = roofs["draft_step"]["roofline_s"] / roofs["verify"]["roofline_s"]
    out["gamma_over_roofline"] = out["gamma"] / out["gamma_roofline"]
    out["gamma_int8_roofline"] = roofs["draft_step_int8"]["roofline_s"] / roofs["verify"]["roofline_s"]
    # Best case (alpha = 1): K+1 tokens per cycle of K drafts + 1 verify, against K+1 AR steps,
    # with every step at its floor.
    out["roofline_max_speedup"] = max_speedup(K, roofs["ar_step"]["roofline_s"], roofs["draft_step"]["roofline_s"],
                                              roofs["verify"]["roofline_s"])
    return out


def decompose_step(model, cache, B: int, T: int, P: int, reps: int, warmup: int) -> dict[str, float]:
    """Seconds of a forward's parts alone, as the forward runs them: every linear (the layers'
    projections at ``B * T`` rows and the LM head) through the model's kernel plan, and every
    layer's attention over ``P`` cached keys (with the importance rows of the T queries when
    ``T > 1``). The step minus both is the rest (norms, RoPE, embedding, dispatch)."""
    import torch

    from sparsespec.kernels import cpu
    from sparsespec.kernels.reference import grouped_attention
    from sparsespec.quant import linear_weights

    cfg, dev = model.cfg, model.device
    M = B * T
    ws = [(w, b) for w, b in zip(linear_weights(model), [None] + [x for layer in model.layers
                                                                   for x in (layer.bqkv, None, None, None)])]
    dims = {id(w): (w.qweight if hasattr(w, "qweight") else w).shape[1] for w, _ in ws}
    xs = {k: torch.randn(M, k, dtype=model.dtype, device=dev) for k in set(dims.values())}

    def linears():
        for w, b in ws:
            model._linear(xs[dims[id(w)]], w, b)

    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = torch.randn(B, H, T, D, dtype=model.dtype, device=dev)
    starts = torch.full((B,), P, dtype=torch.int64, device=dev)
    W = T if T > 1 else 0
    rows = torch.empty(B, Hkv, W, P + T, device=dev) if W else None
    ours = model.attention_backend() == "ss"
    mask = None if T == 1 else (torch.arange(P + T, device=dev)[None, None, P:] <= (P + torch.arange(T, device=dev))[None, :, None]).expand(B, T, T)

    def attention():
        for i in range(cfg.num_layers):
            if ours:
                cpu.attention(q, cache.k[i], cache.v[i], starts, P, model.scale, rows)
            else:
                grouped_attention(q, cache.k[i, :, :, : P + T], cache.v[i, :, :, : P + T], mask, W, model.scale,
                                  mask_from=P)

    with torch.inference_mode():
        return {"linears_s": time_call(linears, dev, reps, warmup), "attention_s": time_call(attention, dev, reps, warmup)}


def profile_step(model, prompts: list[list[int]], cfg: BenchConfig, step: str, rows: int = 25) -> str:
    """The torch profiler's op table (self CPU time) of three calls of one step kind (``ar``,
    ``verify``, ``draft``, ``index``) on a cache of ``prompts``: where a step's time goes, op by
    op (our kernels appear as ``ss::...`` ranges)."""
    import torch

    from sparsespec.adaptive import FixedK
    from sparsespec.config import SamplingParams
    from sparsespec.drafters.sparse_self import SparseSelfDrafter
    from sparsespec.kv.cache import KVCache
    from sparsespec.sampling import BatchSampling

    dev = model.device
    B, P, K = len(prompts), len(prompts[0]), cfg.k
    spec = SparseSelfDrafter.options.from_options("sparsespec-l", {"k": K, "budget_frac": cfg.budget_frac})
    cache = KVCache(model.cfg, B, P + K + 2, model.dtype, dev)
    g = torch.Generator(device=dev).manual_seed(cfg.seed)
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    cache.lengths = [P] * B
    drafter = SparseSelfDrafter(model, spec, P + K + 2, B, K)
    for b in range(B):
        drafter.prefill_row(b, cache, None)
    tok1 = torch.full((B, 1), 42, dtype=torch.long, device=dev)
    tokv = torch.full((B, K + 1), 42, dtype=torch.long, device=dev)
    sampling = BatchSampling([SamplingParams(max_new_tokens=K + 2)] * B, [None] * B)
    base = [P] * B

    def ar():
        model.forward_dense(tok1, cache)
        cache.rollback(base)

    def verify():
        target = drafter.importance_target(B, K + 1, P + K + 1)
        model.forward_dense_features(tokv, cache, want_rows=K + 1, rows_into=target)
        cache.rollback(base)

    def draft():
        drafter.propose(cache, tok1, [K] * B, [FixedK(K)] * B, sampling)

    def index():
        drafter.importance_target(B, K + 1, P + K + 1)
        drafter.commit(cache, None, [K + 1] * B)
        drafter.flush(cache)

    fn = {"ar": ar, "verify": verify, "draft": draft, "index": index}[step]
    with torch.inference_mode():
        fn()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                fn()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def peer_rows(model, tokenizer, cells: Mapping[tuple[int, int], list[list[int]]], cfg: BenchConfig,
              progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """The peer table (``cluster.peers.compare``): our ``ar`` and ``ngram``, then each of
    ``cfg.peers``, one engine after the other (never two at once), on the same cells."""
    import torch

    from cluster.peers import compare
    from sparsespec.engine import Engine

    n, reps, k = cfg.peer_tokens, cfg.peer_reps, cfg.peer_ngram_k
    rows = compare.ours(Engine(model, tokenizer, name=cfg.model), cells, n, reps, k)
    if "transformers" in cfg.peers:
        rows += compare.transformers_peer(model.source_folder, cfg.dtype, cells, n, reps, k)
    if "vllm" in cfg.peers:
        progress("peers: vLLM (one engine start per method, ~100 s each)")
        rows += compare.vllm_peer(model.source_folder, cfg.dtype, torch.get_num_threads(), cells, n, reps, k)
    compare.compare_tokens(rows, n)
    for r in rows:
        ms = r.get("decode_ms_per_step")
        progress(f"peer {r['method']} ctx {r['context_len']} B {r['batch_size']}: "
                 + (f"{ms:.1f} ms/step, same tokens {r.get('same_tokens_as_ours')}" if ms else f"- ({r.get('error')})"))
    return rows


def run_stamp(model, machine: Mapping[str, float]) -> dict[str, Any]:
    """What every bench row records about where it ran: the CPU (model, ISA flags), the kernel
    plan (one line, how it was chosen, its tuning and build seconds) and the bandwidth and GEMM
    rate measured in this run."""
    from sparsespec.kernels import cpu

    plan = model.kernel_plan
    return {"cpu": cpu.cpu_model(), "isa": cpu.isa_summary(), "kernels": plan.summary(),
            "kernels_source": plan.source, "kernels_tune_s": plan.tune_s, "kernels_build_s": cpu.build_seconds(),
            "batch_invariant": plan.batch_invariant, "read_bytes_per_s": machine["read_bytes_per_s"],
            "gemm_flops_per_s": machine["gemm_flops_per_s"], "gemm_backend": machine.get("gemm_backend", "torch")}


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


# --------------------------------------------------------------------------- steps driver
def _check_window(cfg: BenchConfig, window: int) -> None:
    """Every L must fit the window (the sweep's prompt + generation) and so must the step
    timings' cache (prompt + K + 2)."""
    longest = window - max(0, cfg.k + 2 - cfg.gen_tokens)
    too_long = [L for L in cfg.context_lengths if L > longest]
    if too_long:
        raise ValueError(f"context length(s) {too_long} (prompt + {cfg.gen_tokens} generated, {cfg.k + 2} draft "
                         f"tokens) exceed the model's window ({window}); the longest that fits is {longest}")


def best_rates(samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The best read bandwidth and the best GEMM rate among ``measure_machine`` samples (with the
    GEMM backend that ran it, and its product's size)."""
    fastest = max(samples, key=lambda m: m["gemm_flops_per_s"])
    return {"read_bytes_per_s": max(m["read_bytes_per_s"] for m in samples),
            "gemm_flops_per_s": fastest["gemm_flops_per_s"], "gemm_backend": fastest.get("gemm_backend", "torch"),
            "gemm_n": fastest.get("gemm_n")}


def measure_steps(cfg: BenchConfig, *, progress: Callable[[str], None] = log.info) -> dict[str, Any]:
    """The machine, the step timings and the transformers reference, in this process:
    ``{"meta", "machine", "rows"}``. The model is freed on return (GPU memory included), so the
    end-to-end sweep's workers may load it on the same device."""
    import torch

    from sparsespec.engine import _DTYPES

    model, tokenizer, name = load_model(cfg)
    window = model.cfg.max_position_embeddings
    _check_window(cfg, window)  # before measuring anything
    if model.kernel_plan.source == "default":  # random weights: the measured choice, as a real load makes
        model.use_kernels("auto")
    plan = model.kernel_plan
    progress(f"kernels: {plan.summary()}")
    # The machine's rates, sampled now and after every cell (a shared machine's bandwidth moves by
    # a third between minutes): every row's roofline uses the best of the run's samples, so one
    # slow sample can make no step look faster than its floor.
    samples = [measure_machine(cfg.device, _DTYPES[cfg.dtype])]
    machine = best_rates(samples)
    progress(f"machine: read {machine['read_bytes_per_s'] / 1e9:.1f} GB/s, "
             f"GEMM {machine['gemm_flops_per_s'] / 1e9:.0f} GFLOP/s ({cfg.dtype}, {machine['gemm_backend']}; "
             + ", ".join(f"{k} {v / 1e9:.0f}" for k, v in samples[0].get("gemm_rates", {}).items()) + ")")
    rows: list[dict[str, Any]] = []
    cells: dict[tuple[int, int], list[list[int]]] = {}
    for L in cfg.context_lengths:
        base_prompts = make_prompts(tokenizer, model.cfg.vocab_size, window, max(cfg.batch_sizes), L, cfg)
        prefill_s = time_prefill(model, base_prompts[0], cfg)
        progress(f"ctx {L}: prefill of {len(base_prompts[0])} tokens {prefill_s:.2f} s")
        for B in cfg.batch_sizes:  # the peer table's cells (prompt = context - gen_tokens, as the steps')
            if cfg.peer_max_tokens is None or B * L <= cfg.peer_max_tokens:
                cells[(L, B)] = base_prompts[:B]
        for B in cfg.batch_sizes:
            steps = bench_steps(model, base_prompts[:B], cfg, machine, prefill_s if B == 1 else None, L)
            rows.append(steps)
            progress(f"ctx {L} B {B}: AR {steps['ar_step_s'] * 1e3:.1f} ms ({steps['ar_step_x_roofline']:.2f}x roofline "
                     f"at the rates so far, {_f(steps['ar_step_x_roofline_beside'], '.2f')}x at the "
                     f"{_f((steps['ar_step_read_beside_bytes_per_s'] or 0) / 1e9, '.1f')} GB/s read beside its reps), "
                     f"verify {steps['verify_importance_s'] * 1e3:.1f} ms ({steps['verify_x_roofline']:.2f}x, "
                     f"{_f(steps['verify_x_roofline_beside'], '.2f')}x at the "
                     f"{_f((steps['verify_gemm_beside_flops_per_s'] or 0) / 1e9, '.0f')} GFLOP/s beside its reps), "
                     f"draft {steps['draft_step_s'] * 1e3:.1f} ms, "
                     f"gamma {steps['gamma']:.3f} (roofline {steps['gamma_roofline']:.3f})")
            if torch.device(cfg.device).type == "cuda":
                torch.cuda.empty_cache()
            samples.append(measure_machine(cfg.device, _DTYPES[cfg.dtype], reps=3))
            machine = best_rates(samples)  # the running best: the next cells' rooflines
    for r in rows:  # every step row against the run's one roofline
        add_rooflines(r, model, machine)
    progress(f"machine, best of {len(samples)} samples: read {machine['read_bytes_per_s'] / 1e9:.1f} GB/s "
             f"({min(m['read_bytes_per_s'] for m in samples) / 1e9:.1f}-{machine['read_bytes_per_s'] / 1e9:.1f}), "
             f"GEMM {machine['gemm_flops_per_s'] / 1e9:.0f} GFLOP/s "
             f"({min(m['gemm_flops_per_s'] for m in samples) / 1e9:.0f}-{machine['gemm_flops_per_s'] / 1e9:.0f})")
    stamp = run_stamp(model, machine)
    # (peers run the full-precision model from its folder: none for an int8 target or random weights)
    if cfg.peers and cfg.quantize == "none" and tokenizer is not None and cells:
        rows += peer_rows(model, tokenizer, cells, cfg, progress)
    if cfg.profile:
        progress(f"profile of the {cfg.profile} step at ctx {cfg.context_lengths[0]}, B {cfg.batch_sizes[0]}:\n"
                 + profile_step(model, make_prompts(tokenizer, model.cfg.vocab_size, window, cfg.batch_sizes[0],
                                                    cfg.context_lengths[0], cfg), cfg, cfg.profile))
    for r in rows:  # every row says what it ran on (the CPU, its ISA, the kernels, the bandwidth)
        r.update(stamp)
    meta = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "model": name,
        "config": dataclasses.asdict(cfg),
        "host": platform.node(),
        "machine_desc": machine_desc(cfg.device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        **stamp,
        "kernel_plan": plan.describe(),
    }
    del model, tokenizer
    gc.collect()
    if torch.device(cfg.device).type == "cuda":
        torch.cuda.empty_cache()
    for r in rows:
        r.pop("_draft_int8_roofline_weight_bytes", None)
    return {"meta": meta, "machine": {**machine, "samples": samples}, "rows": rows}


# --------------------------------------------------------------------------- end to end: a sweep
def e2e_specs(cfg: BenchConfig, db: str, *, num_workers: int | None = None, threads: int | None = None) -> list:
    """The end-to-end sweep as specs (``cluster.sweep.schema.SweepSpec``), one per batch size with the
    context lengths that ``e2e_max_tokens`` allows at it: benchmark ``speed``, ``ar`` plus every
    method with ``k`` (and ``budget_frac``, ``draft_weights`` where it takes them), greedy,
    ``gen_tokens`` generated, ``e2e_reps`` repetitions. Raises SpecError."""
    from cluster.sweep.schema import parse_spec

    from sparsespec import options_class

    def opts(m: str) -> dict[str, Any]:  # each method gets the options it takes
        takes = options_class(m).option_names()
        o: dict[str, Any] = {"k": cfg.method_k}
        if "budget_frac" in takes:
            o["budget_frac"] = cfg.budget_frac
        if cfg.draft_weights != "target" and "draft_weights" in takes:
            o["draft_weights"] = cfg.draft_weights
        return o

    methods = {AR: {}, **{m: opts(m) for m in cfg.methods if m != AR}}
    specs = []
    for B in cfg.batch_sizes:
        lengths = [L for L in cfg.context_lengths if cfg.e2e_max_tokens is None or B * L <= cfg.e2e_max_tokens]
        if not lengths:
            continue
        specs.append(parse_spec({
            "name": f"bench-e2e-B{B}", "models": [cfg.model], "dtype": cfg.dtype, "device": cfg.device,
            "quantize": [cfg.quantize],
            "methods": methods, "batch_sizes": [B], "context_lengths": lengths,
            "benchmarks": [{"name": SPEED, "num_samples": cfg.e2e_samples or B, "options": _speed_options(cfg)}],
            "sampling": {"temperature": 0.0, "seed": cfg.seed, "max_new_tokens": cfg.gen_tokens},
            "repetitions": cfg.e2e_reps,
            "workers": {"num_workers": num_workers, "threads": threads},
            "db": db,
        }, where="cluster.speed.measure"))
    return specs


def _batch_decode_tokens_per_s(rows: Sequence[Mapping[str, Any]]) -> float | None:
    """Median over the batches of one method of decoded tokens / batch decode seconds
    (``1 / sparsespec.stats.batch_tpot``: the batch's throughput, every row counted)."""
    from sparsespec.stats import batch_tpot

    batches: dict[tuple[str, str], list[Mapping[str, Any]]] = defaultdict(list)
    for r in rows:
        st = r.get("stats") or {}
        batches[(r["run_id"], str(st.get("batch_key") or r["sample_id"]))].append(st)
    rates = [1.0 / t for t in (batch_tpot(b) for b in batches.values()) if t]
    return statistics.median(rates) if rates else None


def e2e_rows(results: Sequence[Mapping[str, Any]], steps: Sequence[Mapping[str, Any]],
             cfg: BenchConfig) -> list[dict[str, Any]]:
    """The bench's end-to-end rows: ``cluster.results.aggregate.cell_table`` of the sweep's result rows
    (the report's numbers), one per (L, B, method), joined with the step timings of the same
    (L, B) (``steps``: the ``steps`` and ``hf`` rows) for the roofline predictions."""
    from cluster.results.aggregate import cell_table
    from cluster.results.report import batch_speedups
    from sparsespec.stats import ledger_speedup

    results = list(results)
    by_group: dict[tuple, list[Mapping[str, Any]]] = defaultdict(list)
    for r in results:
        by_group[(r["context_length"], int(r.get("batch_size") or 1), r["method"])].append(r)
    step_at = {(s["context_len"], s["batch_size"]): s for s in steps if s.get("kind") == "steps"}
    out = []
    for rep in cell_table(results):  # one aggregation, bootstrapped once
        L, B, method = rep["context_length"], rep["batch_size"], rep["method"]
        mine, ar_rows = by_group[(L, B, method)], by_group[(L, B, AR)]
        row: dict[str, Any] = {
            "kind": "e2e", "method": method, "context_len": L, "batch_size": B, "gen_tokens": cfg.gen_tokens,
            "k": 0 if method == AR else cfg.method_k, "n": rep["n"], "num_batches": len(
                {(r["run_id"], (r.get("stats") or {}).get("batch_key")) for r in mine}),
            "decode_tokens_per_s": _batch_decode_tokens_per_s(mine),
            "tpot_s": rep["tpot_s"], "tokens_per_s": rep["tokens_per_s"],
            "speedup": rep["speedup"],
            "speedup_runs": [] if method == AR else batch_speedups(mine, ar_rows),
            "speedup_total": rep["speedup_total"],
            "alpha": rep["alpha"], "tau": rep["tau"], "mean_k": rep["mean_k"], "gamma": rep["gamma"],
            "lossless_rate": rep["lossless_rate"],
            "lossless": None if rep["lossless_rate"] is None else rep["lossless_rate"] == 1.0,
            "run_ids": sorted({r["run_id"] for r in mine}),
        }
        st = step_at.get((L, B))
        if method != AR:
            tau, mean_k = rep["tau"], rep["mean_k"]
            row["ledger_speedup"] = rep["predicted_speedup"]
            # a static batch waits for its slowest row: the share of the per-row figures it keeps
            row["straggle"] = rep.get("straggle")
            # the run's own round times instead of the ledger's assumptions (verify == AR step,
            # nothing else per step): tau tokens per round of draft + verify + the rest
            row["cycle_predicted_speedup"] = rep["predicted_speedup_round"]
            if st is not None:
                # what the roofline allows at this acceptance (every step at its floor: the verify's
                # at the run's own mean k), and what the measured step times predict
                v_floor = verify_floor_at(st.get("verify_roofline_s_by_k") or {}, mean_k)
                row["roofline_speedup"] = roofline_speedup(tau, mean_k, st["ar_step_roofline_s"],
                                                           st["draft_step_roofline_s"],
                                                           st["verify_roofline_s"] if v_floor is None else v_floor)
                if row["roofline_speedup"] and rep["speedup"] is not None:
                    row["measured_over_roofline"] = rep["speedup"] / row["roofline_speedup"]
                row["roofline_best_k"], row["roofline_best_speedup"] = roofline_best_k(
                    rep["alpha"], st["ar_step_roofline_s"], st["draft_step_roofline_s"],
                    st.get("verify_roofline_s_by_k") or {})
                row["step_predicted_speedup"] = roofline_speedup(tau, mean_k, st["ar_step_s"], st["draft_step_s"],
                                                                 st["verify_importance_s"])
                row["ledger_speedup_roofline_gamma"] = ledger_speedup(rep["alpha"], mean_k, st["gamma_roofline"])
        out.append(row)
    return out


def run_e2e(cfg: BenchConfig, steps: Sequence[Mapping[str, Any]], *, db: str | None, ray_address: str | None = None,
            num_workers: int | None = None, threads: int | None = None, bar: bool = False,
            progress: Callable[[str], None] = log.info) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run the end-to-end sweep (``e2e_specs``) with ``cluster.sweep.run.run_sweep`` (on the Ray
    that is running, else ``ray_address``/RAY_ADDRESS, else a local one), then report it
    (``e2e_rows``). ``db`` None: a throwaway SQLite store (no resume). Returns the rows and
    ``{"run_ids", "shards", "done", "skipped", "failed", "wall_s"}``."""
    import tempfile

    from cluster.sweep.coordinator import ray_session
    from cluster.results.store import open_store
    from cluster.sweep.run import run_sweep

    with tempfile.TemporaryDirectory(prefix="sparsespec-bench-") as tmp:
        url = db or f"sqlite:///{Path(tmp) / 'e2e.db'}"
        specs = e2e_specs(cfg, url, num_workers=num_workers, threads=threads)
        info: dict[str, Any] = {"run_ids": [], "shards": 0, "done": 0, "skipped": 0, "failed": {}, "wall_s": 0.0,
                                "db": db or None}
        if not specs:
            progress("end to end: no (batch, context) cell within --e2e-max-tokens")
            return [], info
        with ray_session(ray_address):
            for spec in specs:
                res = run_sweep(spec, ray_address=ray_address, progress=bar)
                info["run_ids"] += res.run_ids
                info["shards"] += res.num_shards
                info["done"] += len(res.done)
                info["skipped"] += len(res.skipped)
                info["failed"].update(res.failed)
                info["wall_s"] += res.wall_s
                progress(f"end to end {spec.name}: {len(res.done)} shard(s) run, {len(res.skipped)} already stored, "
                         f"{len(res.failed)} failed, {res.wall_s:.1f} s")
        with open_store(url, create=False) as store:
            from cluster.results.aggregate import with_run_fields

            results = with_run_fields(store.results(run_ids=info["run_ids"]), store.runs())
    rows = e2e_rows(results, steps, cfg)
    for r in rows:
        progress(f"ctx {r['context_len']} B {r['batch_size']} {r['method']}: "
                 f"{_f(r['decode_tokens_per_s'], '.1f')} tok/s, speedup {_f(r['speedup'])}")
    return rows, info


# --------------------------------------------------------------------------- drivers
def run_bench(cfg: BenchConfig, *, progress: Callable[[str], None] = log.info, db: str | None = None,
              ray_address: str | None = None, num_workers: int | None = None, threads: int | None = None,
              bar: bool = False) -> dict[str, Any]:
    """Every measurement of ``cfg``: the steps in this process, then (``cfg.runs_e2e``) the
    end-to-end sweep into ``db`` (None: a throwaway store). Returns ``{"meta", "machine",
    "rows"}``; ``meta["e2e"]`` holds the sweep's run ids and shard counts (None without it)."""
    result = measure_steps(cfg, progress=progress)
    _add_e2e(result, cfg, db=db, ray_address=ray_address, num_workers=num_workers, threads=threads, bar=bar,
             progress=progress)
    return result


def _add_e2e(result: dict[str, Any], cfg: BenchConfig, **kw: Any) -> None:
    result["meta"]["e2e"] = None
    if not cfg.runs_e2e:
        if cfg.random_weights and not cfg.steps_only:
            kw["progress"]("random weights: steps only (end-to-end runs need a real model and its tokenizer)")
        return
    rows, info = run_e2e(cfg, result["rows"], **kw)
    result["rows"].extend(rows)
    result["meta"]["e2e"] = info


def _bench_task(cfg_fields: dict[str, Any], threads: int | None) -> dict[str, Any]:
    """The step timings of one context length in a Ray worker (``run_bench_ray``): its own
    machine measurement."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    res = measure_steps(BenchConfig(**cfg_fields), progress=log.info)
    for r in res["rows"]:  # each worker measured its own device: keep it with its rows
        r["machine"] = dict(res["machine"], desc=res["meta"]["machine_desc"], host=res["meta"]["host"])
    return res


def run_bench_ray(cfg: BenchConfig, *, ray_address: str | None = None, num_workers: int | None = None,
                  threads: int | None = None, db: str | None = None, bar: bool = False,
                  progress: Callable[[str], None] = log.info) -> dict[str, Any]:
    """``run_bench`` with the step timings fanned out over Ray: one task per context length,
    each on one worker (one GPU when the device is cuda, else all of a node's CPUs per worker
    as ``cluster.sweep.coordinator.plan_workers`` plans them, so CPU timings never share cores); rows
    are merged in context order; failed tasks are retried once. The end-to-end sweep then runs
    on the same Ray."""
    import ray

    from cluster.sweep.coordinator import plan_workers, ray_session

    with ray_session(ray_address):
        plan = plan_workers(num_workers, threads, cfg.device)
        task = ray.remote(_bench_task).options(num_gpus=plan.num_gpus, num_cpus=plan.num_cpus, max_retries=1)
        fields = {**dataclasses.asdict(cfg), "steps_only": True}
        refs = [task.remote({**fields, "context_lengths": (L,)}, plan.threads) for L in cfg.context_lengths]
        parts = ray.get(refs)
        merged = dict(parts[0])
        merged["meta"] = dict(parts[0]["meta"], config=dataclasses.asdict(cfg), ray_workers=plan.num_workers)
        merged["rows"] = [r for part in parts for r in part["rows"]]
        _add_e2e(merged, cfg, db=db, ray_address=ray_address, num_workers=num_workers, threads=threads, bar=bar,
                 progress=progress)
    return merged


# --------------------------------------------------------------------------- output
def _f(v: Any, fmt: str = ".3f") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return format(v, fmt)
    return str(v)


def _ms3(r: Mapping[str, Any], step: str) -> str:
    parts = [r.get(f"{step}_{p}_s") for p in ("linears", "attention", "rest")]
    return " / ".join(_f(p and p * 1e3, ".1f") for p in parts)


def markdown(result: dict[str, Any]) -> str:
    """The report as Markdown tables (steps, end to end)."""
    m = result["machine"]
    meta = result["meta"]
    lines = [
        f"{meta['date']} · {meta['machine_desc']} · torch {meta['torch']} · {meta['threads']} threads · "
        f"model {meta['model']} ({meta['config']['dtype']})",
        f"measured read bandwidth {m['read_bytes_per_s'] / 1e9:.1f} GB/s, GEMM {m['gemm_flops_per_s'] / 1e9:.0f} GFLOP/s"
        f" ({m.get('gemm_backend', 'torch')})"
        + (f" (the best of {len(m['samples'])} samples through the run: "
           f"{min(x['read_bytes_per_s'] for x in m['samples']) / 1e9:.1f}-{m['read_bytes_per_s'] / 1e9:.1f} GB/s, "
           f"{min(x['gemm_flops_per_s'] for x in m['samples']) / 1e9:.0f}-{m['gemm_flops_per_s'] / 1e9:.0f} GFLOP/s)"
           if len(m.get("samples") or ()) > 1 else ""),
        f"CPU {meta.get('cpu', '-')} [{meta.get('isa', '-')}] · kernels: {meta.get('kernels', '-')}, "
        f"built in {_f(meta.get('kernels_build_s'), '.1f')} s",
        "",
        "| ctx (prompt) | B | N | prefill s (x roof) | AR ms (x roof) | AR linears / attention / rest ms "
        "| verify K+1 ms | +importance (x roof) | verify linears / attention / rest ms | index update ms (of verify) "
        "| rebuild ms | gather ms | draft ms (x roof) | int8 draft ms (x roof) | gamma / roofline "
        "| int8 gamma / roofline | max S roofline / steps | read beside the steps GB/s (max / min) "
        "| GEMM beside the steps GFLOP/s (max / min) | x roof at the rates beside: AR / verify / draft |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if r["kind"] != "steps":
            continue
        lines.append(
            f"| {r['context_len']} ({r.get('prompt_len', r['context_len'])}) | {r['batch_size']} | {r['n_index']} "
            f"| {_f(r['prefill_s'], '.2f')} ({_f(r.get('prefill_x_roofline'), '.2f')}x) "
            f"| {r['ar_step_s'] * 1e3:.1f} ({r['ar_step_x_roofline']:.2f}x) "
            f"| {_ms3(r, 'ar')} | {r['verify_s'] * 1e3:.1f} "
            f"| {100 * r['importance_overhead']:+.1f} % ({_f(r.get('verify_x_roofline'), '.2f')}x) | {_ms3(r, 'verify')} "
            f"| {r['index_update_s'] * 1e3:.2f} "
            f"({100 * r['index_update_frac_of_verify']:.1f} %) | {r['index_rebuild_s'] * 1e3:.2f} "
            f"| {r['gather_s'] * 1e3:.2f} | {r['draft_step_s'] * 1e3:.1f} ({r['draft_step_x_roofline']:.2f}x) "
            f"| {_f(r.get('draft_step_int8_s') and r['draft_step_int8_s'] * 1e3, '.1f')} "
            f"({_f(r.get('draft_step_int8_x_roofline'), '.2f')}x) "
            f"| {r['gamma']:.3f} / {r['gamma_roofline']:.3f} "
            f"| {_f(r.get('gamma_int8'))} / {_f(r.get('gamma_int8_roofline'))} "
            f"| {_f(r.get('roofline_max_speedup'), '.2f')} / {_f(r.get('step_max_speedup'), '.2f')} "
            f"| {_f(r.get('read_beside_bytes_per_s') and r['read_beside_bytes_per_s'] / 1e9, '.1f')} "
            f"({_f(r.get('read_beside_spread'), '.2f')}) "
            f"| {_f(r.get('gemm_beside_flops_per_s') and r['gemm_beside_flops_per_s'] / 1e9, '.0f')} "
            f"({_f(r.get('gemm_beside_spread'), '.2f')}) "
            f"| {' / '.join(_f(r.get(f'{n}_x_roofline_beside'), '.2f') for n in ('ar_step', 'verify', 'draft_step'))} |"
        )
    peers = [r for r in result["rows"] if r["kind"] == "peer"]
    if peers:
        lines += ["", f"peers: the same prompts, model, dtype and threads, N = {meta['config'].get('peer_tokens', 'N')} "
                      "tokens; decode ms per step = (last emission of any row - first emission of the last row) / "
                      "output positions after the first emission, from each engine's own token times (no prefill "
                      "in it), best of reps; tokens compared with our ar's (first N - 1)", "",
                  "| ctx | B | engine:method | decode ms/step | x our ar | same tokens as our ar | note |",
                  "|---|---|---|---|---|---|---|"]
        for r in peers:
            spec = r.get("spec_decode") or {}
            note = r.get("error") or r.get("note") or (f"accept rate {spec['acceptance_rate']:.2f}" if spec.get("acceptance_rate") else "")
            lines.append(f"| {r['context_len']} | {r['batch_size']} | {r['method']} "
                         f"| {_f(r.get('decode_ms_per_step'), '.1f')} | {_f(r.get('over_ours_ar'), '.2f')} "
                         f"| {_f(r.get('same_tokens_as_ours'))} | {note} |")
    e2e = [r for r in result["rows"] if r["kind"] == "e2e"]
    if e2e:
        info = meta.get("e2e") or {}
        lines += [
            "",
            f"end to end: sweep of the `speed` benchmark, {len(info.get('run_ids') or [])} run(s), "
            f"{info.get('done', 0)} shard(s) run, {info.get('skipped', 0)} already stored, "
            f"{len(info.get('failed') or {})} failed; speedup = median over paired batches (`cluster.results.report`)",
            "",
            "| ctx | B | method | n | decode tok/s | speedup (per batch) | alpha | tau | mean k | gamma | ledger S | "
            "cycle-predicted S | step-predicted S | roofline S | measured / roofline | roofline k (S) | straggle "
            "| lossless |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in e2e:
            runs = ", ".join(f"{x:.2f}" for x in r.get("speedup_runs") or [])
            lossless = "-" if r.get("lossless_rate") is None else f"{100 * r['lossless_rate']:.0f} %"
            lines.append(
                f"| {r['context_len']} | {r['batch_size']} | {r['method']} | {r['n']} "
                f"| {_f(r['decode_tokens_per_s'], '.1f')} "
                f"| {_f(r['speedup'])} ({runs}) | {_f(r.get('alpha'))} | {_f(r.get('tau'), '.2f')} "
                f"| {_f(r.get('mean_k'), '.2f')} | {_f(r.get('gamma'))} | {_f(r.get('ledger_speedup'))} "
                f"| {_f(r.get('cycle_predicted_speedup'))} | {_f(r.get('step_predicted_speedup'))} "
                f"| {_f(r.get('roofline_speedup'))} | {_f(r.get('measured_over_roofline'), '.2f')} "
                f"| {_f(r.get('roofline_best_k'))} ({_f(r.get('roofline_best_speedup'), '.2f')}) "
                f"| {_f(r.get('straggle'))} | {lossless} |"
            )
    return "\n".join(lines)


def store_result(db: str, result: dict[str, Any]) -> str:
    """Write the bench run and its rows (steps, hf, e2e) to the ``bench`` table; returns the run
    id. The end-to-end results themselves are the sweep's runs (``meta["e2e"]["run_ids"]``)."""
    import hashlib

    from cluster.results.store import open_store

    blob = json.dumps(result["meta"], sort_keys=True, default=str)
    run_id = "bench-" + hashlib.sha256(blob.encode()).hexdigest()[:16]
    cfg = result["meta"]["config"]
    e2e = result["meta"].get("e2e") or {}
    with open_store(db) as store:
        store.start_run(run_id, benchmark="bench", model=result["meta"]["model"],
                        methods=[AR, *cfg["methods"]],
                        config={**cfg, "machine": result["machine"], "e2e_run_ids": e2e.get("run_ids", [])},
                        host={"host": result["meta"]["host"], "machine": result["meta"]["machine_desc"]})
        store.add_bench_rows(run_id, result["meta"]["model"], cfg["device"], result["rows"])
        store.finish_run(run_id)
    return run_id


# --------------------------------------------------------------------------- CLI
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
    from cluster.results.store import DEFAULT_DB_URL

    p = argparse.ArgumentParser(prog="python -m cluster.speed", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="model preset or local HF folder")
    p.add_argument("--shape", default=None, help="model shape from sparsespec.shapes (with --random-weights)")
    p.add_argument("--random-weights", action="store_true",
                   help="random weights at --shape (no download; step timings only)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--context-lengths", type=_ints, default=(1024, 2048, 4096, 8192),
                   help="prompt + generated tokens, as in every sweep")
    p.add_argument("--batch-sizes", type=_ints, default=(1, 4, 8))
    p.add_argument("--methods", default="sparsespec-l", help="comma list; ar is always the reference")
    p.add_argument("--k", type=int, default=8, help="draft length of the step timings")
    p.add_argument("--method-k", type=_k, default=None, help="k of the end-to-end runs (default: --k; or 'auto')")
    p.add_argument("--budget-frac", type=float, default=0.1)
    p.add_argument("--draft-weights", default="target", choices=("target", "int8"),
                   help="draft weights of the self-speculative methods in the end-to-end runs (the step timings "
                        "measure both)")
    p.add_argument("--quantize", default="none", choices=("none", "int8"),
                   help="the target's weights: int8 times every step (ar included) and runs the end-to-end sweep "
                        "on the int8 target, whose ar is the reference")
    p.add_argument("--gen-tokens", type=int, default=64, help="fixed generation length (ignore_eos)")
    p.add_argument("--reps", type=int, default=5, help="timed calls per step (median)")
    p.add_argument("--e2e-reps", type=int, default=2, help="repetitions of every end-to-end cell (sweep repetitions)")
    p.add_argument("--e2e-samples", type=int, default=None,
                   help="speed samples per end-to-end cell (default: its batch size, one batch per cell)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps-only", action="store_true", help="skip the end-to-end sweep")
    p.add_argument("--e2e-max-tokens", type=int, default=None,
                   help="end-to-end cells only where batch x context <= this (prefill of every row is slow on CPU)")
    p.add_argument("--peers", default="transformers,vllm",
                   help="external engines timed beside our ar and ngram: comma list of transformers, vllm; 'none'")
    p.add_argument("--peer-tokens", type=int, default=32, help="tokens per peer timing (decode ms/step from each engine's token times)")
    p.add_argument("--peer-ngram-k", type=int, default=4, help="drafts of every engine's prompt lookup / ngram")
    p.add_argument("--peer-reps", type=int, default=3, help="timed repetitions of every peer timing, after one warm-up (best of)")
    p.add_argument("--peer-max-tokens", type=int, default=None,
                   help="peer cells only where batch x context <= this (default: every cell)")
    p.add_argument("--text", default=None,
                   help="plain-text file the prompts are cut from (default: the speed benchmark's public-domain book)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads here and per end-to-end worker (default: torch's / the worker's CPUs)")
    p.add_argument("--ray", action="store_true",
                   help="also fan the step timings out over Ray workers, one task per context length")
    p.add_argument("--ray-address", default=None,
                   help="Ray cluster to join (default: a running Ray, else RAY_ADDRESS, else a local Ray)")
    p.add_argument("--num-workers", type=int, default=None,
                   help="engine actors of the end-to-end sweep, and Ray workers with --ray "
                        "(default: one per GPU, else 1)")
    p.add_argument("--db", default=DEFAULT_DB_URL,
                   help="result store URL: the sweep's results and the bench table ('' to store nothing; the "
                        "end-to-end sweep then uses a throwaway store and cannot resume)")
    p.add_argument("--json-out", default=None, help="also write the full result as JSON here")
    p.add_argument("--markdown-out", default=None, help="also write the Markdown tables here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar for the end-to-end sweep")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    p.add_argument("--profile", default=None, choices=("ar", "verify", "draft", "index"),
                   help="also print the torch profiler's op table of this step (first context length and batch size)")
    a = p.parse_args(argv)
    methods = tuple(m.strip() for m in a.methods.split(",") if m.strip() and m.strip() != AR)
    try:
        cfg = BenchConfig(model=a.model, shape=a.shape, random_weights=a.random_weights, device=a.device,
                          dtype=a.dtype, context_lengths=a.context_lengths, batch_sizes=a.batch_sizes,
                          methods=methods, k=a.k, method_k=a.k if a.method_k is None else a.method_k,
                          budget_frac=a.budget_frac, gen_tokens=a.gen_tokens, reps=a.reps, e2e_reps=a.e2e_reps,
                          e2e_samples=a.e2e_samples, warmup=a.warmup, steps_only=a.steps_only,
                          peers=tuple(x.strip() for x in a.peers.split(",") if x.strip() and x.strip() != "none"),
                          peer_tokens=a.peer_tokens, peer_ngram_k=a.peer_ngram_k, peer_reps=a.peer_reps,
                          peer_max_tokens=a.peer_max_tokens,
                          seed=a.seed, text=a.text, e2e_max_tokens=a.e2e_max_tokens,
                          draft_weights=a.draft_weights, quantize=a.quantize, profile=a.profile)
    except ValueError as e:
        p.error(str(e))
    return cfg, a


def main(argv: Sequence[str] | None = None) -> int:
    cfg, a = parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=a.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch

    import sparsespec
    from cluster.results.store import StoreError, safe_url

    errors: tuple[type[Exception], ...] = (StoreError,)
    if cfg.runs_e2e or a.ray:  # a sweep's workers (the sweep layer needs pydantic and Ray: not on bare GPU images)
        from cluster.sweep.coordinator import WorkerStartError

        errors += (WorkerStartError,)

    if a.threads:
        torch.set_num_threads(a.threads)
    unknown = [m for m in cfg.methods if m not in sparsespec.METHODS]
    if unknown:
        print(f"error: unknown method(s) {unknown}; available: {sorted(sparsespec.METHODS)}", file=sys.stderr)
        return 2
    if cfg.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    kw = dict(ray_address=a.ray_address, num_workers=a.num_workers, threads=a.threads, db=a.db or None,
              bar=not a.no_progress)
    try:
        result = run_bench_ray(cfg, **kw) if a.ray else run_bench(cfg, **kw)
    except (ValueError, FileNotFoundError, sparsespec.ModelNotAvailableError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except errors as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
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
        print(f"\nstored as run {run_id} in {safe_url(a.db)}")
    failed = (result["meta"].get("e2e") or {}).get("failed") or {}
    for key, err in failed.items():
        print(f"FAILED {key}: {err}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

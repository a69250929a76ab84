"""Paired end-to-end decode: ``ar`` against speculation, step by step on one machine.

Per (batch, context) cell, one ``EngineCore`` per method decodes the same prompts (``ignore_eos``,
so every method decodes exactly ``--gen-tokens``), and the cores take their steps **in turn**
(``--schedule step``, the default: method 1's step, method 2's step, ..., the order rotating every
round). Each core's decode time is the sum of its own steps' wall times less its rows' prefills,
so a slow minute of a shared, noisy machine lands on every method alike and the speedup is a
paired ratio of one run. (Sequential runs of a whole batch per method, each paired with its own
``ar`` run, moved by 10-16 % between runs on the 2-core CPU machines: more than the effects being
measured.) ``--schedule run`` instead runs each method's whole batch back to back, alternating
the order every repetition (one pool in memory at a time: the GPU check's long cells).

Per method and cell it reports the batch TPOT (``sparsespec.stats.batch_tpot`` of the rows'
stats with the core's own decode time), the speedup over ``ar`` in the same repetition (median
over ``--reps``), alpha, tau, mean k and gamma (``sparsespec.stats.derive`` of the pooled
stats), ``k="auto"``'s choices (the controller's k histogram) and whether its greedy tokens equal
``ar``'s. Every run records the CPU (model, ISA flags), the kernel plan and the bandwidth and GEMM
rate measured at its start.

Real model (``--model``: a preset or a local HF folder; prompts are the ``speed`` benchmark's
windows of a public-domain book, as in ``cluster.speed.measure``) or random weights at a real shape
(``--shape``, for GPU checks where no checkpoint is on the machine; random ids, near-uniform
logits, so alpha says little there)::

    python benchmarks/paired_e2e.py --model smollm2-135m --device cpu --dtype float32 --threads 2 \\
        --batch-sizes 4 --context-lengths 6144 --methods sparsespec-l:2,sparsespec-l:8,sparsespec-l:auto
    python benchmarks/paired_e2e.py --shape llama-3.1-8b --device cuda --dtype bfloat16 --schedule run \\
        --batch-sizes 1,4,16 --context-lengths 16384,32768,65536 --json-out e2e.json
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from sparsespec import SamplingParams
from sparsespec.engine import _DTYPES, Engine, EngineCore, step_in_turn
from sparsespec.stats import batch_tpot, derive, pool


class IdTokenizer:
    """Decodes ids as their numbers (random-weight runs have no vocabulary; the engine only
    decodes for stop strings and text deltas, which these runs do not use)."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(int(i)) for i in ids)


def parse_methods(spec: str) -> list[tuple[str, dict[str, Any]]]:
    """``"sparsespec-l:2,ngram:4,sparsespec-l:auto"`` -> ``[("ar", {}), (name, {"k": k}), ...]``
    (``ar`` first, always; a method without ``:k`` gets k = 4; duplicates are dropped).

    Raises:
        ValueError: a k that is neither an integer >= 1 nor ``auto``.
    """
    out: list[tuple[str, dict[str, Any]]] = [("ar", {})]
    for item in spec.split(","):
        name, _, k = item.strip().partition(":")
        if not name or name == "ar":
            continue
        if k and k != "auto" and not (k.isdigit() and int(k) >= 1):
            raise ValueError(f"{item!r}: k must be an integer >= 1 or 'auto'")
        entry = (name, {"k": k if k == "auto" else int(k or 4)})
        if entry not in out:
            out.append(entry)
    return out


def label(name: str, opts: dict[str, Any]) -> str:
    return name if name == "ar" else f"{name} k={opts['k']}"


class _Run:
    """One method's core in a cell: its own step time, its rows' final outputs."""

    def __init__(self, engine: Engine, name: str, opts: dict[str, Any], prompts: Sequence[Sequence[int]],
                 gen_tokens: int, window: int):
        self.name, self.opts = name, opts
        self.core = EngineCore(engine, name, opts or None, max_num_seqs=len(prompts), max_model_len=window)
        params = SamplingParams(max_new_tokens=gen_tokens, ignore_eos=True)
        for i, p in enumerate(prompts):
            self.core.add_request(str(i), list(p), params)
        self.wall_s = 0.0
        self.outputs: dict[int, Any] = {}

    @property
    def done(self) -> bool:
        return not self.core.has_unfinished_requests()

    def step(self, clock) -> None:
        t0 = clock()
        outs = self.core.step()
        self.took(outs, clock() - t0)

    def took(self, outs, seconds: float) -> None:
        """One of this core's steps: its outputs and wall seconds."""
        self.wall_s += seconds
        for o in outs:
            if o.finished:
                self.outputs[int(o.request_id)] = o.output

    def result(self) -> dict[str, Any]:
        outs = [self.outputs[i] for i in sorted(self.outputs)]
        stats = [dict(o.stats) for o in outs]
        # the batch's decode time: its own steps' wall time less the rows' prefills (batch_tpot)
        prefill = sum(s.get("prefill_s", 0.0) for s in stats)
        for s in stats:
            s.update(batch_wall_s=self.wall_s, batch_prefill_s=prefill)
        ctl = self.core.controller
        # the counts' ratios (alpha, tau, mean k, gamma) from derive; not its tpot_s / tokens_per_s,
        # which read the rows' emit times: under the step schedule those include the other cores' steps
        ratios = {f: v for f, v in derive(pool(stats)).items() if f in ("alpha", "tau", "mean_k", "gamma")}
        return {**ratios, "tpot_s": batch_tpot(stats), "tokens": [list(o.token_ids) for o in outs],
                "k_hist": None if ctl is None else ctl.state()["k_hist"]}


def run_cell(engine: Engine, methods: Sequence[tuple[str, dict[str, Any]]], prompts: Sequence[Sequence[int]],
             gen_tokens: int, window: int, schedule: str) -> dict[str, dict[str, Any]]:
    """One repetition of a cell: every method's result keyed by ``label``."""
    clock = engine.clock
    if schedule == "run":
        results = {}
        for name, opts in methods:
            r = _Run(engine, name, opts, prompts, gen_tokens, window)
            while not r.done:
                r.step(clock)
            results[label(name, opts)] = r.result()
            del r
        return results
    runs = [_Run(engine, name, opts, prompts, gen_tokens, window) for name, opts in methods]
    for i, outs, seconds in step_in_turn([r.core for r in runs], clock):  # the order rotates every round
        runs[i].took(outs, seconds)
    return {label(r.name, r.opts): r.result() for r in runs}


def summarise(reps: Sequence[dict[str, dict[str, Any]]], methods: Sequence[tuple[str, dict[str, Any]]]
              ) -> list[dict[str, Any]]:
    """Per method: median TPOT, median of the per-repetition speedups over ``ar``, the last
    repetition's acceptance figures, and whether every repetition gave ``ar``'s tokens."""
    rows = []
    for name, opts in methods:
        key = label(name, opts)
        runs = [rep[key] for rep in reps]
        ratios = [rep["ar"]["tpot_s"] / rep[key]["tpot_s"] for rep in reps if rep["ar"]["tpot_s"] and rep[key]["tpot_s"]]
        last = runs[-1]
        rows.append({"method": name, "k": opts.get("k", 0),
                     "tpot_s": statistics.median(r["tpot_s"] for r in runs if r["tpot_s"]),
                     "speedup": statistics.median(ratios) if ratios else None,
                     "speedups": ratios,
                     **{f: last[f] for f in ("alpha", "tau", "mean_k", "gamma", "k_hist")},
                     "same_tokens": all(rep[key]["tokens"] == rep["ar"]["tokens"] for rep in reps)})
    return rows


def _fmt(v: Any, fmt: str = ".3f") -> str:
    return "-" if v is None else format(v, fmt)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="model preset or local HF folder (real weights, book prompts)")
    src.add_argument("--shape", default=None, help="random weights at this sparsespec.shapes shape (random prompts)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    p.add_argument("--batch-sizes", default="1,4,16")
    p.add_argument("--context-lengths", default="16384,32768,65536",
                   help="prompt + generated tokens, as in every sweep")
    p.add_argument("--methods", default="sparsespec-l:auto,sparsespec-l:4",
                   help="comma list of method[:k]; ar is always the reference")
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed warm-up cells per batch size before its timed ones (every method, a short "
                        "context): compiles the GPU kernels for each (batch, draft length) outside the timing; "
                        "default 1 on cuda, 0 on cpu")
    p.add_argument("--schedule", default="step", choices=("step", "run"),
                   help="step: the methods' cores take turns step by step (default); run: whole batches back to back")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-batch-tokens", type=int, default=None,
                   help="skip (batch, context) cells with batch x context above this (prefill time and KV memory)")
    p.add_argument("--json-out", default=None)
    a = p.parse_args(argv)
    if a.model is None and a.shape is None:
        a.shape = "llama-3.1-8b"
    if a.threads:
        torch.set_num_threads(a.threads)
    methods = parse_methods(a.methods)
    warmup = a.warmup if a.warmup is not None else (1 if torch.device(a.device).type == "cuda" else 0)
    if warmup < 0:
        p.error(f"--warmup must be >= 0, got {warmup}")
    batch_sizes = [int(x) for x in a.batch_sizes.split(",")]
    lengths = [int(x) for x in a.context_lengths.split(",")]

    from cluster.speed.measure import BenchConfig, make_prompts, run_stamp
    from sparsespec.roofline import measure_machine

    if a.model is not None:
        engine = Engine.from_pretrained(a.model, dtype=a.dtype, device=a.device)
        tokenizer, name = engine.tokenizer, a.model
    else:
        from sparsespec.shapes import random_transformer

        model = random_transformer(a.shape, dtype=_DTYPES[a.dtype], device=a.device, seed=0)
        engine, tokenizer, name = Engine(model, IdTokenizer(), name=f"random:{a.shape}"), None, f"random:{a.shape}"
    model = engine.model
    machine = measure_machine(a.device, model.dtype, reps=3)
    meta = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "model": name,
            "device": a.device, "dtype": a.dtype, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "schedule": a.schedule, "gen_tokens": a.gen_tokens, "reps": a.reps,
            "warmup": warmup, **run_stamp(model, machine)}
    print(f"{meta['date']} · {name} ({a.dtype}, {a.device}) · {meta['cpu']} [{meta['isa']}] · torch {meta['torch']} · "
          f"{meta['threads']} threads · kernels: {meta['kernels']}")
    print(f"read {meta['read_bytes_per_s'] / 1e9:.1f} GB/s, GEMM {meta['gemm_flops_per_s'] / 1e9:.0f} GFLOP/s ({meta['gemm_backend']}) · "
          f"schedule {a.schedule}, {a.reps} rep(s), {a.gen_tokens} tokens, {warmup} warm-up cell(s) per batch size\n")
    print("| B | ctx | method | TPOT ms | speedup vs ar (per rep) | alpha | tau | mean k | gamma | k chosen | same tokens as ar |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    cfg = BenchConfig(model=a.model or "smollm2-135m", gen_tokens=a.gen_tokens)
    for B in batch_sizes:
        runnable = [L for L in lengths if L - a.gen_tokens >= 1 and L <= engine.max_context]
        if warmup and runnable:  # (cells that cannot run are reported below; they get no warm-up)
            warm_cfg = BenchConfig(model=a.model or "smollm2-135m", gen_tokens=min(8, a.gen_tokens))
            warm_L = min(2048, *runnable)
            warm_prompts = make_prompts(tokenizer, model.cfg.vocab_size, engine.max_context, B, warm_L, warm_cfg)
            for _ in range(warmup):
                run_cell(engine, methods, warm_prompts, warm_cfg.gen_tokens, warm_L, a.schedule)
        for L in lengths:
            if a.max_batch_tokens and B * L > a.max_batch_tokens:
                print(f"| {B} | {L} | (skipped: {B} x {L} > --max-batch-tokens {a.max_batch_tokens}) |||||||||")
                continue
            if L - a.gen_tokens < 1 or L > engine.max_context:
                print(f"| {B} | {L} | (skipped: needs 1 <= prompt and context <= the model's {engine.max_context}) |||||||||")
                continue
            prompts = make_prompts(tokenizer, model.cfg.vocab_size, engine.max_context, B, L, cfg)
            t0 = time.perf_counter()
            try:
                reps = []
                for rep in range(a.reps):
                    order = methods if rep % 2 == 0 else methods[:1] + methods[1:][::-1]
                    reps.append(run_cell(engine, order, prompts, a.gen_tokens, L, a.schedule))
            except torch.OutOfMemoryError as e:  # a cell that does not fit is reported, not fatal
                print(f"| {B} | {L} | (out of memory: {str(e).splitlines()[0]}) |||||||||")
                torch.cuda.empty_cache()
                continue
            for row in summarise(reps, methods):
                row.update(batch_size=B, context_len=L, cell_wall_s=time.perf_counter() - t0)
                rows.append(row)
                hist = "-" if not row["k_hist"] else " ".join(f"{k}:{n}" for k, n in row["k_hist"].items())
                per = "/".join(f"{x:.3f}" for x in row["speedups"])
                print(f"| {B} | {L} | {label(row['method'], {'k': row['k']})} | {row['tpot_s'] * 1e3:.2f} | "
                      f"{_fmt(row['speedup'])} ({per}) | {_fmt(row['alpha'])} | {_fmt(row['tau'], '.2f')} | "
                      f"{_fmt(row['mean_k'], '.2f')} | {_fmt(row['gamma'])} | {hist} | {row['same_tokens']} |", flush=True)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"meta": meta, "machine": machine, "rows": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

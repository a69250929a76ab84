"""Where one decode step's time goes: ``torch.profiler`` of the AR, verify and draft steps.

Random weights at a real shape (``sparsespec.shapes``; step times depend on shapes, not on
values), a cache filled to ``--context`` positions per row, ``--batch`` rows::

    python benchmarks/profile_steps.py --shape smollm2-135m --batch 4 --context 4096 --k 8 --threads 2
    python benchmarks/profile_steps.py ... --profile verify      # + the profiler's op table

Prints the median seconds of each step (``--reps`` timed calls after warm-up) beside its
roofline (``sparsespec.roofline``, bandwidth and GEMM rate measured now), then, with
``--profile STEP``, the top ops of that step by self CPU time. Run it alone on the machine
(no test run or other timing beside it).
"""
from __future__ import annotations

import argparse

import torch

from sparsespec.adaptive import FixedK
from sparsespec.config import SamplingParams, SpecConfig
from sparsespec.drafters.sparse_self import SparseSelfDrafter
from sparsespec.kv.cache import KVCache
from sparsespec.roofline import measure_machine, roofline, time_call
from sparsespec.sampling import BatchSampling
from sparsespec.shapes import random_transformer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--budget-frac", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--profile", choices=("ar", "verify", "draft", "index"), default=None)
    p.add_argument("--rows", type=int, default=25, help="ops shown by --profile")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model = random_transformer(a.shape, dtype=torch.float32, device="cpu", seed=0)
    B, P, K = a.batch, a.context, a.k
    spec = SpecConfig.from_options({"k": K, "budget_frac": a.budget_frac})
    cache = KVCache(model.cfg, B, P + K + 2, model.dtype, "cpu")
    g = torch.Generator().manual_seed(0)
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    cache.lengths = [P] * B
    drafter = SparseSelfDrafter(model, spec, P + K + 2, B, K)
    tokv = torch.full((B, K + 1), 42, dtype=torch.long)
    tok1 = tokv[:, :1]
    _, rows = model.forward_dense(tokv, cache, want_rows=K + 1)  # [L, B, H_kv, K+1, S]
    cache.rollback([P] * B)
    drafter.commit(cache, rows, [K + 1] * B)
    sampling = BatchSampling([SamplingParams(max_new_tokens=K + 2)] * B, [None] * B)
    base = [P] * B

    def ar():
        model.forward_dense(tok1, cache)
        cache.rollback(base)

    def verify():
        model.forward_dense(tokv, cache, want_rows=K + 1)
        cache.rollback(base)

    def draft():
        drafter.propose(cache, tok1, [K] * B, [FixedK(K)] * B, sampling)

    def index():
        drafter.commit(cache, rows, [K + 1] * B)

    steps = {"ar": ar, "verify": verify, "draft": draft, "index": index}
    machine = measure_machine("cpu", torch.float32)
    n = max(drafter.index_sizes())
    floors = {"ar": roofline(model, machine, B, 1, P)["roofline_s"],
              "verify": roofline(model, machine, B, K + 1, P)["roofline_s"],
              "draft": K * roofline(model, machine, B, 1, n + K / 2)["roofline_s"], "index": None}
    print(f"{a.shape} B={B} ctx={P} K={K} N={n} threads={a.threads}; read {machine['read_bytes_per_s'] / 1e9:.1f} GB/s, "
          f"GEMM {machine['gemm_flops_per_s'] / 1e9:.0f} GFLOP/s")
    for name, fn in steps.items():
        t = time_call(fn, "cpu", a.reps, 2)
        f = floors[name]
        extra = f" (roofline {f * 1e3:.1f} ms, {t / f:.2f}x)" if f else ""
        print(f"{name:7s} {t * 1e3:8.1f} ms{extra}")
    if a.profile:
        fn = steps[a.profile]
        fn()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                fn()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows))


if __name__ == "__main__":
    main()

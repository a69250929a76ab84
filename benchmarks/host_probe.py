"""Is the host slow right now, and in what? One process, a loop for ``--seconds``: the target's AR
decode step at batch x context, beside the read rate over (a) a fresh 256 MiB buffer (what
``sparsespec.roofline.measure_machine`` and ``ReadProbe`` read), (b) the model's own packed weight
panels (what the step reads), (c) the KV cache, a small in-cache GEMM (the cores' speed), the
host's steal ticks (``/proc/stat``) and this process's minor page faults per step.

On the 2-core AMD EPYC of benchmarks/RESULTS.md (twenty-second session) the step's "slow state"
(Qwen2.5-Coder-1.5B, 1 x 8K: 134-137 ms against 92-95) came with every read rate at once
(48-55 GB/s against 78-90), the GEMM unchanged, no steal and no page faults: the host's memory
bandwidth, for seconds to minutes. The KV cache holds random values (a step's time depends on
shapes, not on what the rows hold)::

    .venv/bin/python benchmarks/host_probe.py --model qwen2.5-coder-1.5b --context 8192 --seconds 60

Prints one line per sample: time, step ms (median and min of 5), the three read rates (GB/s),
GEMM GFLOP/s, steal ticks and faults per step over the sample.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import time


def _steal_ticks() -> int:
    with open("/proc/stat") as f:
        return int(f.readline().split()[8])


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a preset or a local HF folder")
    ap.add_argument("--context", type=int, default=8192, help="tokens in the cache")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if args.context < 2 or args.batch < 1 or args.seconds <= 0:
        ap.error("--context must be >= 2, --batch >= 1 and --seconds > 0")

    import torch

    from sparsespec.kv.cache import KVCache
    from sparsespec.model import Transformer
    from sparsespec.provision import resolve_model
    from sparsespec.quant import PANELS_ATTR, linear_weights

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model = Transformer.from_folder(resolve_model(args.model), dtype=torch.float32, device="cpu")
    print(f"pid {os.getpid()}, loaded in {time.perf_counter() - t0:.1f} s, kernels: {model.kernel_plan.summary()}")
    if args.context + 4 > model.cfg.max_position_embeddings:
        ap.error(f"--context {args.context} does not fit the model's window ({model.cfg.max_position_embeddings})")
    panels = [getattr(w, PANELS_ATTR) for w in linear_weights(model) if hasattr(w, PANELS_ATTR)]
    panel_bytes = sum(p.numel() * p.element_size() for p in panels)
    B, P = args.batch, args.context - 2
    cache = KVCache(model.cfg, B, args.context + 4, model.dtype, "cpu")
    g = torch.Generator().manual_seed(0)
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    cache.lengths = [P] * B
    kv_bytes = cache.k.numel() * cache.k.element_size()
    tok = torch.full((B, 1), 42, dtype=torch.long)
    fresh = torch.ones((256 << 20) // 4)
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def best(fn, n: int) -> tuple[float, float]:
        ts = []
        for _ in range(n):
            s = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - s)
        return min(ts), statistics.median(ts)

    def step() -> None:
        model.forward_dense(tok, cache, logits_for="all")
        cache.rollback([P] * B)

    def read_panels() -> None:
        for p in panels:
            p.sum()

    step()
    step()
    print("time step_median_ms step_min_ms panels_GBps fresh_GBps kv_GBps gemm_GFLOPs steal_ticks faults_per_step")
    end = time.time() + args.seconds
    while time.time() < end:
        s0, f0 = _steal_ticks(), _faults()
        s_min, s_med = best(step, 5)
        faults = (_faults() - f0) / 5
        p_min = best(read_panels, 3)[0] if panels else float("nan")
        x_min = best(lambda: fresh.sum(), 5)[0]
        k_min = best(lambda: cache.k.sum(), 3)[0]
        g_min = best(lambda: torch.mm(a, b), 50)[0]
        print(f"{time.strftime('%H:%M:%S')} {s_med * 1e3:.1f} {s_min * 1e3:.1f} "
              f"{panel_bytes / p_min / 1e9 if panels else float('nan'):.1f} {fresh.numel() * 4 / x_min / 1e9:.1f} "
              f"{kv_bytes / k_min / 1e9:.1f} {2 * 256 ** 3 / g_min / 1e9:.0f} {_steal_ticks() - s0} {faults:.0f}",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

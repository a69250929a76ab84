"""The kernel plan's default against every alternative, on this CPU, in one process.

For one model, the AR step (T = 1) and the verify step (T = k + 1, importance rows into a ring
target, as the engine runs it) at the given batch sizes and context, under each plan:

* ``default``: what ``model.use_kernels("auto")`` chose here (measured at load, or cached);
* ``again``: the default once more (an A/A control: the spread between identical plans);
* ``torch``: PyTorch's ops only (MKL ``F.linear``, the reference attention);
* ``onednn``: oneDNN's prepacked linears for every width, the rest as the default;
* ``mkl``: PyTorch's ``F.linear`` for every width, the rest as the default;
* ``ss``: our packed linear for every width, the rest as the default.

The plans are timed interleaved, in a new seeded order each round and after an untimed step of their
own (best of ``--reps``), each step as a multiple of the default's::

    .venv/bin/python benchmarks/plan_alternatives.py --model smollm2-135m --context 4096 --batch-sizes 1,4

Run it alone on the machine: it is a measurement.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time

import torch

from sparsespec.kernels import cpu
from sparsespec.kernels.plan import torch_plan
from sparsespec.kv.cache import KVCache
from sparsespec.kv.index import RowsTarget
from sparsespec.model import Transformer
from sparsespec.provision import resolve_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--batch-sizes", default="1,4")
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json-out", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model = Transformer.from_folder(resolve_model(a.model))
    default = model.kernel_plan
    # the library plans keep the default's attention and its measured knobs (tiles, prefetches): each
    # differs from the default in its linears only. "again" is the default itself, timed as one more
    # plan: the spread between two identical plans in the same run is what a difference must exceed.
    plans = {"default": default, "again": dataclasses.replace(default, source="user"),
             "torch": torch_plan("alternative", "user"),
             **{lin: dataclasses.replace(default, linear=((None, lin),), source="user")
                for lin in ("onednn", "mkl", "ss")}}
    P, K, cfg = a.context, a.k, model.cfg
    rows_out = []
    print(f"{a.model}: CPU {cpu.cpu_model()} [{cpu.isa_summary()}], default {default.summary()}")
    for B in (int(x) for x in a.batch_sizes.split(",")):
        cache = KVCache(cfg, B, P + K + 2, model.dtype, "cpu")
        g = torch.Generator().manual_seed(0)
        cache.k.normal_(generator=g)
        cache.v.normal_(generator=g)
        cache.lengths = [P] * B
        ring = RowsTarget(torch.empty(cfg.num_layers, B, cfg.num_kv_heads, K + 1, P + K + 1),
                          torch.arange(K + 1).repeat(B, 1))
        t1, tv = torch.full((B, 1), 42), torch.full((B, K + 1), 42)
        best = {(n, s): float("inf") for n in plans for s in ("ar", "verify")}
        order = random.Random(B)
        with torch.inference_mode():
            for rep in range(a.reps + 1):  # the first round warms every plan up (not kept)
                # a new order each round and an untimed step after each switch: in a fixed order the
                # first plan timed after a switch ran 1-13 % slower than the same plan right after it
                # (the "again" control, AMD EPYC without AVX-512, 2026-12-07)
                for name in order.sample(list(plans), len(plans)):
                    model.use_kernels(plans[name])
                    for step, ids, target in (("warm", t1, None), ("ar", t1, None), ("verify", tv, ring)):
                        t0 = time.perf_counter()
                        model.forward_dense_features(ids, cache, want_rows=ids.shape[1] if target else 0,
                                                     rows_into=target)
                        dt = time.perf_counter() - t0
                        cache.rollback([P] * B)
                        if rep and step != "warm":
                            best[(name, step)] = min(best[(name, step)], dt)
        model.use_kernels(default)
        for step in ("ar", "verify"):
            base = best[("default", step)]
            row = {"model": a.model, "batch_size": B, "context": P, "step": step,
                   **{f"{n}_ms": best[(n, step)] * 1e3 for n in plans},
                   **{f"{n}_over_default": best[(n, step)] / base for n in plans}}
            rows_out.append(row)
            print(f"B={B} {step:6s} " + "  ".join(f"{n} {best[(n, step)] * 1e3:7.1f} ms ({best[(n, step)] / base:.2f}x)"
                                                  for n in plans))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"cpu": cpu.cpu_model(), "isa": cpu.isa_summary(), "default": default.describe(),
                       "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()

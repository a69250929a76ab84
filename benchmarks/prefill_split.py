"""A whole chunked prefill with each prefill attention, interleaved in one process on the same
random prompt: the masked SDPA, PyTorch's flash split in two (``sparsespec.model.chunk_attention_cpu``:
the prefix as grouped query rows plus the chunk's own causal block, merged by log-sum-exp) and ours
(``sparsespec.kernels.cpu.prefill_attention``, AVX-512 or AVX2 tiles as the plan runs them), with the
largest logit difference of each from the masked SDPA. The rest of the forward is the measured
kernel plan's in all three.

    python benchmarks/prefill_split.py --model smollm2-135m --lengths 2048,4096,8192 --reps 2 --threads 2
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import torch

import sparsespec.model as M
from sparsespec.kernels import cpu
from sparsespec.kv.cache import KVCache
from sparsespec.model import Transformer
from sparsespec.provision import resolve_model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/prefill_split.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--lengths", default="2048,4096,8192")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    model = Transformer.from_folder(resolve_model(a.model)).use_kernels("auto")
    split = M._FLASH_CPU
    if split is None:
        raise SystemExit("this torch has no fused CPU flash attention op: nothing to compare")
    plan = model.kernel_plan
    ours = plan.attention == "ss" and cpu.prefill_attention_supported(model.cfg.head_dim)
    variants = {"masked SDPA": (None, "torch"), "split flash": (split, "torch")}
    if ours:
        variants["ours"] = (split, "ss")
    print(f"{a.model}, {a.threads} threads, {cpu.cpu_model()}; kernels: {plan.summary()}")
    if not ours:
        print(f"(our prefill attention does not run here: {cpu.unavailable_reason() or 'head_dim % 16 != 0'})")
    lengths = [int(x) for x in a.lengths.split(",")]
    ids = torch.randint(100, min(30000, model.cfg.vocab_size), (1, max(lengths)),
                        generator=torch.Generator().manual_seed(0))

    def run(L: int, name: str) -> tuple[float, torch.Tensor]:
        flash, prefill = variants[name]
        M._FLASH_CPU = flash  # None: the masked SDPA path
        model.kernel_plan = dataclasses.replace(plan, prefill_attention=prefill)
        cache = KVCache(model.cfg, 1, L + 1, model.dtype, model.device)
        t = time.perf_counter()
        logits, _ = model.prefill(ids[:, :L], cache)
        return time.perf_counter() - t, logits

    try:
        for name in variants:  # warm-up
            run(512, name)
        print("seconds per whole prefill (512-token chunks)")
        for L in lengths:
            for _ in range(a.reps):
                res = {name: run(L, name) for name in variants}
                base_t, base_l = res["masked SDPA"]
                print(f"{L:>6} tokens: " + "; ".join(
                    f"{name} {t:6.2f} s ({base_t / t:.2f}x, max |logit diff| {(lg - base_l).abs().max().item():.1e})"
                    for name, (t, lg) in res.items()), flush=True)
    finally:
        M._FLASH_CPU = split
        model.kernel_plan = plan
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

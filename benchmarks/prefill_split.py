"""A whole chunked prefill with the split chunk attention (``sparsespec.model.chunk_attention_cpu``:
the prefix as grouped query rows plus the chunk's own causal block, merged by log-sum-exp) against
the masked SDPA it replaced, interleaved in one process on the same random prompt, with the largest
logit difference between the two.

    python benchmarks/prefill_split.py --model smollm2-135m --lengths 2048,4096,8192 --reps 2 --threads 2
"""
from __future__ import annotations

import argparse
import time

import torch

import sparsespec.model as M
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
    lengths = [int(x) for x in a.lengths.split(",")]
    ids = torch.randint(100, min(30000, model.cfg.vocab_size), (1, max(lengths)),
                        generator=torch.Generator().manual_seed(0))

    def run(L: int, flash) -> tuple[float, torch.Tensor]:
        M._FLASH_CPU = flash  # None: the masked SDPA path
        cache = KVCache(model.cfg, 1, L + 1, model.dtype, model.device)
        t = time.perf_counter()
        logits, _ = model.prefill(ids[:, :L], cache)
        return time.perf_counter() - t, logits

    run(512, split), run(512, None)  # warm-up
    print(f"{a.model}, {a.threads} threads; seconds per whole prefill (512-token chunks)")
    for L in lengths:
        for _ in range(a.reps):
            t_mask, l_mask = run(L, None)
            t_split, l_split = run(L, split)
            print(f"{L:>6} tokens: masked SDPA {t_mask:6.2f} s, split {t_split:6.2f} s, {t_mask / t_split:.3f}x; "
                  f"max |logit diff| {(l_split - l_mask).abs().max().item():.1e}", flush=True)
    M._FLASH_CPU = split
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

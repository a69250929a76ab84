"""Paired end-to-end decode at a real shape with random weights: ``ar`` against speculation.

For GPU checks where no real checkpoint is on the machine (``benchmarks/gpu_check.sh``): random
weights at ``--shape`` (``sparsespec.shapes``), random prompt ids, ``ignore_eos`` so every method
decodes exactly ``--gen-tokens``; per (batch, context) the methods run back to back in
alternating order, ``--reps`` times, and each is reported as its median batch TPOT (decode wall
time of the batch over the tokens decoded after each row's first, ``sparsespec.stats.batch_tpot``),
its speedup over ``ar`` measured in the same repetition, alpha, mean k, and whether its greedy
tokens equal ``ar``'s (random weights give near-uniform logits, so alpha here says little about
real models; the timing of the steps at that acceptance is what this measures)::

    python benchmarks/paired_e2e.py --shape llama-3.1-8b --device cuda --dtype bfloat16 \\
        --batch-sizes 1,4,16 --context-lengths 16384,32768,65536 --json-out e2e.json
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from sparsespec.engine import _DTYPES, Engine
from sparsespec.shapes import random_transformer
from sparsespec.stats import batch_tpot


class IdTokenizer:
    """Decodes ids as their numbers (random-weight runs have no vocabulary; the engine only
    decodes for stop strings and text deltas, which these runs do not use)."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(int(i)) for i in ids)


def _methods(spec: str) -> list[tuple[str, dict]]:
    out = [("ar", {})]
    for item in spec.split(","):
        name, _, k = item.strip().partition(":")
        if name and name != "ar":
            out.append((name, {"k": k if k == "auto" else int(k or 4)}))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    p.add_argument("--batch-sizes", default="1,4,16")
    p.add_argument("--context-lengths", default="16384,32768,65536")
    p.add_argument("--methods", default="sparsespec-l:auto,sparsespec-l:4",
                   help="comma list of method[:k]; ar is always the reference")
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-batch-tokens", type=int, default=None,
                   help="skip (batch, context) cells with batch x context above this (prefill time and KV memory)")
    p.add_argument("--json-out", default=None)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    model = random_transformer(a.shape, dtype=_DTYPES[a.dtype], device=a.device, seed=0)
    engine = Engine(model, IdTokenizer(), name=f"random:{a.shape}")
    g = torch.Generator().manual_seed(0)
    methods = _methods(a.methods)
    rows = []
    print("| B | ctx | method | TPOT ms | speedup vs ar | alpha | mean k | same tokens as ar |")
    print("|---|---|---|---|---|---|---|---|")
    for B in (int(x) for x in a.batch_sizes.split(",")):
        for L in (int(x) for x in a.context_lengths.split(",")):
            if a.max_batch_tokens and B * L > a.max_batch_tokens:
                print(f"| {B} | {L} | (skipped: {B} x {L} > --max-batch-tokens {a.max_batch_tokens}) | | | | | |")
                continue
            P = L - a.gen_tokens
            prompts = torch.randint(3, model.cfg.vocab_size, (B, P), generator=g).tolist()
            tpot: dict[str, list[float]] = {m + str(o.get("k", "")): [] for m, o in methods}
            info: dict[str, dict] = {}
            ref = None
            try:
                for rep in range(a.reps):
                    order = methods if rep % 2 == 0 else methods[:1] + methods[1:][::-1]
                    for name, opts in order:
                        key = name + str(opts.get("k", ""))
                        outs = engine.generate(prompts, method=name, method_options=opts or None,
                                               max_new_tokens=a.gen_tokens, ignore_eos=True)
                        st = [o.stats for o in outs]
                        tpot[key].append(batch_tpot(st))
                        toks = [o.token_ids for o in outs]
                        if name == "ar":
                            ref = toks
                        drafted = sum(s["num_drafted"] for s in st)
                        steps = sum(s["num_drafting_steps"] for s in st)
                        info[key] = {"alpha": sum(s["num_accepted"] for s in st) / drafted if drafted else None,
                                     "mean_k": drafted / steps if steps else 0.0,
                                     "same_tokens": None if ref is None else toks == ref}
            except torch.OutOfMemoryError as e:  # a cell that does not fit is reported, not fatal
                print(f"| {B} | {L} | (out of memory: {str(e).splitlines()[0]}) | | | | | |")
                torch.cuda.empty_cache()
                continue
            ar = tpot["ar"]
            for name, opts in methods:
                key = name + str(opts.get("k", ""))
                ratios = [x / y for x, y in zip(ar, tpot[key]) if x and y]
                row = {"batch_size": B, "context_len": L, "method": name, "k": opts.get("k", 0),
                       "tpot_s": statistics.median(tpot[key]), "speedup": statistics.median(ratios) if ratios else None,
                       **info.get(key, {})}
                rows.append(row)
                alpha = "-" if row.get("alpha") is None else f"{row['alpha']:.3f}"
                print(f"| {B} | {L} | {name} k={row['k']} | {row['tpot_s'] * 1e3:.2f} | "
                      f"{row['speedup']:.3f} | {alpha} | {row.get('mean_k', 0):.2f} | {row.get('same_tokens')} |",
                      flush=True)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"shape": a.shape, "dtype": a.dtype, "device": a.device,
                                                "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

"""One sweep cell, in this process (no Ray), with the cost controller's every decision printed.

Runs the shards of one benchmark of a sweep spec through ``cluster.sweep.worker.EngineWorker``
(the methods stepped in turn, as a sweep does) and prints, per repetition, each method's batch
TPOT (``sparsespec.stats.batch_tpot``), the speedup over ``ar``, the draft length of every round
and, for the rounds over long contexts, what ``k="auto"``'s ``CostAwareController`` decided
from: the rows' alphas and reach, the predicted verify cost per width, the draft forward, the
rest of the round and the predicted tokens per second at each k it may choose
(``CostAwareController.rates``). Repetitions reuse the
engine, so from the second on a core starts from the first one's measurements (as a sweep
worker's later shards do).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/controller_trace.py configs/demo.yaml --benchmark speed \\
        [--options '{"k": 2}'] [--reps 2] [--threads 2] [--min-context 1000]

``--options`` replaces the options of the spec's speculative method (one method besides ar).
Run it alone on the machine: it times.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import sparsespec.adaptive as adaptive  # noqa: E402
from cluster.sweep import run as sweep  # noqa: E402
from cluster.sweep.plan import AR, plan_shards  # noqa: E402
from cluster.sweep.schema import load_spec  # noqa: E402
from cluster.sweep.worker import EngineWorker  # noqa: E402
from sparsespec.stats import batch_tpot  # noqa: E402


def _trace(min_context: float, rounds: list[int]):
    """Wrap ``CostAwareController.plan`` to record the k of each round over ``min_context``
    tokens (the worker's warm-up batch is shorter) and print its inputs."""
    plan = adaptive.CostAwareController.plan

    def traced(self, policies, limits, lengths, index_sizes, remaining=None):
        ks = plan(self, policies, limits, lengths, index_sizes, remaining)
        B = len(limits)
        S = sum(lengths) / max(1, B)
        if S >= min_context:  # the shard's own rounds, not its short warm-up's
            rounds.append(max(ks, default=0))
        N = sum(index_sizes) / max(1, B) if index_sizes else S
        if S < min_context or self.verify_cost.predict(B, 1, S) is None:
            return ks
        alphas = self.alphas(policies)
        reach = [min(int(lim), p.reach) for p, lim in zip(policies, limits)]
        verify = self.verify_cost.predict_many(B, np.arange(1.0, 7.0), S)  # widths 1..6
        draft_ms = self.draft_ratio * float(self.verify_cost.predict(B, 1, N)) * 1e3
        rates = self.rates(alphas, reach, B, S, N)
        print(f"  round S={S:.0f} N={N:.0f} k={max(ks, default=0)} alphas={[round(a, 3) for a in alphas]} "
              f"reach={reach} exploring={self.exploring(policies)} verify_ms(w=1..6)={np.round(verify * 1e3, 1).tolist()} "
              f"draft_ms={draft_ms:.1f} other_ms={(self.other_s or 0.0) * 1e3:.2f} "
              f"tokens_per_s(k=0..)={np.round(rates, 1).tolist()}", flush=True)
        return ks

    adaptive.CostAwareController.plan = traced


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec", help="a sweep spec (YAML), e.g. configs/demo.yaml")
    ap.add_argument("--benchmark", required=True, help="the spec's benchmark whose cells to run (e.g. speed)")
    ap.add_argument("--options", default=None, help="JSON options of the speculative method (default: the spec's)")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-context", type=float, default=1000.0, help="print the rounds over at least this many tokens")
    args = ap.parse_args(argv)

    overrides: dict = {"db": "sqlite://"}
    spec = load_spec(args.spec, overrides)
    methods = [m for m in spec.methods if m != AR]
    if len(methods) != 1:
        ap.error(f"the spec needs exactly one method besides ar, it has {methods}")
    method = methods[0]
    if args.options is not None:
        try:
            options = json.loads(args.options)
        except json.JSONDecodeError as e:
            ap.error(f"--options is not JSON: {e}")
        spec = load_spec(args.spec, {**overrides, "methods": {method: options}})
    cells = [c for c in sweep.plan(spec)[0] if c.benchmark == args.benchmark]
    if not cells:
        ap.error(f"no cell of benchmark {args.benchmark!r} in {args.spec}")
    rounds: list[int] = []
    _trace(args.min_context, rounds)
    worker = EngineWorker(cells[0].model, spec.dtype, "cpu", threads=args.threads)
    for rep in range(args.reps):
        for cell in cells:
            for shard in plan_shards(cell):
                rounds.clear()
                rows = worker.run_shard(shard)["rows"]
                tpot = {m: batch_tpot([r["stats"] for r in rows if r["method"] == m]) for m in (AR, method)}
                spec_rows = [r["stats"] for r in rows if r["method"] == method]
                print(f"rep {rep} {cell.benchmark} ctx {cell.context_length} batch {cell.batch_size} {method} "
                      f"{json.dumps(shard.method_options.get(method, {}))}: batch TPOT ms ar {tpot[AR] * 1e3:.2f}, "
                      f"{method} {tpot[method] * 1e3:.2f}, speedup {tpot[AR] / tpot[method]:.3f}; drafted "
                      f"{sum(s['num_drafted'] for s in spec_rows)}, accepted {sum(s['num_accepted'] for s in spec_rows)}; "
                      f"k per round {rounds}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Run a sweep spec on Ray: ``python -m cluster.sweep configs/demo.yaml``.

    python -m cluster.sweep SPEC.yaml [--dry-run] [--models a,b] [--methods ar,sparsespec-l]
        [--batch-sizes 1,4] [--context-lengths 2048,4096] [--num-samples N] [--tasks t1,t2]
        [--repetitions R] [--max-new-tokens N] [--temperature T] [--sampling-seed S] [--device auto|cpu|cuda]
        [--num-workers N] [--threads N] [--max-retries N] [--schedule step|run] [--db URL] [--ray-address ADDR]

Flags override the spec (the resolved spec is stored with every run). ``--dry-run`` builds the
samples, prints the shard keys one per line on stdout and runs nothing. Through a cluster::

    ray job submit --address http://127.0.0.1:8265 --working-dir . -- \\
        python -m cluster.sweep configs/demo.yaml --db sqlite:////abs/path/sparsespec.db

Rerunning the same command resumes: shards already stored are skipped, the others (including
failed ones) run. Exit status: 0 all shards done, 1 some shard failed (the rest completed),
2 bad spec or flags, 130 interrupted (rerun to resume).
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cluster.results.store import StoreError, SweepRecorder, open_store, safe_url
from cluster.sweep.coordinator import WorkerStartError, run_on_ray
from cluster.sweep.plan import Cell, Shard, TokenizerInfo, default_tokenizer_info, plan_cells, plan_shards
from cluster.sweep.schema import SpecError, SweepSpec, check_benchmarks, check_method_sets, load_spec
from cluster.sweep.worker import EngineFactory

log = logging.getLogger(__name__)


@dataclass
class SweepResult:
    run_ids: list[str]
    num_shards: int
    done: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # already stored before this invocation
    failed: dict[str, str] = field(default_factory=dict)
    worker_deaths: int = 0
    wall_s: float = 0.0


def plan(spec: SweepSpec, tokenizer_info: TokenizerInfo = default_tokenizer_info) -> tuple[list[Cell], list[Shard]]:
    """Cells and shards of ``spec`` (deterministic). Raises SpecError."""
    check_benchmarks(spec)
    options = check_method_sets(spec)
    try:
        cells = plan_cells(spec, options, tokenizer_info)
    except (ValueError, FileNotFoundError) as e:
        raise SpecError(str(e)) from None
    except Exception as e:  # a model whose tokenizer cannot be loaded offline
        if type(e).__name__ == "ModelNotAvailableError":
            raise SpecError(str(e)) from None
        raise
    return cells, [sh for c in cells for sh in plan_shards(c)]


def run_sweep(spec: SweepSpec, *, ray_address: str | None = None, engine_factory: EngineFactory | None = None,
              tokenizer_info: TokenizerInfo = default_tokenizer_info, progress: bool = True,
              local_num_cpus: int | None = None) -> SweepResult:
    """Plan, resume and run ``spec``; every completed shard is stored as it finishes (by a
    ``cluster.results.store.SweepRecorder``, from the coordinator's events).

    ``engine_factory`` (tests) replaces ``sparsespec.Engine.from_pretrained`` in the workers;
    it must be importable there. Raises SpecError (bad spec), WorkerStartError (no such
    resources, model load failure), StoreError; KeyboardInterrupt leaves the store consistent
    (the runs are marked ``interrupted`` and resume on the next call).
    """
    from cluster.sweep import provenance
    from evals.registry import get_benchmark

    t0 = time.perf_counter()
    cells, shards = plan(spec, tokenizer_info)
    result = SweepResult(run_ids=[c.run_id for c in cells], num_shards=len(shards))
    prov = {"sweep": {"name": spec.name, "spec": spec.resolved()}, **provenance.collect()}
    store = open_store(spec.db)
    recorder = SweepRecorder(store, cells, prov)
    status_of: dict[str, str] = {}
    try:
        done_keys = recorder.start_runs()
        todo = [s for s in shards if s.key not in done_keys]
        result.skipped = [s.key for s in shards if s.key in done_keys]
        log.info("sweep %s: %d run(s), %d shard(s): %d stored, %d to run", spec.name, len(cells), len(shards),
                 len(result.skipped), len(todo))
        if not todo:
            recorder.finish_all("finished")
            return result
        status_of = {c.run_id: "failed" for c in cells}
        w = spec.workers
        out = run_on_ray(todo, emit=recorder.record, scorers={b.name: get_benchmark(b.name).score_sample
                                                                for b in spec.benchmarks},
                         dtype=spec.dtype, num_workers=w.num_workers, threads=w.threads, device=spec.device,
                         schedule=w.schedule, max_retries=w.max_retries, ray_address=ray_address,
                         local_num_cpus=local_num_cpus, engine_factory=engine_factory, progress=progress,
                         desc=spec.name)
        result.done, result.failed, result.worker_deaths = out.done, out.failed, out.worker_deaths
        failed_runs = {k.rsplit("/", 2)[0] for k in out.failed}
        status_of = {c.run_id: ("failed" if c.run_id in failed_runs else "finished") for c in cells}
    except KeyboardInterrupt:
        status_of = {r: "interrupted" for r in status_of} or {c.run_id: "interrupted" for c in cells}
        raise
    finally:
        recorder.finish(status_of)
        store.close()
        result.wall_s = time.perf_counter() - t0
    return result


# --------------------------------------------------------------------------- CLI
def _ints(text: str) -> list[int]:
    try:
        vals = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}") from None
    if not vals:
        raise argparse.ArgumentTypeError("expected a comma list of integers")
    return vals


def _lengths(text: str) -> list[int | None]:
    out: list[int | None] = []
    for t in text.split(","):
        t = t.strip()
        if t.lower() in ("default", "none", "null"):
            out.append(None)
        elif t:
            try:
                out.append(int(t))
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected integers or 'default', got {t!r}") from None
    if not out:
        raise argparse.ArgumentTypeError("expected a comma list of context lengths")
    return out


def _names(text: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    return items


def add_override_flags(p: argparse.ArgumentParser, *, benchmark_flags: bool = True) -> None:
    """Flags that override a spec (shared by ``cluster.sweep.run`` and the benchmark scripts)."""
    p.add_argument("--models", "--model", dest="models", type=_names, default=None,
                   help="comma list of models (presets, hub ids or local folders)")
    p.add_argument("--methods", type=_names, default=None,
                   help='comma list of methods; "ar" is always added (the reference)')
    p.add_argument("--batch-sizes", "--batch-size", dest="batch_sizes", type=_ints, default=None,
                   help="comma list of batch sizes")
    p.add_argument("--queue-depth", dest="queue_depth", type=int, default=None,
                   help="batches per shard, every benchmark: 1 = static batches; Q > 1 = queues of Q x batch size "
                        "samples through batch-size slots (continuous batching: a finished row's slot takes the next)")
    p.add_argument("--context-lengths", "--context-length", dest="context_lengths", type=_lengths, default=None,
                   help="comma list of context lengths in tokens (prompt + generation budget; 'default' = the "
                        "benchmark's own)")
    if benchmark_flags:
        p.add_argument("--tasks", type=_names, default=None, help="comma list of tasks (every benchmark)")
        p.add_argument("--num-samples", type=int, default=None, help="samples per task (every benchmark)")
    p.add_argument("--repetitions", type=int, default=None, help="runs of each cell")
    p.add_argument("--max-new-tokens", type=int, default=None, help="override every task's generation budget")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--sampling-seed", dest="sampling_seed", type=int, default=None,
                   help="sampling seed (row i of a task gets its own stream from (seed, i))")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    p.add_argument("--quantize", type=_names, default=None,
                   help="comma list of target weight formats, a sweep axis: none (full precision), int8 "
                        "(every method, ar included, on an int8 target; its ar is that run's reference)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                   help="auto: GPU workers (num_gpus=1 each) when the cluster has GPUs; cuda fails at once without")
    p.add_argument("--num-workers", type=int, default=None, help="engine actors (default: one per GPU, else 1)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per actor")
    p.add_argument("--max-retries", type=int, default=None, help="retries of a shard whose worker died")
    p.add_argument("--schedule", choices=("step", "run"), default=None,
                   help="step (default): a batch's methods take turns step by step, paired against the machine's "
                        "drift; run: each method's whole batch in turn (one KV pool in memory at a time)")
    p.add_argument("--db", default=None, help="result store URL (sqlite:///path.db, postgresql+psycopg://...)")
    p.add_argument("--ray-address", default=None, help="Ray cluster to join (default: RAY_ADDRESS, else local)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))


def overrides_from(args: argparse.Namespace) -> dict[str, Any]:
    """Spec overrides (dotted keys, see ``cluster.sweep.schema.apply_overrides``) from parsed flags."""
    g = lambda name: getattr(args, name, None)  # noqa: E731
    methods = g("methods")
    return {
        "models": g("models"), "methods": methods, "batch_sizes": g("batch_sizes"),
        "context_lengths": g("context_lengths"), "repetitions": g("repetitions"), "dtype": g("dtype"),
        "quantize": g("quantize"), "device": g("device"), "db": g("db"),
        "benchmarks.tasks": g("tasks"), "benchmarks.num_samples": g("num_samples"),
        "benchmarks.queue_depth": g("queue_depth"),
        "sampling.max_new_tokens": g("max_new_tokens"), "sampling.temperature": g("temperature"),
        "sampling.top_p": g("top_p"), "sampling.top_k": g("top_k"), "sampling.seed": g("sampling_seed"),
        "workers.num_workers": g("num_workers"), "workers.threads": g("threads"),
        "workers.max_retries": g("max_retries"), "workers.schedule": g("schedule"),
    }


def setup_logging(level: str) -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=getattr(logging, level, logging.INFO),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@contextlib.contextmanager
def _sigterm_is_interrupt() -> Any:
    """While running, SIGTERM (``ray job stop``, a scheduler's kill) ends the sweep like Ctrl-C:
    runs marked ``interrupted``, shards in flight released, resumable."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def execute(spec: SweepSpec, args: argparse.Namespace, *, engine_factory: EngineFactory | None = None) -> int:
    """Dry-run or run ``spec`` and print the report; the exit status (see the module docstring)."""
    from cluster.results.report import format_table, report_rows

    try:
        if getattr(args, "dry_run", False):
            _, shards = plan(spec)
            for s in shards:
                print(s.key)
            print(f"{len(shards)} shard(s)", file=sys.stderr)
            return 0
        with _sigterm_is_interrupt():
            res = run_sweep(spec, ray_address=args.ray_address, engine_factory=engine_factory,
                            progress=not args.no_progress)
    except KeyboardInterrupt:
        print("interrupted: finished shards are stored; rerun the same command to resume", file=sys.stderr)
        return 130
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (WorkerStartError, StoreError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    rows = report_rows(spec.db, res.run_ids)
    print(f"sweep {spec.name}: {len(res.done)} shard(s) run, {len(res.skipped)} already stored, "
          f"{len(res.failed)} failed, {res.worker_deaths} worker death(s), {res.wall_s:.1f} s "
          f"({safe_url(spec.db)})")
    print(format_table(rows))
    for key, err in res.failed.items():
        print(f"FAILED {key}: {err}", file=sys.stderr)
    return 1 if res.failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.sweep", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", help="sweep spec (YAML; schema in cluster/sweep/schema.py and the README)")
    p.add_argument("--dry-run", action="store_true", help="print the shard keys, one per line, and run nothing")
    add_override_flags(p)
    args = p.parse_args(argv)
    setup_logging(args.log_level)
    try:
        spec = load_spec(args.spec, overrides_from(args))
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return execute(spec, args)


if __name__ == "__main__":
    raise SystemExit(main())


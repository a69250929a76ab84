"""Coordinator: plan shards, drive Ray workers, score, check losslessness, write results.

``run_benchmark`` is resumable and idempotent: the run id is a hash of the resolved configuration
(benchmark, model, methods, dtype, options, temperature, caller config and a digest of the
samples), and (task, sample_id, method) triples already stored for that run are skipped. Results
are written as each shard finishes, so a crash loses at most the shards in flight.

Pairing: all methods of one sample always travel in the same shard, so they run in the same actor,
on the same prompt, interleaved (see ``cluster.worker``). "ar" is always added, as the first
method: it is the reference for speedup and losslessness.

Ray: an initialised Ray is used as is; else ``ray_address`` or RAY_ADDRESS (which ``ray job submit``
sets) is joined; else a local Ray is started and shut down at the end. On a remote cluster the
workers must be able to import ``cluster``, ``evals`` and ``sparsespec``: submit with
``ray job submit --working-dir . -- python evals/ruler.py ...`` or install the package on the nodes.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import platform
import socket
import sys
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cluster.store import Store, open_store
from cluster.worker import EngineFactory, Shard
from evals.base import Sample

log = logging.getLogger(__name__)

AR = "ar"
LOCAL_OBJECT_STORE_BYTES = 500 * 1024**2
#: Upper bound on samples per shard (a crash loses at most this many samples per worker).
MAX_SHARD_SIZE = 8
#: How long to wait for workers to be placed and load the engine before giving up.
WORKER_START_TIMEOUT_S = float(os.environ.get("SPARSESPEC_WORKER_START_TIMEOUT_S", "1800"))

Scorer = Callable[[Sample, str], float]


class ShardFailedError(RuntimeError):
    """A shard could not be completed (worker died twice, or the engine/scorer raised)."""


class WorkerStartError(RuntimeError):
    """A worker could not start (engine failed to load, or no resources)."""


# --------------------------------------------------------------------------- planning (pure)
def normalize_methods(methods: Sequence[str] | str) -> list[str]:
    """'ar' first, then the other methods in the given order, without duplicates."""
    if isinstance(methods, str):
        methods = [m for m in methods.split(",")]
    out = [AR]
    for m in methods:
        m = m.strip()
        if m and m not in out:
            out.append(m)
    return out


def samples_digest(samples: Sequence[Sample]) -> str:
    """Hash of what is decoded (task, id, prompt, budget): changed data -> a different run."""
    h = hashlib.sha256()
    for s in sorted(samples, key=lambda s: (s.task, s.sample_id)):
        h.update(json.dumps([s.benchmark, s.task, s.sample_id, list(s.prompt_ids), s.max_new_tokens]).encode())
    return h.hexdigest()


def resolve_config(*, benchmark: str, model: str, methods: Sequence[str], dtype: str,
                   method_options: Mapping[str, Mapping[str, Any]], temperature: float,
                   config: Mapping[str, Any], samples: Sequence[Sample]) -> dict[str, Any]:
    """The configuration that identifies a run (JSON-able; hashed into the run id).

    Deliberately excluded: where results go and how work is spread (db URL, Ray address, number
    of workers, threads). Rerunning with more workers resumes the same run.
    """
    return json.loads(json.dumps({
        "benchmark": benchmark,
        "model": model,
        "methods": list(methods),
        "dtype": dtype,
        "method_options": {m: dict(method_options.get(m, {})) for m in methods},
        "temperature": float(temperature),
        "config": dict(config),
        "num_samples": len(samples),
        "samples_sha256": samples_digest(samples),
    }, sort_keys=True, default=str))


def compute_run_id(resolved: Mapping[str, Any]) -> str:
    """Deterministic id: '<benchmark>-<16 hex of sha256(canonical JSON)>'."""
    blob = json.dumps(resolved, sort_keys=True, separators=(",", ":"), default=str)
    return f"{resolved.get('benchmark', 'run')}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"


def plan_shards(samples: Sequence[Sample], methods: Sequence[str], done: set[tuple[str, str, str]],
                *, method_options: Mapping[str, Mapping[str, Any]], temperature: float,
                shard_size: int) -> list[Shard]:
    """Split (task x chunk of samples) into shards, skipping (task, sample, method) already done.

    The methods of a sample never split across shards. Consecutive samples of a task that need
    the same methods share a shard, at most ``shard_size`` per shard.
    """
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    by_task: dict[str, list[tuple[int, Sample]]] = {}
    for s in samples:
        items = by_task.setdefault(s.task, [])
        items.append((len(items), s))  # (index of the sample within its task, sample)
    shards: list[Shard] = []

    def flush(task: str, chunk: list[tuple[int, Sample]], ms: tuple[str, ...]) -> None:
        if chunk and ms:
            shards.append(Shard(
                task=task,
                samples=tuple(s for _, s in chunk),
                methods=ms,
                method_options={m: dict(method_options.get(m, {})) for m in ms},
                temperature=float(temperature),
                index=len(shards),
                sample_offset=chunk[0][0],
            ))

    for task, items in by_task.items():
        chunk: list[tuple[int, Sample]] = []
        chunk_methods: tuple[str, ...] = ()
        for idx, s in items:
            missing = tuple(m for m in methods if (task, s.sample_id, m) not in done)
            if not missing:
                continue
            contiguous = bool(chunk) and chunk[-1][0] == idx - 1
            if chunk and (missing != chunk_methods or len(chunk) >= shard_size or not contiguous):
                flush(task, chunk, chunk_methods)
                chunk = []
            chunk_methods = missing
            chunk.append((idx, s))
        flush(task, chunk, chunk_methods)
    return shards


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (or the shorter length); None if identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def lossless_check(ar_tokens: Sequence[int] | None, tokens: Sequence[int], stats: Mapping[str, Any],
                   temperature: float) -> tuple[bool | None, int | None]:
    """(lossless, first_divergence) of a method's output against AR on the same sample.

    None when not applicable: sampling runs (equality is distributional, not per token) or no AR
    output. Identical output with zero drafted tokens is inconclusive (None), not a pass.
    """
    if ar_tokens is None or temperature > 0:
        return None, None
    div = first_divergence(ar_tokens, tokens)
    if div is None:
        return (True if int(stats.get("num_drafted", 0) or 0) > 0 else None), None
    return False, div


# --------------------------------------------------------------------------- Ray plumbing
def _local_ray_env() -> None:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@contextlib.contextmanager
def ray_session(ray_address: str | None = None) -> Iterator[None]:
    """Use an initialised Ray as is; else connect to ``ray_address``/RAY_ADDRESS; else start a
    local Ray for the duration (shut down afterwards; other Ray processes are never touched)."""
    import ray

    if ray.is_initialized():
        yield
        return
    address = ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        log.info("connecting to Ray at %s", address)
        ray.init(address=address, log_to_driver=True)
    else:
        _local_ray_env()
        log.info("starting a local Ray (%s CPUs)", os.cpu_count())
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False,
                 object_store_memory=LOCAL_OBJECT_STORE_BYTES, log_to_driver=True)
    try:
        yield
    finally:
        ray.shutdown()  # disconnects this driver; stops only the local cluster it started


@dataclass
class _Plan:
    num_workers: int
    num_gpus: int  # per actor
    num_cpus: int  # per actor
    threads: int


def plan_workers(num_workers: int | None, threads: int | None) -> _Plan:
    """One actor per GPU (num_gpus=1) when the cluster has GPUs; else one CPU actor by default."""
    import ray

    res = ray.cluster_resources()
    gpus = int(res.get("GPU", 0))
    cpus = int(res.get("CPU", 0))
    node_cpus = [int(n.get("Resources", {}).get("CPU", 0)) for n in ray.nodes() if n.get("Alive")]
    max_node_cpus = max(node_cpus, default=cpus)
    if num_workers is not None and num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if gpus > 0:
        n = num_workers or gpus
        if n > gpus:
            raise ValueError(f"num_workers={n} but the Ray cluster has {gpus} GPU(s); each worker needs one")
        per = max(1, min(cpus // n, max_node_cpus))
        return _Plan(n, 1, per if cpus >= n else 0, threads or per)
    n = num_workers or 1
    if cpus < n:
        raise ValueError(f"num_workers={n} but the Ray cluster has only {cpus} CPU(s)")
    per = max(1, min(cpus // n, max_node_cpus))
    return _Plan(n, 0, per, threads or per)


class _WorkerPool:
    def __init__(self, plan: _Plan, model: str, dtype: str, engine_factory: EngineFactory | None) -> None:
        self.plan = plan
        self.model = model
        self.dtype = dtype
        self.engine_factory = engine_factory
        self.actors: list[Any] = [self._spawn() for _ in range(plan.num_workers)]

    def _spawn(self) -> Any:
        from cluster.worker import EngineWorkerActor

        return EngineWorkerActor.options(num_cpus=self.plan.num_cpus, num_gpus=self.plan.num_gpus).remote(
            self.model, self.dtype, self.plan.threads, self.engine_factory
        )

    def ping_all(self, timeout_s: float | None = None) -> list[dict[str, Any]]:
        """Wait until every actor has loaded its engine; host info of each."""
        import ray

        timeout_s = WORKER_START_TIMEOUT_S if timeout_s is None else timeout_s
        try:
            return ray.get([a.ping.remote() for a in self.actors], timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise WorkerStartError(
                f"{self.plan.num_workers} engine worker(s) (num_cpus={self.plan.num_cpus}, "
                f"num_gpus={self.plan.num_gpus} each) not ready after {timeout_s:.0f} s: the Ray cluster may "
                f"lack free resources (available: {ray.available_resources()}) or the model load hangs; "
                f"set SPARSESPEC_WORKER_START_TIMEOUT_S to wait longer"
            ) from e
        except ray.exceptions.RayError as e:
            raise WorkerStartError(f"engine worker failed to start (model={self.model!r}, dtype={self.dtype}): {e}") from e

    def restart(self, slot: int) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.kill(self.actors[slot], no_restart=True)
        self.actors[slot] = self._spawn()

    def shutdown(self) -> None:
        import ray

        for a in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(a, no_restart=True)
        self.actors = []


def _death_errors() -> tuple[type[BaseException], ...]:
    import ray.exceptions as rex

    names = ("RayActorError", "ActorDiedError", "ActorUnavailableError", "WorkerCrashedError",
             "OutOfMemoryError", "NodeDiedError", "LocalRayletDiedError")
    return tuple(getattr(rex, n) for n in names if hasattr(rex, n))


def _host_info() -> dict[str, Any]:
    return {"hostname": socket.gethostname(), "platform": platform.platform(),
            "python": platform.python_version(), "argv": sys.argv[:]}


def _progress(total: int, enabled: bool, desc: str) -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError:  # plain logging fallback
        class _Log:
            n = 0

            def update(self, k: int) -> None:
                self.n += k
                log.info("%s: %d/%d generations", desc, self.n, total)

            def close(self) -> None:
                pass

        return _Log()
    return tqdm(total=total, desc=desc, unit="gen", disable=not enabled, file=sys.stderr)


# --------------------------------------------------------------------------- entry point
def run_benchmark(*, benchmark: str, samples: Sequence[Sample], scorer: Scorer, model: str,
                  methods: Sequence[str], db_url: str, config: Mapping[str, Any], dtype: str = "float32",
                  method_options: Mapping[str, Mapping[str, Any]] | None = None, temperature: float = 0.0,
                  ray_address: str | None = None, num_workers: int | None = None, threads: int | None = None,
                  engine_factory: EngineFactory | None = None, shard_size: int | None = None,
                  progress: bool = True) -> str:
    """Run (or resume) a benchmark and store every (sample, method) result. Returns the run id.

    Args:
        samples: from ``evals.<benchmark>.build_samples``; (task, sample_id) must be unique.
        scorer: ``score_sample(sample, prediction) -> float in [0, 1]``; called here, not in workers.
        methods: engine method names; "ar" is added (first) if absent.
        config: caller configuration (CLI flags) recorded with the run and hashed into its id.
        method_options: per-method options, e.g. ``{"sparsespec-l": {"k": 8}}``.
        engine_factory: ``(model, dtype) -> engine``; default ``sparsespec.Engine.from_pretrained``.
        shard_size: samples per shard; default ``ceil(n_task / (2 * workers))`` capped at 8.
    """
    samples = list(samples)
    if not samples:
        raise ValueError("run_benchmark: no samples")
    keys = [(s.task, s.sample_id) for s in samples]
    if len(set(keys)) != len(keys):
        dup = sorted({k for k in keys if keys.count(k) > 1})[:5]
        raise ValueError(f"run_benchmark: duplicate (task, sample_id): {dup}")
    wrong = sorted({s.benchmark for s in samples if s.benchmark != benchmark})
    if wrong:
        raise ValueError(f"run_benchmark(benchmark={benchmark!r}) got samples of benchmark(s) {wrong}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    methods = normalize_methods(methods)
    opts = {m: dict((method_options or {}).get(m, {})) for m in methods}
    unknown_opts = sorted(set(method_options or {}) - set(methods))
    if unknown_opts:
        raise ValueError(f"method_options for methods not being run: {unknown_opts} (methods: {methods})")

    resolved = resolve_config(benchmark=benchmark, model=model, methods=methods, dtype=dtype,
                              method_options=opts, temperature=temperature, config=config, samples=samples)
    run_id = compute_run_id(resolved)
    store = open_store(db_url)
    try:
        new = store.start_run(run_id, benchmark=benchmark, model=model, methods=methods, config=resolved,
                              host={"driver": _host_info()})
        done = store.done_keys(run_id)
        log.info("%s run %s (%d results already stored)", "new" if new else "resuming", run_id, len(done))
        status = "failed"
        try:
            _execute(store=store, run_id=run_id, samples=samples, scorer=scorer, model=model, methods=methods,
                     opts=opts, temperature=temperature, dtype=dtype, done=done, ray_address=ray_address,
                     num_workers=num_workers, threads=threads, engine_factory=engine_factory,
                     shard_size=shard_size, progress=progress)
            status = "finished"
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        except BaseException as e:
            with contextlib.suppress(Exception):
                store.record_event(run_id, f"run failed: {type(e).__name__}: {e}")
            raise
        finally:
            with contextlib.suppress(Exception):
                store.finish_run(run_id, status=status)
    finally:
        store.close()
    return run_id


def _execute(*, store: Store, run_id: str, samples: list[Sample], scorer: Scorer, model: str,
             methods: list[str], opts: dict[str, dict[str, Any]], temperature: float, dtype: str,
             done: set[tuple[str, str, str]], ray_address: str | None, num_workers: int | None,
             threads: int | None, engine_factory: EngineFactory | None, shard_size: int | None,
             progress: bool) -> None:
    todo = sum(1 for s in samples for m in methods if (s.task, s.sample_id, m) not in done)
    if todo == 0:
        log.info("run %s: nothing to do (all %d generations stored)", run_id, len(samples) * len(methods))
        return
    by_key = {(s.task, s.sample_id): s for s in samples}
    ar_tokens = store.token_ids(run_id, AR)  # AR outputs from earlier attempts of this run

    with ray_session(ray_address):
        import ray

        plan = plan_workers(num_workers, threads)
        if shard_size is None:
            largest_task = max(sum(1 for s in samples if s.task == t) for t in {s.task for s in samples})
            shard_size = max(1, min(MAX_SHARD_SIZE, math.ceil(largest_task / (2 * plan.num_workers))))
        shards = plan_shards(samples, methods, done, method_options=opts, temperature=temperature,
                             shard_size=shard_size)
        log.info("run %s: %d shard(s), %d generation(s), %d worker(s) x %d thread(s)%s", run_id, len(shards),
                 todo, plan.num_workers, plan.threads, " on GPU" if plan.num_gpus else "")
        pool = _WorkerPool(plan, model, dtype, engine_factory)
        bar = _progress(todo, progress, run_id)
        try:
            hosts = pool.ping_all()
            run = store.get_run(run_id) or {}
            store.update_run(run_id, host={**(run.get("host") or {}), "workers": hosts})

            death = _death_errors()
            pending: deque[tuple[Shard, int]] = deque((s, 0) for s in shards)
            in_flight: dict[Any, tuple[int, Shard, int]] = {}

            def submit(slot: int) -> None:
                if pending:
                    shard, attempt = pending.popleft()
                    ref = pool.actors[slot].run_shard.remote(shard)
                    in_flight[ref] = (slot, shard, attempt)

            for slot in range(len(pool.actors)):
                submit(slot)
            while in_flight:
                ready, _ = ray.wait(list(in_flight), num_returns=1)
                ref = ready[0]
                slot, shard, attempt = in_flight.pop(ref)
                try:
                    outs = ray.get(ref)
                except death as e:
                    msg = f"worker died running {shard.describe()} (attempt {attempt + 1}): {type(e).__name__}"
                    log.warning("%s%s", msg, "; restarting the worker" if attempt == 0 else "")
                    store.record_event(run_id, msg, shard=shard.index, task=shard.task,
                                       samples=[s.sample_id for s in shard.samples], error=str(e)[:2000])
                    if attempt >= 1:
                        raise ShardFailedError(
                            f"run {run_id}: {shard.describe()} failed twice, the worker died each time; "
                            f"last error: {type(e).__name__}: {e}"
                        ) from e
                    pool.restart(slot)
                    pending.appendleft((shard, attempt + 1))
                    submit(slot)
                    continue
                except ray.exceptions.RayTaskError as e:
                    raise ShardFailedError(f"run {run_id}: {shard.describe()} raised in the worker: {e}") from e
                n = _write_shard(store, run_id, shard, outs, by_key, scorer, ar_tokens, temperature, model)
                bar.update(n)
                submit(slot)
        finally:
            bar.close()
            pool.shutdown()


def _write_shard(store: Store, run_id: str, shard: Shard, outs: list[dict[str, Any]],
                 by_key: Mapping[tuple[str, str], Sample], scorer: Scorer,
                 ar_tokens: dict[tuple[str, str], list[int]], temperature: float, model: str) -> int:
    expected = {(s.sample_id, m) for s in shard.samples for m in shard.methods}
    got = {(o["sample_id"], o["method"]) for o in outs}
    if got != expected:
        raise ShardFailedError(f"{shard.describe()}: worker returned {len(got)} results, expected {len(expected)} "
                               f"(missing {sorted(expected - got)[:5]})")
    for o in outs:  # AR first, so methods of the same shard can be checked against it
        if o["method"] == AR:
            ar_tokens[(o["task"], o["sample_id"])] = list(o["token_ids"])
    rows = []
    for o in outs:
        sample = by_key[(o["task"], o["sample_id"])]
        try:
            score = scorer(sample, o["text"])
        except Exception as e:  # noqa: BLE001 - re-raised with context
            raise ShardFailedError(
                f"scorer failed on {sample.benchmark}/{sample.task}/{sample.sample_id} ({o['method']}): "
                f"{type(e).__name__}: {e}"
            ) from e
        if o["method"] == AR:
            lossless, div = None, None
        else:
            lossless, div = lossless_check(ar_tokens.get((o["task"], o["sample_id"])), o["token_ids"],
                                           o["stats"], temperature)
        rows.append({
            "run_id": run_id,
            "benchmark": sample.benchmark,
            "task": sample.task,
            "model": model,
            "method": o["method"],
            "sample_id": sample.sample_id,
            "prediction": o["text"],
            "token_ids": o["token_ids"],
            "score": None if score is None else float(score),
            "stats": o["stats"],
            "lossless": lossless,
            "first_divergence": div,
            "num_input_tokens_raw": sample.num_input_tokens_raw,
            "num_input_tokens": sample.num_input_tokens,
            "references": list(sample.references),
        })
    store.add_results(rows)
    return len(rows)


__all__ = [
    "AR",
    "ShardFailedError",
    "WorkerStartError",
    "compute_run_id",
    "first_divergence",
    "lossless_check",
    "normalize_methods",
    "plan_shards",
    "plan_workers",
    "ray_session",
    "resolve_config",
    "run_benchmark",
    "samples_digest",
]

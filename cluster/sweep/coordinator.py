"""Coordinator: drive Ray engine actors over planned shards, score, check losslessness, and hand
every shard event back to the caller.

Thin, resumable and idempotent:

- Workers are actors that each pin one GPU (``num_gpus=1``) on a GPU cluster, or a share of the
  CPUs (``device="cpu"``); each loads its model once. Shards are run grouped by model, so weights
  load once per worker per model; one shard per actor is in flight at a time.
- The coordinator never touches the store: it hands each event (``cluster.results.events``:
  workers ready, shard started, done with its scored rows, failed) to ``emit`` as it happens, and
  the caller writes it (``cluster.results.store.SweepRecorder``, the one writer: a shard's results and
  its ``done`` mark in one transaction), so a crash or Ctrl-C loses at most the shards in flight,
  and a resume skips every ``done`` shard. No (run, task, sample, method) row is written twice.
- A worker that dies mid-shard (SIGKILL, out of memory, node lost) is replaced by a new actor
  and its shard goes back to the front of the queue for the next free worker, up to
  ``max_retries`` times; an error raised by the engine is retried the same way. A shard that
  keeps failing is recorded as ``failed`` with its error, and the sweep goes on.

Ray: an initialised Ray is used as is; else ``ray_address`` or RAY_ADDRESS (which ``ray job
submit`` sets) is joined; else a local Ray is started and shut down at the end.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cluster.peers.methods import VLLM_PREFIX
from cluster.results.events import ShardDone, ShardEvent, ShardFailed, ShardStarted, WorkersReady
from cluster.sweep.plan import AR, Shard
from cluster.sweep.worker import EngineFactory, summarize_workers

log = logging.getLogger(__name__)

LOCAL_OBJECT_STORE_BYTES = 500 * 1024**2
#: How long to wait for workers to be placed and load their model before giving up.
WORKER_START_TIMEOUT_S = float(os.environ.get("SPARSESPEC_WORKER_START_TIMEOUT_S", "1800"))


class WorkerStartError(RuntimeError):
    """Workers cannot start: no such resources (e.g. GPUs asked for, none present), or the model
    failed to load."""


# --------------------------------------------------------------------------- Ray plumbing
def _local_ray_env() -> None:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@contextlib.contextmanager
def ray_session(ray_address: str | None = None, num_cpus: int | None = None) -> Iterator[None]:
    """Use an initialised Ray as is; else connect to ``ray_address``/RAY_ADDRESS (``"auto"``: the
    cluster running on this machine); else start a local Ray of our own for the duration (on
    loopback, even when another cluster runs here; shut down afterwards; other Ray processes are
    never touched)."""
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
        n = num_cpus or os.cpu_count()
        log.info("starting a local Ray (%s CPUs)", n)
        # address="local": a fresh Ray of our own even when another cluster runs on this machine
        # (joining it implicitly hung for minutes on a cluster whose GCS had gone; a cluster is
        # joined only when asked: --ray-address / RAY_ADDRESS, as `ray job submit` sets it)
        ray.init(address="local", num_cpus=n, include_dashboard=False, object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                 log_to_driver=True, _node_ip_address="127.0.0.1")
    try:
        yield
    finally:
        ray.shutdown()


@dataclass(frozen=True)
class WorkerPlan:
    num_workers: int
    num_gpus: int  # per actor
    num_cpus: int  # per actor
    threads: int  # torch threads per actor
    device: str  # "cuda" | "cpu"
    schedule: str = "step"  # how a batch's methods share the actor's device (cluster.sweep.worker.SCHEDULES)


def plan_workers(num_workers: int | None, threads: int | None, device: str = "auto",
                 resources: Mapping[str, float] | None = None,
                 node_cpus: Sequence[int] | None = None) -> WorkerPlan:
    """Actors for the cluster's resources: one per GPU (``num_gpus=1`` each) when ``device`` is
    ``cuda`` (or ``auto`` and the cluster has GPUs), else ``num_workers`` (default 1) CPU actors
    sharing the CPUs. Asking for GPUs where there are none, or for more workers than devices,
    raises WorkerStartError at once (instead of actors pending forever)."""
    if resources is None or node_cpus is None:
        import time

        import ray

        for _ in range(40):  # a node that just started may not have reported its resources yet
            resources = ray.cluster_resources()
            if resources.get("CPU", 0) or resources.get("GPU", 0):
                break
            time.sleep(0.25)
        node_cpus = [int(n.get("Resources", {}).get("CPU", 0)) for n in ray.nodes() if n.get("Alive")]
    gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 0))
    max_node_cpus = max(node_cpus, default=cpus)
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    use_gpu = device == "cuda" or (device == "auto" and gpus > 0)
    if use_gpu:
        if gpus == 0:
            raise WorkerStartError("device=cuda but the Ray cluster has no GPUs "
                                   f"(resources: {dict(resources)}); use --device cpu or add GPU nodes")
        n = num_workers or gpus
        if n > gpus:
            raise WorkerStartError(f"num_workers={n} but the Ray cluster has {gpus} GPU(s); each worker needs one")
        per = max(1, min(cpus // n, max_node_cpus)) if cpus >= n else 0
        return WorkerPlan(n, 1, per, threads or max(1, per), "cuda")
    n = num_workers or 1
    if cpus < n:
        raise WorkerStartError(f"num_workers={n} but the Ray cluster has only {cpus} CPU(s)")
    per = max(1, min(cpus // n, max_node_cpus))
    return WorkerPlan(n, 0, per, threads or per, "cpu")


class WorkerPool:
    """``plan.num_workers`` actors holding one model; a dead actor is replaced in its slot."""

    def __init__(self, plan: WorkerPlan, model: str, dtype: str, engine_factory: EngineFactory | None,
                 quantize: str = "none") -> None:
        self.plan, self.model, self.dtype, self.engine_factory = plan, model, dtype, engine_factory
        self.quantize = quantize
        self.actors: list[Any] = [self._spawn() for _ in range(plan.num_workers)]

    def _spawn(self) -> Any:
        from cluster.sweep.worker import EngineWorkerActor

        return EngineWorkerActor.options(num_cpus=self.plan.num_cpus, num_gpus=self.plan.num_gpus,
                                         max_restarts=0).remote(
            self.model, self.dtype, self.plan.device, self.plan.threads, self.engine_factory, self.quantize,
            self.plan.schedule)

    def ping_all(self, timeout_s: float | None = None) -> list[dict[str, Any]]:
        """Wait until every actor has loaded its model; host information of each."""
        import ray

        timeout_s = WORKER_START_TIMEOUT_S if timeout_s is None else timeout_s
        with self._start_errors(timeout_s):
            return ray.get([a.ping.remote() for a in self.actors], timeout=timeout_s)

    @contextlib.contextmanager
    def _start_errors(self, timeout_s: float) -> Iterator[None]:
        """Ray's errors while the actors start, as one WorkerStartError that says what to do."""
        import ray

        try:
            yield
        except ray.exceptions.GetTimeoutError as e:
            raise WorkerStartError(
                f"{self.plan.num_workers} worker(s) for {self.model} (num_cpus={self.plan.num_cpus}, "
                f"num_gpus={self.plan.num_gpus} each) not ready after {timeout_s:.0f} s: the cluster may lack free "
                f"resources (available: {ray.available_resources()}) or the model load hangs; set "
                f"SPARSESPEC_WORKER_START_TIMEOUT_S to wait longer") from e
        except ray.exceptions.RayError as e:
            raise WorkerStartError(f"worker for model {self.model!r} (dtype {self.dtype}) failed to start: "
                                   f"{_short_error(e)}") from e

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


def _short_error(e: BaseException, limit: int = 600) -> str:
    """The cause of a Ray error in one line (the worker's exception, not Ray's traceback)."""
    cause = getattr(e, "cause", None)
    if cause is not None and not isinstance(cause, type(e)):
        text = f"{type(cause).__name__}: {cause}"
    else:
        text = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------- scoring + rows
Scorer = Callable[[Any, str], float]


#: vLLM's plain decoding: its greedy tokens against ours are an oracle of our model code
ENGINE_AR = VLLM_PREFIX + AR


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (or the shorter length); None if identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def lossless_check(ar_tokens: Sequence[int] | None, tokens: Sequence[int], stats: Mapping[str, Any],
                   temperature: float, *, oracle: bool = False) -> tuple[bool | None, int | None]:
    """(lossless, first_divergence) of a method's output against AR on the same sample.

    None when not applicable: sampling runs (equality is distributional, not per token) or no AR
    output. Identical output with zero drafted tokens is inconclusive (None), not a pass, except
    for ``oracle``: another engine's plain decoding (``vllm:ar``), where equal greedy tokens are
    the check itself (an independent implementation of the same model agrees with ours).
    """
    if ar_tokens is None or temperature > 0:
        return None, None
    div = first_divergence(ar_tokens, tokens)
    if div is None:
        return (True if oracle or int(stats.get("num_drafted", 0) or 0) > 0 else None), None
    return False, div


def result_rows(shard: Shard, outs: Sequence[Mapping[str, Any]], scorer: Scorer,
                unavailable: Iterable[str] = ()) -> list[dict[str, Any]]:
    """The store's result rows for a finished shard: scored, AR-checked (losslessness vs the AR
    row of the same sample in the same batch). ``unavailable``: methods of the shard the worker
    could not run (no rows expected; never ``ar``). Raises ValueError if rows are missing, a
    method is unknown to the shard or the scorer fails."""
    skipped = set(unavailable)
    if AR in skipped or not skipped <= set(shard.methods):
        raise ValueError(f"{shard.label}: the worker reported methods {sorted(skipped)} as unavailable "
                         f"(the shard runs {list(shard.methods)}; ar must run)")
    expected = {(s.sample_id, m) for s in shard.samples for m in shard.methods if m not in skipped}
    got = {(o["sample_id"], o["method"]) for o in outs}
    if got != expected or len(outs) != len(expected):
        raise ValueError(f"{shard.label}: the worker returned {len(outs)} rows, expected {len(expected)} "
                         f"(missing {sorted(expected - got)[:4]})")
    by_id = {s.sample_id: s for s in shard.samples}
    ar = {o["sample_id"]: o["token_ids"] for o in outs if o["method"] == AR}
    temperature = float(shard.sampling.get("temperature", 0.0))
    rows = []
    for o in outs:
        sample = by_id[o["sample_id"]]
        try:
            score = scorer(sample, o["text"])
        except Exception as e:  # noqa: BLE001 - re-raised with context
            raise ValueError(f"scorer failed on {sample.benchmark}/{sample.task}/{sample.sample_id} "
                             f"({o['method']}): {type(e).__name__}: {e}") from e
        lossless, div = (None, None) if o["method"] == AR else lossless_check(
            ar.get(o["sample_id"]), o["token_ids"], o["stats"], temperature, oracle=o["method"] == ENGINE_AR)
        rows.append({
            "run_id": shard.run_id, "benchmark": sample.benchmark, "task": sample.task, "model": shard.model,
            "method": o["method"], "sample_id": sample.sample_id, "prediction": o["text"],
            "token_ids": o["token_ids"], "score": None if score is None else float(score),
            "stats": {**o["stats"], "batch_key": shard.key, "finish_reason": o.get("finish_reason")},
            "lossless": lossless, "first_divergence": div,
            "num_input_tokens_raw": sample.num_input_tokens_raw, "num_input_tokens": sample.num_input_tokens,
            "references": list(sample.references),
        })
    return rows


def shard_summary(shard: Shard, rows: Sequence[Mapping[str, Any]], unavailable: Iterable[str] = ()) -> str:
    """One line per completed shard: batch speedup, acceptance and losslessness per method (and
    the methods that could not run)."""
    from sparsespec.stats import batch_tpot, derive, pool

    by_m: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        by_m.setdefault(r["method"], []).append(r)

    def tpot(rs: Sequence[Mapping[str, Any]]) -> float | None:
        return batch_tpot(r["stats"] for r in rs)

    t_ar = tpot(by_m.get(AR, []))
    parts = []
    for m, rs in by_m.items():
        if m == AR:
            parts.append(f"ar {1 / t_ar:.1f} tok/s" if t_ar else "ar")
            continue
        t = tpot(rs)
        d = derive(pool(r["stats"] for r in rs))
        ok = [r["lossless"] for r in rs if r["lossless"] is not None]
        sp = f"{t_ar / t:.2f}x" if (t and t_ar) else "-"
        alpha = f"{d['alpha']:.2f}" if d["alpha"] is not None else "-"
        parts.append(f"{m} {sp} alpha {alpha} lossless {sum(ok)}/{len(ok)}")
    size = f"B={shard.slots}" + (f" queue {len(shard.samples)}" if shard.slots < len(shard.samples) else "")
    return f"{shard.key} {size}: " + ", ".join(parts + [f"{m} unavailable" for m in unavailable])


# --------------------------------------------------------------------------- the loop
@dataclass
class Outcome:
    done: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # key -> last error
    worker_deaths: int = 0
    hosts: list[dict[str, Any]] = field(default_factory=list)


def run_on_ray(shards: Sequence[Shard], *, emit: Callable[[ShardEvent], None], scorers: Mapping[str, Scorer],
               dtype: str, num_workers: int | None = None, threads: int | None = None, device: str = "auto",
               schedule: str = "step", max_retries: int = 2, ray_address: str | None = None,
               local_num_cpus: int | None = None, engine_factory: EngineFactory | None = None,
               progress: bool = False, desc: str = "") -> Outcome:
    """Run ``shards`` on Ray from start to end: join or start Ray (:func:`ray_session`), plan the
    workers for its resources (:func:`plan_workers`), run the shards (:func:`run_shards`) and hand
    every event to ``emit``; the session (Ray's resources, the worker plan) travels with each
    :class:`WorkersReady`. Raises WorkerStartError (no such resources, a model that does not load)."""
    from cluster.sweep import provenance

    with ray_session(ray_address, num_cpus=local_num_cpus):
        wplan = dataclasses.replace(plan_workers(num_workers, threads, device), schedule=schedule)
        log.info("%d worker(s) x %d thread(s) on %s, schedule %s", wplan.num_workers, wplan.threads, wplan.device,
                 wplan.schedule)
        session = {"ray": provenance.ray_resources(),
                   "worker_plan": {"num_workers": wplan.num_workers, "num_gpus": wplan.num_gpus,
                                   "num_cpus": wplan.num_cpus, "threads": wplan.threads, "device": wplan.device,
                                   "schedule": wplan.schedule}}
        return run_shards(shards, plan=wplan, dtype=dtype, scorers=scorers, emit=emit, max_retries=max_retries,
                          engine_factory=engine_factory, progress=progress, desc=desc, session=session)


def run_shards(shards: Sequence[Shard], *, plan: WorkerPlan, dtype: str, scorers: Mapping[str, Scorer],
               emit: Callable[[ShardEvent], None], max_retries: int = 2,
               engine_factory: EngineFactory | None = None, progress: bool = False, desc: str = "",
               session: Mapping[str, Any] | None = None) -> Outcome:
    """Run ``shards`` (grouped by model and target quantisation) on ``plan``'s actors; hand every
    event to ``emit`` as it happens (the caller stores them).

    ``scorers``: benchmark name -> ``score_sample``. ``emit`` gets :class:`WorkersReady` once a
    model's workers have loaded (provenance), :class:`ShardStarted` before a shard is submitted,
    :class:`ShardDone` with its rows, and :class:`ShardFailed` for each failed attempt.
    ``progress``: a progress bar over the shards on stderr (``desc``: its label). ``session``: what
    each :class:`WorkersReady` carries about the Ray session (:func:`run_on_ray`).
    KeyboardInterrupt propagates after the shards in flight are released (a non-final
    :class:`ShardFailed` ``"interrupted"`` each: back to ``pending``) and the actors are stopped.
    """
    bar = _bar(len(shards), progress, desc)
    try:
        return _run_shards(shards, plan=plan, dtype=dtype, scorers=scorers, emit=emit, max_retries=max_retries,
                           engine_factory=engine_factory, bar=bar, session=dict(session or {}))
    finally:
        bar.close()


def _bar(total: int, enabled: bool, desc: str) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="shard", disable=not enabled, file=sys.stderr, dynamic_ncols=True)


def _run_shards(shards: Sequence[Shard], *, plan: WorkerPlan, dtype: str, scorers: Mapping[str, Scorer],
                emit: Callable[[ShardEvent], None], max_retries: int, engine_factory: EngineFactory | None,
                bar: Any, session: dict[str, Any]) -> Outcome:
    import ray

    outcome = Outcome()
    death = _death_errors()
    groups: list[tuple[str, str]] = []  # (model, quantize): one worker pool each
    for s in shards:
        if (s.model, s.quantize) not in groups:
            groups.append((s.model, s.quantize))
    samples_done = 0
    for model, quantize in groups:
        queue: deque[tuple[Shard, int]] = deque((s, 0) for s in shards
                                                if (s.model, s.quantize) == (model, quantize))
        pool = WorkerPool(plan, model, dtype, engine_factory, quantize)
        in_flight: dict[Any, tuple[int, Shard, int]] = {}
        try:
            hosts = pool.ping_all()
            outcome.hosts.extend(hosts)
            emit(WorkersReady(model, quantize, hosts, summarize_workers(hosts), session))
            pids = {slot: h.get("pid") for slot, h in enumerate(hosts)}

            def submit(slot: int) -> None:
                if queue:
                    shard, failures = queue.popleft()
                    emit(ShardStarted(shard, {"pid": pids.get(slot), "slot": slot}))
                    in_flight[pool.actors[slot].run_shard.remote(shard)] = (slot, shard, failures)

            for slot in range(len(pool.actors)):
                submit(slot)
            while in_flight:
                ready, _ = ray.wait(list(in_flight), num_returns=1)
                slot, shard, failures = in_flight.pop(ready[0])
                try:
                    res = ray.get(ready[0])
                    unavailable = dict(res.get("unavailable") or {})
                    rows = result_rows(shard, res["rows"], scorers[shard.benchmark], unavailable)
                except death as e:
                    outcome.worker_deaths += 1
                    err = f"worker died (attempt {failures + 1}): {_short_error(e)}"
                    final = failures >= max_retries
                    _log(bar, f"{shard.key}: {err}; " + ("giving up" if final else "retrying on a new worker"))
                    emit(ShardFailed(shard, err, final, note=err))
                    pool.restart(slot)
                    try:
                        pids[slot] = ray.get(pool.actors[slot].ping.remote(),
                                             timeout=WORKER_START_TIMEOUT_S).get("pid")
                    except ray.exceptions.RayError as e2:
                        raise WorkerStartError(f"could not replace a dead worker for {model}: "
                                               f"{_short_error(e2)}") from e2
                    if final:
                        outcome.failed[shard.key] = err
                        _advance(bar, samples_done)
                    else:
                        queue.appendleft((shard, failures + 1))
                    submit(slot)
                    continue
                except (ray.exceptions.RayTaskError, ValueError) as e:
                    err = f"attempt {failures + 1}: {_short_error(e)}"
                    scorer_fault = isinstance(e, ValueError)  # deterministic: the driver's own check
                    final = scorer_fault or failures >= max_retries
                    _log(bar, f"{shard.key}: {err}; " + ("recorded as failed" if final else "retrying"))
                    emit(ShardFailed(shard, err, final, note=f"shard failed: {err}" if final else None))
                    if final:
                        outcome.failed[shard.key] = err
                        _advance(bar, samples_done)
                    else:
                        queue.append((shard, failures + 1))
                    submit(slot)
                    continue
                emit(ShardDone(shard, rows, res.get("wall_s"), res.get("worker"), unavailable))
                outcome.done.append(shard.key)
                samples_done += len(shard.samples)
                _log(bar, shard_summary(shard, rows, unavailable))
                _advance(bar, samples_done)
                submit(slot)
        except BaseException:
            for _, shard, _ in in_flight.values():
                with contextlib.suppress(Exception):
                    emit(ShardFailed(shard, "interrupted", False))
            raise
        finally:
            pool.shutdown()
    return outcome


def _log(bar: Any, msg: str) -> None:
    if bar is not None and hasattr(bar, "write"):
        bar.write(msg, file=sys.stderr)
    else:
        log.info("%s", msg)


def _advance(bar: Any, samples_done: int) -> None:
    """One shard left the queue (done or failed)."""
    if bar is not None:
        bar.set_postfix_str(f"{samples_done} samples done", refresh=False)
        bar.update(1)


__all__ = ["Outcome", "ShardDone", "ShardEvent", "ShardFailed", "ShardStarted", "WorkerPlan", "WorkerPool",
           "WorkerStartError", "WorkersReady", "first_divergence", "lossless_check", "plan_workers", "ray_session",
           "result_rows", "run_on_ray", "run_shards", "shard_summary"]

"""What a sweep records: the events ``cluster.sweep.coordinator`` hands back as shards run, and
the one writer that stores them (``cluster.results.store.SweepRecorder``).

Plain data, no behaviour: the coordinator creates them without touching the store, the recorder
stores them without knowing Ray. ``shard`` is a ``cluster.sweep.plan.Shard`` (read here only for
``run_id``, ``key``, ``task`` and its samples' ``sample_id``).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: the run-event message of a method that cannot run on a target (``sparsespec.MethodUnavailable``)
UNAVAILABLE_EVENT = "method unavailable"


@dataclass(frozen=True)
class WorkersReady:
    """A model's workers have loaded it (``quantize``: the target's weights): their host records
    (``hosts``, one ``EngineWorker.ping`` each), their summary (``devices``:
    ``cluster.sweep.worker.summarize_workers``) and the session they run in (``session``: Ray's
    resources and the worker plan), stored with the runs' provenance."""

    model: str
    quantize: str
    hosts: list[dict[str, Any]]
    devices: dict[str, Any] = field(default_factory=dict)
    session: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ShardStarted:
    """A shard was handed to the worker in ``worker`` (``{"pid": ..., "slot": ...}``)."""

    shard: Any
    worker: dict[str, Any]


@dataclass(frozen=True)
class ShardDone:
    """A shard's scored, AR-checked result rows (``cluster.sweep.coordinator.result_rows``), its
    wall time and worker; ``unavailable``: the shard's methods that cannot run on this target
    here, and why (``sparsespec.MethodUnavailable``: no rows for them)."""

    shard: Any
    rows: list[dict[str, Any]]
    wall_s: float | None
    worker: Any
    unavailable: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ShardFailed:
    """An attempt failed with ``error``; ``final``: the shard will not be retried. ``note``: the
    line for the run's event log (None: nothing to log)."""

    shard: Any
    error: str
    final: bool
    note: str | None = None


ShardEvent = WorkersReady | ShardStarted | ShardDone | ShardFailed

__all__ = ["ShardDone", "ShardEvent", "ShardFailed", "ShardStarted", "UNAVAILABLE_EVENT", "WorkersReady"]

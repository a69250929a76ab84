"""per-method run ids: rewrite each sweep run's id to the hash of its methods' own options

Until this revision every method's resolved options held all 14 fields of one shared
``SpecConfig`` (ngram carried ``budget_frac``, sparsespec-l carried ``ngram_max`` ...), so adding
an option for one drafter moved every method's run ids. Now each drafter declares its own
options dataclass and a run's ``config["method_options"][method]`` holds only those (issue 26).
For a store written before, this revision:

* recomputes the id of every sweep run (a run whose id is the hash of its stored config, as
  ``cluster.sweep.plan.compute_run_id`` made it; others, e.g. ``bench-...`` runs, are left alone) from
  its config with each method's options cut to the ones the method takes (``OWN_OPTIONS``, frozen
  here) and ``draft_weights`` filled in for the self-speculative methods (the old form left it
  out at ``"target"``);
* moves the run to the new id everywhere an id is held: ``runs`` (the config rewritten too),
  ``results.run_id`` and the shard key in ``results.stats.batch_key``, ``shards.run_id`` and
  ``shards.key`` (``<run_id>/<task>/<batch>``), ``bench.run_id``, the shard keys in
  ``runs.events``, and the sweep ids a bench run lists (``runs.config.e2e_run_ids``,
  ``bench.metrics.run_ids``);
* records every run it looked at in ``run_id_map`` (old id, new id, the old config, a note), so
  the move can be traced and undone (``downgrade`` moves the runs back and drops the table).

So ``cluster.sweep.run`` on the same spec plans the new ids and finds those runs' shards done.
Two old runs whose configs differed only in options their method never read (e.g. ngram with two
``budget_frac`` values) map to the same new id: the first (by old id) moves, the other keeps its
old id, with the reason in ``note``.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSONType = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")

_SPEC = ("k", "max_k", "controller")
_SELF = _SPEC + ("budget_frac", "min_budget", "max_budget", "draft_weights")
#: The options each method takes at this revision (its options dataclass's fields), frozen: a
#: later option is a later revision's business (or a ``later_option``, which needs none).
OWN_OPTIONS: dict[str, tuple[str, ...]] = {
    "sparsespec-l": _SELF + ("n_sink", "n_recent", "window"),
    "magicdec-streaming": _SELF + ("n_sink",),
    "magicdec-snapkv": _SELF + ("window", "pool_kernel"),
    "ngram": _SPEC + ("ngram_min", "ngram_max"),
    "draft-model": _SPEC + ("draft_model",),
    "eagle3": _SPEC + ("draft_model",),
}
#: Options the old form left out at this value (its ``LATER_OPTION_DEFAULTS``) and the new keeps.
FILLED: dict[str, dict[str, Any]] = {m: {"draft_weights": "target"}
                                     for m in ("sparsespec-l", "magicdec-streaming", "magicdec-snapkv")}

runs = sa.table("runs", sa.column("run_id"), sa.column("benchmark"), sa.column("model"),
                sa.column("methods", JSONType), sa.column("config", JSONType), sa.column("created_at"),
                sa.column("finished_at"), sa.column("status"), sa.column("host", JSONType),
                sa.column("events", JSONType))
results = sa.table("results", sa.column("id"), sa.column("run_id"), sa.column("stats", JSONType))
shards = sa.table("shards", sa.column("id"), sa.column("run_id"), sa.column("key"))
bench = sa.table("bench", sa.column("id"), sa.column("run_id"), sa.column("metrics", JSONType))


def run_id_of(benchmark: str, config: Mapping[str, Any]) -> str:
    """``cluster.sweep.plan.compute_run_id`` as of this revision (frozen)."""
    blob = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return f"{benchmark}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"


def own_options(method: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """A method's stored options in this revision's form (a method not known here: unchanged)."""
    if method not in OWN_OPTIONS:
        return dict(options)
    out = {k: v for k, v in options.items() if k in OWN_OPTIONS[method]}
    for k, v in FILLED.get(method, {}).items():
        out.setdefault(k, v)
    return out


def new_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A sweep run's stored config with each method's options in this revision's form."""
    out = dict(config)
    out["method_options"] = {m: own_options(m, o or {}) for m, o in (config.get("method_options") or {}).items()}
    return out


def is_sweep_run(run_id: str, config: Any) -> bool:
    """The run's id is the hash of its stored config (a ``cluster.sweep.plan`` cell)."""
    return (isinstance(config, Mapping) and isinstance(config.get("method_options"), Mapping)
            and isinstance(config.get("benchmark"), str) and run_id == run_id_of(config["benchmark"], config))


def _rekey(key: Any, old: str, new: str) -> Any:
    return new + key[len(old):] if isinstance(key, str) and key.startswith(old + "/") else key


def _move(conn: sa.Connection, old: str, new: str, config: Mapping[str, Any]) -> None:
    """Move run ``old`` (and everything keyed by it) to ``new``, its config set to ``config``.
    The new runs row is written first and the old one deleted last, so the foreign keys hold."""
    row = conn.execute(sa.select(runs).where(runs.c.run_id == old)).mappings().one()
    events = [{**e, "shard": _rekey(e["shard"], old, new)} if isinstance(e, Mapping) and "shard" in e else e
              for e in (row["events"] or [])]
    conn.execute(sa.insert(runs).values({**row, "run_id": new, "config": dict(config), "events": events}))
    conn.execute(sa.update(results).where(results.c.run_id == old).values(run_id=new))
    conn.execute(sa.update(shards).where(shards.c.run_id == old).values(run_id=new))
    conn.execute(sa.update(bench).where(bench.c.run_id == old).values(run_id=new))
    for rid, stats in conn.execute(sa.select(results.c.id, results.c.stats).where(results.c.run_id == new)).all():
        if isinstance(stats, Mapping) and _rekey(stats.get("batch_key"), old, new) != stats.get("batch_key"):
            conn.execute(sa.update(results).where(results.c.id == rid).values(
                stats={**stats, "batch_key": _rekey(stats["batch_key"], old, new)}))
    for sid, key in conn.execute(sa.select(shards.c.id, shards.c.key).where(shards.c.run_id == new)).all():
        if _rekey(key, old, new) != key:
            conn.execute(sa.update(shards).where(shards.c.id == sid).values(key=_rekey(key, old, new)))
    conn.execute(sa.delete(runs).where(runs.c.run_id == old))


def _remap_lists(conn: sa.Connection, mapping: Mapping[str, str]) -> None:
    """The sweep run ids a bench run lists (``config.e2e_run_ids``, ``metrics.run_ids``)."""
    if not mapping:
        return
    for rid, config in conn.execute(sa.select(runs.c.run_id, runs.c.config)).all():
        ids = config.get("e2e_run_ids") if isinstance(config, Mapping) else None
        if isinstance(ids, list) and any(i in mapping for i in ids):
            conn.execute(sa.update(runs).where(runs.c.run_id == rid).values(
                config={**config, "e2e_run_ids": [mapping.get(i, i) for i in ids]}))
    for bid, metrics in conn.execute(sa.select(bench.c.id, bench.c.metrics)).all():
        ids = metrics.get("run_ids") if isinstance(metrics, Mapping) else None
        if isinstance(ids, list) and any(i in mapping for i in ids):
            conn.execute(sa.update(bench).where(bench.c.id == bid).values(
                metrics={**metrics, "run_ids": sorted(mapping.get(i, i) for i in ids)}))


def upgrade() -> None:
    run_id_map = op.create_table(
        "run_id_map",
        sa.Column("old_run_id", sa.String(64), nullable=False),
        sa.Column("new_run_id", sa.String(64), nullable=False),
        sa.Column("revision", sa.String(32), nullable=False),
        sa.Column("old_config", JSONType, nullable=False),
        sa.Column("note", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("old_run_id"),
    )
    op.create_index("ix_run_id_map_new_run_id", "run_id_map", ["new_run_id"])
    conn = op.get_bind()
    stored = conn.execute(sa.select(runs.c.run_id, runs.c.config).order_by(runs.c.run_id)).all()
    taken = {rid for rid, _ in stored}
    mapping: dict[str, str] = {}
    records = []
    for old, config in stored:
        if not is_sweep_run(old, config):
            continue
        cfg = new_config(config)
        new = run_id_of(cfg["benchmark"], cfg)
        note = None
        if new == old:
            note = "unchanged"
        elif new in taken:
            note = f"kept: {new} is already taken (its methods' own options are the same)"
            new = old
        else:
            _move(conn, old, new, cfg)
            taken.add(new)
            mapping[old] = new
        records.append({"old_run_id": old, "new_run_id": new, "revision": revision, "old_config": config,
                        "note": note})
    _remap_lists(conn, mapping)
    if records:
        op.bulk_insert(run_id_map, records)


def downgrade() -> None:
    conn = op.get_bind()
    m = sa.table("run_id_map", sa.column("old_run_id"), sa.column("new_run_id"), sa.column("revision"),
                 sa.column("old_config", JSONType))
    back: dict[str, str] = {}
    for old, new, config in conn.execute(
            sa.select(m.c.old_run_id, m.c.new_run_id, m.c.old_config).where(m.c.revision == revision)).all():
        if new != old and conn.execute(sa.select(runs.c.run_id).where(runs.c.run_id == new)).first():
            _move(conn, new, old, config)
            back[new] = old
    _remap_lists(conn, back)
    op.drop_table("run_id_map")

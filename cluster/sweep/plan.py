"""The planner: a validated sweep spec -> cells (one run each) -> shards (one batch each).

Pure: no Ray, no SQL. Building samples needs each model's tokenizer and window (read from the
local model folder or preset; nothing is downloaded).

- A **cell** is one (model, quantize, benchmark, context length, batch size, repetition): one run
  in the store, whose id is a hash of everything that decides its numbers (methods with their
  resolved options, each method's own only, dtype, the target's quantisation (left out when
  "none", so earlier ids stay), sampling, tasks, benchmark options, and a digest of the samples
  themselves).
  Where results go and how work is spread (db, Ray address, workers, threads) are left out, so
  rerunning a spec with more workers resumes the same runs.
- A **shard** is one batch: up to ``batch_size`` consecutive samples of one task of one cell,
  run together through the engine with *every* method of the sweep (``ar`` first in the list),
  in the same actor, interleaved (the order rotates with the batch index). Speedup is paired
  per batch; quality and losslessness per sample. With ``queue_depth`` Q > 1 a shard is a queue
  of up to Q x ``batch_size`` samples that one core of ``batch_size`` slots decodes with
  continuous batching (``Shard.max_num_seqs``); the pairing is per queue.

Shard keys are ``<run_id>/<task>/<batch index>``: the same spec always gives the same keys.
"""
from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cluster.sweep.schema import AR, SweepSpec
from evals.base import Sample
from evals.registry import Benchmark, get_benchmark


@dataclass(frozen=True)
class Shard:
    """One batch of one cell: ``samples`` (same task) decoded together with every method."""

    key: str
    run_id: str
    model: str
    benchmark: str
    task: str
    samples: tuple[Sample, ...]
    methods: tuple[str, ...]
    method_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    quantize: str = "none"  # the target's weights (cluster.sweep.schema.QUANTIZE): the worker quantises at load
    sampling: Mapping[str, Any] = field(default_factory=dict)  # temperature, top_p, top_k, seed
    batch_index: int = 0  # index of this batch within (run, task): with the run id, sets the method rotation
    sample_offset: int = 0  # index of samples[0] within its task: sets the sampling seeds
    #: where the batch's method order starts (``cluster.sweep.worker.method_order``); default: the
    #: batch index plus an offset drawn from the run id (CRC-32). Consecutive batches of a cell
    #: rotate; cells of a single batch (a batch x context map) no longer all run the same method
    #: first, which under ``schedule="run"`` put ``ar`` first in every cell of a measured map, where
    #: the first method's batch ran slower in most cells (benchmarks/RESULTS.md, 2026-12-05,
    #: twentieth session)
    rotation: int | None = None
    #: slots of the core that decodes the shard; None: one per sample (a static batch). Fewer
    #: slots than samples: the rest wait, and each finished row's slot takes the next
    #: (continuous batching, ``SweepSpec.queue_depth``)
    max_num_seqs: int | None = None
    #: how errors name the shard: ``shard <key> (<model>, <n> sample(s): <first ids>)``
    label: str = field(init=False, repr=False, compare=False)
    #: rows decoded at once: ``max_num_seqs``, or every sample of a static batch
    slots: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ids = [s.sample_id for s in self.samples]
        shown = ", ".join(ids[:4]) + (f", ... (+{len(ids) - 4})" if len(ids) > 4 else "")
        object.__setattr__(self, "label", f"shard {self.key} ({self.model}, {len(ids)} sample(s): {shown})")
        if self.rotation is None:
            object.__setattr__(self, "rotation", self.batch_index + zlib.crc32(self.run_id.encode()))
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"{self.label}: max_num_seqs must be >= 1, got {self.max_num_seqs}")
        object.__setattr__(self, "slots", min(self.max_num_seqs or len(self.samples), len(self.samples)))


@dataclass(frozen=True)
class Cell:
    """One run: a (model, benchmark, context length, batch size, repetition) of the sweep."""

    run_id: str
    model: str
    benchmark: str
    context_length: int | None
    batch_size: int
    repetition: int
    config: dict[str, Any]  # what was hashed into run_id (stored as the run's config)
    samples: tuple[Sample, ...]
    quantize: str = "none"  # the target's weights; "int8": every method, ar included, runs quantised
    queue_depth: int = 1  # batches per shard (SweepSpec.queue_depth): 1 = static batches


def samples_digest(samples: Sequence[Sample]) -> str:
    """Hash of what is decoded (task, id, prompt, budget, stop rule): changed data -> new run."""
    h = hashlib.sha256()
    for s in samples:
        stop = {k: s.meta.get(k) for k in ("stop", "stop_token_ids", "min_new_tokens", "ignore_eos")
                if s.meta.get(k)}
        h.update(json.dumps([s.benchmark, s.task, s.sample_id, list(s.prompt_ids), s.max_new_tokens, stop],
                            sort_keys=True, default=str).encode())
    return h.hexdigest()


def compute_run_id(benchmark: str, config: Mapping[str, Any]) -> str:
    """``<benchmark>-<16 hex of sha256(canonical JSON of config)>``."""
    blob = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return f"{benchmark}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"


TokenizerInfo = Callable[[str], tuple[Any, int]]  # model -> (tokenizer, window in tokens)


def default_tokenizer_info(model: str) -> tuple[Any, int]:
    import sparsespec

    return sparsespec.load_tokenizer(model), int(sparsespec.model_max_context(model))


def _check_batch(samples: Sequence[Sample], where: str) -> None:
    keys = [(s.task, s.sample_id) for s in samples]
    if len(set(keys)) != len(keys):
        dup = sorted({k for k in keys if keys.count(k) > 1})[:5]
        raise ValueError(f"{where}: duplicate (task, sample_id) {dup}")


def plan_cells(spec: SweepSpec,
               method_options: Mapping[str, Mapping[str, Any]] | Sequence[Mapping[str, Mapping[str, Any]]],
               tokenizer_info: TokenizerInfo = default_tokenizer_info) -> list[Cell]:
    """Every cell of the sweep, samples built (once per model, benchmark and context length).

    ``method_options``: the resolved options (``cluster.sweep.schema.check_methods``), or a list
    of such method sets (``check_method_sets``: a cell per set). Raises ValueError (bad task,
    context length over a model's window, ...) naming the benchmark and model.
    """
    cells: list[Cell] = []
    method_sets = [method_options] if isinstance(method_options, Mapping) else list(method_options)
    sampling = spec.sampling.model_dump(mode="json")
    for model in spec.models:
        tokenizer, window = tokenizer_info(model)
        for b in spec.benchmarks:
            bench: Benchmark = get_benchmark(b.name)
            lengths = b.context_lengths if b.context_lengths is not None else spec.context_lengths
            for L in lengths:
                where = f"{b.name} on {model} at context length {L if L is not None else 'default'}"
                try:
                    samples = tuple(bench.build_samples(
                        tokenizer, window=window, context_length=L, tasks=b.tasks, num_samples=b.num_samples,
                        max_new_tokens=spec.sampling.max_new_tokens, options=dict(b.options)))
                except (ValueError, FileNotFoundError) as e:
                    raise ValueError(f"{where}: {e}") from None
                if not samples:
                    raise ValueError(f"{where}: no samples were built (tasks={b.tasks}, num_samples={b.num_samples})")
                _check_batch(samples, where)
                over = [s for s in samples if s.num_input_tokens + s.max_new_tokens > window]
                if over:
                    s = over[0]
                    raise ValueError(f"{where}: {s.task}/{s.sample_id} has {s.num_input_tokens} prompt tokens + "
                                     f"{s.max_new_tokens} to generate, over the model's window of {window}")
                digest = samples_digest(samples)
                depth = b.queue_depth if b.queue_depth is not None else spec.queue_depth
                for q in spec.quantize:
                    for B in (b.batch_sizes if b.batch_sizes is not None else spec.batch_sizes):
                        for rep, opts in ((r, o) for r in range(spec.repetitions) for o in method_sets):
                            methods = list(opts) if len(method_sets) > 1 else list(spec.methods)
                            config = {
                                "benchmark": b.name, "model": model, "dtype": spec.dtype, "methods": methods,
                                "method_options": {m: dict(opts.get(m, {})) for m in methods},
                                "sampling": sampling, "context_length": L, "batch_size": B, "repetition": rep,
                                "tasks": list(b.tasks) if b.tasks else None, "num_samples": b.num_samples,
                                "options": dict(b.options), "num_built": len(samples), "samples_sha256": digest,
                            }
                            if q != "none":
                                config["quantize"] = q
                            if depth > 1:  # left out at 1 (static batches), so earlier run ids stay
                                config["queue_depth"] = depth
                            config = json.loads(json.dumps(config, sort_keys=True, default=str))
                            cells.append(Cell(compute_run_id(b.name, config), model, b.name, L, B, rep, config,
                                              samples, quantize=q, queue_depth=depth))
    ids = [c.run_id for c in cells]
    if len(set(ids)) != len(ids):  # e.g. two context lengths that build identical samples
        seen: set[str] = set()
        cells = [c for c in cells if not (c.run_id in seen or seen.add(c.run_id))]
    return cells


def plan_shards(cell: Cell) -> list[Shard]:
    """The cell's batches: consecutive samples of each task, ``batch_size`` at a time (the last
    batch of a task may be smaller); with ``queue_depth`` Q > 1, queues of ``Q x batch_size``
    samples, each decoded by a core of ``batch_size`` slots (``Shard.max_num_seqs``)."""
    by_task: dict[str, list[Sample]] = {}
    for s in cell.samples:
        by_task.setdefault(s.task, []).append(s)
    methods = tuple(cell.config["methods"])
    opts = cell.config["method_options"]
    sampling = {k: cell.config["sampling"][k] for k in ("temperature", "top_p", "top_k", "seed")}
    shards = []
    B, n = cell.batch_size, cell.batch_size * cell.queue_depth
    for task, items in by_task.items():
        for bi, start in enumerate(range(0, len(items), n)):
            shards.append(Shard(
                key=f"{cell.run_id}/{task}/{bi}", run_id=cell.run_id, model=cell.model, benchmark=cell.benchmark,
                task=task, samples=tuple(items[start:start + n]), methods=methods,
                method_options={m: dict(opts.get(m, {})) for m in methods}, sampling=dict(sampling),
                quantize=cell.quantize,
                batch_index=bi, sample_offset=start, max_num_seqs=B if cell.queue_depth > 1 else None,
            ))
    return shards


__all__ = ["AR", "Cell", "Shard", "compute_run_id", "default_tokenizer_info", "plan_cells",
           "plan_shards", "samples_digest"]

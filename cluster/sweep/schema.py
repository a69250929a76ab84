"""Sweep specs: the YAML a user writes to run a grid of (model x method x batch size x context
length x benchmark task x repetition) cells, validated once, up front.

Schema (every key except ``name``, ``models`` and ``benchmarks`` is optional; see
``configs/*.yaml`` and the README's "Sweeps" section)::

    name: demo                        # label of the sweep (stored with every run)
    models: [smollm2-135m]            # presets, hub ids or local Hugging Face folders
    dtype: float32                    # float32 | bfloat16 | float16
    quantize: [none]                  # target weights per run: none | int8 (a sweep axis; each its own ar)
    device: auto                      # auto (GPU workers when the cluster has GPUs) | cpu | cuda
    methods:                          # method -> options; "ar" is always run (the reference)
      sparsespec-l: {k: auto}
      magicdec-snapkv: [{k: 2}, {k: 4}]   # a list: variants; the first runs with the other methods,
                                          # each further one in a run of its own beside ar
      vllm:ngram: {num_speculative_tokens: 4}   # vLLM's own method on the same batches (its
                                          # speculative_config keys; cluster.peers.methods; make peers)
    batch_sizes: [1, 4]               # samples decoded together in one engine batch
    queue_depth: 1                    # 1: static batches (all rows start together, the batch waits for
                                      # its slowest); Q > 1: each shard feeds Q x batch size samples
                                      # through one core of batch-size slots, a finished row's slot
                                      # taking the next waiting sample (continuous batching, as served)
    context_lengths: [4096]           # tokens (prompt + generation budget); null = the benchmark's default
    benchmarks:
      - name: ruler                   # registry key (evals.registry.BENCHMARKS)
        tasks: [niah_single_1]        # default: the benchmark's default tasks
        num_samples: 1                # per task (default: the benchmark's own)
        context_lengths: [4096]       # overrides the sweep's for this benchmark
        batch_sizes: [1]              # overrides the sweep's for this benchmark
        queue_depth: 4                # overrides the sweep's for this benchmark
        options: {seed: 42}           # the benchmark's own options (its CLI flags' dest names)
    sampling:
      temperature: 0.0                # 0 = greedy (token-identical losslessness check)
      top_p: 1.0
      top_k: 0
      seed: 0                         # sampling seed; row i of a batch gets (seed, sample index)
      max_new_tokens: null            # null = each task's official budget
    repetitions: 1                    # each cell this many times (timing spread)
    workers:
      num_workers: null               # engine actors (default: one per GPU, else 1)
      threads: null                   # torch threads per actor (default: its CPUs)
      max_retries: 2                  # a shard whose worker dies is retried this many times
      schedule: step                  # step: the methods' cores take turns step by step | run: whole batches in turn
    db: sqlite:///results/sparsespec.db

The planner (``cluster.sweep.plan``) turns a spec into cells and shards; ``cluster.sweep.run`` runs them.
"""
from __future__ import annotations

import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cluster.results.store import DEFAULT_DB_URL
from sparsespec.registry import AR

DTYPES = ("float32", "bfloat16", "float16")
QUANTIZE = ("none", "int8")  # sparsespec.quant.QUANTIZE (not imported: the spec must not need torch)
DEVICES = ("auto", "cpu", "cuda")


class SpecError(ValueError):
    """A sweep spec that cannot be read or does not validate (one readable message)."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class BenchmarkSpec(_Frozen):
    """One benchmark of the sweep (``name`` is a key of ``evals.registry.BENCHMARKS``)."""

    name: str
    tasks: tuple[str, ...] | None = None
    num_samples: int | None = Field(default=None, ge=1)
    context_lengths: tuple[int | None, ...] | None = None
    batch_sizes: tuple[int, ...] | None = None
    #: batches per shard fed through one core (``SweepSpec.queue_depth``); None: the sweep's
    queue_depth: int | None = Field(default=None, ge=1)
    options: dict[str, Any] = Field(default_factory=dict)

    @field_validator("batch_sizes")
    @classmethod
    def _batches(cls, v: Any) -> Any:
        return v if v is None else _check_batches(v)

    @field_validator("tasks", mode="before")
    @classmethod
    def _tasks(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [t.strip() for t in v.split(",") if t.strip()]
        if v is not None and not v:
            raise ValueError("tasks must name at least one task (or be omitted)")
        return v

    @field_validator("context_lengths")
    @classmethod
    def _lengths(cls, v: Any) -> Any:
        return _check_lengths(v)


class SamplingSpec(_Frozen):
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int = 0
    max_new_tokens: int | None = Field(default=None, ge=1)


class WorkersSpec(_Frozen):
    num_workers: int | None = Field(default=None, ge=1)
    threads: int | None = Field(default=None, ge=1)
    max_retries: int = Field(default=2, ge=0)
    #: how a batch's methods share the device (``cluster.sweep.worker``): "step" interleaves their cores'
    #: steps (paired timing on a noisy machine), "run" decodes each method's whole batch in turn
    #: (one KV pool in memory at a time). Not part of the run id: it changes no output.
    schedule: Literal["step", "run"] = "step"


def _check_batches(v: tuple[int, ...]) -> tuple[int, ...]:
    if not v or any(b < 1 for b in v):
        raise ValueError(f"batch sizes must be >= 1, got {list(v)}")
    if len(set(v)) != len(v):
        raise ValueError(f"duplicate batch sizes in {list(v)}")
    return v


def _check_lengths(v: Any) -> Any:
    if v is None:
        return v
    if not v:
        raise ValueError("must list at least one context length")
    for x in v:
        if x is not None and x < 2:
            raise ValueError(f"context lengths must be >= 2 tokens (or null), got {x}")
    if len(set(v)) != len(v):
        raise ValueError(f"duplicate context lengths in {list(v)}")
    return v


class SweepSpec(_Frozen):
    """A validated sweep (see the module docstring for the YAML schema)."""

    name: str = Field(min_length=1)
    models: tuple[str, ...] = Field(min_length=1)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    quantize: tuple[Literal["none", "int8"], ...] = ("none",)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    methods: dict[str, dict[str, Any]] = Field(default_factory=lambda: {"sparsespec-l": {}})
    #: a method's further option sets (from a list under ``methods``: its first set stays in
    #: ``methods``); each runs as its own run with ``ar`` (``method_sets``)
    method_variants: dict[str, tuple[dict[str, Any], ...]] = Field(default_factory=dict)
    batch_sizes: tuple[int, ...] = (1,)
    #: 1: static batches (a shard is one batch; its rows start together and it decodes until its
    #: slowest row is done). Q > 1: a shard is a queue of Q x batch size samples decoded by one
    #: core of batch-size slots, each freed slot taking the next waiting sample (continuous
    #: batching, as a server runs; ``cluster.sweep.worker``). Part of the run id when > 1.
    queue_depth: int = Field(default=1, ge=1)
    context_lengths: tuple[int | None, ...] = (None,)
    benchmarks: tuple[BenchmarkSpec, ...] = Field(min_length=1)
    sampling: SamplingSpec = SamplingSpec()
    repetitions: int = Field(default=1, ge=1)
    workers: WorkersSpec = WorkersSpec()
    db: str = DEFAULT_DB_URL

    @field_validator("benchmarks", mode="before")
    @classmethod
    def _bench_names(cls, v: Any) -> Any:
        """``- ruler`` is short for ``- {name: ruler}``."""
        if isinstance(v, (list, tuple)):
            return [{"name": b} if isinstance(b, str) else b for b in v]
        return v

    @field_validator("models", mode="before")
    @classmethod
    def _models(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [m.strip() for m in v.split(",") if m.strip()]
        if isinstance(v, (list, tuple)) and len(set(v)) != len(v):
            raise ValueError(f"duplicate models in {list(v)}")
        return v

    @field_validator("quantize", mode="before")
    @classmethod
    def _quantize(cls, v: Any) -> Any:
        """``int8`` is short for ``[int8]``; ``none`` / null is the full-precision target."""
        if v is None:
            return ["none"]
        if isinstance(v, str):
            v = [m.strip() for m in v.split(",") if m.strip()]
        if isinstance(v, (list, tuple)):
            if not v:
                raise ValueError("quantize must list at least one of none, int8")
            v = ["none" if x is None else x for x in v]
            if len(set(v)) != len(v):
                raise ValueError(f"duplicate quantize values in {list(v)}")
        return v

    @model_validator(mode="before")
    @classmethod
    def _split_variants(cls, data: Any) -> Any:
        """``methods: {m: [opts1, opts2, ...]}``: ``opts1`` stays in ``methods``, the rest go to
        ``method_variants``."""
        if not isinstance(data, Mapping) or not isinstance(data.get("methods"), Mapping):
            return data
        listed = any(isinstance(o, (list, tuple)) for o in data["methods"].values())
        if "method_variants" in data:  # a resolved spec (``resolved()``) reads back as it is
            if listed:
                raise ValueError("method_variants is filled from list-valued methods: give the option sets "
                                 "as `methods: {method: [{...}, {...}]}` only")
            return data
        methods, variants = {}, {}
        for m, opts in data["methods"].items():
            if isinstance(opts, (list, tuple)):
                if not opts:
                    raise ValueError(f"method {m!r}: an empty list of option sets")
                sets = [{} if o is None else o for o in opts]
                bad = [o for o in sets if not isinstance(o, Mapping)]
                if bad:
                    raise ValueError(f"options of method {m!r} must be mappings, got {bad[0]!r}")
                if m == AR and (len(sets) > 1 or sets[0]):
                    raise ValueError("method 'ar' takes no options")
                methods[m] = dict(sets[0])
                if len(sets) > 1:
                    variants[m] = [dict(o) for o in sets[1:]]
            else:
                methods[m] = opts
        return {**data, "methods": methods, "method_variants": variants}

    @field_validator("methods", mode="before")
    @classmethod
    def _methods(cls, v: Any) -> Any:
        """A list ``[ar, sparsespec-l]`` or a mapping ``{method: {option: value}}``; ``ar``
        first, always present, and takes no options."""
        if isinstance(v, str):
            v = [m.strip() for m in v.split(",") if m.strip()]
        if isinstance(v, (list, tuple)):
            if len(set(v)) != len(v):
                raise ValueError(f"duplicate methods in {list(v)}")
            v = {m: {} for m in v}
        if not isinstance(v, Mapping):
            raise ValueError("methods must be a list of names or a mapping method -> options")
        out: dict[str, dict[str, Any]] = {AR: {}}
        for m, opts in v.items():
            if opts is None:
                opts = {}
            if not isinstance(opts, Mapping):
                raise ValueError(f"options of method {m!r} must be a mapping, got {opts!r}")
            if m == AR:
                if opts:
                    raise ValueError("method 'ar' takes no options")
                continue
            out[str(m)] = dict(opts)
        return out

    @field_validator("batch_sizes")
    @classmethod
    def _batches(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        return _check_batches(v)

    @field_validator("context_lengths")
    @classmethod
    def _lengths(cls, v: Any) -> Any:
        return _check_lengths(v)

    @model_validator(mode="after")
    def _known_names(self) -> SweepSpec:
        from evals.registry import BENCHMARKS

        for b in self.benchmarks:
            if b.name not in BENCHMARKS:
                close = difflib.get_close_matches(b.name, list(BENCHMARKS), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"unknown benchmark {b.name!r}{hint} (known: {', '.join(BENCHMARKS)})")
        names = [b.name for b in self.benchmarks]
        if len(set(names)) != len(names):
            raise ValueError(f"benchmark listed twice in {names}: merge its tasks into one entry")
        return self

    @property
    def method_names(self) -> list[str]:
        return list(self.methods)

    def resolved(self) -> dict[str, Any]:
        """The spec as plain JSON (every default filled in): what is stored with each run."""
        return self.model_dump(mode="json")


def check_method_sets(spec: SweepSpec) -> list[dict[str, dict[str, Any]]]:
    """The sets of methods the sweep runs, each a run per cell, options resolved
    (``check_methods``): every method with its first options, then ``{ar, method: variant}``
    for each further variant (``method_variants``). Raises SpecError (an unknown method, bad
    options, a variant that resolves to options already listed)."""
    import sparsespec
    from cluster.peers.methods import is_vllm_method, resolve_vllm_options

    base = check_methods(spec)
    sets = [base]
    for m, variants in spec.method_variants.items():
        seen = [base[m]]
        for v in variants:
            try:
                opts = (resolve_vllm_options(m, dict(v)) if is_vllm_method(m)
                        else sparsespec.resolve_method_options(m, dict(v)))
            except ValueError as e:
                raise SpecError(str(e)) from None
            if opts in seen:
                raise SpecError(f"method {m!r} lists the options {dict(v)} twice (resolved: {opts})")
            seen.append(opts)
            sets.append({AR: {}, m: opts})
    return sets


def check_methods(spec: SweepSpec) -> dict[str, dict[str, Any]]:
    """Every method known to the engine, its options resolved to the full config of that method's
    own options (``sparsespec.resolve_method_options``: defaults included, so a changed default
    changes the run id; another method's options never do). Raises SpecError."""
    import sparsespec
    from cluster.peers.methods import VLLM_METHODS, VLLM_PREFIX, is_vllm_method, resolve_vllm_options

    known = list(getattr(sparsespec, "METHODS", ())) + [VLLM_PREFIX + m for m in VLLM_METHODS]
    unknown = [m for m in spec.methods if m not in known]
    if unknown:
        hints = [difflib.get_close_matches(m, known, n=1) for m in unknown]
        hint = "".join(f"; did you mean {h[0]!r}?" for h in hints if h)
        raise SpecError(f"unknown method(s) {unknown}{hint} (available: {', '.join(sorted(known))})")
    try:
        return {m: ({} if m == AR else resolve_vllm_options(m, dict(o)) if is_vllm_method(m)
                    else sparsespec.resolve_method_options(m, dict(o)))
                for m, o in spec.methods.items()}
    except ValueError as e:
        raise SpecError(str(e)) from None


def check_benchmarks(spec: SweepSpec) -> None:
    """Each benchmark's fast preflight (task names, data folders, option keys). Raises SpecError."""
    from evals.registry import get_benchmark

    for b in spec.benchmarks:
        try:
            get_benchmark(b.name).check(tasks=b.tasks, options=dict(b.options))
        except (ValueError, FileNotFoundError) as e:
            raise SpecError(f"benchmark {b.name}: {e}") from None


def _format_validation(e: ValidationError, where: str) -> str:
    lines = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"{where}: {loc}: {msg}")
    return "\n".join(lines)


def parse_spec(data: Any, where: str = "spec") -> SweepSpec:
    """Validate a mapping (the parsed YAML). Raises SpecError with one line per problem."""
    if not isinstance(data, Mapping):
        raise SpecError(f"{where}: a sweep spec is a mapping (name:, models:, benchmarks:, ...), got "
                        f"{type(data).__name__}")
    try:
        return SweepSpec.model_validate(dict(data))
    except ValidationError as e:
        raise SpecError(_format_validation(e, where)) from None


def load_spec(path: str | Path, overrides: Mapping[str, Any] | None = None) -> SweepSpec:
    """Read and validate a YAML spec; ``overrides`` (top-level keys, e.g. from CLI flags) replace
    the file's values before validation. Raises SpecError."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise SpecError(f"cannot read sweep spec {path}: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f":{mark.line + 1}" if mark is not None else ""
        raise SpecError(f"{path}{at}: not valid YAML ({getattr(e, 'problem', None) or e})") from None
    if data is None:
        raise SpecError(f"{path}: empty sweep spec")
    if not isinstance(data, Mapping):
        raise SpecError(f"{path}: a sweep spec is a mapping (name:, models:, benchmarks:, ...)")
    return parse_spec(apply_overrides(data, overrides or {}), str(path))


def apply_overrides(data: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` with CLI overrides applied. Keys are top-level spec keys, or dotted
    ``sampling.temperature`` / ``workers.threads``; ``benchmarks.num_samples`` /
    ``benchmarks.tasks`` apply to every benchmark entry; ``methods`` (a list of names) selects
    methods and keeps the options the spec gives them (``--methods draft-model`` on a spec whose
    ``draft-model`` names its draft still names it). None values are ignored."""
    out: dict[str, Any] = {k: v for k, v in data.items()}
    for key, value in overrides.items():
        if value is None:
            continue
        head, _, tail = key.partition(".")
        if head == "methods" and not tail and isinstance(out.get("methods"), Mapping) \
                and not isinstance(value, Mapping):
            given = out["methods"]
            out["methods"] = {m: given.get(m, {}) for m in value}
        elif not tail:
            out[head] = value
        elif head == "benchmarks":
            out["benchmarks"] = [{**(b if isinstance(b, Mapping) else {"name": b}), tail: value}
                                 for b in (out.get("benchmarks") or [])]
        else:
            sub = dict(out.get(head) or {})
            sub[tail] = value
            out[head] = sub
    return out


__all__ = ["AR", "BenchmarkSpec", "SamplingSpec", "SpecError", "SweepSpec", "WorkersSpec", "apply_overrides",
           "check_benchmarks", "check_method_sets", "check_methods", "load_spec", "parse_spec"]

"""The measured crossover map as a deployable speculation policy (issue 27 item 3).

``build_policy`` turns a store's cells (``cluster.results.aggregate.cell_table``, tasks and benchmarks
pooled per (model, context length, batch size, method, k, draft weights), full-precision
targets only) into, per model and per (batch bucket, context bucket), the fastest *lossless*
method and k, or ``k = 0`` (speculation off, ``ar``). Every number in an entry is a cell's
``cell_table`` number (median paired speedup over batches, its 95 % bootstrap interval, pairs);
nothing here re-derives a ratio.

A candidate (a non-``ar`` cell of the bucket) is *eligible* when

- its greedy lossless rate is 1 over at least one conclusive sample (None, i.e. no conclusive
  sample, is not proof: not eligible; below 1 is lossy);
- it has at least ``min_pairs`` paired batches (default ``cluster.results.aggregate.MIN_CI_PAIRS``, the
  fewest that get an interval) and an interval;
- its interval lies above 1 (``ci_low > 1``): conclusively faster than ``ar``; a median above 1
  whose interval reaches 1 is inconclusive.

The entry is the eligible candidate with the largest median speedup (``status`` ``speculate``);
with none, ``k = 0`` and ``status`` ``off`` (nothing is conclusively faster than ``ar``) or
``insufficient_pairs`` (no candidate was rejected for anything but too few pairs: the cell says
it has not been measured enough). ``candidates`` lists every cell considered and why it lost.

Lookup (``SpeculationPolicy.lookup``): a request's context is its prompt tokens plus its
``max_tokens`` (the sweep's ``context_length`` is prompt + generation budget); its batch is the
number of requests the serving engine holds once it joins. Each falls in the nearest measured
bucket on a log scale: the bucket edges are the geometric means of neighbouring measured values,
and a value on an edge belongs to the upper bucket (contexts 1024 and 8192 split at 2896; batches
1 and 4 at 2). Context is matched first, then the batch among that context's entries.

``vllm_fragment`` writes the equivalent ``--speculative-config`` for vLLM (keys of the installed
version, ``VLLM_SPECULATIVE_KEYS``), with ``notes`` on what vLLM cannot express.

    python -m cluster.results.report --policy --db URL [--policy-out policy.json] [--vllm-out vllm.json]
"""
from __future__ import annotations

import datetime as dt
import json
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cluster.results.aggregate import MIN_CI_PAIRS, N_BOOT, cell_table
from sparsespec.registry import AR

POLICY_VERSION = 1

#: The grouping of a policy's cells: ``cluster.results.aggregate.CELL_KEYS`` without benchmark and task
#: (runs of a method with different other options stay apart; their variants name those options).
POLICY_KEYS = ("model", "quantize", "context_length", "batch_size", "method", "k", "draft_weights", "options")

Status = Literal["speculate", "off", "insufficient_pairs"]


class PolicyError(ValueError):
    """A policy file that cannot be read or does not validate, or a lookup it cannot answer."""


class Candidate(BaseModel):
    """One measured non-``ar`` cell of a bucket, and why it was (not) chosen."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    variant: str
    method: str
    k: int | Literal["auto"] | None
    draft_weights: str | None = None
    speedup: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    n_pairs: int = 0
    lossless_rate: float | None = None
    mean_k: float | None = None
    options: dict[str, Any] = Field(default_factory=dict)  # the method's other options (besides k)
    rejected: str | None = None  # None: eligible


class PolicyEntry(BaseModel):
    """The decision for one (context bucket, batch bucket) of a model.

    ``k``: draft tokens per round (an int, ``"auto"`` for the cost-aware controller, ``0`` for
    off); ``method`` is ``ar`` exactly when ``k == 0``. ``speedup``, ``ci_low``, ``ci_high``,
    ``n_pairs``: the chosen cell's median paired speedup over ``ar`` and its 95 % interval
    (``ar``: 1.0 and no interval). ``reason``: the decision in words.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    context_length: int = Field(ge=1)
    batch_size: int = Field(ge=1)
    status: Status
    method: str
    k: int | Literal["auto"]
    options: dict[str, Any] = Field(default_factory=dict)
    variant: str
    speedup: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    n_pairs: int = 0
    reason: str
    candidates: tuple[Candidate, ...] = ()

    @model_validator(mode="after")
    def _check(self) -> "PolicyEntry":
        off = self.k == 0
        if off != (self.method == AR):
            raise ValueError(f"entry ctx={self.context_length} batch={self.batch_size}: k=0 means method 'ar' "
                             f"and 'ar' means k=0 (got method {self.method!r}, k={self.k!r})")
        if isinstance(self.k, int) and self.k < 0:
            raise ValueError(f"entry ctx={self.context_length} batch={self.batch_size}: k must be >= 0, got {self.k}")
        if self.status == "speculate" and off:
            raise ValueError(f"entry ctx={self.context_length} batch={self.batch_size}: status 'speculate' with k=0")
        if self.status != "speculate" and not off:
            raise ValueError(f"entry ctx={self.context_length} batch={self.batch_size}: status {self.status!r} "
                             f"needs k=0")
        if self.method != AR:
            from sparsespec.engine import resolve_method_options

            resolve_method_options(self.method, self.core_options)  # unknown method or option: ValueError
        return self

    @property
    def core_options(self) -> dict[str, Any]:
        """The ``EngineCore`` options that decode this entry (``{}`` for ``ar``)."""
        return {} if self.method == AR else {**self.options, "k": self.k}

    @property
    def core_name(self) -> str:
        """The policy arm's core that decodes this entry (``SpeculationPolicy.cores``): one per
        speculative method (and other options) at fixed k, one per method (and other options) at
        ``k="auto"``; ``ar`` has none of its own."""
        name = f"{self.method} auto" if self.k == "auto" else self.method
        if self.options:
            name += " (" + ", ".join(f"{k}={v}" for k, v in sorted(self.options.items())) + ")"
        return name


def _edges(values: Sequence[int]) -> list[float]:
    """Geometric means of neighbouring sorted values (the bucket edges)."""
    return [math.sqrt(a * b) for a, b in zip(values, values[1:])]


def bucket_of(value: float, measured: Sequence[int]) -> int:
    """The measured value whose log-scale bucket holds ``value`` (edges: geometric means of
    neighbours; a value on an edge goes to the upper bucket; below the first / above the last
    measured value: the first / last).

    Raises:
        PolicyError: no measured values.
    """
    vals = sorted(set(int(v) for v in measured))
    if not vals:
        raise PolicyError("no measured buckets")
    for v, edge in zip(vals, _edges(vals)):
        if value < edge:
            return v
    return vals[-1]


class SpeculationPolicy(BaseModel):
    """A policy file: per model, one ``PolicyEntry`` per measured (context, batch) bucket.

    ``source``: the store it was built from (password masked); ``min_pairs``: the fewest paired
    batches an entry's cell needed. Frozen; ``load``/``loads`` validate (``PolicyError``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[1] = POLICY_VERSION
    created_at: str | None = None
    source: str | None = None
    min_pairs: int = Field(MIN_CI_PAIRS, ge=1)
    models: dict[str, tuple[PolicyEntry, ...]]

    @model_validator(mode="after")
    def _check(self) -> "SpeculationPolicy":
        if not self.models:
            raise ValueError("a policy needs at least one model")
        for model, entries in self.models.items():
            if not entries:
                raise ValueError(f"model {model!r}: no entries")
            seen = [(e.context_length, e.batch_size) for e in entries]
            dup = sorted({s for s in seen if seen.count(s) > 1})
            if dup:
                raise ValueError(f"model {model!r}: (context, batch) buckets listed twice: {dup}")
        return self

    # ---------------------------------------------------------------- files
    @classmethod
    def loads(cls, text: str, where: str = "policy") -> "SpeculationPolicy":
        """Parse and validate a policy's JSON text.

        Raises:
            PolicyError: not JSON, or a field that does not validate (one line per field).
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PolicyError(f"{where}: not valid JSON: {e}") from None
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            lines = [f"{'.'.join(str(x) for x in err['loc']) or 'policy'}: {err['msg']}" for err in e.errors()]
            raise PolicyError(f"{where}: invalid policy:\n  " + "\n  ".join(lines)) from None

    @classmethod
    def load(cls, path: str | Path) -> "SpeculationPolicy":
        """Read a policy file (``PolicyError`` if missing or invalid)."""
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as e:
            raise PolicyError(f"cannot read policy file {p}: {e.strerror or e}") from None
        return cls.loads(text, str(p))

    def dumps(self) -> str:
        return self.model_dump_json(indent=2) + "\n"

    # ---------------------------------------------------------------- lookup
    def entries(self, model: str) -> tuple[PolicyEntry, ...]:
        """A model's entries (``PolicyError`` naming the models the policy has)."""
        if model not in self.models:
            raise PolicyError(f"the policy has no entries for model {model!r}; it has {', '.join(self.models)}")
        return self.models[model]

    def lookup(self, model: str, context_tokens: int, batch: int) -> PolicyEntry:
        """The entry for a request of ``context_tokens`` (prompt + max_tokens) joining a batch of
        ``batch`` requests (itself included); see the module docstring for the buckets."""
        if context_tokens < 1 or batch < 1:
            raise PolicyError(f"context_tokens and batch must be >= 1, got {context_tokens}, {batch}")
        entries = self.entries(model)
        ctx = bucket_of(context_tokens, [e.context_length for e in entries])
        at_ctx = [e for e in entries if e.context_length == ctx]
        b = bucket_of(batch, [e.batch_size for e in at_ctx])
        return next(e for e in at_ctx if e.batch_size == b)

    def round_cap(self, model: str, core: str, contexts: Sequence[int], *,
                  prefill: bool) -> tuple[int | None, PolicyEntry | None, str]:
        """The draft cap of every row of the policy arm's core ``core`` (a ``cores`` name) in its
        next round, from the batch that round decodes: ``(max_k, entry, why)``; ``max_k`` None: no
        cap (an ``auto`` core's controller chooses), 0: the round is an AR step.

        The map's cells are uniform batches decoding alone, and one round drafts for the whole
        batch (a row capped at 0 still waits through the others' draft phase, for one token), so
        the round, not each request, is decided:

        - ``prefill``: the round also carries a prefill chunk (a request being admitted while
          others decode). Its cost is about a chunk whatever the verify's width, so the tokens a
          round yields decide its rows' TPOT: the core drafts at the largest k its entries use
          (measured on the Serve A/B at concurrency 4 with 1K and 8K prompts, SmolLM2 on 2 CPU
          cores: speculation at k = 2 had 0.49x and 0.40x ``ar``'s TPOT, while on decode-only
          batches of 1K x 4 it was slower than ``ar``, a speedup of 0.87, and the map kept it off).
        - otherwise the entry of the batch's mean context (prompt + max_tokens of each row) at its
          size: its k when the entry is this core's, else 0 (off, or another method's bucket).

        ``contexts``: one per row of the round (empty: nothing to decide, cap None).
        """
        if not contexts or core == AR:
            return (None if not contexts else 0), None, "no rows" if not contexts else "ar core"
        mine = [e for e in self.entries(model) if e.method != AR and e.core_name == core]
        if prefill:
            if any(e.k == "auto" for e in mine):
                return None, None, "prefill chunk in the round: k auto"
            k = max((int(e.k) for e in mine), default=0)
            return k, None, f"prefill chunk in the round: k={k}"
        e = self.lookup(model, max(1, round(sum(contexts) / len(contexts))), len(contexts))
        if e.method == AR or e.core_name != core:
            return 0, e, f"bucket {e.context_length} x {e.batch_size}: {e.variant}"
        return (None if e.k == "auto" else int(e.k)), e, f"bucket {e.context_length} x {e.batch_size}: {e.variant}"

    def cores(self, model: str) -> dict[str, tuple[str, dict[str, Any]]]:
        """The ``EngineCore`` s a policy arm needs for ``model``: ``{name: (method, options)}``.

        One core per speculative method at fixed k, built with the largest k its entries use
        (each request is capped to its own entry's k: ``EngineCore.add_request(max_k=...)``), one
        per method at ``k="auto"``, and ``ar`` entries ride in the first of them capped at
        ``k=0`` (a row that never drafts, in the same batch: one weight read per step for
        everyone); an ``ar`` core only when nothing speculates."""
        out: dict[str, tuple[str, dict[str, Any]]] = {}
        for e in sorted(self.entries(model), key=lambda e: (e.core_name, str(e.k))):
            if e.method == AR:
                continue
            if e.k == "auto":
                out[e.core_name] = (e.method, e.core_options)
            else:
                prev = out.get(e.core_name, (e.method, {"k": 0}))[1]
                out[e.core_name] = (e.method, {**e.core_options, "k": max(int(e.k), int(prev["k"]))})
        return out or {AR: (AR, {})}

    def core_for(self, model: str, entry: PolicyEntry) -> tuple[str, int | None]:
        """``(core name, max_k)`` for a request ``entry`` decides: its own core capped at its k
        (None for ``k="auto"``: the controller's choice), or for ``k=0`` the first core capped at 0
        (None when that core is ``ar``)."""
        cores = self.cores(model)
        if entry.method != AR:
            return entry.core_name, (None if entry.k == "auto" else int(entry.k))
        first = next(iter(cores))
        return first, (None if first == AR else 0)


# ====================================================================== building
def _candidate(c: Mapping[str, Any], min_pairs: int) -> Candidate:
    lr, n, lo = c.get("lossless_rate"), int(c.get("n_pairs") or 0), c.get("ci_low")
    if lr is None:
        why = "losslessness not shown (no conclusive greedy sample paired with ar)"
    elif lr < 1.0:
        why = f"lossy (lossless rate {lr:.3g} < 1)"
    elif n < min_pairs or lo is None:
        why = f"too few pairs ({n} < {min_pairs})" if n < min_pairs else f"no interval ({n} pairs)"
    elif c.get("speedup") is None:
        why = "no speedup"
    elif c.get("ci_high") is not None and c["ci_high"] < 1.0:
        why = f"slower than ar: median {c['speedup']:.3g}, 95% interval [{lo:.3g}, {c['ci_high']:.3g}]"
    elif lo <= 1.0:
        why = f"inconclusive: median {c['speedup']:.3g}, 95% interval [{lo:.3g}, {c['ci_high']:.3g}] reaches 1"
    else:
        why = None
    k = c.get("k")
    options = json.loads(c["options"]) if c.get("options") else {}  # aggregate.run_options: canonical JSON
    return Candidate(variant=str(c["variant"]), method=str(c["method"]), k=k, draft_weights=c.get("draft_weights"),
                     speedup=c.get("speedup"), ci_low=lo, ci_high=c.get("ci_high"), n_pairs=n, lossless_rate=lr,
                     mean_k=c.get("mean_k"), options=options, rejected=why)


def decide(context_length: int, batch_size: int, cells: Sequence[Mapping[str, Any]], *,
           min_pairs: int = MIN_CI_PAIRS) -> PolicyEntry:
    """The entry of one bucket from its ``cell_table`` cells (``ar``'s among them or not).

    A candidate with ``k`` None (unknown) or ``draft_weights`` other than ``target`` /None is
    listed but never chosen (the policy arm could not reproduce it from the entry).
    """
    cands = []
    for c in cells:
        if c["method"] == AR:
            continue
        cand = _candidate(c, min_pairs)
        if cand.rejected is None and cand.k is None:
            cand = cand.model_copy(update={"rejected": "unknown k (not reproducible)"})
        if cand.rejected is None and cand.draft_weights not in (None, "target"):
            cand = cand.model_copy(update={"rejected": f"{cand.draft_weights} draft weights (the policy arm "
                                                       f"decodes with the target's)"})
        cands.append(cand)
    cands.sort(key=lambda x: -(x.speedup if x.speedup is not None else -math.inf))
    eligible = [x for x in cands if x.rejected is None]
    base = dict(context_length=int(context_length), batch_size=int(batch_size), candidates=tuple(cands))
    if eligible:
        best = eligible[0]
        return PolicyEntry(**base, status="speculate", method=best.method, k=best.k, options=best.options,
                           variant=best.variant,
                           speedup=best.speedup, ci_low=best.ci_low, ci_high=best.ci_high, n_pairs=best.n_pairs,
                           reason=f"{best.variant}: median speedup {best.speedup:.3g}, 95% interval "
                                  f"[{best.ci_low:.3g}, {best.ci_high:.3g}] over {best.n_pairs} paired batches")
    if cands and all((x.rejected or "").startswith(("too few pairs", "no interval")) for x in cands):
        status: Status = "insufficient_pairs"
        reason = "not enough paired batches to decide: " + "; ".join(f"{x.variant}: {x.rejected}" for x in cands)
    elif not cands:
        status, reason = "off", "no speculative method measured in this cell"
    else:
        status = "off"
        reason = "nothing is conclusively faster than ar and lossless: " + "; ".join(
            f"{x.variant}: {x.rejected}" for x in cands)
    return PolicyEntry(**base, status=status, method=AR, k=0, variant=AR, speedup=1.0, reason=reason)


def build_policy(rows: Iterable[Mapping[str, Any]], *, min_pairs: int = MIN_CI_PAIRS, source: str | None = None,
                 n_boot: int = N_BOOT) -> SpeculationPolicy:
    """The policy of result rows (the store's ``results``, ``with_run_fields`` applied or not):
    full-precision targets only (a quantised target is another model).

    Raises:
        PolicyError: no full-precision row with a context length.
    """
    rows = [r for r in rows if str(r.get("quantize") or "none") == "none" and r.get("context_length")]
    if not rows:
        raise PolicyError("no full-precision results with a context length in the store: run a sweep first")
    # a bucket measured both as static batches and as queues (continuous batching, as the policy
    # arm is served): the deepest queue's runs decide it, never the two pooled
    deepest: dict[tuple, int] = {}
    for r in rows:
        b = (r.get("model"), r.get("context_length"), int(r.get("batch_size") or 1))
        deepest[b] = max(deepest.get(b, 1), int(r.get("queue_depth") or 1))
    rows = [r for r in rows if int(r.get("queue_depth") or 1)
            == deepest[(r.get("model"), r.get("context_length"), int(r.get("batch_size") or 1))]]
    cells = cell_table(rows, by=POLICY_KEYS, n_boot=n_boot)
    groups: dict[tuple[str, int, int], list[dict[str, Any]]] = defaultdict(list)
    for c in cells:
        groups[(c["model"], int(c["context_length"]), int(c["batch_size"]))].append(c)
    models: dict[str, list[PolicyEntry]] = defaultdict(list)
    for (model, ctx, b) in sorted(groups):
        models[model].append(decide(ctx, b, groups[(model, ctx, b)], min_pairs=min_pairs))
    return SpeculationPolicy(created_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                             source=source, min_pairs=min_pairs, models={m: tuple(es) for m, es in models.items()})


def policy_from_store(db_url: str, *, min_pairs: int = MIN_CI_PAIRS,
                      run_ids: str | Iterable[str] | None = None) -> SpeculationPolicy:
    """``build_policy`` over a store (``StoreError`` for a bad URL or missing file)."""
    from cluster.results import aggregate as queries
    from cluster.results.store import open_store, safe_url

    with open_store(db_url, create=False) as store:
        runs = store.runs()
        rows = queries.with_run_fields(store.results(run_ids=run_ids), runs)
    return build_policy(rows, min_pairs=min_pairs, source=safe_url(db_url))


def format_policy(policy: SpeculationPolicy) -> str:
    """A Markdown table per model: bucket, decision, speedup and interval, reason."""
    from tabulate import tabulate

    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    out = []
    for model, entries in policy.models.items():
        body = [[e.context_length, e.batch_size, e.status, e.variant, e.k, f(e.speedup),
                 "-" if e.ci_low is None else f"[{f(e.ci_low)}, {f(e.ci_high)}]", e.n_pairs, e.reason]
                for e in entries]
        out.append(f"## {model}\n\n" + tabulate(body, headers=["ctx", "batch", "status", "method", "k", "speedup",
                                                                "95% CI", "pairs", "reason"],
                                                  tablefmt="github", disable_numparse=True))
    return "\n\n".join(out) + (f"\n\nbuckets: nearest measured value on a log scale (context = prompt + max_tokens; "
                               f"batch = requests held incl. this one); k=0: speculation off (ar); a method is "
                               f"chosen only if lossless and its interval (>= {policy.min_pairs} pairs) is above 1\n")


# ====================================================================== vLLM
#: ``vllm.config.speculative.SpeculativeConfig``'s user-settable fields in vLLM 0.32.0 (recorded
#: from the installed source; ``vllm_speculative_keys`` re-reads it where it is installed).
VLLM_VERSION = "0.32.0"
VLLM_SPECULATIVE_KEYS = frozenset({
    "enforce_eager", "num_speculative_tokens", "model", "method", "draft_tensor_parallel_size",
    "tensor_parallel_size", "quantization", "moe_backend", "attention_backend", "kv_cache_dtype", "max_model_len",
    "revision", "code_revision", "index_share_for_mtp_iteration", "disable_padded_drafter_batch",
    "disable_eagle_block_drop", "use_local_argmax_reduction", "use_heterogeneous_vocab", "prompt_lookup_max",
    "prompt_lookup_min", "parallel_drafting", "num_speculative_tokens_per_batch_size",
    "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests", "suffix_decoding_max_spec_factor",
    "suffix_decoding_min_token_prob", "rejection_sample_method", "synthetic_acceptance_rates",
    "synthetic_acceptance_length", "enable_adaptive_verification", "draft_sample_method", "dspark_draft_topk",
})

#: our method -> vLLM's ``method`` (None: vLLM has no equivalent)
VLLM_METHODS: dict[str, str | None] = {"ngram": "ngram", "draft-model": "draft_model", "eagle3": "eagle3",
                                       "sparsespec-l": None, "magicdec-streaming": None, "magicdec-snapkv": None}


def vllm_speculative_keys(source: str | Path) -> set[str]:
    """The annotated fields of ``class SpeculativeConfig`` in vLLM's ``config/speculative.py``
    (parsed with ``ast``, nothing imported), less the ones the engine fills in itself."""
    import ast

    tree = ast.parse(Path(source).read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "SpeculativeConfig")
    keys = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    internal = {k for k in keys if k.startswith(("target_", "draft_model_config", "draft_parallel_config",
                                                 "draft_load_config"))}
    return keys - internal


def vllm_fragment(policy: SpeculationPolicy, model: str | None = None, *, max_num_seqs: int = 256) -> dict[str, Any]:
    """The policy of one model (default: the only one) as vLLM's ``--speculative-config``.

    vLLM 0.32 schedules ``k`` by batch size only (``num_speculative_tokens_per_batch_size``:
    inclusive ``(start, end, k)`` ranges starting at 1; ``num_speculative_tokens`` is the
    largest), and skips speculation for sequences longer than the draft's ``max_model_len``
    (an upper length cutoff). Per batch bucket the fragment takes the map's k where it is the
    same at every context; where it differs, a cutoff expresses "speculate below L, not above"
    (one L for all batches); otherwise it takes the k of the longest measured context and the
    ``notes`` name each cell the fragment decodes differently from the map. ``k="auto"``
    becomes the cell's measured mean k (rounded, at least 1).

    Returns ``{"vllm_version", "model", "speculative_config" (None: the map never speculates:
    run vLLM without one), "cli", "notes", "exact"}``.

    Raises:
        PolicyError: unknown model, or several models and none named.
    """
    if model is None:
        if len(policy.models) != 1:
            raise PolicyError(f"the policy has several models ({', '.join(policy.models)}): name one")
        model = next(iter(policy.models))
    entries = policy.entries(model)
    notes: list[str] = []
    exact = True

    def k_of(e: PolicyEntry) -> int:
        if e.k == "auto":
            mean = next((c.mean_k for c in e.candidates if c.variant == e.variant), None)
            return max(1, round(mean or 1))
        return int(e.k)

    for e in entries:
        if e.k == "auto":
            exact = False
            notes.append(f"ctx {e.context_length}, batch {e.batch_size}: k='auto' (our cost-aware controller, per "
                         f"step) has no vLLM equivalent; the fragment uses its measured mean k = {k_of(e)}")
    methods = sorted({e.method for e in entries if e.method != AR})
    cfg: dict[str, Any] = {}
    if not methods:
        notes.append("the map never speculates (k=0 in every cell): run vLLM without --speculative-config")
        return {"vllm_version": VLLM_VERSION, "model": model, "speculative_config": None, "cli": "", "notes": notes,
                "exact": True}
    if len(methods) > 1:
        exact = False
        notes.append(f"the map uses several methods ({', '.join(methods)}); vLLM runs one per server: the fragment "
                     f"uses {methods[0]} and the cells of the others are decoded with it")
    ours = methods[0]
    vm = VLLM_METHODS.get(ours)
    if vm is None:
        exact = False
        notes.append(f"vLLM {VLLM_VERSION} has no {ours} (sparse self-speculation: the target drafts with a "
                     f"sparse KV index); the fragment carries the measured k schedule with no 'method': add a "
                     f"vLLM method and draft model yourself, and re-measure (its costs and acceptance differ)")
    else:
        cfg["method"] = vm
    ctxs = sorted({e.context_length for e in entries})
    batches = sorted({e.batch_size for e in entries})
    by = {(e.context_length, e.batch_size): e for e in entries}

    def at(ctx: int, b: int) -> PolicyEntry:
        return by.get((ctx, b)) or policy.lookup(model, ctx, b)

    ks = {b: [k_of(at(c, b)) for c in ctxs] for b in batches}
    cutoff = None
    if any(len(set(v)) > 1 for v in ks.values()):
        # "speculate up to L, off above" is vLLM's draft max_model_len: one L for every batch, so
        # each batch's ks must be one k then zeros, switching at the same context (or all zero)
        switch: set[int | None] = set()
        for v in ks.values():
            on = [i for i, k in enumerate(v) if k > 0]
            if not on:
                continue
            prefix = on == list(range(len(on))) and len({v[i] for i in on}) == 1
            switch.add(on[-1] if prefix and len(on) < len(v) else None)
        if len(switch) == 1 and None not in switch:
            cutoff = int(math.floor(_edges(ctxs)[next(iter(switch))]))
        if cutoff is not None:
            cfg["max_model_len"] = cutoff
            chosen = {b: next((k for k in v if k > 0), 0) for b, v in ks.items()}
            notes.append(f"speculation stops above {cutoff} tokens through the draft's max_model_len (vLLM skips "
                         f"speculation for sequences longer than it; it applies to methods with a draft model)")
        else:
            exact = False
            chosen = {b: v[-1] for b, v in ks.items()}
            for b, v in ks.items():
                for c, k in zip(ctxs, v):
                    if k != chosen[b]:
                        notes.append(f"ctx {c}, batch {b}: the map says k={k}, the fragment k={chosen[b]} (vLLM "
                                     f"sets k by batch size only, and its length cutoff only turns speculation "
                                     f"off above a length, not below)")
    else:
        chosen = {b: v[0] for b, v in ks.items()}
    edges = [int(math.ceil(x)) for x in _edges(batches)]  # bucket b_i covers [edge_{i-1}, edge_i - 1]
    starts = [1] + edges
    ends = [e - 1 for e in edges] + [max(max_num_seqs, starts[-1])]
    schedule = [[s, e, chosen[b]] for s, e, b in zip(starts, ends, batches)]
    cfg["num_speculative_tokens"] = max(max(chosen.values()), 1)
    if len({k for *_, k in schedule}) > 1 or schedule[0][2] == 0:
        cfg["num_speculative_tokens_per_batch_size"] = schedule
    if all(k == 0 for *_, k in schedule):
        notes.append("after collapsing to batch sizes no range speculates: run vLLM without --speculative-config")
        return {"vllm_version": VLLM_VERSION, "model": model, "speculative_config": None, "cli": "", "notes": notes,
                "exact": False}
    notes.append(f"batch ranges come from the measured batch sizes {batches} (edges at their geometric means); "
                 f"the last range ends at max_num_seqs={max_num_seqs}")
    unknown = set(cfg) - VLLM_SPECULATIVE_KEYS
    assert not unknown, f"not vLLM {VLLM_VERSION} keys: {unknown}"
    return {"vllm_version": VLLM_VERSION, "model": model, "speculative_config": cfg,
            "cli": f"--speculative-config '{json.dumps(cfg, separators=(',', ':'))}'", "notes": notes, "exact": exact}

"""Per-request counters and clocks, and the one place ratios are derived from them.

A request's ``stats`` hold raw counts and seconds only (what the store keeps); ``derive`` turns
them (one request's, or ``pool``-ed sums over many) into alpha, tau, mean k, gamma, TPOT, the
ledger's predicted speedup and the full-round prediction. The report, the dashboard, the speed
benchmark and the controller all read ratios through ``derive`` (the controller through the same
per-round costs it is given, see ``sparsespec.adaptive.StepCosts``).
"""
from __future__ import annotations

import math
import resource
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

import numpy as np

if TYPE_CHECKING:
    import torch

#: Additive raw keys of a request's stats (pooling sums them).
SUM_KEYS = (
    "num_prompt_tokens", "num_output_tokens", "num_steps", "num_drafting_steps", "num_emitted", "num_drafted",
    "num_accepted", "num_draft_forwards", "prefill_s", "ttft_s", "decode_s", "draft_s", "verify_s", "index_s",
    "other_s", "total_s", "controller_s", "budget_tokens_sum", "context_tokens_sum",
)

#: Every key ``derive`` returns.
DERIVED_KEYS = ("alpha", "tau", "mean_k", "gamma", "tpot_s", "tokens_per_s", "budget_frac", "round_s",
                "predicted_speedup", "predicted_speedup_round")


class Clock:
    """Wall clock that synchronises the device before reading (CUDA work is asynchronous)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self) -> float:
        if self.cuda:
            import torch  # (here: the store's readers import this module without torch)

            torch.cuda.synchronize()
        return time.perf_counter()


class StepClock:
    """One engine core's own clock: the device clock with the time between its steps taken out.

    The core calls ``resume()`` as a step starts and ``pause()`` as it ends; while paused the
    clock reads the instant it paused at. Timestamps on it (a request's arrival, first token and
    every emission: ``ttft_s``, ``decode_s``, ``total_s``, ``emit_times``) then measure the core as
    if its steps had run back to back, which is what a schedule that interleaves several cores'
    steps on one device needs (``cluster.sweep.worker``'s ``schedule="step"``: one core per method,
    stepped in turn, so a slow minute of a shared machine lands on every method alike). Seconds
    measured within one step (draft, verify, prefill) equal the device clock's. Created paused.

    ``busy_s``: seconds spent inside steps so far (the core's own wall time).
    """

    def __init__(self, base: Callable[[], float]):
        self.base = base
        self._idle = 0.0  # seconds spent paused (between steps)
        self._paused_at: float | None = base()
        self._start = self._paused_at

    def __call__(self) -> float:
        now = self._paused_at if self._paused_at is not None else self.base()
        return now - self._idle

    def resume(self) -> None:
        if self._paused_at is not None:
            self._idle += self.base() - self._paused_at
            self._paused_at = None

    def pause(self) -> None:
        if self._paused_at is None:
            self._paused_at = self.base()

    @property
    def busy_s(self) -> float:
        return self() - self._start


@dataclass
class RunStats:
    """Raw counts and seconds of one request (see the README for each key).

    Seconds of a step shared by the batch are charged to every row that took part in it:
    ``draft_s`` only to rows that drafted in that step, ``verify_s`` / ``index_s`` / ``other_s``
    to every running row. ``other_s`` is the measured rest of each round (sampling, acceptance
    bookkeeping, cache and index maintenance: it includes ``index_s``).
    """

    method: str
    k: int | str
    num_prompt_tokens: int
    #: a ``k="auto"`` request's own cap on draft tokens per round (``EngineCore.add_request``), else None
    max_k: int | None = None
    num_steps: int = 0
    num_drafting_steps: int = 0
    num_emitted: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    num_draft_forwards: int = 0
    accept_hist: Counter = field(default_factory=Counter)  # (k, accepted) -> steps
    # one (k, accepted) per verify step, in order (k = 0: the step drafted nothing); empty for AR.
    # The store keeps it as acceptance_steps rows, not in the stats JSON; pool/derive ignore it.
    step_trace: list[tuple[int, int]] = field(default_factory=list)
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    controller_s: float = 0.0
    draft_entropies: list[float] = field(default_factory=list)
    draft_labels: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    index_s: float = 0.0
    other_s: float = 0.0
    total_s: float = 0.0
    budget_tokens_sum: int = 0
    context_tokens_sum: int = 0
    kv_bytes: int = 0
    draft_weight_bytes: int = 0  # the draft's own weight copy (``draft_weights="int8"``), shared by all rows
    emit_times: list[float] = field(default_factory=list)
    #: what the drafter drafted with (its ``provenance()``: e.g. the EAGLE-3 head's path, source and
    #: weights sha256), None for a method without one
    drafter: dict | None = None

    def to_dict(self, num_output_tokens: int, device: torch.device) -> dict:
        """The request's stats: counts, seconds and bytes only (no ratios; see ``derive``), and
        the drafter's provenance where it has one."""
        from sparsespec.adaptive import roc_auc

        decode_s = max(0.0, self.total_s - self.ttft_s)
        gaps = np.diff(np.asarray(self.emit_times)) if len(self.emit_times) > 1 else np.zeros(0)
        if device.type == "cuda":
            import torch

            peak = int(torch.cuda.max_memory_allocated(device))
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # process peak RSS
        return {
            "method": self.method,
            "k": self.k,
            **({"max_k": self.max_k} if self.max_k is not None else {}),
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": num_output_tokens,
            "num_steps": self.num_steps,
            "num_drafting_steps": self.num_drafting_steps,
            "num_emitted": self.num_emitted,
            "num_drafted": self.num_drafted,
            "num_accepted": self.num_accepted,
            "num_draft_forwards": self.num_draft_forwards,
            "accept_hist": {f"{k}:{a}": n for (k, a), n in sorted(self.accept_hist.items())},
            "step_trace": [[int(k), int(a)] for k, a in self.step_trace],
            "prefill_s": self.prefill_s,
            "ttft_s": self.ttft_s,
            "decode_s": decode_s,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "index_s": self.index_s,
            "other_s": self.other_s,
            "total_s": self.total_s,
            "controller_s": self.controller_s,
            "num_entropy_labels": len(self.draft_labels),
            # how well low draft entropy predicts acceptance (None until both outcomes were seen)
            "entropy_auc": roc_auc([-h for h in self.draft_entropies], self.draft_labels)
            if self.draft_labels else None,
            **itl_percentiles(gaps),
            "budget_tokens_sum": self.budget_tokens_sum,
            "context_tokens_sum": self.context_tokens_sum,
            "kv_bytes": self.kv_bytes,
            "draft_weight_bytes": self.draft_weight_bytes,
            "peak_mem_bytes": peak,
            **({"drafter": self.drafter} if self.drafter else {}),
        }


def _num(st: Mapping[str, Any], key: str) -> float:
    """``st[key]`` as a finite float; 0 when missing, non-numeric or not finite."""
    v = st.get(key)
    if v is None or isinstance(v, bool):
        return 0.0
    try:
        f = float(v)
    except (TypeError, ValueError):
        return 0.0
    return f if math.isfinite(f) else 0.0


def drafting_steps(st: Mapping[str, Any]) -> float:
    """Steps that drafted at least one token: ``num_drafting_steps``; for rows stored before it
    existed, the histogram's steps with ``k > 0`` (no histogram but drafts: every step)."""
    if "num_drafting_steps" in st:
        return _num(st, "num_drafting_steps")
    total, found = 0.0, False
    for key, count in (st.get("accept_hist") or {}).items():
        try:
            k = int(str(key).split(":", 1)[0])
        except ValueError:
            continue
        found = True
        if k > 0:
            total += float(count)
    if found or _num(st, "num_drafted") == 0:
        return total
    return _num(st, "num_steps")


def pool(stats: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Sum the raw keys of many requests' stats (``derive`` of the result pools them)."""
    out = dict.fromkeys(SUM_KEYS, 0.0)
    out["num_decode_tokens"] = 0.0  # sum of (output tokens - 1): what pooled TPOT divides by
    for st in stats:
        for key in SUM_KEYS:
            out[key] += drafting_steps(st) if key == "num_drafting_steps" else _num(st, key)
        out["num_decode_tokens"] += max(0.0, _num(st, "num_output_tokens") - 1)
    return out


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def ledger_speedup(alpha: float | None, k: float | None, gamma: float | None) -> float | None:
    """The ledger ``S = (alpha*k + 1) / (k*gamma + 1)`` (None when a term is unknown)."""
    if alpha is None or k is None or gamma is None:
        return None
    return (alpha * k + 1.0) / (k * gamma + 1.0)


def derive(st: Mapping[str, Any], ar: Mapping[str, Any] | None = None) -> dict[str, float | None]:
    """Every ratio, from raw counts and seconds (one request's stats or ``pool``-ed sums).

    alpha = accepted / drafted; tau = emitted / steps; mean_k = drafted / drafting steps;
    gamma = (draft_s / draft forwards) / (verify_s / steps); tpot_s = decode_s / (output - 1)
    (pooled: / the sum of each request's output - 1);
    tokens_per_s = output / total_s; budget_frac = index tokens / context tokens;
    round_s = (draft_s + verify_s + other_s) / steps (the full round ``T_round``);
    predicted_speedup = the ledger ``S`` at (alpha, mean_k, gamma);
    predicted_speedup_round = ``tau * T_AR / T_round`` with ``T_AR`` the round of ``ar``'s stats
    (given as ``ar``, else None).
    """
    drafted, steps = _num(st, "num_drafted"), _num(st, "num_steps")
    alpha = _ratio(_num(st, "num_accepted"), drafted)
    tau = _ratio(_num(st, "num_emitted"), steps)
    mean_k = _ratio(drafted, drafting_steps(st))
    per_draft = _ratio(_num(st, "draft_s"), _num(st, "num_draft_forwards"))
    per_verify = _ratio(_num(st, "verify_s"), steps)
    gamma = per_draft / per_verify if (per_draft is not None and per_verify) else None
    round_s = _ratio(_num(st, "draft_s") + _num(st, "verify_s") + _num(st, "other_s"), steps)
    ar_round = None
    if ar is not None:
        ar_round = _ratio(_num(ar, "draft_s") + _num(ar, "verify_s") + _num(ar, "other_s"), _num(ar, "num_steps"))
    out_tokens = _num(st, "num_output_tokens")
    dec_tokens = _num(st, "num_decode_tokens") if "num_decode_tokens" in st else out_tokens - 1
    return {
        "alpha": alpha,
        "tau": tau,
        "mean_k": mean_k,
        "gamma": gamma,
        "tpot_s": _ratio(_num(st, "decode_s"), dec_tokens) if dec_tokens > 0 else None,
        "tokens_per_s": _ratio(out_tokens, _num(st, "total_s")),
        "budget_frac": _ratio(_num(st, "budget_tokens_sum"), _num(st, "context_tokens_sum")),
        "round_s": round_s,
        "predicted_speedup": ledger_speedup(alpha, mean_k, gamma) if drafted else (1.0 if steps else None),
        "predicted_speedup_round": (tau * ar_round / round_s) if (tau and ar_round and round_s) else None,
    }


def batch_tpot(rows: Iterable[Mapping[str, Any]]) -> float | None:
    """Seconds per decoded token of one batch (the rows' stats, all from the same batch).

    ``(batch_wall_s - batch_prefill_s) / sum(num_output_tokens - 1)``: the batch's decode wall
    time over the tokens decoded after each row's first (which prefill produced). For a batch of
    one this is the row's own TPOT. None without decode time or decoded tokens; rows stored
    before batches existed (no ``batch_wall_s``) fall back to their pooled ``decode_s``.
    """
    rows = list(rows)
    if not rows:
        return None
    toks = sum(max(0.0, _num(r, "num_output_tokens") - 1) for r in rows)
    if "batch_wall_s" in rows[0]:
        dec = _num(rows[0], "batch_wall_s") - _num(rows[0], "batch_prefill_s")
    else:
        dec = sum(_num(r, "decode_s") for r in rows)
    return dec / toks if toks > 0 and dec > 0 else None


def batch_straggle(rows: Iterable[Mapping[str, Any]]) -> float | None:
    """How evenly one static batch's rows shared its rounds: the mean over the rows (their
    stats, all from the same batch) of their rounds (``num_steps``) over the most any row took.

    A static batch decodes until its slowest row is done, so its rounds are the maximum, while
    the ledger's ``S`` (``derive``) is per row, at the rows' pooled tau. Rows whose acceptance
    differs need different numbers of rounds, and the batch pays for the slowest: against an
    ``ar`` batch of the same rows, ``S x straggle(method) / straggle(ar)`` is what the ledger
    predicts for the batch (``ar`` rows of equal length: 1.0). 1.0 for a batch of one; None
    without steps.

    A queue (rows with ``batch_rounds``: a core of ``batch_size`` slots that admitted each
    waiting row as another finished, ``cluster.sweep.worker``): the rows' rounds over the
    slot-rounds the core ran, ``sum(num_steps) / (batch_size x batch_rounds)``, which is the
    static formula when every row starts together (then ``batch_rounds`` = the most rounds).
    """
    rows = list(rows)
    steps = [_num(r, "num_steps") for r in rows]
    if not steps or max(steps) <= 0:
        return None
    rounds, slots = _num(rows[0], "batch_rounds"), _num(rows[0], "batch_size")
    if rounds > 0 and slots > 0:
        return sum(steps) / (slots * rounds)
    return statistics.fmean(steps) / max(steps)


def itl_percentiles(gaps: Any) -> dict[str, float | None]:
    """``itl_p50_s``, ``itl_p95_s``, ``itl_p99_s``: percentiles of one request's inter-token (or
    inter-chunk) gaps in seconds (numpy's linear interpolation); None without gaps."""
    a = np.asarray(gaps, dtype=float).reshape(-1)
    return {f"itl_p{q}_s": (float(np.percentile(a, q)) if a.size else None) for q in (50, 95, 99)}


def request_tpot(e2el_s: float | None, ttft_s: float | None, output_tokens: int | None) -> float | None:
    """A served request's TPOT: ``(E2EL - TTFT) / (output tokens - 1)`` seconds (vLLM's
    definition); None without both times or with fewer than 2 output tokens."""
    if e2el_s is None or ttft_s is None or not output_tokens or output_tokens <= 1:
        return None
    return (e2el_s - ttft_s) / (output_tokens - 1)


def mean_acceptance_length(num_accepted: float, num_spec_steps: float) -> float | None:
    """vLLM's mean acceptance length: ``1 + accepted draft tokens / drafting steps`` (tokens a
    drafting step commits, the bonus or recovered token included); None without drafting steps."""
    return (1.0 + num_accepted / num_spec_steps) if num_spec_steps else None


def bench_spec_decode(num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int,
                      accepted_per_pos: Sequence[int] = ()) -> dict[str, Any]:
    """``vllm bench serve``'s ``spec_decode_*`` result keys from counter deltas over a run (its
    ``vllm:spec_decode_num_drafts_total``, ``..._num_draft_tokens_total``,
    ``..._num_accepted_tokens_total`` and ``..._num_accepted_tokens_per_pos_total`` by position):

    ``spec_decode_acceptance_rate`` = 100 * accepted / draft tokens (a percentage);
    ``spec_decode_acceptance_length`` = 1 + accepted / drafts (0.0 without drafts);
    ``spec_decode_num_drafts`` / ``_draft_tokens`` / ``_accepted_tokens``: the deltas;
    ``spec_decode_per_position_acceptance_rates[i]`` = accepted at position i / drafts ([] without
    drafts). Empty dict when no token was drafted (vLLM then omits the keys)."""
    if num_draft_tokens <= 0:
        return {}
    return {
        "spec_decode_acceptance_rate": 100.0 * num_accepted_tokens / num_draft_tokens,
        "spec_decode_acceptance_length": (1.0 + num_accepted_tokens / num_drafts) if num_drafts > 0 else 0.0,
        "spec_decode_num_drafts": int(num_drafts),
        "spec_decode_draft_tokens": int(num_draft_tokens),
        "spec_decode_accepted_tokens": int(num_accepted_tokens),
        "spec_decode_per_position_acceptance_rates": ([p / num_drafts for p in accepted_per_pos]
                                                      if num_drafts > 0 else []),
    }


def spec_decode_metrics(st: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's per-request speculation fields, from one request's stats (or ``pool``-ed sums).

    ``num_spec_steps``: steps that drafted at least one token; ``num_draft_tokens`` /
    ``num_accepted_draft_tokens``: drafted and accepted tokens; ``draft_acceptance_rate`` =
    accepted / drafted (alpha); ``mean_acceptance_length`` = 1 + accepted / spec steps (tokens a
    drafting step commits, bonus or recovered token included; vLLM's definition);
    ``acceptance_histogram[i]``: drafting steps that accepted exactly ``i`` draft tokens (from the
    ``accept_hist`` counts; empty when nothing was drafted). Ratios are None without drafts.
    """
    steps = drafting_steps(st)
    drafted, accepted = _num(st, "num_drafted"), _num(st, "num_accepted")
    hist: list[int] = []
    for key, count in (st.get("accept_hist") or {}).items():
        try:
            k, a = (int(x) for x in str(key).split(":", 1))
        except ValueError:
            continue
        if k <= 0:
            continue
        hist.extend([0] * (a + 1 - len(hist)))
        hist[a] += int(count)
    return {
        "num_spec_steps": int(steps),
        "num_draft_tokens": int(drafted),
        "num_accepted_draft_tokens": int(accepted),
        "draft_acceptance_rate": _ratio(accepted, drafted),
        "mean_acceptance_length": mean_acceptance_length(accepted, steps),
        "acceptance_histogram": hist,
    }


# --------------------------------------------------------------------------- bootstrap (paired intervals)
def bootstrap_medians(x: np.ndarray, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """``n_boot`` medians of resamples (with replacement) of ``x`` [n] -> [n_boot]."""
    return _bootstrap(x, n_boot, rng, np.median)


def bootstrap_means(x: np.ndarray, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """``n_boot`` means of resamples (with replacement) of ``x`` [n] -> [n_boot]."""
    return _bootstrap(x, n_boot, rng, np.mean)


def _bootstrap(x: np.ndarray, n_boot: int, rng: np.random.Generator, stat: Callable) -> np.ndarray:
    out = np.empty(n_boot)
    block = max(1, min(n_boot, 2_000_000 // max(1, x.size)))  # bound the [block, n] index matrix
    for s in range(0, n_boot, block):
        e = min(n_boot, s + block)
        idx = rng.integers(0, x.size, size=(e - s, x.size))
        out[s:e] = stat(x[idx], axis=1)
    return out


def percentile_ci(values: np.ndarray, confidence: float = 0.95) -> tuple[float, float] | None:
    """The central ``confidence`` interval of the finite ``values`` (None if there are none)."""
    values = values[np.isfinite(values)]
    if values.size == 0:
        return None
    a = (1.0 - confidence) / 2.0 * 100.0
    lo, hi = np.percentile(values, [a, 100.0 - a])
    return float(lo), float(hi)

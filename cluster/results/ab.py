"""The A/B decision over request records: one arm's median TPOT against the baseline arm's, with
a percentile-bootstrap interval, and the goodput (SLO attainment) ratio.

``cluster.serve.loadtest`` decides from the requests it measured; ``cluster.results.aggregate``
(``ab_decisions``: the dashboard's A/B page) from the rows the endpoint stored, turned into the
same :class:`RequestRecord`. One decision, two callers. Both leave warm-up requests out: the load
test sends them with :data:`WARMUP_HEADER`, the endpoint stores the flag (``serve_requests.warmup``)
and ``Store.serve_requests`` leaves those rows out unless asked.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from sparsespec.stats import bootstrap_means, bootstrap_medians, percentile_ci

MIN_AB_SAMPLES = 5
#: Request header by which a client marks a warm-up request (any value but "", "0", "false", "no").
WARMUP_HEADER = "x-sparsespec-warmup"


def is_warmup(value: str | None) -> bool:
    """The :data:`WARMUP_HEADER` value as a flag (absent, "", "0", "false", "no": not a warm-up)."""
    return value is not None and value.strip().lower() not in ("", "0", "false", "no")


@dataclass
class RequestRecord:
    """What the client measured for one request (seconds; ``start_s`` is relative to the start
    of its phase). ``success`` False: ``status`` / ``error`` say why."""

    index: int
    session: str = ""
    prompt_len: int = 0
    max_tokens: int = 0
    task: str | None = None
    sample_id: str | None = None
    warmup: bool = False
    arm: str | None = None
    method: str | None = None
    sent: bool = False
    success: bool = False
    status: int | None = None
    error: str | None = None
    start_s: float | None = None
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2el_s: float | None = None
    output_tokens: int = 0
    num_chunks: int = 0
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    speculation: dict[str, Any] | None = None
    text: str = ""

    @property
    def tpot_s(self) -> float | None:
        """(E2EL - TTFT) / (output_tokens - 1); None unless completed with > 1 output token."""
        if not self.success or self.output_tokens <= 1 or self.ttft_s is None or self.e2el_s is None:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tpot_s"] = self.tpot_s
        return d


def to_ms(values: Iterable[float]) -> np.ndarray:
    return np.asarray([v * 1000.0 for v in values], dtype=float)


def meets_slo(r: RequestRecord, goodput: Mapping[str, float]) -> bool:
    if not r.success:
        return False
    if "ttft" in goodput and (r.ttft_s is None or r.ttft_s * 1000.0 > goodput["ttft"]):
        return False
    if "tpot" in goodput and (r.tpot_s or 0.0) * 1000.0 > goodput["tpot"]:
        return False
    if "e2el" in goodput and (r.e2el_s is None or r.e2el_s * 1000.0 > goodput["e2el"]):
        return False
    return True


def _fmt_ci(ci: tuple[float, float] | None, pct: int) -> str:
    return f"{pct}% CI {ci[0]:.2f}-{ci[1]:.2f}" if ci else "no CI"


def ab_decision(
    records: Sequence[RequestRecord],
    baseline: str | None = None,
    treatment: str | None = None,
    *,
    goodput: Mapping[str, float] | None = None,
    n_boot: int = 2000,
    seed: int = 0,
    confidence: float = 0.95,
    min_samples: int = MIN_AB_SAMPLES,
) -> dict[str, Any]:
    """Compare ``treatment`` with ``baseline`` on the median TPOT (and the goodput attainment).

    ``baseline`` default: ``ar`` if an arm has that name, else the first arm by name;
    ``treatment`` default: the only other arm (more than one other arm: ValueError, use
    :func:`ab_decisions`). Returns ``baseline, treatment, n_baseline, n_treatment`` (requests with
    a TPOT), the two medians, ``tpot_ratio`` (treatment / baseline), ``tpot_ratio_ci``,
    ``speedup`` (1 / ratio) and ``speedup_ci``, ``significant`` (CI excludes 1; None without a
    CI), ``too_small``, the goodput fields when ``goodput`` is given, and ``conclusion`` (one line).
    """
    arms = sorted({r.arm for r in records if r.arm is not None})
    if baseline is None:
        if not arms:
            raise ValueError("no arm seen in the records")
        baseline = "ar" if "ar" in arms else arms[0]
    others = [a for a in arms if a != baseline]
    if treatment is None:
        if len(others) != 1:
            raise ValueError(f"need exactly one arm besides the baseline {baseline!r}; seen {arms}")
        treatment = others[0]
    pct = int(round(confidence * 100))
    rng = np.random.default_rng(seed)

    def tpots(arm: str) -> np.ndarray:
        return to_ms(t for t in (r.tpot_s for r in records if r.arm == arm) if t is not None)

    xb, xt = tpots(baseline), tpots(treatment)
    med_b = float(np.median(xb)) if xb.size else None
    med_t = float(np.median(xt)) if xt.size else None
    ratio = med_t / med_b if med_b and med_t is not None else None
    too_small = min(xb.size, xt.size) < min_samples
    ci = None
    if not too_small and ratio is not None:
        with np.errstate(divide="ignore", invalid="ignore"):
            ci = percentile_ci(bootstrap_medians(xt, n_boot, rng) / bootstrap_medians(xb, n_boot, rng), confidence)
    significant = None if ci is None else bool(ci[1] < 1.0 or ci[0] > 1.0)
    d: dict[str, Any] = {
        "baseline": baseline,
        "treatment": treatment,
        "metric": "median_tpot_ms",
        "n_baseline": int(xb.size),
        "n_treatment": int(xt.size),
        "baseline_median_tpot_ms": med_b,
        "treatment_median_tpot_ms": med_t,
        "tpot_ratio": ratio,
        "tpot_ratio_ci": list(ci) if ci else None,
        "speedup": (1.0 / ratio) if ratio else None,
        "speedup_ci": [1.0 / ci[1], 1.0 / ci[0]] if ci and ci[0] > 0 else None,
        "significant": significant,
        "too_small": too_small,
        "confidence": confidence,
        "bootstrap": n_boot,
        "seed": seed,
    }
    n_txt = f"n={xt.size}/{xb.size}"
    if ratio is None:
        line = f"{treatment} vs {baseline}: no TPOT to compare ({n_txt} requests with > 1 output token)"
    elif too_small:
        line = (f"{treatment}'s median TPOT is {ratio:.2f}x {baseline}'s ({n_txt}): sample too small for a "
                f"confidence interval (need >= {min_samples} completed requests per arm)")
    else:
        verdict = ("not significant at this sample size" if not significant
                   else "significantly faster" if ci[1] < 1.0 else "significantly slower")
        line = (f"{treatment}'s median TPOT is {ratio:.2f}x {baseline}'s ({_fmt_ci(ci, pct)}, {n_txt}; "
                f"speedup {1.0 / ratio:.2f}x): {verdict}")
    if goodput:
        def attained(arm: str) -> np.ndarray:
            return np.asarray([1.0 if meets_slo(r, goodput) else 0.0 for r in records if r.arm == arm])

        gb, gt = attained(baseline), attained(treatment)
        ab = float(gb.mean()) if gb.size else None
        at = float(gt.mean()) if gt.size else None
        g_ratio = at / ab if ab and at is not None else None
        g_small = min(gb.size, gt.size) < min_samples
        g_ci = None
        if not g_small and g_ratio is not None:
            with np.errstate(divide="ignore", invalid="ignore"):
                g_ci = percentile_ci(bootstrap_means(gt, n_boot, rng) / bootstrap_means(gb, n_boot, rng), confidence)
        g_sig = None if g_ci is None else bool(g_ci[1] < 1.0 or g_ci[0] > 1.0)
        d.update({
            "goodput": dict(goodput),
            "baseline_slo_attainment": ab,
            "treatment_slo_attainment": at,
            "goodput_ratio": g_ratio,
            "goodput_ratio_ci": list(g_ci) if g_ci else None,
            "goodput_significant": g_sig,
        })
        if g_ratio is None:
            gline = ("goodput: no ratio (SLO attainment "
                     + " vs ".join("-" if v is None else f"{v:.2f}" for v in (at, ab)) + ")")
        elif g_ci is None:
            gline = f"goodput {g_ratio:.2f}x: sample too small for a confidence interval"
        else:
            g_verdict = ("not significant" if not g_sig
                         else "significantly higher" if g_ci[0] > 1.0 else "significantly lower")
            gline = f"goodput (SLO attainment) {g_ratio:.2f}x ({_fmt_ci(g_ci, pct)}): {g_verdict}"
        line = f"{line}; {gline}"
    d["conclusion"] = line
    return d


def ab_decisions(records: Sequence[RequestRecord], baseline: str | None = None, **kw: Any) -> list[dict[str, Any]]:
    """:func:`ab_decision` of every other arm against the baseline ([] with fewer than 2 arms)."""
    arms = sorted({r.arm for r in records if r.arm is not None})
    if baseline is None:
        if len(arms) < 2:
            return []
        baseline = "ar" if "ar" in arms else arms[0]
    return [ab_decision(records, baseline, a, **kw) for a in arms if a != baseline]


__all__ = ["MIN_AB_SAMPLES", "RequestRecord", "ab_decision", "ab_decisions", "meets_slo", "to_ms"]

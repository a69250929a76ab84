"""Load test for the OpenAI-compatible A/B serving endpoint (``cluster/serve/endpoint.py``), in the
conventions of ``vllm bench serve``.

It sends real benchmark prompts (token ids from :mod:`evals.registry`, chat template applied) to
``POST {url}/v1/completions`` with ``stream=true`` and ``stream_options.include_usage``, at a
Poisson request rate and/or a concurrency cap, reads each server-sent-event stream, and reports
latency, throughput, goodput and speculation counters per arm (the response header
``x-sparsespec-arm``) and overall, then decides the A/B question with a bootstrap CI. It needs
nothing of ours from the server: against a plain ``vllm serve`` it reports the whole run (no
arms, no A/B).

Run it against a local Ray Serve app::

    serve run configs/serve.yaml                     # in one shell (the A/B ingress on :8000)
    .venv/bin/python -m cluster.serve.loadtest --url http://127.0.0.1:8000 --model smollm2-135m \\
        --benchmark longbench --context-length 2048 --num-prompts 40 --request-rate 0.5 \\
        --max-concurrency 4 --num-warmups 2 --goodput ttft:2000 tpot:200 \\
        --save-result --result-dir results --result-filename loadtest.json --save-requests

Flags shared with ``vllm bench serve`` have its names and meanings: ``--num-prompts``,
``--request-rate``, ``--burstiness``, ``--max-concurrency``, ``--num-warmups``, ``--goodput``,
``--metric-percentiles``, ``--base-url``, ``--model``, ``--tokenizer``, ``--ignore-eos``,
``--disable-tqdm``, ``--save-result`` / ``--result-dir`` / ``--result-filename`` / ``--label``
(default file name ``{label}-{request_rate}qps[-concurrency{N}]-{model}-{date}.json``, label
default ``openai``) and ``--save-detailed``. ``--output-json PATH`` is kept as
``--save-result --result-filename PATH``.

Only loopback URLs (127.0.0.1, localhost, ::1) are accepted.

Per request (client side, ``time.perf_counter``; a "chunk" is one ``data:`` event whose
``choices[0].text`` is non-empty; chunks with empty text are ignored for timing):

    TTFT   = t(first chunk) - t(send)
    ITL    = t(chunk i+1) - t(chunk i)            (one value per gap between chunks)
    E2EL   = t(data: [DONE]) - t(send)
    output_tokens = usage.completion_tokens       (fallback: the number of chunks)
    TPOT   = (E2EL - TTFT) / (output_tokens - 1)   (only when output_tokens > 1)

A speculative arm may put several accepted tokens into one chunk, so its ITL is per chunk, not per
token; TPOT is per token and is the number to compare. A request is *failed* when the status is
not 200, the stream ends without ``[DONE]`` or without any text, an exception or its per-request
timeout (``--request-timeout-s``) hits, or the total budget (``--timeout-s``) cancels it in flight.

Metrics (per arm and overall; the names of ``vllm bench serve``; latencies over completed
requests; ``std`` is the population std, percentiles are numpy's linear ones):

    completed, failed, duration (seconds: wall time of the measured phase; arms share it, they run
        concurrently), total_input_tokens / total_output_tokens (completed requests),
    request_throughput = completed / duration, output_throughput = total_output_tokens / duration,
    total_token_throughput = (input + output tokens) / duration,
    {mean,median,std,p<P>}_{ttft,tpot,itl,e2el}_ms for each P of --percentiles (default 99),
    request_goodput = (completed requests meeting every --goodput SLO) / duration, None without
        --goodput (a request with one output token has TPOT 0 for the SLO check, as vllm does),
    spec_decode_* exactly as vllm bench serve computes them: the deltas of the server's
        ``GET /metrics`` counters vllm:spec_decode_num_drafts_total, ..._num_draft_tokens_total,
        ..._num_accepted_tokens_total and ..._num_accepted_tokens_per_pos_total{position} between
        just before and just after the measured phase (after the warm-ups; other traffic on the
        server counts too), summed over all series for the run and per ``arm`` label for the arms:
        spec_decode_num_drafts, spec_decode_draft_tokens, spec_decode_accepted_tokens,
        spec_decode_acceptance_rate = 100 * accepted / draft tokens (a percentage),
        spec_decode_acceptance_length = 1 + accepted / drafts,
        spec_decode_per_position_acceptance_rates[i] = accepted at position i / drafts
        (``sparsespec.stats.bench_spec_decode``). Absent when /metrics cannot be read, has no
        such counters or nothing was drafted; ``spec_decode_unavailable`` then says why.
    Our additions: good_requests, failure_reasons, not_sent, timed_out; num_spec_steps,
    num_draft_tokens, num_accepted_draft_tokens (summed per-request ``usage.speculation``),
    draft_acceptance_rate = accepted / draft tokens (a fraction), mean_acceptance_length = 1 +
    accepted / spec steps (None without spec steps), acceptance_histogram (summed element-wise).

Result JSON (``--save-result``): vllm bench serve's layout, keys and units at the top level for
the whole run (its header ``date``, ``backend``, ``model_id``, ``num_prompts``, ``request_rate``,
``max_concurrency``, ...; the metrics above; ``latencies``; with ``--save-detailed`` its
``input_lens``, ``output_lens``, ``ttfts``, ``itls``, ``generated_texts``, ``errors``), plus
ours: ``arms`` (the same metrics per arm), ``decisions`` / ``decision`` (the A/B), ``config``,
``warmup`` and, with ``--save-requests``, ``requests`` / ``warmup_requests``. Not computed:
vLLM's ``max_output_tokens_per_s``, ``max_concurrent_requests``, ``rtfx``, ``start_times``.

A/B decision (:func:`cluster.results.ab.ab_decision`; baseline ``--baseline``, default ``ar`` if present else the
first arm by name; one comparison per other arm):

    tpot_ratio = median TPOT(treatment) / median TPOT(baseline)   (< 1: the treatment is faster)
    speedup    = 1 / tpot_ratio
    95% CI: percentile bootstrap, --bootstrap resamples (seeded), requests resampled with
    replacement within each arm independently; significant = the CI excludes 1.0.
    goodput_ratio (with --goodput) = SLO attainment(treatment) / SLO attainment(baseline), with
    attainment = requests meeting every SLO / requests sent to the arm (the per-arm request_goodput
    in req/s scales with the arm's traffic share, the attainment does not); same bootstrap.
    Fewer than 5 requests with a TPOT in either arm: "sample too small", no CI.

Warm-up requests (``--num-warmups``, sent one after another first) are excluded from every
metric; they carry the ``x-sparsespec-warmup: 1`` header, so the endpoint stores them flagged
and the store's A/B views (dashboard, ``cluster.results.aggregate.ab_decisions``) leave them
out too. Exit status: 0 when the measured phase ran (even with failed requests), 1 when every
measured request failed, 2 on bad arguments or an unreachable server.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import math
import os
import re
import sys
import time
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from cluster.results.ab import WARMUP_HEADER, RequestRecord, ab_decisions, meets_slo, to_ms
from sparsespec.stats import bench_spec_decode, mean_acceptance_length

__all__ = [
    "Prompt",
    "LoadResult",
    "LoopbackError",
    "check_loopback",
    "parse_goodput",
    "parse_percentiles",
    "poisson_gaps",
    "load_prompts",
    "summarize",
    "summarize_by_arm",
    "parse_spec_decode_counters",
    "spec_decode_from_metrics",
    "fetch_metrics",
    "result_filename",
    "send_request",
    "run_load",
    "format_table",
    "build_parser",
    "main",
]

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
GOODPUT_KEYS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
SPEC_COUNTERS = ("num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens")
DEFAULT_MAX_TOKENS = 128


# ----------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Prompt:
    """One request payload: ``prompt`` is a token-id tuple (or a string), ``max_tokens`` the
    generation cap; ``task`` / ``sample_id`` only label the per-request records."""

    prompt: tuple[int, ...] | str
    max_tokens: int
    task: str | None = None
    sample_id: str | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt length in tokens (a string prompt: 0, the server's usage count is used)."""
        return 0 if isinstance(self.prompt, str) else len(self.prompt)


@dataclass
class LoadResult:
    """The outcome of :func:`run_load`: the measured records (sent requests only), the warm-up
    records, the measured phase's wall time, requests never sent (the budget ran out) and whether
    the total budget cut the run short; with ``scrape_metrics``, the server's ``GET /metrics`` text
    just before and just after the measured phase (or ``metrics_error``: why not)."""

    records: list[RequestRecord]
    warmups: list[RequestRecord]
    duration_s: float
    num_prompts: int
    not_sent: int = 0
    timed_out: bool = False
    metrics_before: str | None = None
    metrics_after: str | None = None
    metrics_error: str | None = None


class LoopbackError(ValueError):
    """The URL's host is not a loopback name or address."""


class Unreachable(RuntimeError):
    """No HTTP answer from the server at all (connection refused, DNS, connect timeout)."""


# ----------------------------------------------------------------------------- parsing


def check_loopback(url: str) -> str:
    """``url`` without a trailing slash if it is http(s) on 127.0.0.1 / localhost / ::1; else
    :class:`LoopbackError` (the load test never sends traffic off this machine)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise LoopbackError(f"--url must start with http:// or https:// (got {url!r})")
    host = parts.hostname
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        raise LoopbackError(f"--url {url!r}: {exc}") from None
    if host is None or host.lower() not in LOOPBACK_HOSTS:
        raise LoopbackError(
            f"refusing to load-test {host or url!r}: only loopback hosts are allowed "
            f"({', '.join(LOOPBACK_HOSTS)})"
        )
    return url.rstrip("/")


def parse_goodput(spec: str | Sequence[str] | None) -> dict[str, float]:
    """vllm's ``--goodput`` syntax: ``["ttft:500", "tpot:50"]`` (or one string, items separated
    by spaces or commas) -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds). Keys: ttft, tpot,
    e2el; values finite and >= 0; a key at most once. Anything else raises ValueError."""
    if spec is None:
        return {}
    items: list[str] = []
    for part in [spec] if isinstance(spec, str) else list(spec):
        items.extend(x for x in str(part).replace(",", " ").split() if x)
    out: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition(":")
        key = key.strip().lower()
        if not sep or not key or not value.strip():
            raise ValueError(f"--goodput item {item!r} is not KEY:MS (e.g. ttft:500 tpot:50)")
        if key not in GOODPUT_KEYS:
            raise ValueError(f"--goodput key {key!r} is not one of {', '.join(GOODPUT_KEYS)}")
        if key in out:
            raise ValueError(f"--goodput key {key!r} given twice")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput value {value!r} for {key} is not a number of milliseconds") from None
        if not math.isfinite(ms) or ms < 0:
            raise ValueError(f"--goodput value for {key} must be a finite number >= 0 (got {value!r})")
        out[key] = ms
    return out


def parse_percentiles(spec: str | Sequence[float] | None) -> tuple[float, ...]:
    """``"50,95,99"`` -> ``(50.0, 95.0, 99.0)``; each in (0, 100]; default ``(99.0,)``."""
    if spec is None:
        return (99.0,)
    raw = spec.replace(",", " ").split() if isinstance(spec, str) else list(spec)
    out: list[float] = []
    for x in raw:
        try:
            p = float(x)
        except (TypeError, ValueError):
            raise ValueError(f"--percentiles entry {x!r} is not a number") from None
        if not (0 < p <= 100):
            raise ValueError(f"--percentiles entry {x!r} must be in (0, 100]")
        if p not in out:
            out.append(p)
    if not out:
        raise ValueError("--percentiles is empty")
    return tuple(out)


def poisson_gaps(rate: float, n: int, seed: int | np.random.Generator = 0, burstiness: float = 1.0) -> np.ndarray:
    """``n`` inter-arrival gaps in seconds for ``rate`` requests/s: exponential with mean
    ``1/rate`` (a Poisson process) for burstiness 1, else gamma(shape=burstiness,
    scale=1/(rate*burstiness)) as vllm does; ``rate`` inf: all zeros (everything at once).
    Request ``i`` is sent ``sum(gaps[:i])`` after the start (the first one at once)."""
    if n < 0:
        raise ValueError("n must be >= 0")
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 (got {rate})")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0 (got {burstiness})")
    if math.isinf(rate):
        return np.zeros(n)
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    if burstiness == 1.0:
        return rng.exponential(1.0 / rate, size=n)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


# ----------------------------------------------------------------------------- prompts


def _as_prompt(p: Any, max_tokens: int | None) -> Prompt:
    if isinstance(p, Prompt):
        return p if max_tokens is None else Prompt(p.prompt, max_tokens, p.task, p.sample_id)
    if hasattr(p, "prompt_ids"):  # an evals.base.Sample
        return Prompt(tuple(int(t) for t in p.prompt_ids), int(max_tokens or p.max_new_tokens),
                      getattr(p, "task", None), getattr(p, "sample_id", None))
    if isinstance(p, str):
        return Prompt(p, int(max_tokens or DEFAULT_MAX_TOKENS))
    return Prompt(tuple(int(t) for t in p), int(max_tokens or DEFAULT_MAX_TOKENS))


def _interleave_by_task(samples: Sequence[Any]) -> list[Any]:
    """Round-robin over tasks (in order of first appearance) so the first N prompts cover every
    task instead of N copies of the first one."""
    groups: dict[Any, list[Any]] = {}
    for s in samples:
        groups.setdefault(getattr(s, "task", None), []).append(s)
    out: list[Any] = []
    queues = [list(g) for g in groups.values()]
    i = 0
    while len(out) < len(samples):
        for q in queues:
            if i < len(q):
                out.append(q[i])
        i += 1
    return out


def load_prompts(
    model: str,
    benchmark: str = "longbench",
    *,
    num_prompts: int,
    tasks: Sequence[str] | None = None,
    context_length: int | None = None,
    num_samples: int | None = None,
    max_tokens: int | None = None,
    window: int = 8192,
    tokenizer: Any = None,
    options: Mapping[str, Any] | None = None,
) -> list[Prompt]:
    """Real prompts from the benchmark registry, tokenized for ``model`` (a preset such as
    ``smollm2-135m`` or a local folder; ``tokenizer`` overrides). ``num_samples`` per task
    (default: enough for ``num_prompts`` requests over the selected tasks, which are then cycled).
    ``max_tokens`` overrides each task's official generation budget (and the truncation accounts
    for it). Samples are interleaved by task."""
    from evals.registry import get_benchmark

    bench = get_benchmark(benchmark)
    opts = dict(bench.option_defaults())
    opts.update(options or {})
    task_arg = list(tasks) if tasks else None
    bench.check(tasks=task_arg, options=opts)
    if num_samples is None:
        resolve = getattr(bench, "resolve_tasks", None)
        selected = resolve(task_arg, opts) if resolve is not None else (task_arg or bench.default_tasks)
        num_samples = max(1, math.ceil(num_prompts / max(1, len(selected))))
    if tokenizer is None:
        import transformers

        from sparsespec.provision import resolve_model

        tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model(model))
    samples = bench.build_samples(
        tokenizer, window=window, context_length=context_length, tasks=task_arg,
        num_samples=num_samples, max_new_tokens=max_tokens, options=opts,
    )
    if not samples:
        raise ValueError(f"benchmark {benchmark!r} built no samples (tasks={task_arg}, context_length={context_length})")
    return [_as_prompt(s, None) for s in _interleave_by_task(samples)]


# ----------------------------------------------------------------------------- statistics


def _pkey(p: float) -> str:
    return f"p{p:g}"


def _failure_kind(r: RequestRecord) -> str:
    if r.status is not None and r.status != 200:
        return f"HTTP {r.status}"
    return (r.error or "unknown").split(":", 1)[0]


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    goodput: Mapping[str, float] | None = None,
    percentiles: Sequence[float] = (99.0,),
) -> dict[str, Any]:
    """The metrics of ``records`` (the sent, measured requests) over a wall time of
    ``duration_s`` seconds, with vllm bench serve's key names (see the module docstring).
    Latency statistics of an empty set are None; ``request_goodput`` is None without ``goodput``
    (as in vLLM). The ``spec_decode_*`` keys come from the server's ``/metrics``
    (:func:`spec_decode_from_metrics`), not from here."""
    done = [r for r in records if r.success]
    dur = float(duration_s)
    rate = (lambda x: x / dur) if dur > 0 else (lambda x: None)
    inp = sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in done)
    out_tok = sum(r.output_tokens for r in done)
    m: dict[str, Any] = {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration": dur,
        "total_input_tokens": int(inp),
        "total_output_tokens": int(out_tok),
        "request_throughput": rate(len(done)),
        "output_throughput": rate(out_tok),
        "total_token_throughput": rate(inp + out_tok),
        "request_goodput": None,
    }
    if goodput:
        good = sum(1 for r in done if meets_slo(r, goodput))
        m["good_requests"] = good
        m["request_goodput"] = rate(good)
    values = {
        "ttft": to_ms(r.ttft_s for r in done if r.ttft_s is not None),
        "tpot": to_ms(t for t in (r.tpot_s for r in done) if t is not None),
        "itl": to_ms(x for r in done for x in r.itl_s),
        "e2el": to_ms(r.e2el_s for r in done if r.e2el_s is not None),
    }
    for name in LATENCY_METRICS:
        x = values[name]
        empty = x.size == 0
        m[f"mean_{name}_ms"] = None if empty else float(np.mean(x))
        m[f"median_{name}_ms"] = None if empty else float(np.median(x))
        m[f"std_{name}_ms"] = None if empty else float(np.std(x))
        for p in percentiles:
            m[f"{_pkey(p)}_{name}_ms"] = None if empty else float(np.percentile(x, p))
    counts = {k: 0 for k in SPEC_COUNTERS}
    hist: list[int] = []
    for r in done:
        spec = r.speculation or {}
        for k in SPEC_COUNTERS:
            counts[k] += int(spec.get(k) or 0)
        for i, c in enumerate(spec.get("acceptance_histogram") or []):
            if i >= len(hist):
                hist.extend([0] * (i + 1 - len(hist)))
            hist[i] += int(c)
    m.update(counts)
    m["draft_acceptance_rate"] = (counts["num_accepted_draft_tokens"] / counts["num_draft_tokens"]
                                  if counts["num_draft_tokens"] else None)
    m["mean_acceptance_length"] = mean_acceptance_length(counts["num_accepted_draft_tokens"], counts["num_spec_steps"])
    m["acceptance_histogram"] = hist
    m["failure_reasons"] = dict(Counter(_failure_kind(r) for r in records if not r.success))
    return m


def summarize_by_arm(
    records: Sequence[RequestRecord],
    duration_s: float,
    goodput: Mapping[str, float] | None = None,
    percentiles: Sequence[float] = (99.0,),
) -> dict[str, dict[str, Any]]:
    """:func:`summarize` per arm (sorted by name), each over the whole measured duration.
    Records without an arm (e.g. a failure before routing) count only in the overall summary."""
    arms = sorted({r.arm for r in records if r.arm is not None})
    return {a: summarize([r for r in records if r.arm == a], duration_s, goodput, percentiles) for a in arms}


# ----------------------------------------------------------------------------- /metrics (spec decode)

#: The counters ``vllm bench serve`` reads from ``GET /metrics`` (vllm/benchmarks/serve.py,
#: ``fetch_spec_decode_metrics``): only their ``_total`` samples, summed over every label set.
SPEC_DECODE_SERIES = {
    "vllm:spec_decode_num_drafts_total": "num_drafts",
    "vllm:spec_decode_num_draft_tokens_total": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos_total": "accepted_per_pos",
}
_SAMPLE_RE = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)")
_LABEL_RE = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


def _zero_counters() -> dict[str, Any]:
    return {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": {}}


def parse_spec_decode_counters(text: str) -> dict[str | None, dict[str, Any]] | None:
    """The speculative-decoding counters in a Prometheus text exposition, read as ``vllm bench
    serve`` reads them: the ``_total`` samples of ``vllm:spec_decode_num_drafts``,
    ``..._num_draft_tokens``, ``..._num_accepted_tokens`` and ``..._num_accepted_tokens_per_pos``
    (by its ``position`` label), summed over all other labels.

    Returns ``{None: the whole server, arm: that arm's series}`` (per value of an ``arm`` label,
    which our endpoint adds and ``vllm serve`` has not), each ``{"num_drafts", "num_draft_tokens",
    "num_accepted_tokens": int, "accepted_per_pos": {position: int}}``; None when the text has
    no such sample (speculative decoding is off on that server)."""
    groups: dict[str | None, dict[str, Any]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE_RE.match(line)
        if m is None or m.group(1) not in SPEC_DECODE_SERIES:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if not math.isfinite(value):
            continue
        labels = dict(_LABEL_RE.findall(m.group(2) or ""))
        key = SPEC_DECODE_SERIES[m.group(1)]
        if key == "accepted_per_pos":
            try:
                pos = int(labels.get("position", ""))
            except ValueError:
                continue
        for g in {None, labels.get("arm")} if "arm" in labels else (None,):
            c = groups.setdefault(g, _zero_counters())
            if key == "accepted_per_pos":
                c[key][pos] = c[key].get(pos, 0) + int(value)
            else:
                c[key] += int(value)
    return groups or None


def spec_decode_from_metrics(before: str, after: str) -> tuple[dict[str | None, dict[str, Any]], str | None]:
    """``vllm bench serve``'s ``spec_decode_*`` result keys from the ``/metrics`` texts scraped
    just before and just after the measured phase: the counters' deltas (a position missing
    after the run counts 0, as in vLLM) through :func:`sparsespec.stats.bench_spec_decode`.

    Returns ``({None: whole run, arm: that arm}, reason)``: groups that drafted nothing, or whose
    counters went down (a replica restarted), are left out; ``reason`` says why the whole-run
    keys are missing (None when they are there)."""
    b, a = parse_spec_decode_counters(before), parse_spec_decode_counters(after)
    if b is None or a is None:
        return {}, "no vllm:spec_decode_* counters in the server's /metrics (speculative decoding off?)"
    out: dict[str | None, dict[str, Any]] = {}
    reasons: dict[str | None, str] = {}
    for g, ca in a.items():
        cb = b.get(g, _zero_counters())
        delta = {k: ca[k] - cb[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
        positions = sorted(set(cb["accepted_per_pos"]) | set(ca["accepted_per_pos"]))
        per_pos = [ca["accepted_per_pos"].get(p, cb["accepted_per_pos"].get(p, 0)) - cb["accepted_per_pos"].get(p, 0)
                   for p in positions]
        if any(v < 0 for v in [*delta.values(), *per_pos]):
            reasons[g] = "a spec-decode counter went down during the run (a replica restarted?)"
            continue
        keys = bench_spec_decode(delta["num_drafts"], delta["num_draft_tokens"], delta["num_accepted_tokens"], per_pos)
        if keys:
            out[g] = keys
        else:
            reasons[g] = "the server drafted no token during the measured phase"
    went_down = [why for why in reasons.values() if "went down" in why]
    if went_down:  # one arm's restart makes the whole-server sum wrong too
        out.pop(None, None)
        reasons[None] = went_down[0]
    return out, (None if None in out else reasons.get(None, "no whole-server spec-decode series"))


async def fetch_metrics(client: Any, base_url: str, *, api_key: str | None = None,
                        timeout_s: float = 10.0) -> tuple[str | None, str | None]:
    """``GET {base_url}/metrics``: ``(text, None)``, or ``(None, why not)``; never raises
    (except on cancellation)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = await client.get(f"{base_url}/metrics", timeout=timeout_s, headers=headers)
    except Exception as exc:  # noqa: BLE001 - the load test runs on without spec-decode numbers
        return None, f"GET /metrics failed: {type(exc).__name__}: {exc}"
    if r.status_code != 200:
        return None, f"GET /metrics answered HTTP {r.status_code}"
    return r.text, None


# ----------------------------------------------------------------------------- HTTP


def _error_message(body: bytes) -> str:
    try:
        obj = json.loads(body)
        err = obj.get("error") if isinstance(obj, dict) else None
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
    except (ValueError, UnicodeDecodeError):
        pass
    return body[:200].decode("utf-8", "replace").strip() or "(empty body)"


async def send_request(
    client: Any,
    url: str,
    record: RequestRecord,
    payload: dict[str, Any],
    headers: Mapping[str, str],
    *,
    phase_start: float,
    request_timeout_s: float | None = None,
    forced_arm: str | None = None,
) -> RequestRecord:
    """POST ``payload`` to ``url`` (an ``httpx.AsyncClient``), read the SSE stream and fill
    ``record`` in (see the module docstring for the timings). Never raises except on
    cancellation (then ``record`` says "cancelled" and the error propagates)."""
    record.sent = True
    t0 = time.perf_counter()
    record.start_s = t0 - phase_start
    last: float | None = None
    done = False
    usage: dict[str, Any] | None = None
    texts: list[str] = []
    try:
        async with asyncio.timeout(request_timeout_s):
            async with client.stream("POST", url, json=payload, headers=dict(headers)) as resp:
                record.status = resp.status_code
                record.arm = resp.headers.get("x-sparsespec-arm") or None
                record.method = resp.headers.get("x-sparsespec-method") or None
                if resp.status_code != 200:
                    body = await resp.aread()
                    record.error = f"HTTP {resp.status_code}: {_error_message(body)}"
                    return record
                async for line in resp.aiter_lines():
                    line = line.strip()
                    if not line or not line.startswith("data:"):
                        continue  # blank separators, comments, event:/id: fields
                    data = line[5:].strip()
                    if data == "[DONE]":
                        record.e2el_s = time.perf_counter() - t0
                        done = True
                        break
                    now = time.perf_counter()
                    try:
                        chunk = json.loads(data)
                    except ValueError:
                        record.error = f"bad_sse: {data[:120]!r}"
                        return record
                    if not isinstance(chunk, dict):
                        record.error = f"bad_sse: {data[:120]!r}"
                        return record
                    if chunk.get("error"):
                        err = chunk["error"]
                        record.error = "stream_error: " + (str(err.get("message")) if isinstance(err, dict) else str(err))
                        return record
                    choices = chunk.get("choices") or []
                    text = "".join(str(c.get("text") or "") for c in choices if isinstance(c, dict))
                    for c in choices:
                        if isinstance(c, dict) and c.get("finish_reason"):
                            record.finish_reason = c["finish_reason"]
                    if text:
                        if last is None:
                            record.ttft_s = now - t0
                        else:
                            record.itl_s.append(now - last)
                        last = now
                        record.num_chunks += 1
                        texts.append(text)
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                        if chunk.get("speculation") is not None:
                            record.speculation = dict(chunk["speculation"])
                        record.arm = record.arm or chunk.get("arm")
                        record.method = record.method or chunk.get("method")
    except asyncio.CancelledError:
        record.error = "cancelled: the total --timeout-s budget ran out"
        raise
    except TimeoutError:
        record.error = f"timeout: no complete answer within --request-timeout-s {request_timeout_s:g}"
        return record
    except Exception as exc:  # httpx transport errors, broken streams, ...
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    finally:
        record.text = "".join(texts)
        if record.arm is None:
            record.arm = forced_arm
    if usage is not None:
        record.prompt_tokens = usage.get("prompt_tokens")
        if usage.get("completion_tokens") is not None:
            record.output_tokens = int(usage["completion_tokens"])
    if not record.output_tokens:
        record.output_tokens = record.num_chunks
    if not done:
        record.error = "incomplete: the stream ended without data: [DONE]"
    elif record.ttft_s is None:
        record.error = "no_output: the stream carried no text"
    else:
        record.success = True
    return record


async def check_reachable(client: Any, base_url: str, timeout_s: float = 10.0, model: str | None = None,
                          api_key: str | None = None) -> list[str]:
    """Any HTTP answer from ``GET {base_url}/v1/models`` (even 404) proves the server is up;
    no answer raises :class:`Unreachable`. Returns the arms the server lists for ``model``
    (ids ``"<model>:<arm>"``; empty when it lists none), so warm-ups can reach every arm."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = await client.get(f"{base_url}/v1/models", timeout=timeout_s, headers=headers)
    except (httpx.TransportError, OSError) as exc:
        raise Unreachable(f"cannot reach the server at {base_url}: {type(exc).__name__}: {exc}") from None
    try:
        ids = [d["id"] for d in r.json()["data"]] if r.status_code == 200 else []
    except (ValueError, KeyError, TypeError):
        ids = []
    return [i.split(":", 1)[1] for i in ids if model and i.startswith(f"{model}:")]


async def run_load(
    client: Any,
    *,
    url: str,
    model: str,
    prompts: Sequence[Any],
    num_prompts: int,
    endpoint: str = "/v1/completions",
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    num_warmups: int = 0,
    seed: int = 0,
    sessions: int | None = None,
    session_prefix: str | None = None,
    arm: str | None = None,
    ignore_eos: bool = False,
    max_tokens: int | None = None,
    timeout_s: float | None = None,
    request_timeout_s: float | None = 600.0,
    api_key: str | None = None,
    progress: bool = False,
    warmup_arms: Sequence[str] | None = None,
    scrape_metrics: bool = False,
) -> LoadResult:
    """Warm up (``num_warmups`` requests, one after another), then send ``num_prompts`` requests
    (cycling over ``prompts``: token-id sequences, strings, :class:`Prompt` or benchmark samples)
    at ``request_rate`` (Poisson, seeded) with at most ``max_concurrency`` in flight.

    ``timeout_s`` is the total wall budget (warm-ups included): after it no request is sent and
    the in-flight ones are cancelled and count as failed. ``sessions`` K reuses K session ids
    round-robin (default: a fresh one per request); ``arm`` forces every request to that arm.
    ``warmup_arms``: warm-up ``i`` goes to arm ``warmup_arms[i % n]`` (``x-arm``), so every arm's
    first, slow requests are excluded (give at least one warm-up per arm). ``scrape_metrics``:
    read ``GET {url}/metrics`` after the warm-ups and after the measured phase, as ``vllm bench
    serve`` does for its ``spec_decode_*`` numbers (outside the measured duration).
    """
    if not prompts:
        raise ValueError("no prompts")
    if num_prompts < 1:
        raise ValueError("num_prompts must be >= 1")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError("max_concurrency must be >= 1")
    plist = [_as_prompt(p, max_tokens) for p in prompts]
    prefix = session_prefix or f"lt-{uuid.uuid4().hex[:8]}"
    target = url.rstrip("/") + endpoint
    budget_start = time.perf_counter()
    deadline = budget_start + timeout_s if timeout_s else None

    def make(i: int, warm: bool) -> tuple[RequestRecord, dict[str, Any], dict[str, str]]:
        p = plist[i % len(plist)]
        if warm:
            session = f"{prefix}-warmup-{i}"
        elif sessions:
            session = f"{prefix}-s{i % sessions}"
        else:
            session = f"{prefix}-{i}"
        payload = {
            "model": model, "prompt": list(p.prompt) if not isinstance(p.prompt, str) else p.prompt,
            "max_tokens": p.max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": bool(ignore_eos), "user": session,
        }
        headers = {"x-session-id": session}
        if warm:  # stored with the request, so views of the store leave it out as this report does
            headers[WARMUP_HEADER] = "1"
        if arm:
            headers["x-arm"] = arm
        elif warm and warmup_arms:
            headers["x-arm"] = warmup_arms[i % len(warmup_arms)]
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        rec = RequestRecord(index=i, session=session, prompt_len=p.num_tokens, max_tokens=p.max_tokens,
                            task=p.task, sample_id=p.sample_id, warmup=warm)
        return rec, payload, headers

    warmups: list[RequestRecord] = []
    for i in range(num_warmups):
        if deadline is not None and time.perf_counter() >= deadline:
            break
        rec, payload, headers = make(i, True)
        left = None if deadline is None else deadline - time.perf_counter()
        limits = [x for x in (request_timeout_s, left) if x is not None]
        limit = min(limits) if limits else None
        warmups.append(await send_request(client, target, rec, payload, headers, phase_start=budget_start,
                                          request_timeout_s=limit, forced_arm=arm))

    before = after = metrics_error = None
    if scrape_metrics:
        before, metrics_error = await fetch_metrics(client, url.rstrip("/"), api_key=api_key)

    gaps = poisson_gaps(request_rate, num_prompts, seed, burstiness)
    offsets = np.concatenate([[0.0], np.cumsum(gaps[:-1])]) if num_prompts else np.zeros(0)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    records: list[RequestRecord] = []
    tasks: list[asyncio.Task] = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=num_prompts, file=sys.stderr, desc="requests", leave=False)

    async def one(i: int, start: float) -> None:
        rec, payload, headers = make(i, False)
        if sem is not None:
            await sem.acquire()
        try:
            if deadline is not None and time.perf_counter() >= deadline:
                return  # never sent
            records.append(rec)
            await send_request(client, target, rec, payload, headers, phase_start=start,
                               request_timeout_s=request_timeout_s, forced_arm=arm)
        finally:
            if sem is not None:
                sem.release()
            if bar is not None:
                bar.update(1)

    start = time.perf_counter()
    timed_out = False
    try:
        for i in range(num_prompts):
            when = start + float(offsets[i])
            if deadline is not None and when >= deadline:
                timed_out = True
                break
            now = time.perf_counter()
            delay = when - now if deadline is None else min(when, deadline) - now
            if delay > 0:
                await asyncio.sleep(delay)
            if deadline is not None and time.perf_counter() >= deadline:
                timed_out = True
                break
            tasks.append(asyncio.create_task(one(i, start)))
        if tasks:
            left = None if deadline is None else max(0.0, deadline - time.perf_counter())
            _, pending = await asyncio.wait(tasks, timeout=left)
            if pending:
                timed_out = True
                for t in pending:
                    t.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        if bar is not None:
            bar.close()
    duration = time.perf_counter() - start
    if scrape_metrics and before is not None:
        after, metrics_error = await fetch_metrics(client, url.rstrip("/"), api_key=api_key)
    records.sort(key=lambda r: r.index)
    return LoadResult(records=records, warmups=warmups, duration_s=duration, num_prompts=num_prompts,
                      not_sent=num_prompts - len(records), timed_out=timed_out, metrics_before=before,
                      metrics_after=after, metrics_error=metrics_error)


# ----------------------------------------------------------------------------- output


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return f"{v:.2f}" if abs(v) >= 0.01 or v == 0 else f"{v:.4f}"
    if isinstance(v, (list, dict)):
        return json.dumps(v) if v else "-"
    return str(v)


_NOT_IN_TABLE = ("failure_reasons", "spec_decode_unavailable")


def format_table(overall: Mapping[str, Any], arms: Mapping[str, Mapping[str, Any]]) -> str:
    """One row per metric, one column per arm and one for the whole run (tabulate)."""
    from tabulate import tabulate

    keys = [k for k in overall if k not in _NOT_IN_TABLE]
    for m in arms.values():
        keys += [k for k in m if k not in keys and k not in _NOT_IN_TABLE]
    rows = [[k, *(_fmt(arms[a].get(k)) for a in arms), _fmt(overall.get(k))] for k in keys]
    return tabulate(rows, headers=["metric", *arms, "overall"], disable_numparse=True)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float):
        if math.isnan(obj):
            return None
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        return _jsonable(obj.item())
    return obj


def _positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{s!r} must be > 0")
    return v


def _int_at_least(lo: int):
    """An argparse type: an integer >= ``lo``."""
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"{s!r} must be >= {lo}")
        return v
    return parse


_positive_int = _int_at_least(1)
_nonneg_int = _int_at_least(0)


def _task_list(s: str) -> list[str]:
    return [t for t in s.replace(",", " ").split() if t]


BACKEND = "openai"  # vllm bench serve's name for streaming POST /v1/completions


def result_filename(args: argparse.Namespace, current_dt: str) -> str:
    """vllm bench serve's result path: ``--result-filename`` or
    ``{label}-{request_rate}qps[-concurrency{N}]-{model basename}-{current_dt}.json``
    (label default: the backend, ``openai``), inside ``--result-dir`` when given."""
    conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    name = args.result_filename or (
        f"{args.label or BACKEND}-{args.request_rate}qps{conc}-{args.model.split('/')[-1]}-{current_dt}.json")
    return os.path.join(args.result_dir, name) if args.result_dir else name


def result_json(result: LoadResult, overall: Mapping[str, Any], args: argparse.Namespace, *,
                current_dt: str) -> dict[str, Any]:
    """The result document in ``vllm bench serve``'s layout: its run header (``date``,
    ``backend``, ``label``, ``model_id``, ``tokenizer_id``, ``num_prompts``, ``request_rate``,
    ``burstiness``, ``max_concurrency``), then the whole run's metrics (``overall``: vLLM's keys
    and our additions), ``latencies`` (seconds, one per measured request, 0.0 when it failed)
    and, with ``--save-detailed``, vLLM's per-request lists (``input_lens``, ``output_lens``,
    ``ttfts`` / ``itls`` in seconds, ``generated_texts``, ``errors``: "" when it succeeded)."""
    recs = result.records
    doc: dict[str, Any] = {
        "date": current_dt,
        "endpoint_type": BACKEND,
        "backend": BACKEND,
        "label": args.label,
        "model_id": args.model,
        "tokenizer_id": args.tokenizer or args.model,
        "num_prompts": result.num_prompts,
        "request_rate": args.request_rate if args.request_rate < math.inf else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        **overall,
        "latencies": [(r.e2el_s or 0.0) if r.success else 0.0 for r in recs],
    }
    if args.save_detailed:
        doc.update({
            "input_lens": [r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in recs],
            "output_lens": [r.output_tokens if r.success else 0 for r in recs],
            "ttfts": [r.ttft_s or 0.0 for r in recs],
            "itls": [list(r.itl_s) for r in recs],
            "generated_texts": [r.text for r in recs],
            "errors": ["" if r.success else (r.error or "") for r in recs],
        })
    return doc


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cluster.serve.loadtest",
        description="Load-test the local OpenAI-compatible A/B endpoint (vllm bench serve conventions).",
    )
    g = p.add_argument_group("server")
    g.add_argument("--url", "--base-url", dest="url", default="http://127.0.0.1:8000",
                   help="server base URL, loopback only (default %(default)s)")
    g.add_argument("--endpoint", default="/v1/completions", help="default %(default)s")
    g.add_argument("--model", required=True, help="model name sent in the request (a preset, e.g. smollm2-135m)")
    g.add_argument("--tokenizer", default=None, help="tokenizer preset or folder (default: --model)")
    g.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    g = p.add_argument_group("prompts")
    g.add_argument("--benchmark", default="longbench", help="registry name (default %(default)s)")
    g.add_argument("--tasks", type=_task_list, action="extend", default=None,
                   help="tasks (comma or space separated; default: the benchmark's)")
    g.add_argument("--context-length", type=_positive_int, default=None,
                   help="prompt + generation budget in tokens (default: the benchmark's)")
    g.add_argument("--window", type=_positive_int, default=8192, help="model context window (default %(default)s)")
    g.add_argument("--num-samples", type=_positive_int, default=None,
                   help="samples per task (default: enough for --num-prompts)")
    g.add_argument("--max-tokens", type=_positive_int, default=None,
                   help="generation cap per request (default: each task's official budget)")
    g.add_argument("--ignore-eos", action="store_true", help="fixed-length outputs (vLLM's ignore_eos)")
    g = p.add_argument_group("load")
    g.add_argument("--num-prompts", type=_positive_int, default=100, help="measured requests (default %(default)s)")
    g.add_argument("--request-rate", type=_positive_float, default=math.inf,
                   help="requests/s, Poisson arrivals; inf: all at once (default)")
    g.add_argument("--burstiness", type=_positive_float, default=1.0,
                   help="gamma shape of the arrivals, 1 = Poisson (default %(default)s)")
    g.add_argument("--max-concurrency", type=_positive_int, default=None, help="max requests in flight")
    g.add_argument("--num-warmups", type=_nonneg_int, default=0, help="warm-up requests, excluded from metrics")
    g.add_argument("--seed", type=int, default=0, help="arrivals and bootstrap seed (default %(default)s)")
    g.add_argument("--timeout-s", type=_positive_float, default=3600.0,
                   help="total wall budget in seconds (default %(default)s)")
    g.add_argument("--request-timeout-s", type=_positive_float, default=600.0,
                   help="per-request limit in seconds (default %(default)s)")
    g.add_argument("--sessions", type=_positive_int, default=None,
                   help="reuse K session ids round-robin (default: a fresh session per request)")
    g.add_argument("--session-prefix", default=None, help="session id prefix (default: random)")
    g.add_argument("--arm", default=None, help="force every request to this arm (x-arm header)")
    g = p.add_argument_group("metrics")
    g.add_argument("--percentiles", "--metric-percentiles", dest="percentiles", default="99",
                   help='comma-separated percentiles (default "%(default)s")')
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. --goodput ttft:500 tpot:50 (keys ttft, tpot, e2el)")
    g.add_argument("--baseline", default=None, help="baseline arm (default: ar if present, else the first by name)")
    g.add_argument("--bootstrap", type=_positive_int, default=2000, help="bootstrap resamples (default %(default)s)")
    g = p.add_argument_group("output (vllm bench serve's flags)")
    g.add_argument("--save-result", action="store_true",
                   help="save the result JSON (vLLM's keys; our additions: arms, decisions, config, ...)")
    g.add_argument("--result-dir", default=None,
                   help="folder for the result JSON (default: the current one); needs --save-result")
    g.add_argument("--result-filename", default=None,
                   help="file name of the result JSON (default {label}-{request_rate}qps[-concurrency{N}]-"
                        "{model}-{date}.json); needs --save-result")
    g.add_argument("--label", default=None, help="prefix of the default file name (default: the backend, openai)")
    g.add_argument("--save-detailed", action="store_true",
                   help="add vLLM's per-request lists (input_lens, output_lens, ttfts, itls, generated_texts, errors)")
    g.add_argument("--output-json", default=None, metavar="PATH",
                   help="same as --save-result --result-filename PATH (the older flag)")
    g.add_argument("--save-requests", action="store_true", help="add our per-request records (requests)")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    return p


def _err(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None, *, prompts: Sequence[Any] | None = None, client: Any = None) -> int:
    """The CLI. ``prompts`` (token-id sequences, strings, :class:`Prompt` or samples) replace
    the registry prompts and ``client`` an own ``httpx.AsyncClient``; both are for tests."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse printed its one-line error (or --help)
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    try:
        base = check_loopback(args.url)
        goodput = parse_goodput(args.goodput) if args.goodput else {}
        percentiles = parse_percentiles(args.percentiles)
    except ValueError as exc:
        return _err(str(exc))
    if not args.endpoint.startswith("/"):
        return _err(f"--endpoint must start with / (got {args.endpoint!r})")
    if args.output_json:
        if args.result_filename and args.result_filename != args.output_json:
            return _err("--output-json PATH is --save-result --result-filename PATH: give one of them")
        args.save_result, args.result_filename = True, args.output_json
    elif not args.save_result and (args.result_filename or args.result_dir):
        print("warning: --result-filename / --result-dir do nothing without --save-result (as in vllm bench serve)",
              file=sys.stderr)

    if prompts is None:
        print(f"building {args.benchmark} prompts for {args.tokenizer or args.model} ...", file=sys.stderr)
        try:
            plist = load_prompts(args.tokenizer or args.model, args.benchmark, num_prompts=args.num_prompts,
                                 tasks=args.tasks, context_length=args.context_length, num_samples=args.num_samples,
                                 max_tokens=args.max_tokens, window=args.window)
        except Exception as exc:  # unknown benchmark/task, missing data, model not provisioned, ...
            return _err(f"cannot build prompts: {type(exc).__name__}: {exc}")
    else:
        if not prompts:
            return _err("no prompts")
        plist = [_as_prompt(p, args.max_tokens) for p in prompts]

    async def go() -> LoadResult:
        import httpx

        own = client is None
        c = client or httpx.AsyncClient(
            timeout=httpx.Timeout(args.request_timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=args.max_concurrency or 100),
            trust_env=False,  # loopback: never through a proxy from the environment
        )
        try:
            arms = await check_reachable(c, base, model=args.model, api_key=args.api_key)
            return await run_load(
                c, url=base, endpoint=args.endpoint, model=args.model, prompts=plist, num_prompts=args.num_prompts,
                request_rate=args.request_rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                num_warmups=args.num_warmups, seed=args.seed, sessions=args.sessions,
                session_prefix=args.session_prefix, arm=args.arm, ignore_eos=args.ignore_eos,
                max_tokens=args.max_tokens, timeout_s=args.timeout_s, request_timeout_s=args.request_timeout_s,
                api_key=args.api_key, progress=not args.disable_tqdm and sys.stderr.isatty(), warmup_arms=arms,
                scrape_metrics=True,
            )
        finally:
            if own:
                await c.aclose()

    try:
        result = asyncio.run(go())
    except Unreachable as exc:
        return _err(str(exc))
    except KeyboardInterrupt:
        return _err("interrupted")

    overall = summarize(result.records, result.duration_s, goodput, percentiles)
    overall["not_sent"] = result.not_sent
    overall["timed_out"] = result.timed_out
    arms = summarize_by_arm(result.records, result.duration_s, goodput, percentiles)
    if result.metrics_before is not None and result.metrics_after is not None:
        spec, why = spec_decode_from_metrics(result.metrics_before, result.metrics_after)
    else:
        spec, why = {}, result.metrics_error or "GET /metrics was not read"
    overall.update(spec.get(None, {}))
    for name, m in arms.items():
        m.update(spec.get(name, {}))
    if why is not None:
        overall["spec_decode_unavailable"] = why
        print(f"note: no spec_decode_* numbers: {why}", file=sys.stderr)
    if args.baseline is not None and args.baseline not in arms:
        print(f"warning: --baseline {args.baseline!r} saw no requests (arms: {', '.join(arms) or 'none'})",
              file=sys.stderr)
        decisions: list[dict[str, Any]] = []
    else:
        decisions = ab_decisions(result.records, args.baseline, goodput=goodput or None,
                                 n_boot=args.bootstrap, seed=args.seed)

    print(format_table(overall, arms))
    for name, m in [*arms.items(), ("overall", overall)]:
        if m["failure_reasons"]:
            print(f"failed ({name}): " + ", ".join(f"{k} x{v}" for k, v in m["failure_reasons"].items()))
    wc = sum(r.success for r in result.warmups)
    print(f"\nwarm-ups: {len(result.warmups)} sent, {wc} completed (excluded from the metrics)")
    if result.timed_out:
        print(f"--timeout-s {args.timeout_s:g} reached: {result.not_sent} request(s) not sent")
    if decisions:
        for d in decisions:
            print(f"A/B: {d['conclusion']}")
    else:
        print(f"A/B: no decision ({len(arms)} arm(s) seen; need a baseline and at least one other arm)")

    if args.save_result:
        current_dt = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        cfg = {k: v for k, v in vars(args).items() if k != "api_key"}
        cfg["url"] = base
        cfg["goodput"] = goodput or None
        cfg["percentiles"] = list(percentiles)
        cfg["prompts"] = "injected" if prompts is not None else "registry"
        doc = result_json(result, overall, args, current_dt=current_dt)
        doc.update({
            "config": cfg,
            "warmup": {"sent": len(result.warmups), "completed": wc},
            "arms": arms,
            "decisions": decisions,
            "decision": decisions[0] if len(decisions) == 1 else None,
        })
        if args.save_requests:
            doc["requests"] = [r.to_dict() for r in result.records]
            doc["warmup_requests"] = [r.to_dict() for r in result.warmups]
        name = result_filename(args, current_dt)
        path = os.path.abspath(name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(_jsonable(doc), f, indent=2, allow_nan=False)
        os.replace(tmp, path)
        print(f"wrote {name}", file=sys.stderr)

    if result.records and overall["completed"] == 0:
        print("error: every measured request failed", file=sys.stderr)
        return 1
    if not result.records:
        print("error: no measured request was sent (the --timeout-s budget ran out)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

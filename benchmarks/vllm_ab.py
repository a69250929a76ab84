"""A/B of our engine's arms against a ``vllm serve`` arm on the same traffic (issue 29).

Starts ``vllm serve`` from ``.venv-peers`` (``make peers``; its start, 1-3 min on 2 cores, is not
part of any timing) on a free loopback port, then one Serve app (a local Ray on loopback, never an
existing cluster) whose arms are ours (``--ours``: ``ar`` and/or ``sparsespec-l``) plus an
external arm (``cluster.serve.endpoint.ExternalArmServer``) that forwards to that server. The same
prompts (book windows of ``--lengths`` tokens, interleaved) go to each arm in turn through
``cluster.serve.loadtest`` (``--arm``, closed loop at ``--concurrency``, ``--max-tokens``
fixed-length outputs), so each arm sees the same mix at the same load with the machine to itself
(the idle server takes no CPU). The stored rows (experiment ``vllm-ab``) give the decisions:
every arm's median TPOT against our ``ar`` with the bootstrap 95 % interval
(``cluster.results.aggregate.ab_decisions``).

    python benchmarks/vllm_ab.py --db sqlite:///$PWD/results/vllm_ab.db --lengths 992,4064 \\
        --concurrency 2 --num-prompts 12 --max-tokens 32

``--vllm-method ngram`` starts the server with vLLM's n-gram speculation (``--speculative-config``).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.policy_ab import book_prompts  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_vllm(folder: Path, served: str, port: int, threads: int, max_model_len: int, method: str,
               log: Path) -> subprocess.Popen:
    """``vllm serve`` (vLLM's own CLI through ``cluster/peers/vllm_cli.py``) in its own session."""
    from cluster.peers import _DROP_ENV, peers_python
    from cluster.peers.engine import kv_cache_gib

    python = peers_python()
    if python is None:
        raise SystemExit("no .venv-peers: run make peers")
    cmd = [str(python), str(ROOT / "cluster" / "peers" / "vllm_cli.py"), "serve", str(folder),
           "--served-model-name", served, "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", str(max_model_len), "--disable-uvicorn-access-log"]
    if method == "ngram":  # (vLLM refuses per-request speculation metrics without speculation)
        cmd += ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 4,
                                                    "prompt_lookup_min": 1, "prompt_lookup_max": 4}),
                "--per-request-spec-decode-metrics", "summary"]
    env = {k: v for k, v in os.environ.items() if k not in _DROP_ENV}
    env.update(PYTHONNOUSERSITE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               VLLM_CPU_OMP_THREADS_BIND=",".join(str(c) for c in sorted(os.sched_getaffinity(0))[:threads]),
               VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib(folder, "float32", 8 * max_model_len, 1.25)))
    return subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> float:
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        if proc.poll() is not None:
            raise SystemExit(f"vllm serve exited with status {proc.returncode} (see its log)")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return time.time() - t0
        except OSError:
            pass
        time.sleep(2)
    raise SystemExit(f"vllm serve not healthy after {timeout_s:.0f} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/vllm_ab.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--ours", default="ar,sparsespec-l", help="our arms (comma list of methods)")
    p.add_argument("--spec-options", default='{"k": "auto"}', help="the sparsespec-l arm's options (JSON)")
    p.add_argument("--vllm-method", default="ar", choices=("ar", "ngram"))
    p.add_argument("--lengths", default="992,4064", help="prompt lengths in tokens, interleaved (comma list)")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=12, help="requests per arm")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2, help="threads of every arm (ours: torch; vLLM: its worker)")
    p.add_argument("--db", required=True)
    p.add_argument("--vllm-log", default="vllm_serve.log")
    a = p.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve
    from transformers import AutoTokenizer

    from benchmarks.policy_ab import decisions
    from cluster.results.store import open_store
    from cluster.serve import loadtest
    from cluster.serve.endpoint import build_app
    from sparsespec.provision import resolve_model

    lengths = [int(x) for x in a.lengths.split(",")]
    folder = Path(resolve_model(a.model))
    prompts = book_prompts(AutoTokenizer.from_pretrained(folder), lengths, a.num_prompts)
    window = max(lengths) + a.max_tokens
    vport = _free_port()
    vurl = f"http://127.0.0.1:{vport}"
    vllm_arm = f"vllm-{a.vllm_method}"
    proc = start_vllm(folder, a.model, vport, a.threads, max(window, 2048), a.vllm_method, Path(a.vllm_log))
    try:
        print(f"vllm serve healthy after {wait_healthy(vurl, proc, 900):.0f} s", flush=True)
        arms = [{"name": m, "method": m, **({"options": json.loads(a.spec_options)} if m == "sparsespec-l" else {})}
                for m in a.ours.split(",") if m]
        arms.append({"name": vllm_arm, "method": f"vllm:{a.vllm_method}", "url": vurl + "/v1",
                     "served_model": a.model})
        ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False,
                 object_store_memory=500 * 1024**2, _node_ip_address="127.0.0.1")
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        base = f"http://127.0.0.1:{port}"
        try:
            serve.run(build_app({"model": a.model, "device": "cpu", "threads": a.threads, "arm_num_cpus": 0,
                                 "arms": arms, "max_num_seqs": max(4, a.concurrency), "max_model_len": window,
                                 "db": a.db, "experiment": "vllm-ab"}), name="vllm-ab", route_prefix="/")
            for arm in [x["name"] for x in arms]:
                print(f"\n--- arm {arm}, concurrency {a.concurrency}", flush=True)
                rc = loadtest.main(["--url", base, "--model", a.model, "--tokenizer", str(folder), "--arm", arm,
                                    "--num-prompts", str(len(prompts)), "--max-concurrency", str(a.concurrency),
                                    "--max-tokens", str(a.max_tokens), "--ignore-eos", "--disable-tqdm",
                                    "--num-warmups", "1"], prompts=prompts)
                if rc:
                    print(f"loadtest exited {rc}", file=sys.stderr)
            time.sleep(2.0)  # the request log flushes every 0.5 s
            with open_store(a.db, create=False) as store:
                summary = decisions(store.serve_requests("vllm-ab"), a.concurrency, lengths)
            serve.delete("vllm-ab")
        finally:
            serve.shutdown()
            ray.shutdown()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    print("\n" + json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

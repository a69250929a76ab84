"""A/B of the Serve ``policy`` arm against single-method arms under a mixed-length workload
(issue 27 item 3): is the policy at least as fast as the best single arm, and faster than
``sparsespec-l`` always on?

One Serve app (a local Ray on loopback, never an existing cluster) with arms ``ar``,
``sparsespec-l`` (``--spec-options``, default ``{"k": 2}``) and ``policy`` (``--policy``). For each
``--concurrencies`` level, the same prompts (book windows of each ``--lengths``, interleaved) go to
each arm in turn through ``cluster.serve.loadtest`` (``--arm``, closed loop at that concurrency,
``--max-tokens`` fixed-length outputs), so every arm sees the same mix at the same load. The
stored rows (experiment ``policy-ab-c<concurrency>``) give the decisions: every arm's median
TPOT against ``ar`` and against ``sparsespec-l`` with the bootstrap 95 % interval
(``cluster.results.aggregate.ab_decisions``), and what the policy arm chose per (context, batch) bucket.

    python benchmarks/policy_ab.py --policy results/policy.json --db sqlite:///$PWD/results/policy_ab.db \\
        --lengths 992,8160 --concurrencies 1,4 --num-prompts 8 --max-tokens 32

``--model`` / ``--policy-model``: a preset or folder and its key in the policy file (a
random-weight folder checks the plumbing in seconds; its timings mean nothing).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT.parent / "shared" / "data" / "public_domain_books" / "11-0.txt"


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def book_prompts(tokenizer, lengths: list[int], n: int, book: Path = BOOK) -> list[list[int]]:
    """``n`` prompts cycling through ``lengths`` (tokens), consecutive windows of the book."""
    ids = tokenizer(book.read_text(encoding="utf-8-sig"), add_special_tokens=False).input_ids
    out, pos = [], 0
    for i in range(n):
        L = lengths[i % len(lengths)]
        if pos + L > len(ids):
            pos = 0
        out.append(ids[pos:pos + L])
        pos += L
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/policy_ab.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", required=True,
                   help="policy file (python -m cluster.results.report --policy --policy-out)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--policy-model", default=None, help="the model's key in the policy (default --model)")
    p.add_argument("--spec-options", default='{"k": 2}', help="the sparsespec-l arm's options (JSON)")
    p.add_argument("--lengths", default="992,8160",
                   help="prompt lengths in tokens, interleaved (comma list); a length repeated weights the mix "
                        "(992,992,992,8160: three short prompts per long one)")
    p.add_argument("--concurrencies", default="1,4", help="closed-loop concurrency levels (comma list)")
    p.add_argument("--num-prompts", type=int, default=8, help="requests per arm per concurrency level")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--blocks", type=int, default=1,
                   help="split the prompts into this many blocks and run the arms in turn per block, the order "
                        "rotating each block (ar, sparsespec-l, policy; then sparsespec-l, policy, ar; ...), so the "
                        "machine's drift over the run falls on every arm alike (1: each arm's prompts in one go)")
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--threads", type=int, default=None, help="torch threads per arm replica")
    p.add_argument("--db", required=True)
    p.add_argument("--request-timeout-s", type=float, default=1800.0)
    p.add_argument("--analyze-only", action="store_true",
                   help="print the decisions from the rows already in --db (a previous run's) and start nothing")
    a = p.parse_args(argv)
    if not 1 <= a.blocks <= a.num_prompts:
        p.error(f"--blocks must be between 1 and --num-prompts ({a.num_prompts}), got {a.blocks}")
    if a.analyze_only:
        return analyze(a.db, _ints(a.lengths), _ints(a.concurrencies))
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray
    from ray import serve
    from transformers import AutoTokenizer

    from cluster.results.store import open_store
    from cluster.serve import loadtest
    from cluster.serve.endpoint import build_app
    from sparsespec.provision import resolve_model

    lengths, levels = _ints(a.lengths), _ints(a.concurrencies)
    folder = resolve_model(a.model)
    tok = AutoTokenizer.from_pretrained(folder)
    prompts = book_prompts(tok, lengths, a.num_prompts)
    arms = [{"name": "ar", "method": "ar"},
            {"name": "sparsespec-l", "method": "sparsespec-l", "options": json.loads(a.spec_options)},
            {"name": "policy", "method": "policy",
             "options": {"path": str(Path(a.policy).resolve()), "model": a.policy_model or a.model}}]
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False,
             object_store_memory=500 * 1024**2, _node_ip_address="127.0.0.1")
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base = f"http://127.0.0.1:{port}"
    summary = []
    try:
        for c in levels:
            exp = f"policy-ab-c{c}"
            t0 = time.time()
            serve.run(build_app({"model": a.model, "device": "cpu", "threads": a.threads, "arm_num_cpus": 0,
                                 "arms": arms, "max_num_seqs": a.max_num_seqs,
                                 "max_model_len": max(lengths) + a.max_tokens, "db": a.db, "experiment": exp}),
                      name="policy-ab", route_prefix="/")
            print(f"\n=== concurrency {c}: app up in {time.time() - t0:.0f} s", flush=True)
            for i, (block, order) in enumerate(blocks(prompts, a.blocks, ("ar", "sparsespec-l", "policy"))):
                for arm in order:
                    print(f"\n--- arm {arm}, concurrency {c}, block {i + 1}/{a.blocks}", flush=True)
                    rc = loadtest.main(["--url", base, "--model", a.model, "--tokenizer", str(folder), "--arm", arm,
                                        "--num-prompts", str(len(block)), "--max-concurrency", str(c),
                                        "--max-tokens", str(a.max_tokens), "--ignore-eos", "--disable-tqdm",
                                        "--request-timeout-s", str(a.request_timeout_s)]
                                       + (["--num-warmups", "0"] if i else []), prompts=block)
                    if rc:
                        print(f"loadtest exited {rc}", file=sys.stderr)
            time.sleep(2.0)  # the request log flushes every 0.5 s
            summary += decisions(open_store(a.db).serve_requests(exp), c, lengths)
            serve.delete("policy-ab")
    finally:
        serve.shutdown()
        ray.shutdown()
    print("\n" + json.dumps(summary, indent=1))
    return 0


def blocks(prompts: list, n: int, arms: tuple[str, ...]) -> list[tuple[list, tuple[str, ...]]]:
    """``prompts`` in ``n`` consecutive blocks (sizes differing by at most one), each with the arm
    order rotated by its index: every arm runs every block, each arm first as often as the others."""
    bounds = [round(i * len(prompts) / n) for i in range(n + 1)]
    return [(prompts[bounds[i]:bounds[i + 1]], arms[i % len(arms):] + arms[:i % len(arms)]) for i in range(n)]


def decisions(rows: list[dict], concurrency: int, lengths: list[int]) -> list[dict]:
    """Print and return the decisions of one concurrency level's stored rows: over all requests,
    then per prompt length (each request in the stratum of its nearest ``lengths`` value). A
    median TPOT over a mix of short and long requests is the median of a two-humped
    distribution (it jumps between the humps), so the per-length decisions carry the claim."""
    from cluster.results import aggregate as queries

    keys = ("baseline", "treatment", "tpot_ratio", "tpot_ratio_ci", "speedup", "significant", "n_baseline",
            "n_treatment")
    out = []
    print(f"\n=== decisions, concurrency {concurrency} ({len(rows)} stored rows)")
    for r in queries.ab_arms(rows):
        print(f"  {r['arm']:>13}: {r['requests']} requests, {r['errors']} errors, median TPOT "
              f"{1000 * (r['tpot_p50_s'] or float('nan')):.1f} ms, methods {r['method']}")
    strata = [("all", rows)] + [
        (L, [r for r in rows if r.get("prompt_tokens") is not None
             and min(lengths, key=lambda x: abs(x - r["prompt_tokens"])) == L]) for L in dict.fromkeys(lengths)]
    for label, rs in strata:
        print(f"  -- prompts: {label}" + ("" if label == "all" else " tokens"))
        if label != "all":
            for r in queries.ab_arms(rs):
                print(f"  {r['arm']:>13}: {r['requests']} requests, median TPOT "
                      f"{1000 * (r['tpot_p50_s'] or float('nan')):.1f} ms")
        for base_arm in ("ar", "sparsespec-l"):
            for d in queries.ab_decisions(rs, base_arm):
                print("    " + d["conclusion"])
                out.append({"concurrency": concurrency, "prompts": label, **{k: d[k] for k in keys}})
    chosen = Counter((r["stats"]["policy"]["bucket"]["context_length"],
                      r["stats"]["policy"]["bucket"]["batch_size"], r["method"], r["stats"]["policy"]["k"])
                     for r in rows if r.get("arm") == "policy" and (r.get("stats") or {}).get("policy"))
    for (ctx, b, m, k), n in sorted(chosen.items()):
        print(f"  policy chose {m} k={k} for bucket ctx={ctx} batch={b}: {n} request(s)")
    return out


def analyze(db: str, lengths: list[int], levels: list[int]) -> int:
    """``decisions`` again from the rows a previous run stored (no server)."""
    from cluster.results.store import open_store

    summary = []
    with open_store(db, create=False) as store:
        for c in levels:
            summary += decisions(store.serve_requests(f"policy-ab-c{c}"), c, lengths)
    print("\n" + json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

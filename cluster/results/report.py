"""Report: the per-cell numbers of a store, as ``cluster.results.aggregate.cell_table`` derives them.

There is one aggregation: ``cell_table`` (built on ``sparsespec.stats``: ``pool``, ``derive``,
``batch_tpot``). The report, the leaderboard, the dashboard and the bench's end-to-end rows are
projections of it, so they print the same number for the same cell. A cell is one (benchmark,
task, model, quantize, context_length, batch_size, method, k, draft_weights): a fixed-k run and a
``k="auto"`` run of one method are different cells, as are int8 drafts and int8 targets.
Definitions (docs/CONTRACTS.md): every ratio is pooled over samples (sum of numerators / sum of
denominators), never a mean of per-sample ratios, except the speedup, which is a median of paired
per-batch ratios:

    n             number of result rows (samples) in the cell
    score         mean per-sample score, in [0, 1] (the table prints it x100)
    speedup       median over paired batches of TPOT_ar / TPOT_method, where a batch's
                  TPOT = (batch_wall_s - batch_prefill_s) / sum(num_output_tokens - 1)
                  (``sparsespec.stats.batch_tpot``; for batch 1 the row's own TPOT); a pair =
                  the same batch (same run, same samples, same actor) run with ar and the method;
                  batches with no decoded tokens are skipped. ar: 1.0
    alpha         sum(num_accepted) / sum(num_drafted)                         (ar: None)
    tau           sum(num_emitted) / sum(num_steps)                            (ar: 1.0)
    mean_k        sum(num_drafted) / sum(steps that drafted)                   (ar: None)
    gamma         (sum(draft_s) / sum(num_draft_forwards)) / (sum(verify_s) / sum(num_steps))  (ar: None)
    lossless_rate fraction of the samples paired with an ar row whose output is token-identical
                  to ar, over the conclusive ones (the stored ``lossless`` flag: None for
                  sampling runs and for identical outputs that drafted nothing); None for ar or
                  when none is conclusive

Rows of several runs of one cell are pooled; pass run ids to report a single configuration.
``cluster.results.aggregate.cell_table`` also carries tokens/s, the total-time speedup and the ledger
prediction per cell; ``report_rows`` keeps exactly ``REPORT_KEYS``.

    python -m cluster.results.report --db sqlite:///results/sparsespec.db [--json] [--run RUN_ID ...]

``--policy`` turns the store into a speculation policy (``cluster.results.policy``): per model and
(context, batch) bucket the fastest lossless method and k (k=0: off), with its speedup and
interval, a file the Serve ``policy`` arm reads (``--policy-out``) and vLLM's equivalent
``--speculative-config`` (``--vllm-out``):

    python -m cluster.results.report --policy --db URL --policy-out policy.json --vllm-out vllm_spec.json

``--engines`` puts methods of several engines side by side (``cluster.results.aggregate.engines_table``:
a sweep with ``vllm:ar``, ``vllm:ngram``, ... beside ours): per cell each method's speedup against our
``ar``, against its own engine's plain decoding and against the faster of the two, with alpha, the
accepted length and, for ``vllm:ar``, the share of samples whose greedy tokens equal ours.

``--seed-table`` prints the seed's five-row table in kind (``cluster.results.seed_table``): ar, a
draft model, MagicDec-SnapKV, EAGLE-3 and SparseSpec-L per target, context and batch, with the
ledger and roofline S and the seed's figures beside them.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from cluster.results.aggregate import CELL_KEYS, batch_label, cell_table, paired_batches, with_run_fields
from cluster.results.store import DEFAULT_DB_URL, StoreError, cli_error, open_store, safe_url
from sparsespec.stats import derive

#: the keys of a report row's cell (``cluster.results.aggregate.CELL_KEYS``)
GROUP_KEYS = CELL_KEYS

REPORT_KEYS = (*CELL_KEYS, "variant", "n", "score", "speedup", "alpha", "tau", "mean_k", "gamma", "lossless_rate")


# --------------------------------------------------------------------------- helpers
def tpot(stats: Mapping[str, Any]) -> float | None:
    """Time per output token after the first: decode_s / (num_output_tokens - 1) (``derive``)."""
    t = derive(stats)["tpot_s"]
    return t if (t is not None and t > 0) else None


def batch_speedups(rs: Sequence[Mapping[str, Any]], ar_rows: Sequence[Mapping[str, Any]]) -> list[float]:
    """Paired per-batch ratios TPOT_ar / TPOT_method (``rs``: one method's rows), as
    ``cluster.results.aggregate.paired_batches`` pairs them (the median is the report's speedup)."""
    return [t_ar / t_m for t_ar, t_m, _ in paired_batches(rs, ar_rows)]


# --------------------------------------------------------------------------- the report
def compute_report(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Report rows (keys exactly ``REPORT_KEYS``) from result rows (dicts with the store's
    columns): ``cluster.results.aggregate.cell_table``'s cells, projected."""
    return [{k: c[k] for k in REPORT_KEYS} for c in cell_table(rows)]


def _load(db_url: str, run_ids: str | Iterable[str] | None) -> list[dict[str, Any]]:
    with open_store(db_url, create=False) as store:
        return with_run_fields(store.results(run_ids=run_ids), store.runs())


def report_rows(db_url: str, run_ids: str | Iterable[str] | None = None) -> list[dict[str, Any]]:
    """One dict per cell with exactly ``REPORT_KEYS``.

    Raises StoreNotFoundError (missing SQLite file) / StoreURLError (bad URL); an empty store
    gives an empty list.
    """
    return compute_report(_load(db_url, run_ids))


# --------------------------------------------------------------------------- printing
def _fmt(v: Any, digits: int = 3) -> Any:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return v


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Plain-text table of report rows; score printed x100 (0-100), ratios to 3 decimals."""
    from tabulate import tabulate

    headers = ["benchmark", "task", "model", "target", "ctx", "batch", "method", "k", "draft", "n", "score (x100)",
               "speedup (median)", "alpha", "tau", "mean_k", "gamma", "lossless_rate"]
    body = []
    for r in rows:
        score = None if r["score"] is None else 100.0 * r["score"]
        body.append([r["benchmark"], r["task"], r["model"], r.get("quantize") or "none", _fmt(r["context_length"]),
                     batch_label(r["batch_size"], r.get("queue_depth")),
                     r["method"], _fmt(r.get("k")), _fmt(r.get("draft_weights")), r["n"], _fmt(score, 1),
                     _fmt(r["speedup"]), _fmt(r["alpha"]), _fmt(r["tau"]), _fmt(r["mean_k"], 2),
                     _fmt(r["gamma"]), _fmt(r["lossless_rate"])])
    return tabulate(body, headers=headers, tablefmt="github", disable_numparse=True)


LEADERBOARD_HEADERS = {
    "benchmark": "benchmark", "model": "model", "context_length": "ctx", "batch_size": "batch", "queue_depth": "queue",
    "variant": "method",
    "n": "n", "speedup": "speedup", "ci_low": "ci_low", "ci_high": "ci_high", "speedup_total": "speedup_total",
    "alpha": "alpha", "tau": "tau", "mean_k": "mean_k", "gamma": "gamma", "score": "score", "score_delta": "score_delta",
    "lossless_rate": "lossless_rate", "tpot_p50_s": "tpot_ms", "throughput": "tokens_per_s",
}


def leaderboard_rows(db_url: str, run_ids: str | Iterable[str] | None = None
                     ) -> tuple[list[dict[str, Any]], Any]:
    """``cluster.results.aggregate.leaderboard`` rows of the store and the ``Environment`` they ran in."""
    from cluster.results import aggregate as queries

    with open_store(db_url, create=False) as store:
        runs = [r for r in store.runs() if run_ids is None or r["run_id"] in set(
            [run_ids] if isinstance(run_ids, str) else run_ids)]
        rows = queries.with_run_fields(store.results(run_ids=run_ids), runs)
    return queries.leaderboard(rows), queries.environment(runs)


def _lb_cell(key: str, v: Any) -> Any:
    if v is None:
        return ""
    if key in ("score", "score_delta"):
        return f"{100.0 * v:.1f}"
    if key == "tpot_p50_s":
        return f"{1000.0 * v:.2f}"
    if isinstance(v, float):
        return f"{v:.3f}"
    return v


def _lb_header(env: Any, prefix: str) -> list[str]:
    pkgs = ", ".join(f"{k} {v}" for k, v in env.packages.items()) or "unknown"
    return [f"{prefix}sparsespec leaderboard: {env.runs} run(s)",
            f"{prefix}device: {'; '.join(env.devices) or 'unknown'}",
            f"{prefix}software: {pkgs}",
            f"{prefix}commit: {', '.join(env.commits) or 'unknown'}",
            f"{prefix}speedup: median over paired batches of TPOT_ar / TPOT_method (ci: 95% bootstrap, >= 5 pairs); "
            f"score and score_delta x100; tpot_ms: median request; an ar row per setting is the reference"]


def format_leaderboard_md(rows: Sequence[Mapping[str, Any]], env: Any) -> str:
    """Markdown: the environment as a header, then one table row per (setting, method)."""
    from tabulate import tabulate

    head = _lb_header(env, "")
    body = [[_lb_cell(k, r.get(k)) for k in LEADERBOARD_HEADERS] for r in rows]
    table = tabulate(body, headers=list(LEADERBOARD_HEADERS.values()), tablefmt="github", disable_numparse=True)
    return "# " + head[0] + "\n\n" + "\n".join(f"- {h}" for h in head[1:]) + "\n\n" + table + "\n"


def format_leaderboard_csv(rows: Sequence[Mapping[str, Any]], env: Any) -> str:
    """CSV with the environment as leading ``#`` comment lines (pandas: ``read_csv(comment="#")``);
    raw values (score in [0, 1], seconds)."""
    import csv
    import io

    buf = io.StringIO()
    for h in _lb_header(env, "# "):
        buf.write(h + "\n")
    w = csv.DictWriter(buf, fieldnames=list(LEADERBOARD_HEADERS), extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    w.writerows({k: ("" if r.get(k) is None else r.get(k)) for k in LEADERBOARD_HEADERS} for r in rows)
    return buf.getvalue()


FOUR_WAY_HEADERS = {
    "benchmark": "benchmark", "model": "model", "context_length": "ctx", "batch_size": "batch",
    "speculation": "speculation", "arm": "arm", "variant": "method", "n": "n", "speedup": "speedup vs baseline",
    "ci_low": "ci_low", "ci_high": "ci_high", "speedup_vs_own_ar": "vs own ar", "score": "score",
    "score_delta": "score_delta", "lossless_rate": "lossless_rate", "lossless_against": "lossless against",
    "agreement_with_baseline": "same tokens as baseline",
}


def four_way_rows(db_url: str, run_ids: str | Iterable[str] | None = None) -> list[dict[str, Any]]:
    """``cluster.results.aggregate.four_way`` over the store (runs with and without a quantised target)."""
    from cluster.results import aggregate as queries

    with open_store(db_url, create=False) as store:
        runs = [r for r in store.runs() if run_ids is None or r["run_id"] in set(
            [run_ids] if isinstance(run_ids, str) else run_ids)]
        return queries.four_way(queries.with_run_fields(store.results(run_ids=run_ids), runs))


def format_four_way(rows: Sequence[Mapping[str, Any]]) -> str:
    """Markdown: one row per (setting, speculative variant, arm); scores x100."""
    from tabulate import tabulate

    def against(r: Mapping[str, Any]) -> str:  # which ar a losslessness claim is against
        return r.get("lossless_against") or ("- (new model)" if r["arm"] == "quantisation only" else "-")

    body = [[against(r) if k == "lossless_against" else _lb_cell(k, r.get(k)) for k in FOUR_WAY_HEADERS]
            for r in rows]
    note = ("speedup vs baseline: median over paired batches of TPOT(full-precision ar) / TPOT(arm); the quantised "
            "arms are paired across the two runs (same batches, decoded one run after the other), speculation only "
            "within its run. vs own ar: the arm's speedup over the ar of its own target. score x100; "
            "score_delta: mean per-sample score - the baseline's.")
    return tabulate(body, headers=list(FOUR_WAY_HEADERS.values()), tablefmt="github",
                    disable_numparse=True) + "\n\n" + note + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.results.report",
                                description="Per-cell report of stored results (benchmark, task, model, target, "
                                            "context length, batch size, method, k, draft weights).")
    p.add_argument("--db", default=DEFAULT_DB_URL, help=f"database URL (default {DEFAULT_DB_URL})")
    p.add_argument("--json", action="store_true", help="print a JSON list with exactly the report keys")
    p.add_argument("--run", action="append", dest="runs", metavar="RUN_ID",
                   help="only this run (repeatable); default: all runs, pooled")
    p.add_argument("--leaderboard", action="store_true",
                   help="print the Spec-Bench-style leaderboard (Markdown; an ar row per setting, device and "
                        "software versions in the header)")
    p.add_argument("--out", metavar="PREFIX", default=None,
                   help="with --leaderboard: also write PREFIX.md and PREFIX.csv")
    p.add_argument("--four-way", action="store_true",
                   help="the quantisation x speculation table: full-precision ar (baseline), ar on the int8 target, "
                        "each method on each target (needs runs with quantize: [none, int8])")
    p.add_argument("--seed-table", action="store_true",
                   help="the seed's five-row table in kind (cluster.results.seed_table): per target, context and "
                        "batch: ar, draft-model, magicdec-snapkv, eagle3, sparsespec-l (k auto and each fixed k) "
                        "with alpha, mean k, gamma, speedup, the ledger and roofline S and the seed's figures; a "
                        "method that could not run is a row saying why")
    p.add_argument("--engines", action="store_true",
                   help="methods of several engines side by side (a sweep with vllm:ar, vllm:ngram, ...): per cell "
                        "each method's speedup against our ar, its own engine's ar and the faster ar, with alpha, "
                        "accepted length and vllm:ar's token agreement with our ar")
    p.add_argument("--policy", action="store_true",
                   help="the crossover map as a speculation policy: per model and (context, batch) bucket the "
                        "fastest lossless method and k (k=0: off) with its speedup and interval, and vLLM's "
                        "equivalent --speculative-config")
    p.add_argument("--policy-out", metavar="FILE", default=None,
                   help="with --policy: write the policy file (JSON) the Serve policy arm reads")
    p.add_argument("--vllm-out", metavar="FILE", default=None,
                   help="with --policy: write the vLLM fragment(s) (JSON: speculative_config, cli, notes per model)")
    p.add_argument("--min-pairs", type=int, default=None, metavar="N",
                   help="with --policy: paired batches a cell needs to be chosen (default 5, the fewest that get "
                        "an interval; at least that)")
    p.add_argument("--max-num-seqs", type=int, default=256, metavar="N",
                   help="with --policy: where vLLM's last batch-size range ends (its max_num_seqs; default 256)")
    args = p.parse_args(argv)
    if args.out and not args.leaderboard:
        p.error("--out needs --leaderboard")
    if (args.policy_out or args.vllm_out or args.min_pairs is not None) and not args.policy:
        p.error("--policy-out, --vllm-out and --min-pairs need --policy")
    if args.policy and (args.leaderboard or args.four_way):
        p.error("--policy is its own output: leave out --leaderboard / --four-way")
    if args.seed_table and (args.policy or args.leaderboard or args.four_way):
        p.error("--seed-table is its own output: leave out --policy / --leaderboard / --four-way")
    if args.seed_table:
        return _seed_table_main(args)
    if args.engines and (args.policy or args.leaderboard or args.four_way):
        p.error("--engines is its own output: leave out --policy / --leaderboard / --four-way")
    if args.engines:
        return _engines_main(args)
    if args.policy:
        return _policy_main(args, p)
    if args.leaderboard and args.four_way:
        p.error("--leaderboard and --four-way are separate tables: pick one")
    if args.leaderboard:
        return _leaderboard_main(args)
    if args.four_way:
        return _four_way_main(args)
    try:
        rows = report_rows(args.db, args.runs)
    except StoreError as e:
        return cli_error(e)
    if not rows:
        what = f"run(s) {', '.join(args.runs)}" if args.runs else "any run"
        print(f"error: no results for {what} in {safe_url(args.db)}; run a benchmark first "
              f"(e.g. python evals/ruler.py --db ...)", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(format_table(rows))
    return 0


def _policy_main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from pathlib import Path

    from cluster.results.policy import PolicyError, format_policy, policy_from_store, vllm_fragment
    from cluster.results.aggregate import MIN_CI_PAIRS

    min_pairs = MIN_CI_PAIRS if args.min_pairs is None else args.min_pairs
    if min_pairs < MIN_CI_PAIRS:
        parser.error(f"--min-pairs must be >= {MIN_CI_PAIRS} (below it a cell has no interval to decide on)")
    if args.max_num_seqs < 1:
        parser.error("--max-num-seqs must be >= 1")
    try:
        policy = policy_from_store(args.db, min_pairs=min_pairs, run_ids=args.runs)
        frags = {m: vllm_fragment(policy, m, max_num_seqs=args.max_num_seqs) for m in policy.models}
    except StoreError as e:
        return cli_error(e)
    except PolicyError as e:
        print(f"error: {e} ({safe_url(args.db)})", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"policy": policy.model_dump(mode="json"), "vllm": frags}, indent=2))
    else:
        print(format_policy(policy))
        for m, f in frags.items():
            print(f"## vLLM {f['vllm_version']} for {m}\n")
            print(f"    {f['cli'] or '(no --speculative-config)'}\n")
            print("\n".join(f"- {n}" for n in f["notes"]) + "\n")
    for path, text in ((args.policy_out, policy.dumps() if args.policy_out else ""),
                       (args.vllm_out, json.dumps(frags, indent=2) + "\n" if args.vllm_out else "")):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
            print(f"wrote {path}", file=sys.stderr)
    return 0


def _store_rows(db_url: str, run_ids: str | Iterable[str] | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The store's result rows (with their run's fields) and runs, for the given runs (default all)."""
    from cluster.results import aggregate as queries

    with open_store(db_url, create=False) as store:
        wanted = None if run_ids is None else set([run_ids] if isinstance(run_ids, str) else run_ids)
        runs = [r for r in store.runs() if wanted is None or r["run_id"] in wanted]
        return queries.with_run_fields(store.results(run_ids=run_ids), runs), runs


def seed_table_rows(db_url: str, run_ids: str | Iterable[str] | None = None) -> list[dict[str, Any]]:
    """``cluster.results.seed_table.seed_table`` over the store (the given runs, default all)."""
    from cluster.results.seed_table import seed_table

    return seed_table(*_store_rows(db_url, run_ids))


def _table_main(args: argparse.Namespace, rows_of, fmt, example_spec: str) -> int:
    """One of the report's own tables: ``rows_of(db, runs)``, printed by ``fmt`` (or as JSON)."""
    try:
        rows = rows_of(args.db, args.runs)
    except StoreError as e:
        return cli_error(e)
    if not rows:
        print(f"error: no results in {safe_url(args.db)}; run a sweep first (e.g. python -m cluster.sweep "
              f"{example_spec})", file=sys.stderr)
        return 1
    print(json.dumps(rows, indent=2, default=str) if args.json else fmt(rows), end="" if not args.json else "\n")
    return 0


def _seed_table_main(args: argparse.Namespace) -> int:
    from cluster.results.seed_table import format_seed_table

    return _table_main(args, seed_table_rows, format_seed_table, "configs/seed_table_cpu.yaml")


ENGINES_HEADERS = {"model": "model", "quantize": "target", "context_length": "ctx", "batch_size": "batch",
                   "queue_depth": "queue", "engine": "engine", "variant": "method", "n_pairs": "pairs", "tpot_s": "TPOT ms",
                   "speedup": "vs our ar", "speedup_own_ar": "vs own ar", "speedup_fastest_ar": "vs fastest ar",
                   "fastest_ar": "fastest ar", "alpha": "alpha", "tau": "tau", "lossless_rate": "same tokens as ar"}


def format_engines(rows: Sequence[Mapping[str, Any]]) -> str:
    """Markdown table of ``engines_table`` rows (TPOT in ms, ratios to 3 decimals)."""
    from tabulate import tabulate

    def cell(k: str, v: Any) -> Any:
        if v is None:
            return "-"
        if k == "tpot_s":
            return f"{1000.0 * v:.2f}"
        return f"{v:.3f}" if isinstance(v, float) else v

    body = [[cell(k, r.get(k)) for k in ENGINES_HEADERS] for r in rows]
    note = ("speedups: median over paired batches of TPOT_reference / TPOT_method (the same samples in the same "
            "batch); own ar: the method's engine's plain decoding; fastest ar: the engine ar with the least decode "
            "time in the cell; tau: tokens per decode step; same tokens as ar: share of samples whose greedy tokens "
            "equal our ar's (for speculative methods: among samples that drafted)")
    return tabulate(body, headers=list(ENGINES_HEADERS.values()), tablefmt="github", disable_numparse=True) + \
        "\n\n" + note + "\n"


def engines_rows(db_url: str, run_ids: str | Iterable[str] | None = None) -> list[dict[str, Any]]:
    """``cluster.results.aggregate.engines_table`` over the store (the given runs, default all)."""
    from cluster.results import aggregate as queries

    return queries.engines_table(_store_rows(db_url, run_ids)[0])


def _engines_main(args: argparse.Namespace) -> int:
    return _table_main(args, engines_rows, format_engines, "configs/engines_cpu.yaml")


def _four_way_main(args: argparse.Namespace) -> int:
    try:
        rows = four_way_rows(args.db, args.runs)
    except StoreError as e:
        return cli_error(e)
    if not rows:
        print(f"error: no setting in {safe_url(args.db)} has both a full-precision and an int8-target run; run a "
              f"sweep with quantize: [none, int8] (or --quantize none,int8) first", file=sys.stderr)
        return 1
    print(json.dumps(rows, indent=2) if args.json else format_four_way(rows), end="" if not args.json else "\n")
    return 0


def _leaderboard_main(args: argparse.Namespace) -> int:
    from pathlib import Path

    try:
        rows, env = leaderboard_rows(args.db, args.runs)
    except StoreError as e:
        return cli_error(e)
    if not rows:
        print(f"error: no results in {safe_url(args.db)}; run a benchmark first (e.g. make demo)", file=sys.stderr)
        return 1
    md = format_leaderboard_md(rows, env)
    print(md, end="")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        Path(f"{out}.md").write_text(md)
        Path(f"{out}.csv").write_text(format_leaderboard_csv(rows, env))
        print(f"wrote {out}.md and {out}.csv", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

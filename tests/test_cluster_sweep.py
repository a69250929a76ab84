"""Sweeps: spec validation, the planner's keys, batched shards, the report's per-batch pairing,
and (on local Ray) resume, a worker killed mid-shard, a permanently failing shard, Ctrl-C and a
GPU request without GPUs.

The model is a random-weight tiny Llama with SmolLM2's tokenizer (``helpers.tiny_model_like``):
a real local folder, so the real planner, samples, workers and engine run, in milliseconds.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import yaml

from cluster.sweep import run as sweep
from cluster.sweep.coordinator import WorkerStartError, plan_workers, result_rows, shard_summary
from cluster.sweep.plan import plan_shards
from cluster.results.report import batch_speedups, compute_report
from cluster.sweep.schema import SpecError, load_spec, parse_spec
from cluster.results.store import StoreError, open_store
from cluster.sweep.worker import EngineWorker
from helpers import tiny_model_like

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(tiny_model_like(tmp_path_factory.mktemp("m") / "tiny-llama"))


def _spec(tiny, db, **kw):
    data = {
        "name": "t", "models": [tiny], "methods": {"sparsespec-l": {"k": 3}}, "batch_sizes": [2],
        "benchmarks": [{"name": "ruler", "tasks": ["niah_single_1", "niah_single_2"], "num_samples": 4,
                        "context_lengths": [512]}],
        "sampling": {"max_new_tokens": 6}, "workers": {"num_workers": 1, "threads": 1, "max_retries": 1},
        "db": db,
    }
    data.update(kw)
    return parse_spec(data)


# --------------------------------------------------------------------------- spec
@pytest.mark.parametrize("patch, needle", [
    ({"batch_sizes": [1, 1]}, "duplicate batch sizes"),
    ({"batch_sizes": [0]}, "batch sizes must be >= 1"),
    ({"benchmarks": [{"name": "rulr"}]}, "did you mean 'ruler'"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"methods": {"ar": {"k": 2}}}, "'ar' takes no options"),
    ({"sampling": {"temperature": -1}}, "sampling.temperature"),
    ({"context_lengths": [1]}, ">= 2 tokens"),
    ({"device": "tpu"}, "device"),
    ({"workers": {"schedule": "batch"}}, "workers.schedule"),
    ({"benchmarks": [{"name": "ruler", "batch_sizes": [2, 2]}]}, "duplicate batch sizes"),
    ({"queue_depth": 0}, "queue_depth"),
    ({"benchmarks": [{"name": "ruler", "queue_depth": 0}]}, "queue_depth"),
])
def test_spec_rejects_bad_values_with_the_key(tiny, tmp_path, patch, needle):
    with pytest.raises(SpecError, match=needle):
        _spec(tiny, f"sqlite:///{tmp_path}/x.db", **patch)


def test_spec_yaml_errors_name_the_file_and_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("name: x\nmodels: [a\n")
    with pytest.raises(SpecError, match=r"bad.yaml:\d+: not valid YAML"):
        load_spec(p)
    with pytest.raises(SpecError, match="cannot read"):
        load_spec(tmp_path / "missing.yaml")


def test_unknown_method_is_a_spec_error(tiny, tmp_path):
    spec = _spec(tiny, f"sqlite:///{tmp_path}/x.db", methods=["sparsespec-x"])
    with pytest.raises(SpecError, match="did you mean 'sparsespec-l'"):
        sweep.plan(spec)


def test_cli_flags_override_the_spec(tmp_path):
    spec = load_spec(ROOT / "configs" / "demo.yaml", sweep.overrides_from(_args(
        ["x", "--batch-sizes", "1,4", "--num-samples", "2", "--temperature", "0.5", "--threads", "1",
         "--schedule", "run"])))
    assert spec.batch_sizes == (1, 4) and spec.workers.schedule == "run"
    assert all(b.num_samples == 2 for b in spec.benchmarks)
    assert spec.sampling.temperature == 0.5 and spec.workers.threads == 1


def test_methods_flag_selects_methods_and_keeps_their_spec_options():
    # the pair map's draft-model names its draft in the spec; --methods draft-model (a split sweep)
    # used to drop it ("draft-model needs method_options={'draft_model': ...}")
    spec = load_spec(ROOT / "configs" / "pair_map_cpu.yaml", sweep.overrides_from(_args(
        ["x", "--methods", "draft-model"])))
    assert spec.methods == {"ar": {}, "draft-model": {"draft_model": "qwen2.5-coder-0.5b"}}
    seed = load_spec(ROOT / "configs" / "seed_table_cpu.yaml", sweep.overrides_from(_args(
        ["x", "--methods", "sparsespec-l,ngram"])))
    assert set(seed.methods) == {"ar", "sparsespec-l", "ngram"} and seed.methods["ngram"] == {}
    assert [v.get("k") for v in seed.method_variants["sparsespec-l"]] == [4]  # the list's second set


def _args(argv):
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("spec")
    p.add_argument("--dry-run", action="store_true")
    sweep.add_override_flags(p)
    return p.parse_args(argv)


SWEEP_CONFIGS = sorted(p.name for p in (ROOT / "configs").glob("*.yaml") if p.name != "serve.yaml")  # serve: Ray Serve's


def test_every_shipped_sweep_config_is_checked():
    assert {"demo.yaml", "seed_table_cpu.yaml", "pair_map_cpu.yaml", "paper_llama8b.yaml"} <= set(SWEEP_CONFIGS)


@pytest.mark.parametrize("name", SWEEP_CONFIGS)
def test_shipped_configs_validate(name):
    spec = load_spec(ROOT / "configs" / name)
    assert spec.methods and list(spec.methods)[0] == "ar"


# --------------------------------------------------------------------------- planner
def test_planner_keys_are_stable_and_cover_every_sample(tiny, tmp_path, capsys):
    db = f"sqlite:///{tmp_path}/x.db"
    cells, shards = sweep.plan(_spec(tiny, db))
    cells2, shards2 = sweep.plan(_spec(tiny, db))
    assert [s.key for s in shards] == [s.key for s in shards2]
    assert len({s.key for s in shards}) == len(shards) == 4  # 2 tasks x 4 samples / batch 2
    assert [len(s.samples) for s in shards] == [2, 2, 2, 2]
    # every sample exactly once, in order, with all methods (ar first)
    assert [x.sample_id for s in shards for x in s.samples] == [x.sample_id for x in cells[0].samples]
    assert all(s.methods == ("ar", "sparsespec-l") for s in shards)
    # where results go and how work is spread do not change the run id; what decides numbers does
    assert sweep.plan(_spec(tiny, f"sqlite:///{tmp_path}/other.db",
                            workers={"num_workers": 2}))[0][0].run_id == cells[0].run_id
    for patch in ({"batch_sizes": [4]}, {"methods": {"sparsespec-l": {"k": 4}}}, {"dtype": "bfloat16"},
                  {"sampling": {"max_new_tokens": 7}}):
        assert sweep.plan(_spec(tiny, db, **patch))[0][0].run_id != cells[0].run_id
    # batch 3 over 4 samples: a full batch and the remainder
    assert [len(s.samples) for s in plan_shards(sweep.plan(_spec(tiny, db, batch_sizes=[3]))[0][0])] == [3, 1, 3, 1]


def test_cells_of_one_batch_each_do_not_all_run_the_same_method_first(tiny, tmp_path):
    """A batch x context map with one batch per cell: every shard has batch index 0, so the method
    order must rotate with the run too (it used to put ar first in every cell); the batches of one
    cell still rotate one by one."""
    from cluster.sweep.worker import method_order

    db = f"sqlite:///{tmp_path}/x.db"
    bench = [{"name": "speed", "num_samples": 1, "context_lengths": [256, 320, 384, 448, 512, 576, 640, 704]}]
    methods = {"sparsespec-l": {"k": 2}, "magicdec-streaming": {"k": 2}}
    cells = sweep.plan(_spec(tiny, db, benchmarks=bench, batch_sizes=[1], methods=methods))[0]
    shards = [sh for c in cells for sh in plan_shards(c)]
    assert len(shards) == 8 and all(sh.batch_index == 0 for sh in shards)
    firsts = [method_order(sh.methods, sh.rotation)[0] for sh in shards]
    assert len(set(firsts)) >= 2, firsts
    assert {sh.rotation % 2 for sh in shards} == {0, 1}  # vLLM's phase before and after ours
    # one cell of several batches: consecutive batches start one method further on
    (cell,) = sweep.plan(_spec(tiny, db, batch_sizes=[1]))[0][:1]
    rots = [sh.rotation for sh in plan_shards(cell) if sh.task == "niah_single_1"]
    assert rots == list(range(rots[0], rots[0] + 4))
    assert [method_order(("a", "b", "c"), r) for r in (3, 4)] == [["a", "b", "c"], ["b", "c", "a"]]


def test_a_benchmark_may_set_its_own_batch_sizes(tiny, tmp_path):
    db = f"sqlite:///{tmp_path}/x.db"
    base = _spec(tiny, db)
    speed = {"name": "speed", "num_samples": 4, "context_lengths": [256], "batch_sizes": [4]}
    cells, _ = sweep.plan(_spec(tiny, db, benchmarks=[base.benchmarks[0].model_dump(), speed]))
    assert [(c.benchmark, c.batch_size) for c in cells] == [("ruler", 2), ("speed", 4)]
    # a spec without the per-benchmark key plans (and names) its runs as before
    assert sweep.plan(base)[0][0].run_id == cells[0].run_id


def test_a_queue_is_planned_as_one_shard_of_queue_depth_batches(tiny, tmp_path):
    """queue_depth Q: a shard holds Q x batch size samples and a core of batch-size slots; the
    depth is part of the run id only when > 1 (static runs keep their ids); a benchmark's own
    depth and the --queue-depth flag override the sweep's."""
    db = f"sqlite:///{tmp_path}/x.db"
    static = sweep.plan(_spec(tiny, db))[0]
    cells = sweep.plan(_spec(tiny, db, queue_depth=2))[0]
    assert [c.queue_depth for c in cells] == [2] and cells[0].config["queue_depth"] == 2
    assert "queue_depth" not in static[0].config and cells[0].run_id != static[0].run_id
    shards = plan_shards(cells[0])
    # 2 tasks x 4 samples, batch 2, depth 2: one queue of 4 per task, 2 slots each
    assert [(len(s.samples), s.max_num_seqs, s.slots) for s in shards] == [(4, 2, 2)] * 2
    assert [(len(s.samples), s.max_num_seqs, s.slots) for s in plan_shards(static[0])] == [(2, None, 2)] * 4
    bench = [{**_spec(tiny, db).benchmarks[0].model_dump(), "queue_depth": 4}]
    assert sweep.plan(_spec(tiny, db, queue_depth=2, benchmarks=bench))[0][0].queue_depth == 4
    spec = load_spec_with_flags(tmp_path, _spec(tiny, db, benchmarks=bench), ["--queue-depth", "3"])
    assert sweep.plan(spec)[0][0].queue_depth == 3


def load_spec_with_flags(tmp_path, spec, argv):
    path = tmp_path / "q.yaml"
    path.write_text(yaml.safe_dump(spec.resolved()))
    return load_spec(path, sweep.overrides_from(_args([str(path), *argv])))


def test_dry_run_prints_the_keys_and_runs_nothing(tiny, tmp_path, capsys):
    spec_path = tmp_path / "s.yaml"
    spec_path.write_text(yaml.safe_dump(_spec(tiny, f"sqlite:///{tmp_path}/x.db").resolved()))
    assert sweep.main([str(spec_path), "--dry-run"]) == 0
    first = capsys.readouterr().out.split()
    assert sweep.main([str(spec_path), "--dry-run"]) == 0
    assert capsys.readouterr().out.split() == first
    assert first == [s.key for s in sweep.plan(load_spec(spec_path))[1]]
    assert not (tmp_path / "x.db").exists()


def test_context_length_over_the_window_is_a_spec_error(tiny, tmp_path):
    spec = _spec(tiny, f"sqlite:///{tmp_path}/x.db",
                 benchmarks=[{"name": "ruler", "tasks": ["niah_single_1"], "num_samples": 1,
                              "context_lengths": [10**6]}])
    with pytest.raises(SpecError, match="ruler on .* at context length 1000000"):
        sweep.plan(spec)


# --------------------------------------------------------------------------- worker (no Ray)
def test_a_batch_of_four_equals_four_batches_of_one(tiny, tmp_path):
    """Batching must not change a single token: the batch-4 shard against four batch-1 shards."""
    db = f"sqlite:///{tmp_path}/x.db"
    spec4 = _spec(tiny, db, batch_sizes=[4], benchmarks=[
        {"name": "ruler", "tasks": ["niah_single_1"], "num_samples": 4, "context_lengths": [512]}])
    cell4 = sweep.plan(spec4)[0][0]
    cell1 = sweep.plan(_spec(tiny, db, batch_sizes=[1], benchmarks=spec4.resolved()["benchmarks"]))[0][0]
    w = EngineWorker(tiny, "float32", "cpu", threads=1)
    (b4,) = plan_shards(cell4)
    out4 = w.run_shard(b4)["rows"]
    out1 = [r for sh in plan_shards(cell1) for r in w.run_shard(sh)["rows"]]
    tok = lambda rows: {(r["sample_id"], r["method"]): r["token_ids"] for r in rows}  # noqa: E731
    assert tok(out4) == tok(out1)
    assert len(out4) == 8 and all(r["stats"]["batch_size"] == 4 for r in out4)
    assert sum(r["stats"]["num_drafted"] for r in out4 if r["method"] == "sparsespec-l") > 0
    # every row of a method shares the batch's wall time; rows are the batch's rows 0..3
    for m in ("ar", "sparsespec-l"):
        rs = [r for r in out4 if r["method"] == m]
        assert len({r["stats"]["batch_wall_s"] for r in rs}) == 1
        assert sorted(r["stats"]["batch_row"] for r in rs) == [0, 1, 2, 3]
    rows = result_rows(b4, out4, lambda s, p: 0.5)
    assert all(r["lossless"] is True for r in rows if r["method"] != "ar")


def test_a_queue_refills_its_slots_and_decodes_the_tokens_of_batches_of_one(tiny, tmp_path):
    """queue_depth 2 at batch 2: four samples through a core of two slots. Every row's tokens
    equal its batch-of-one tokens; the core never holds more than two rows; a row admitted as
    another finished starts decoding before the queue's first rows are all done (a refill, not
    two static batches in turn); rows record the slots, the queue and the core's decode rounds,
    whose straggle (rows' rounds over slot-rounds) follows from them."""
    from cluster.sweep.worker import default_engine_factory
    from sparsespec.stats import batch_straggle

    held: list[tuple[str, ...]] = []  # the request ids each ar step decoded

    class Core:
        def __init__(self, core):
            self._core = core

        def step(self):
            out = self._core.step()
            if self._core.method == "ar":
                held.append(tuple(sorted(r.request_id for r in self._core.running)))
            return out

        def __getattr__(self, name):
            return getattr(self._core, name)

    class Eng:
        def __init__(self, engine):
            self._engine = engine

        def core(self, *a, **kw):
            return Core(self._engine.core(*a, **kw))

        def __getattr__(self, name):
            return getattr(self._engine, name)

    db = f"sqlite:///{tmp_path}/x.db"
    bench = [{"name": "ruler", "tasks": ["niah_single_1"], "num_samples": 4, "context_lengths": [512]}]
    (queue,) = plan_shards(sweep.plan(_spec(tiny, db, queue_depth=2, benchmarks=bench))[0][0])
    ones = plan_shards(sweep.plan(_spec(tiny, db, batch_sizes=[1], benchmarks=bench))[0][0])
    # the first sample stops after 2 tokens, the others after 6: its slot frees first
    short = dataclasses.replace(queue.samples[0], max_new_tokens=2)
    queue = dataclasses.replace(queue, samples=(short, *queue.samples[1:]))
    ones[0] = dataclasses.replace(ones[0], samples=(short,))
    w = EngineWorker(tiny, "float32", "cpu", threads=1,
                     engine_factory=lambda m, d, dev: Eng(default_engine_factory(m, d, dev)))
    w.warm_up(queue, "ar"), w.warm_up(queue, "sparsespec-l")
    held.clear()
    out = w.run_shard(queue)["rows"]
    assert held and max(len(h) for h in held) == 2
    # sample 2 took the first sample's slot while sample 1 was still decoding
    assert ("1", "2") in held
    out1 = [r for sh in ones for r in w.run_shard(sh)["rows"]]
    tok = lambda rows: {(r["sample_id"], r["method"]): r["token_ids"] for r in rows}  # noqa: E731
    assert tok(out) == tok(out1) and len(out) == 8
    assert sum(r["stats"]["num_drafted"] for r in out if r["method"] == "sparsespec-l") > 0
    for m in ("ar", "sparsespec-l"):
        st = [r["stats"] for r in out if r["method"] == m]
        assert {(s["batch_size"], s["queue_size"]) for s in st} == {(2, 4)}
        rounds, steps = st[0]["batch_rounds"], [s["num_steps"] for s in st]
        assert len({s["batch_rounds"] for s in st}) == 1
        # two slots: at least half the rows' rounds, fewer than the rows' rounds one after another
        assert sum(steps) / 2 <= rounds < sum(steps)
        assert batch_straggle(st) == pytest.approx(sum(steps) / (2 * rounds))
        if m == "ar":  # 1 and 5 rounds in two slots: sample 2 runs in rounds 2-6, sample 3 in 6-10
            assert (steps, rounds) == ([1, 5, 5, 5], 10)
    assert "B=2 queue 4:" in shard_summary(queue, result_rows(queue, out, lambda s, p: 0.5))


def test_vllm_methods_skip_a_queue_without_being_marked_unavailable(tiny, tmp_path):
    """vLLM's engines decode static batches: a queue shard leaves its vllm: methods out with the
    reason, for that shard only (the worker does not remember them as unavailable)."""
    db = f"sqlite:///{tmp_path}/x.db"
    bench = [{"name": "ruler", "tasks": ["niah_single_1"], "num_samples": 2, "context_lengths": [512]}]
    spec = _spec(tiny, db, batch_sizes=[1], queue_depth=2, benchmarks=bench,
                 methods={"vllm:ar": {}}, sampling={"max_new_tokens": 3})
    (shard,) = plan_shards(sweep.plan(spec)[0][0])
    w = EngineWorker(tiny, "float32", "cpu", threads=1)
    res = w.run_shard(shard)
    assert {r["method"] for r in res["rows"]} == {"ar"}
    assert "static batches" in res["unavailable"]["vllm:ar"] and "vllm:ar" not in w._unavailable


def test_result_rows_flags_a_divergent_method_and_missing_rows(tiny, tmp_path):
    cell = sweep.plan(_spec(tiny, f"sqlite:///{tmp_path}/x.db"))[0][0]
    shard = plan_shards(cell)[0]
    outs = []
    for s in shard.samples:
        for m in shard.methods:
            toks = [5, 6, 7] if (m == "ar" or s is not shard.samples[1]) else [5, 9, 7]
            outs.append({"sample_id": s.sample_id, "task": s.task, "method": m, "token_ids": toks, "text": "x",
                         "stats": {"num_drafted": 3}})
    rows = result_rows(shard, outs, lambda s, p: 1.0)
    verdict = {(r["sample_id"], r["method"]): (r["lossless"], r["first_divergence"]) for r in rows}
    assert verdict[(shard.samples[0].sample_id, "sparsespec-l")] == (True, None)
    assert verdict[(shard.samples[1].sample_id, "sparsespec-l")] == (False, 1)
    with pytest.raises(ValueError, match="expected 4"):
        result_rows(shard, outs[:-1], lambda s, p: 1.0)


# --------------------------------------------------------------------------- report: pairing per batch
def _row(run, batch, sample, method, n_out, wall, prefill):
    return {"run_id": run, "benchmark": "b", "task": "t", "model": "m", "method": method, "sample_id": sample,
            "score": 1.0, "lossless": None if method == "ar" else True, "context_length": 512, "batch_size": 2,
            "stats": {"batch_key": batch, "num_output_tokens": n_out, "batch_wall_s": wall,
                      "batch_prefill_s": prefill, "decode_s": 99.0}}


def test_speedup_is_paired_per_batch_from_batch_wall_time():
    rows = [
        # batch A: ar decodes 2*(11-1)=20 tokens in 3.0-1.0=2.0 s; the method in 1.5-1.0=0.5 s -> 4x
        _row("r", "A", "s0", "ar", 11, 3.0, 1.0), _row("r", "A", "s1", "ar", 11, 3.0, 1.0),
        _row("r", "A", "s0", "x", 11, 1.5, 1.0), _row("r", "A", "s1", "x", 11, 1.5, 1.0),
        # batch B: 2x; batch C: 1x  -> median 2x
        _row("r", "B", "s2", "ar", 6, 2.0, 0.0), _row("r", "B", "s3", "ar", 6, 2.0, 0.0),
        _row("r", "B", "s2", "x", 6, 1.0, 0.0), _row("r", "B", "s3", "x", 6, 1.0, 0.0),
        _row("r", "C", "s4", "ar", 6, 1.0, 0.0), _row("r", "C", "s4", "x", 6, 1.0, 0.0),
        # a batch of the method without its ar batch is not paired
        _row("r", "D", "s5", "x", 6, 0.1, 0.0),
    ]
    xs = [r for r in rows if r["method"] == "x"]
    assert sorted(batch_speedups(xs, [r for r in rows if r["method"] == "ar"])) == pytest.approx([1.0, 2.0, 4.0])
    rep = {r["method"]: r for r in compute_report(rows)}
    assert rep["x"]["speedup"] == pytest.approx(2.0)
    assert rep["x"]["batch_size"] == 2 and rep["x"]["context_length"] == 512 and rep["x"]["n"] == 6


# --------------------------------------------------------------------------- workers plan
def test_gpu_request_without_gpus_fails_at_once():
    with pytest.raises(WorkerStartError, match="no GPUs"):
        plan_workers(None, None, "cuda", resources={"CPU": 2}, node_cpus=[2])
    p = plan_workers(None, None, "auto", resources={"CPU": 16, "GPU": 4}, node_cpus=[16])
    assert (p.num_workers, p.num_gpus, p.device, p.num_cpus) == (4, 1, "cuda", 4)
    p = plan_workers(2, None, "auto", resources={"CPU": 2}, node_cpus=[2])
    assert (p.num_workers, p.num_gpus, p.device, p.threads) == (2, 0, "cpu", 1)
    with pytest.raises(WorkerStartError, match="only 2 CPU"):
        plan_workers(3, None, "cpu", resources={"CPU": 2}, node_cpus=[2])


# --------------------------------------------------------------------------- on local Ray
def _counts(db):
    with open_store(db, create=False) as st:
        res = st.results()
        keys = [(r["run_id"], r["task"], r["sample_id"], r["method"]) for r in res]
        return len(res), len(set(keys)), st.shards()


@pytest.mark.slow
def test_sweep_runs_then_resumes_without_writing_twice(ray_session, tiny, tmp_path):
    db = f"sqlite:///{tmp_path}/r.db"
    spec = _spec(tiny, db)
    res = sweep.run_sweep(spec, progress=False)
    assert len(res.done) == 4 and not res.failed and not res.skipped
    n, unique, shards = _counts(db)
    assert n == unique == 2 * 4 * 2  # tasks x samples x methods
    assert {s["status"] for s in shards} == {"done"} and all(s["attempts"] == 1 for s in shards)
    with open_store(db, create=False) as st:
        run = st.get_run(res.run_ids[0])
    assert run["status"] == "finished"
    prov = run["host"]["provenance"]
    assert prov["git"]["commit"] and prov["packages"]["torch"] and prov["sweep"]["spec"]["batch_sizes"] == [2]
    assert run["host"]["workers"][0]["torch_threads"] == 1
    # the session the coordinator ran in travels with WorkersReady into the same provenance
    assert prov["worker_plan"]["num_workers"] == len(run["host"]["workers"]) == run["host"]["devices"]["num_workers"]
    assert prov["worker_plan"]["threads"] == 1 and prov["ray"]["resources"]["CPU"] > 0
    again = sweep.run_sweep(spec, progress=False)
    assert not again.done and len(again.skipped) == 4
    assert _counts(db)[:2] == (n, n)
    rep = compute_report(open_store(db, create=False).results())
    spec_row = next(r for r in rep if r["method"] == "sparsespec-l")
    assert spec_row["lossless_rate"] == 1.0 and spec_row["speedup"] is not None and spec_row["batch_size"] == 2


def _killer(db, killed, delay_s=0.4):
    """Kill (SIGKILL) the worker of the first shard seen running for ``delay_s``, once."""
    deadline = time.time() + 120
    while time.time() < deadline and not killed:
        try:
            with open_store(db, create=False) as st:
                running = [s for s in st.shards() if s["status"] == "running"]
        except Exception:  # noqa: BLE001 - the file may not exist yet
            running = []
        for s in running:
            pid = (s["worker"] or {}).get("pid")
            if pid and s["attempts"] == 1:
                time.sleep(delay_s)
                os.kill(pid, signal.SIGKILL)
                killed.append((s["key"], pid))
                return
        time.sleep(0.05)


@pytest.mark.slow
def test_a_worker_killed_mid_shard_is_retried_and_nothing_is_lost_or_duplicated(ray_session, tiny, tmp_path):
    from cluster.sweep.testing import slow_engine_factory

    db = f"sqlite:///{tmp_path}/k.db"
    spec = _spec(tiny, db, workers={"num_workers": 2, "threads": 1, "max_retries": 2})
    killed: list = []
    t = threading.Thread(target=_killer, args=(db, killed), daemon=True)
    t.start()
    res = sweep.run_sweep(spec, progress=False,
                          engine_factory=functools.partial(slow_engine_factory, step_sleep_s=0.05))
    t.join(5)
    assert killed, "the test never saw a running shard to kill"
    assert res.worker_deaths == 1 and not res.failed and len(res.done) == 4
    n, unique, shards = _counts(db)
    assert n == unique == 16
    by_key = {s["key"]: s for s in shards}
    assert by_key[killed[0][0]]["attempts"] == 2 and by_key[killed[0][0]]["status"] == "done"
    assert by_key[killed[0][0]]["worker"]["pid"] != killed[0][1]
    with open_store(db, create=False) as st:
        assert any("worker died" in e["message"] for e in st.get_run(res.run_ids[0])["events"])


@pytest.mark.slow
def test_a_shard_that_keeps_failing_is_recorded_and_the_rest_complete(ray_session, tiny, tmp_path):
    from cluster.sweep.testing import failing_engine_factory

    db = f"sqlite:///{tmp_path}/f.db"
    spec = _spec(tiny, db)
    shards = sweep.plan(spec)[1]
    tokens = [set(t for x in s.samples for t in x.prompt_ids) for s in shards]
    others = set().union(*tokens[1:])
    poison = min(tokens[0] - others)  # a token only the first shard's prompts hold
    res = sweep.run_sweep(spec, progress=False,
                          engine_factory=functools.partial(failing_engine_factory, poison_token=poison))
    assert list(res.failed) == [shards[0].key] and len(res.done) == 3
    assert "injected failure" in res.failed[shards[0].key]
    n, unique, rows = _counts(db)
    assert n == unique == 12
    bad = next(s for s in rows if s["key"] == shards[0].key)
    assert bad["status"] == "failed" and bad["attempts"] == 2 and "injected failure" in bad["error"]
    with open_store(db, create=False) as st:
        assert st.get_run(res.run_ids[0])["status"] == "failed"


@pytest.mark.slow
def test_ctrl_c_leaves_the_store_consistent_and_resumable(ray_session, tiny, tmp_path, monkeypatch):
    db = f"sqlite:///{tmp_path}/c.db"
    spec = _spec(tiny, db)

    class Bar:
        def __init__(self, *a, **k):
            self.n = 0

        def update(self, n):
            self.n += n
            raise KeyboardInterrupt  # Ctrl-C right after the first shard is stored

        def set_postfix_str(self, *a, **k): ...
        def write(self, *a, **k): ...
        def close(self): ...

    from cluster.sweep import coordinator

    monkeypatch.setattr(coordinator, "_bar", lambda *a, **k: Bar())
    with pytest.raises(KeyboardInterrupt):
        sweep.run_sweep(spec, progress=False)
    n, unique, shards = _counts(db)
    assert n == unique == 4  # exactly the one stored shard: 2 samples x 2 methods
    assert sorted(s["status"] for s in shards) in (["done", "pending"], ["done"])
    with open_store(db, create=False) as st:
        assert {r["status"] for r in st.runs()} == {"interrupted"}
    monkeypatch.undo()
    res = sweep.run_sweep(spec, progress=False)
    assert len(res.skipped) == 1 and len(res.done) == 3
    assert _counts(db)[:2] == (16, 16)


@pytest.mark.slow
def test_cuda_sweep_on_a_cluster_without_gpus_fails_fast(ray_session, tiny, tmp_path):
    t0 = time.perf_counter()
    with pytest.raises(WorkerStartError, match="no GPUs"):
        sweep.run_sweep(_spec(tiny, f"sqlite:///{tmp_path}/g.db", device="cuda"), progress=False)
    assert time.perf_counter() - t0 < 60


@pytest.mark.slow
def test_a_model_whose_weights_do_not_load_is_a_clear_start_error(ray_session, tiny, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(WorkerStartError, match="failed to start"):
        sweep.run_sweep(_spec(str(broken), f"sqlite:///{tmp_path}/b.db"), progress=False)


def test_step_schedule_interleaves_the_methods_and_times_each_core_alone(tiny, tmp_path):
    """schedule="step": the methods' cores take turns (the order rotating every round), the
    tokens equal those of schedule="run", and each method's ``batch_wall_s`` and per-row times
    count only its own steps: a method whose steps are slow does not slow the others' numbers."""
    from cluster.sweep.worker import default_engine_factory

    log: list[str] = []
    inside: dict[str, float] = {}  # seconds inside each method's core.step calls
    sleep = 0.05

    class Core:
        def __init__(self, core, method):
            self._core, self._method = core, method

        def step(self):
            log.append(self._method)
            if self._method == "sparsespec-l":
                time.sleep(sleep)
            t0 = time.perf_counter()
            try:
                return self._core.step()
            finally:
                inside[self._method] = inside.get(self._method, 0.0) + time.perf_counter() - t0

        def __getattr__(self, name):
            return getattr(self._core, name)

    class Eng:
        def __init__(self, engine):
            self._engine = engine

        def core(self, method, *a, **kw):
            return Core(self._engine.core(method, *a, **kw), method)

        def __getattr__(self, name):
            return getattr(self._engine, name)

    factory = lambda m, d, dev: Eng(default_engine_factory(m, d, dev))  # noqa: E731
    bench = [{"name": "ruler", "tasks": ["niah_single_1"], "num_samples": 2, "context_lengths": [512]}]
    (shard,) = plan_shards(sweep.plan(_spec(tiny, f"sqlite:///{tmp_path}/x.db", benchmarks=bench,
                                            sampling={"max_new_tokens": 16}))[0][0])
    rows = {}
    for schedule in ("run", "step"):
        w = EngineWorker(tiny, "float32", "cpu", threads=1, engine_factory=factory, schedule=schedule)
        w.warm_up(shard, "ar"), w.warm_up(shard, "sparsespec-l")
        log.clear(), inside.clear()
        rows[schedule] = w.run_shard(shard)["rows"]
        if schedule == "step":
            n = min(log.count("ar"), log.count("sparsespec-l"))
            pairs = [tuple(log[2 * i: 2 * i + 2]) for i in range(n)]
            assert set(pairs[0]) == {"ar", "sparsespec-l"} and all(set(p) == set(pairs[0]) for p in pairs)
            assert pairs[0] != pairs[1]  # the order rotates
    tok = lambda rs: {(r["sample_id"], r["method"]): r["token_ids"] for r in rs}  # noqa: E731
    assert tok(rows["step"]) == tok(rows["run"])
    for schedule, rs in rows.items():
        assert {r["stats"]["schedule"] for r in rs} == {schedule}
    step = {m: [r["stats"] for r in rows["step"] if r["method"] == m] for m in ("ar", "sparsespec-l")}
    spec_steps = sum(1 for m in log if m == "sparsespec-l")
    assert sum(s["num_drafted"] for s in step["sparsespec-l"]) > 0
    assert step["sparsespec-l"][0]["batch_wall_s"] >= spec_steps * sleep
    # ar stepped between the sleeping core's steps, but its times leave them out: its batch wall
    # time and every row's total are within its own steps' time
    assert inside["ar"] <= step["ar"][0]["batch_wall_s"] <= inside["ar"] + 0.02
    assert max(s["total_s"] for s in step["ar"]) <= inside["ar"] + 1e-3
    assert spec_steps >= 3 and (spec_steps - 1) * sleep > 0.1


def test_sampled_outputs_do_not_depend_on_the_batching(tiny, tmp_path):
    """Each sample's sampling stream comes from (seed, its index in the task), not its row in a
    batch: ar's sampled tokens of a batch of 2 equal those of batches of 1. (Speculative methods
    sample from the same distribution but may consume their stream differently: the controller's
    draft lengths depend on the batch's measured step costs.)"""
    db = f"sqlite:///{tmp_path}/x.db"
    bench = [{"name": "ruler", "tasks": ["niah_single_1"], "num_samples": 4, "context_lengths": [512]}]
    kw = dict(benchmarks=bench, methods=["ar"], sampling={"temperature": 1.0, "seed": 3, "max_new_tokens": 6})
    w = EngineWorker(tiny, "float32", "cpu")
    tok = lambda rows: {(r["sample_id"], r["method"]): r["token_ids"] for r in rows}  # noqa: E731
    runs = [tok([r for sh in plan_shards(sweep.plan(_spec(tiny, db, batch_sizes=[B], **kw))[0][0])
                 for r in w.run_shard(sh)["rows"]]) for B in (2, 1)]
    assert runs[0] == runs[1]
    assert len({tuple(v) for (s, m), v in runs[0].items() if m == "ar"}) > 1  # rows got different streams


def test_worker_provenance_carries_the_kernel_plan():
    from cluster.sweep.worker import EngineWorker, summarize_workers
    from sparsespec.engine import Engine
    from sparsespec.shapes import IdTokenizer, random_transformer

    w = EngineWorker("tiny", engine_factory=lambda m, d, dev: Engine(random_transformer("tiny"), IdTokenizer()))
    ping = w.ping()
    assert ping["kernels"]["cpu"] and "linear" in ping["kernels"] and ping["kernels_summary"].startswith("linear ")
    summary = summarize_workers([ping, dict(ping, hostname="other")])
    assert summary["kernels"] == [ping["kernels_summary"]] and len(summary["cpus"]) == 1


def test_ray_session_starts_its_own_ray_unless_an_address_is_given(monkeypatch):
    """No address: a fresh local Ray (``address="local"``), never an implicit join of another
    cluster on the machine (that hung on a cluster whose GCS had gone); an address (flag or
    RAY_ADDRESS) is joined as given."""
    import ray

    from cluster.sweep.coordinator import ray_session

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with ray_session(num_cpus=2):
        pass
    assert calls[-1]["address"] == "local" and calls[-1]["num_cpus"] == 2
    assert calls[-1]["_node_ip_address"] == "127.0.0.1"
    with ray_session("ray://10.0.0.1:10001"):
        pass
    assert calls[-1]["address"] == "ray://10.0.0.1:10001"
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    with ray_session():
        pass
    assert calls[-1]["address"] == "auto"


def test_an_unknown_schedule_is_refused_before_the_model_loads():
    def never(*a):
        raise AssertionError("the model must not load")

    with pytest.raises(ValueError, match=r"schedule must be one of \['step', 'run'\], got 'batch'"):
        EngineWorker("tiny", engine_factory=never, schedule="batch")


def test_the_recorder_stores_each_event_and_refuses_anything_else(tmp_path):
    """``cluster.results.store.SweepRecorder`` against a real store: runs started, a shard
    started / done / failed, the workers' session merged into every matching run's provenance,
    an unknown event a TypeError; ``finish_all`` raises a store error, ``finish`` logs it."""
    from types import SimpleNamespace

    from cluster.results.events import ShardDone, ShardFailed, ShardStarted, WorkersReady
    from cluster.results.store import SweepRecorder

    cells = [SimpleNamespace(run_id=f"r{i}", benchmark="ruler", model=m, quantize="none", context_length=1024,
                             batch_size=1, repetition=0, config={"methods": ["ar"]}) for i, m in enumerate("ab")]
    st = open_store(f"sqlite:///{tmp_path}/rec.db")
    rec = SweepRecorder(st, cells, {"sweep": {"name": "x"}})
    assert rec.start_runs() == set()
    shard = SimpleNamespace(run_id="r0", key="r0/t/0", task="t", samples=[SimpleNamespace(sample_id="s0")])
    rec.record(WorkersReady("a", "none", [{"pid": 1}], {"num_workers": 1}, {"worker_plan": {"num_workers": 1}}))
    rec.record(ShardStarted(shard, {"pid": 1, "slot": 0}))
    assert [s["status"] for s in st.shards("r0")] == ["running"]
    rec.record(ShardFailed(shard, "boom", final=False, note="shard failed: boom"))
    rec.record(ShardDone(shard, [], 0.5, {"pid": 1}, {"eagle3": "no head"}))
    assert st.done_shards("r0") == {"r0/t/0"}
    runs = {r["run_id"]: r for r in st.runs()}
    assert runs["r0"]["host"] == {"provenance": {"sweep": {"name": "x"}, "worker_plan": {"num_workers": 1}},
                                  "workers": [{"pid": 1}], "devices": {"num_workers": 1}}
    assert runs["r1"]["host"] == {"provenance": {"sweep": {"name": "x"}}}  # model b's workers never came
    events = [e["message"] for e in st.get_run("r0")["events"]]
    assert "shard failed: boom" in events and "method unavailable: eagle3: no head" in events
    with pytest.raises(TypeError, match="not a shard event"):
        rec.record(object())
    rec.finish({"r0": "finished"})
    assert st.get_run("r0")["status"] == "finished"
    st.close()

    def down(*a, **k):
        raise StoreError("database is down")

    broken = SweepRecorder(SimpleNamespace(release_running=down, finish_run=down), cells)
    broken.finish({"r1": "failed"})  # logged, not raised (the caller may be unwinding another error)
    with pytest.raises(StoreError, match="down"):
        broken.finish_all("finished")

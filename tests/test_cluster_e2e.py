"""End to end with the real engine: ``evals/ruler.py`` (a one-benchmark sweep) on SmolLM2-135M
through local Ray into a temp SQLite store, then the report it prints.

Deliberately no importorskip: a missing or broken engine or model must fail this test loudly.
"""
import pytest

from cluster.results.report import REPORT_KEYS, report_rows
from cluster.results.store import open_store


@pytest.mark.slow
def test_ruler_script_on_the_real_model(ray_session, tmp_path, capsys):
    from evals.ruler import main

    db = f"sqlite:///{tmp_path}/e2e.db"
    argv = ["--model", "smollm2-135m", "--methods", "sparsespec-l", "--k", "4", "--tasks", "niah_single_1",
            "--num-samples", "2", "--batch-size", "2", "--context-length", "512", "--max-new-tokens", "12",
            "--threads", "2", "--no-progress", "--db", db]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "sweep ruler: 1 shard(s) run" in out and "sparsespec-l" in out

    with open_store(db, create=False) as st:
        (run,) = st.runs()
        rows = st.results(run["run_id"])
    assert run["status"] == "finished" and run["config"]["batch_size"] == 2
    assert run["config"]["method_options"]["sparsespec-l"]["k"] == 4
    assert {(r["sample_id"], r["method"]) for r in rows} == {(s, m) for s in {r["sample_id"] for r in rows}
                                                              for m in ("ar", "sparsespec-l")}
    for r in rows:
        assert 1 <= len(r["token_ids"]) <= 12 and r["stats"]["num_output_tokens"] == len(r["token_ids"])
        assert r["stats"]["batch_size"] == 2 and r["stats"]["batch_wall_s"] > r["stats"]["batch_prefill_s"] > 0
        assert r["num_input_tokens"] + 12 <= 512
    spec_rows = [r for r in rows if r["method"] == "sparsespec-l"]
    assert sum(r["stats"]["num_drafted"] for r in spec_rows) > 0
    assert all(r["lossless"] is True for r in spec_rows), [(r["first_divergence"]) for r in spec_rows]

    rep = report_rows(db, [run["run_id"]])
    assert [r["method"] for r in rep] == ["ar", "sparsespec-l"]
    assert all(tuple(r) == REPORT_KEYS and r["n"] == 2 and r["batch_size"] == 2 for r in rep)
    assert rep[1]["lossless_rate"] == 1.0 and rep[1]["speedup"] > 0

    # the same command again resumes: nothing runs, nothing is written twice
    assert main(argv) == 0
    assert "0 shard(s) run, 1 already stored" in capsys.readouterr().out
    with open_store(db, create=False) as st:
        assert len(st.results()) == len(rows)

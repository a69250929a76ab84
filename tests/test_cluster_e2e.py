"""End to end with the real engine: one tiny job through local Ray into a temp SQLite store.

Needs the real ``sparsespec`` (Engine, load_tokenizer) and the offline SmolLM2-135M checkpoint.
Deliberately no importorskip: a missing or broken engine must fail this test loudly.
Run with ``pytest -m slow tests/test_cluster_e2e.py``.
"""
import pytest

from cluster.coordinator import run_benchmark
from cluster.report import REPORT_KEYS, report_rows
from cluster.store import open_store
from evals.base import Sample


def _nonempty(sample, prediction):
    return 1.0 if prediction.strip() else 0.0


@pytest.mark.slow
def test_tiny_real_job(ray_session, tmp_path):
    import sparsespec  # inside the test: a missing engine fails here, not at collection

    tok = sparsespec.load_tokenizer("smollm2-135m")
    ids = tuple(int(t) for t in tok("The capital of France is Paris. The capital of Italy is")["input_ids"])
    sample = Sample(benchmark="smoke", task="capitals", sample_id="0", prompt_ids=ids, references=("Rome",),
                    max_new_tokens=8, num_input_tokens_raw=len(ids), num_input_tokens=len(ids))
    db = f"sqlite:///{tmp_path}/e2e.db"
    run_id = run_benchmark(benchmark="smoke", samples=[sample], scorer=_nonempty, model="smollm2-135m",
                           methods=["sparsespec-l"], db_url=db, config={"test": "e2e"}, dtype="float32",
                           method_options={"sparsespec-l": {"k": 4}}, temperature=0.0, progress=False)

    with open_store(db) as st:
        rows = {r["method"]: r for r in st.results(run_id)}
        run = st.get_run(run_id)
    assert run["status"] == "finished"
    assert set(rows) == {"ar", "sparsespec-l"}
    for r in rows.values():
        assert 1 <= len(r["token_ids"]) <= 8
        assert r["stats"]["num_output_tokens"] == len(r["token_ids"])
        assert r["stats"]["decode_s"] > 0 and r["stats"]["prefill_s"] > 0
        assert r["num_input_tokens"] == len(ids)
    sp = rows["sparsespec-l"]
    assert sp["stats"]["num_drafted"] > 0, sp["stats"]
    assert sp["lossless"] is True, (
        f"greedy SparseSpec-L diverged from AR at token {sp['first_divergence']}: "
        f"ar={rows['ar']['token_ids']} spec={sp['token_ids']}")

    rep = report_rows(db, [run_id])
    assert [r["method"] for r in rep] == ["ar", "sparsespec-l"]
    assert all(tuple(r) == REPORT_KEYS and r["n"] == 1 for r in rep)
    ar, spec = rep
    assert ar["speedup"] == 1.0 and ar["tau"] == 1.0 and ar["alpha"] is None
    assert spec["lossless_rate"] == 1.0
    assert 0.0 <= spec["alpha"] <= 1.0 and spec["tau"] >= 1.0 and spec["mean_k"] > 0
    assert spec["speedup"] is None or spec["speedup"] > 0
    assert spec["score"] in (0.0, 1.0)

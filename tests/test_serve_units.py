"""The Serve app's pure parts, without Ray: the args, the weighted sticky split, vLLM's
per-request speculation fields, and an arm's engine thread driven in-process (continuous
batching shares steps, an abandoned request frees its slot, outputs equal a fresh AR decode)."""
import asyncio
import random
from collections import Counter

import pytest

from cluster.serve import ArmServer, parse_args, pick_arm, session_point
from sparsespec.stats import spec_decode_metrics


# ---------------------------------------------------------------- args
def test_args_defaults_and_json_strings():
    a = parse_args({})
    assert a.model == "smollm2-135m" and [x.name for x in a.arms] == ["ar", "sparsespec-l"]
    b = parse_args({"max_num_seqs": "8", "arms": '[{"method": "ngram", "weight": 2}]'})  # `serve run k=v` strings
    assert b.max_num_seqs == 8 and b.arms[0].name == "ngram" and b.arms[0].weight == 2
    c = parse_args({"arms": {"fast": {"method": "sparsespec-l", "options": {"k": 2}}, "base": {"method": "ar"}}})
    assert [x.name for x in c.arms] == ["fast", "base"] and c.arm("fast").options == {"k": 2}


@pytest.mark.parametrize("args, needle", [
    ({"arms": [{"method": "nosuch"}]}, "nosuch"),
    ({"arms": [{"method": "sparsespec-l", "options": {"k": -3}}]}, "arms.0"),
    ({"arms": [{"method": "ar"}, {"method": "ar"}]}, "duplicate arm names"),
    ({"arms": [{"method": "ar", "weight": 0}]}, "weights sum to 0"),
    ({"arms": [{"method": "ar", "weight": -1}]}, "arms.0.weight"),
    ({"arms": [{"method": "ar", "name": "a:b"}]}, "without ':'"),
    ({"arms": []}, "at least one arm"),
    ({"bogus": 1}, "bogus"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"device": "tpu"}, "device"),
])
def test_bad_args_name_the_field(args, needle):
    with pytest.raises(ValueError, match="invalid serve args") as e:
        parse_args(args)
    assert needle in str(e.value)


# ---------------------------------------------------------------- the split
def test_weighted_split_over_many_sessions_is_within_tolerance():
    weights = [("ar", 0.7), ("sparsespec-l", 0.2), ("ngram", 0.1)]
    n = 20000
    counts = Counter(pick_arm(weights, f"session-{i}") for i in range(n))
    for name, w in weights:  # binomial sd at n=20000 is <= 0.0033: 0.015 is > 4 sd
        assert abs(counts[name] / n - w) < 0.015, (name, counts)


def test_relative_weights_and_zero_weight_arms():
    counts = Counter(pick_arm([("a", 3.0), ("off", 0.0), ("b", 1.0)], f"u{i}") for i in range(8000))
    assert counts["off"] == 0
    assert abs(counts["a"] / 8000 - 0.75) < 0.03


def test_sessions_are_sticky_and_stable_across_processes():
    weights = [("ar", 0.5), ("sparsespec-l", 0.5)]
    for s in ("alice", "bob", "", "x" * 300, "ünïcode"):
        first = pick_arm(weights, s or None, random.Random(0)) if s else None
        if s:
            assert all(pick_arm(weights, s) == first for _ in range(5))
    # SHA-256 based: a fixed value, not Python's per-process salted hash
    assert session_point("alice") == pytest.approx(int("2bd806c97f0e00af", 16) / 2**64)


def test_no_session_splits_at_random_by_weight():
    rng = random.Random(1)
    counts = Counter(pick_arm([("a", 0.25), ("b", 0.75)], None, rng) for _ in range(8000))
    assert abs(counts["a"] / 8000 - 0.25) < 0.03


# ---------------------------------------------------------------- speculation fields
def test_spec_decode_metrics_by_hand():
    st = {"num_drafted": 10, "num_accepted": 6, "num_drafting_steps": 3,
          "accept_hist": {"0:0": 2, "4:1": 1, "3:3": 1, "3:2": 1}}
    m = spec_decode_metrics(st)
    assert m["num_spec_steps"] == 3 and m["num_draft_tokens"] == 10 and m["num_accepted_draft_tokens"] == 6
    assert m["draft_acceptance_rate"] == pytest.approx(0.6)
    assert m["mean_acceptance_length"] == pytest.approx(1 + 6 / 3)
    assert m["acceptance_histogram"] == [0, 1, 1, 1]  # steps with k = 0 are not spec steps
    ar = spec_decode_metrics({"num_drafted": 0, "num_accepted": 0, "num_drafting_steps": 0, "accept_hist": {"0:0": 9}})
    assert ar["draft_acceptance_rate"] is None and ar["mean_acceptance_length"] is None
    assert ar["acceptance_histogram"] == [] and ar["num_spec_steps"] == 0


# ---------------------------------------------------------------- an arm in-process
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from helpers import tiny_model_like

    return tiny_model_like(tmp_path_factory.mktemp("serve") / "tiny", max_pos=512)


def _collect(arm, payload, stop_after=None):
    async def run():
        events = []
        agen = arm.generate(payload)
        async for ev in agen:
            events.append(ev)
            if stop_after is not None and len(events) >= stop_after:
                await agen.aclose()  # what Serve's cancellation does when the client goes away
                break
        return events
    return run()


def _payload(rid, prompt, n, **kw):
    return {"request_id": rid, "prompt_ids": prompt, "endpoint": "completions", "stream": True,
            "sampling": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True, **kw}}


def test_arm_batches_concurrent_requests_and_matches_a_fresh_ar_decode(tiny, tmp_path):
    import sparsespec

    args = {"model": str(tiny), "arms": [{"method": "sparsespec-l", "options": {"k": 4}}], "threads": 1,
            "max_num_seqs": 2, "db": f"sqlite:///{tmp_path}/r.db", "device": "cpu"}
    arm = ArmServer(args, "sparsespec-l")
    try:
        prompts = [[1, 5, 9, 200, 31, 7] * 5, [3, 8, 40, 41, 42] * 7]

        async def both():
            return await asyncio.gather(*(_collect(arm, _payload(f"r{i}", p, 40)) for i, p in enumerate(prompts)))

        results = asyncio.run(both())
        oracle = sparsespec.Engine.from_pretrained(str(tiny)).generate(prompts, method="ar", max_new_tokens=40,
                                                                         ignore_eos=True)
        for events, ref in zip(results, oracle):
            assert events[0]["type"] == "started"
            final = events[-1]
            assert final["type"] == "final" and final["finish_reason"] == "length"
            assert final["all_token_ids"] == ref.token_ids  # lossless through the arm
            streamed = [t for ev in events[1:] for t in ev.get("token_ids", [])]
            assert streamed == ref.token_ids and "".join(ev.get("text", "") for ev in events[1:]) == ref.text
            assert final["speculation"]["num_draft_tokens"] > 0  # it drafted: a real check
            assert final["timing"]["max_batch"] == 2  # both rows decoded in the same steps
            assert final["usage"] == {"prompt_tokens": len(prompts[results.index(events)]), "completion_tokens": 40,
                                      "total_tokens": len(prompts[results.index(events)]) + 40}
        assert arm.state()["max_batch_seen"] == 2
    finally:
        arm.shutdown()
    from cluster.store import open_store

    rows = open_store(f"sqlite:///{tmp_path}/r.db").serve_requests()
    assert sorted(r["request_id"] for r in rows) == ["r0", "r1"]
    assert all(r["status"] == 200 and r["output_tokens"] == 40 and r["ttft_s"] > 0 for r in rows)


def test_an_abandoned_request_frees_its_slot(tiny, tmp_path):
    import time

    arm = ArmServer({"model": str(tiny), "arms": [{"method": "ar"}], "threads": 1, "max_num_seqs": 1,
                     "db": f"sqlite:///{tmp_path}/r.db", "device": "cpu", "max_model_len": 512,
                     "engine_factory": "cluster.testing:slow_engine_factory",
                     "factory_kwargs": {"step_sleep_s": 0.02}}, "ar")
    try:
        events = asyncio.run(_collect(arm, _payload("gone", [1, 2, 3, 4], 400), stop_after=3))
        assert len(events) == 3
        for _ in range(100):
            if arm.state()["running"] == 0:
                break
            time.sleep(0.02)
        st = arm.state()
        assert st["running"] == 0 and st["free_slots"] == 1 and st["num_aborted"] == 1
        # the slot is usable again: a new request completes
        final = asyncio.run(_collect(arm, _payload("next", [5, 6, 7], 3)))[-1]
        assert final["type"] == "final" and final["usage"]["completion_tokens"] == 3
    finally:
        arm.shutdown()
    from cluster.store import open_store

    rows = {r["request_id"]: r for r in open_store(f"sqlite:///{tmp_path}/r.db").serve_requests()}
    assert rows["gone"]["status"] == 499 and rows["gone"]["finish_reason"] == "abort"
    assert rows["next"]["status"] == 200


def test_an_invalid_request_at_the_arm_is_an_error_event_and_the_arm_keeps_serving(tiny, tmp_path):
    arm = ArmServer({"model": str(tiny), "arms": [{"method": "ar"}], "threads": 1, "db": "", "device": "cpu",
                     "max_model_len": 64}, "ar")
    try:
        ev = asyncio.run(_collect(arm, _payload("long", list(range(1, 80)), 4)))
        assert ev[-1]["type"] == "error" and ev[-1]["status"] == 400 and "window" in ev[-1]["message"]
        ev = asyncio.run(_collect(arm, _payload("bad", [1, 2], 4, temperature=-1.0)))
        assert ev[-1]["type"] == "error" and ev[-1]["status"] == 400 and "temperature" in ev[-1]["message"]
        assert asyncio.run(_collect(arm, _payload("ok", [1, 2], 4)))[-1]["type"] == "final"
        arm.check_health()
    finally:
        arm.shutdown()

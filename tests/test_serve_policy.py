"""The Serve ``policy`` arm (issue 27 item 3): one engine, one ``EngineCore`` per (method, k) of
its policy file; each request goes to the core its (context, batch) entry names, and the choice
(method, k, bucket, the batch it saw) is recorded on its request row. A tiny random-weight model:
outputs must equal a fresh ar decode whichever core decodes them."""
import asyncio
import json

import pytest

from cluster.results.policy import PolicyEntry


def _e(ctx, B, method="ar", k=0, status=None, **kw):
    return {"context_length": ctx, "batch_size": B, "status": status or ("off" if k == 0 else "speculate"),
            "method": method, "k": k, "variant": method if k == 0 else f"{method} k={k}", "reason": "test", **kw}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from helpers import tiny_model_like

    return tiny_model_like(tmp_path_factory.mktemp("policy") / "tiny", max_pos=512)


def _collect(arm, payload):
    async def run():
        return [ev async for ev in arm.generate(payload)]
    return run()


def _payload(rid, prompt, n):
    return {"request_id": rid, "prompt_ids": prompt, "endpoint": "completions", "stream": True,
            "sampling": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}}


def test_policy_arm_routes_by_length_and_batch_and_records_the_choice(tiny, tmp_path):
    """Short requests (context 64 bucket) alone: ar; short in a batch of 2+: sparsespec-l k=2; long
    (context 256 bucket): sparsespec-l k=3. Outputs are ar's tokens whichever core decodes."""
    import sparsespec
    from cluster.serve.endpoint import ArmServer, parse_args
    from cluster.results.store import open_store

    pol = tmp_path / "policy.json"
    pol.write_text(json.dumps({"version": 1, "models": {"tiny": [
        _e(64, 1), _e(64, 2, "sparsespec-l", 2), _e(256, 1, "sparsespec-l", 3), _e(256, 2, "sparsespec-l", 3)]}}))
    db = f"sqlite:///{tmp_path}/r.db"
    args = {"model": str(tiny), "arms": [{"method": "policy", "options": {"path": str(pol), "model": "tiny"}}],
            "threads": 1, "max_num_seqs": 2, "db": db, "device": "cpu"}
    arm = ArmServer(args, "policy")
    # one sparsespec-l core at the largest k; each request capped to its entry's k, ar's at 0
    assert list(arm.cores) == ["sparsespec-l"] and arm.core.k_max == 3
    short, long_ = [1, 5, 9, 200, 31, 7] * 4, [3, 8, 40, 41, 42] * 40  # 24 + 16 = 40 (-> 64); 200 + 16 (-> 256)
    try:
        alone = asyncio.run(_collect(arm, _payload("alone", short, 16)))
        assert alone[0]["method"] == "ar"

        async def together():
            return await asyncio.gather(_collect(arm, _payload("pair-a", short, 16)),
                                        _collect(arm, _payload("pair-b", short, 16)),
                                        _collect(arm, _payload("long", long_, 16)))
        res = asyncio.run(together())
        assert arm.state()["free_slots"] == 2  # one core of max_num_seqs=2, idle again
    finally:
        arm.shutdown()
    ref = sparsespec.Engine.from_pretrained(str(tiny)).generate([short, long_], method="ar", max_new_tokens=16,
                                                                ignore_eos=True)
    assert alone[-1]["all_token_ids"] == ref[0].token_ids
    assert [r[-1]["all_token_ids"] for r in res] == [ref[0].token_ids, ref[0].token_ids, ref[1].token_ids]
    rows = {r["request_id"]: r for r in open_store(db).serve_requests()}
    assert rows["alone"]["method"] == "ar" and rows["alone"]["arm"] == "policy"
    pa = rows["alone"]["stats"]["policy"]
    assert (pa["batch"], pa["context_tokens"], pa["k"], pa["bucket"]) == (1, 40, 0, {"context_length": 64,
                                                                                     "batch_size": 1})
    assert rows["alone"]["stats"]["k"] == 0 and rows["alone"]["stats"]["num_drafted"] == 0
    batches = sorted(rows[r]["stats"]["policy"]["batch"] for r in ("pair-a", "pair-b", "long"))
    assert batches == [1, 2, 3]  # each saw the requests admitted before it
    second = [r for r in ("pair-a", "pair-b") if rows[r]["stats"]["policy"]["batch"] >= 2]
    assert second and all(rows[r]["method"] == "sparsespec-l" and rows[r]["stats"]["policy"]["k"] == 2
                          and rows[r]["stats"]["num_drafted"] > 0 for r in second)
    # joining a running row, the first round (its prefill's end rides in it) drafts at the core's largest k
    assert all(rows[r]["stats"]["policy"]["first_round_cap"] == 3 == rows[r]["stats"]["k"] for r in second)
    assert pa["first_round_cap"] == 0  # alone: its own entry
    lg = rows["long"]
    assert (lg["method"], lg["stats"]["k"], lg["stats"]["policy"]["bucket"]["context_length"]) == ("sparsespec-l",
                                                                                                 3, 256)
    assert lg["stats"]["policy"]["context_tokens"] == 216
    # the A/B table names both methods the policy arm used
    from cluster.results.aggregate import ab_arms

    assert ab_arms(list(rows.values()))[0]["method"] == "ar+sparsespec-l"
    assert parse_args(args).arm("policy").options["model"] == "tiny"


def test_policy_arm_config_errors_name_the_problem(tiny, tmp_path):
    from cluster.serve.endpoint import parse_args

    base = {"model": str(tiny), "db": ""}
    with pytest.raises(ValueError, match="needs options.path"):
        parse_args({**base, "arms": [{"method": "policy"}]})
    with pytest.raises(ValueError, match="cannot read policy file"):
        parse_args({**base, "arms": [{"method": "policy", "options": {"path": str(tmp_path / "no.json")}}]})
    with pytest.raises(ValueError, match="unknown policy option"):
        parse_args({**base, "arms": [{"method": "policy", "options": {"path": "x", "k": 2}}]})
    pol = tmp_path / "p.json"
    pol.write_text(json.dumps({"version": 1, "models": {"tiny": [_e(64, 1)]}}))
    with pytest.raises(ValueError, match="no entries for model"):  # the serve model is a path, not "tiny"
        parse_args({**base, "arms": [{"method": "policy", "options": {"path": str(pol)}}]})
    with pytest.raises(ValueError, match="no entries for model 'other'"):
        parse_args({**base, "arms": [{"method": "policy", "options": {"path": str(pol), "model": "other"}}]})
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"version": 1, "models": {"tiny": [_e(64, 1, "nope", 2)]}}))
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        parse_args({**base, "arms": [{"method": "policy", "options": {"path": str(bad), "model": "tiny"}}]})
    ok = parse_args({**base, "arms": [{"method": "policy", "options": {"path": str(pol), "model": "tiny"}}]})
    assert ok.arms[0].name == "policy"


def test_policy_entry_core_options():
    e = PolicyEntry.model_validate(_e(64, 1, "sparsespec-l", 2))
    assert e.core_options == {"k": 2} and e.core_name == "sparsespec-l"
    assert PolicyEntry.model_validate(_e(64, 1)).core_options == {}


def test_policy_cores_one_per_method_with_the_largest_k_and_ar_capped_at_zero():
    from cluster.results.policy import SpeculationPolicy

    def pol(entries):
        return SpeculationPolicy.model_validate({"version": 1, "models": {"m": entries}})

    p = pol([_e(64, 1), _e(64, 2, "sparsespec-l", 2), _e(256, 1, "sparsespec-l", 4), _e(256, 2, "ngram", 3),
             _e(512, 1, "sparsespec-l", "auto")])
    assert p.cores("m") == {"ngram": ("ngram", {"k": 3}), "sparsespec-l": ("sparsespec-l", {"k": 4}),
                            "sparsespec-l auto": ("sparsespec-l", {"k": "auto"})}
    es = {(e.context_length, e.batch_size): e for e in p.entries("m")}
    assert p.core_for("m", es[(64, 1)]) == ("ngram", 0)  # ar rides in the first core, never drafting
    assert p.core_for("m", es[(64, 2)]) == ("sparsespec-l", 2)
    assert p.core_for("m", es[(512, 1)]) == ("sparsespec-l auto", None)
    only_ar = pol([_e(64, 1), _e(256, 1)])
    assert only_ar.cores("m") == {"ar": ("ar", {})} and only_ar.core_for("m", only_ar.entries("m")[0]) == ("ar", None)


def _capped_core(tiny, max_num_seqs):
    """A sparsespec-l core at k=3 on the tiny model, two prompts, their ar reference (24 tokens)
    and greedy params: what the per-row cap tests start from."""
    import sparsespec

    eng = sparsespec.Engine.from_pretrained(str(tiny))
    prompts = [[1, 5, 9, 200, 31, 7] * 5, [3, 8, 40, 41, 42] * 7]
    ref = eng.generate(prompts, method="ar", max_new_tokens=24, ignore_eos=True)
    params = sparsespec.SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    return eng, prompts, ref, eng.core("sparsespec-l", {"k": 3}, max_num_seqs=max_num_seqs), params


def test_a_capped_row_never_drafts_in_a_batch_whose_other_row_does(tiny):
    """EngineCore.add_request(max_k=...): the policy arm's per-request k inside one batch."""
    eng, prompts, ref, core, params = _capped_core(tiny, 2)
    core.add_request("off", prompts[0], params, max_k=0)
    core.add_request("two", prompts[1], params, max_k=2)
    done = {}
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finished:
                done[out.request_id] = out.output
    assert done["off"].token_ids == ref[0].token_ids and done["two"].token_ids == ref[1].token_ids
    assert done["off"].stats["num_drafted"] == 0 and done["off"].stats["k"] == 0
    st = done["two"].stats
    assert st["k"] == 2 and st["num_drafted"] > 0 and st["num_drafted"] <= 2 * st["num_drafting_steps"]
    assert "max_k" not in st  # a fixed k capped is that fixed k
    with pytest.raises(ValueError, match="max_k must be an integer >= 0"):
        core.add_request("bad", prompts[0], params, max_k=-1)
    auto = eng.core("sparsespec-l", {"k": "auto", "max_k": 8}, max_num_seqs=2)  # "auto" capped stays "auto"
    auto.add_request("two", prompts[1], params, max_k=2)
    auto.add_request("free", prompts[0], params)
    done = {}
    while auto.has_unfinished_requests():
        for out in auto.step():
            if out.finished:
                done[out.request_id] = out.output
    st, free = done["two"].stats, done["free"].stats
    assert done["two"].token_ids == ref[1].token_ids and done["free"].token_ids == ref[0].token_ids
    assert st["k"] == "auto" == free["k"] and st["max_k"] == 2 and "max_k" not in free
    assert st["num_drafted"] <= 2 * st["num_drafting_steps"]


def test_set_max_k_recaps_a_row_from_its_next_round(tiny):
    """EngineCore.set_max_k: a row admitted at k=0 drafts once re-capped, one re-capped to 0
    stops drafting; round_rows / prefill_pending describe the next step; bad input is an error."""
    _, prompts, ref, core, params = _capped_core(tiny, 1)
    core.add_request("late", prompts[0], params, max_k=0)
    core.add_request("queued", prompts[1], params, max_k=3)
    assert core.round_rows() == [] and core.prefill_pending()
    with pytest.raises(KeyError, match="no unfinished request 'nope'"):
        core.set_max_k("nope", 1)
    with pytest.raises(ValueError, match="max_k must be an integer >= 0"):
        core.set_max_k("late", -1)
    core.set_max_k("queued", 0)  # a waiting request can be re-capped too
    done, steps = {}, 0
    while core.has_unfinished_requests():
        if [r for r, _ in core.round_rows()] == ["late"] and steps == 3:
            assert core.round_rows() == [("late", len(prompts[0]) + 24)]
            assert not core.prefill_pending()  # the one slot is taken: "queued" waits without a prefill
            core.set_max_k("late", 2)
        steps += 1
        for out in core.step():
            if out.finished:
                done[out.request_id] = out.output
    late, queued = done["late"].stats, done["queued"].stats
    assert done["late"].token_ids == ref[0].token_ids and done["queued"].token_ids == ref[1].token_ids
    assert late["k"] == 0 and 0 < late["num_drafted"] <= 2 * late["num_drafting_steps"]  # k: the admission cap
    assert queued["num_drafted"] == 0


def test_round_cap_decides_the_whole_batch_and_drafts_while_a_prefill_rides():
    from cluster.results.policy import SpeculationPolicy

    p = SpeculationPolicy.model_validate({"version": 1, "models": {"m": [
        _e(1024, 1), _e(1024, 4), _e(8192, 1, "sparsespec-l", 2), _e(8192, 4, "sparsespec-l", 3)]}})
    assert p.round_cap("m", "sparsespec-l", [], prefill=True)[0] is None  # no rows: nothing to decide
    # a prefill chunk in the round: the largest k this core's entries use, whatever the bucket
    assert p.round_cap("m", "sparsespec-l", [1024], prefill=True)[0] == 3
    # decode-only rounds: the bucket of the batch's mean context at its size
    cap, e, why = p.round_cap("m", "sparsespec-l", [1024, 1024], prefill=False)
    assert cap == 0 and (e.context_length, e.batch_size) == (1024, 4) and "1024 x 4" in why  # 2: on the edge
    cap, e, _ = p.round_cap("m", "sparsespec-l", [1024, 8192, 8192, 1024], prefill=False)  # mean 4608 > 2896
    assert cap == 3 and (e.context_length, e.batch_size) == (8192, 4)
    assert p.round_cap("m", "sparsespec-l", [8192], prefill=False)[0] == 2
    assert p.round_cap("m", "sparsespec-l", [1024, 1024, 2048, 1024], prefill=False)[0] == 0  # mean 1280: off
    assert p.round_cap("m", "sparsespec-l", [1024, 1024, 1024, 8192], prefill=False)[0] == 0  # the mean, not the max
    # a bucket of another core's method is an AR round on this core; an auto core is left to its controller
    q = SpeculationPolicy.model_validate({"version": 1, "models": {"m": [
        _e(1024, 1, "ngram", 2), _e(8192, 1, "sparsespec-l", "auto")]}})
    assert q.round_cap("m", "ngram", [8192], prefill=False)[0] == 0
    assert q.round_cap("m", "sparsespec-l auto", [8192], prefill=False)[0] is None
    assert q.round_cap("m", "sparsespec-l auto", [1024], prefill=True)[0] is None
    assert q.round_cap("m", "ngram", [1024], prefill=False)[0] == 2


def test_the_policy_keeps_a_variants_options_and_its_arm_runs_them():
    """A chosen cell whose method ran with other options (``budget_frac``): the entry keeps them,
    its core is named by them and built with them."""
    from cluster.results.policy import SpeculationPolicy, decide

    cells = [{"method": "ar", "variant": "ar", "k": None, "options": ""},
             {"method": "sparsespec-l", "variant": "sparsespec-l k=2 (budget_frac=0.3)", "k": 2,
              "draft_weights": "target", "options": '{"budget_frac": 0.3}', "speedup": 1.3, "ci_low": 1.1,
              "ci_high": 1.5, "n_pairs": 8, "lossless_rate": 1.0}]
    e = decide(8192, 4, cells)
    assert e.status == "speculate" and e.options == {"budget_frac": 0.3}
    assert e.core_options == {"budget_frac": 0.3, "k": 2} and e.core_name == "sparsespec-l (budget_frac=0.3)"
    p = SpeculationPolicy.model_validate({"version": 1, "models": {"m": [_e(1024, 4), e.model_dump()]}})
    assert p.cores("m") == {"sparsespec-l (budget_frac=0.3)": ("sparsespec-l", {"budget_frac": 0.3, "k": 2})}
    assert p.round_cap("m", "sparsespec-l (budget_frac=0.3)", [8192] * 4, prefill=False)[0] == 2
    with pytest.raises(ValueError, match="budget_fraction"):  # an option the method does not have
        PolicyEntry.model_validate(_e(64, 1, "sparsespec-l", 2, options={"budget_fraction": 0.3}))


SHORT, LONG = [1, 5, 9, 200, 31, 7] * 4, [3, 8, 40, 41, 42] * 40  # 24 and 200 prompt tokens


def _one_joins_another(tiny, tmp_path, first, second):
    """A policy arm (contexts up to 64: off; 256: sparsespec-l k=2; batch 1-2) decodes ``first``
    (``(id, prompt, max_tokens)``) alone until its first token, then ``second`` joins. Asserts
    both outputs are ar's tokens; returns the stored rows by request id."""
    import sparsespec
    from cluster.results.store import open_store
    from cluster.serve.endpoint import ArmServer

    pol = tmp_path / "policy.json"
    pol.write_text(json.dumps({"version": 1, "models": {"tiny": [
        _e(64, 1), _e(64, 2), _e(256, 1, "sparsespec-l", 2), _e(256, 2, "sparsespec-l", 2)]}}))
    db = f"sqlite:///{tmp_path}/r.db"
    args = {"model": str(tiny), "arms": [{"method": "policy", "options": {"path": str(pol), "model": "tiny"}}],
            "threads": 1, "max_num_seqs": 2, "db": db, "device": "cpu"}
    arm = ArmServer(args, "policy")

    async def both():
        gen, evs = arm.generate(_payload(*first)), []
        async for ev in gen:  # the first one decodes alone ...
            evs.append(ev)
            if ev.get("token_ids"):
                break
        other = asyncio.ensure_future(_collect(arm, _payload(*second)))  # ... then the second joins
        evs += [ev async for ev in gen]
        return [evs, await other]
    try:
        res = asyncio.run(both())
    finally:
        arm.shutdown()
    eng = sparsespec.Engine.from_pretrained(str(tiny))
    ref = [eng.generate([prompt], method="ar", max_new_tokens=n, ignore_eos=True)[0]
           for _, prompt, n in (first, second)]
    assert [r[-1]["all_token_ids"] for r in res] == [ref[0].token_ids, ref[1].token_ids]
    return {r["request_id"]: r for r in open_store(db).serve_requests()}


def test_policy_arm_decides_each_round_for_its_whole_batch(tiny, tmp_path):
    """A short request admitted alone (its bucket: off) joins a long one: their mean context falls
    in the long bucket, so the short row drafts too (capped at 0 for its life before); every round
    is counted on the row by its cap, and outputs stay ar's tokens."""
    rows = _one_joins_another(tiny, tmp_path, ("short", SHORT, 96), ("long", LONG, 32))  # contexts 120 (-> 64), 232
    sp = rows["short"]["stats"]
    assert sp["policy"]["k"] == 0 and sp["policy"]["method"] == "ar"  # admitted alone: off
    caps = sp["policy"]["round_caps"]
    assert caps.get("0", 0) > 0 and caps.get("2", 0) > 0, caps  # alone: off; beside the long row: k = 2
    assert sp["num_drafted"] > 0  # before: capped at 0 for its life
    assert sum(rows["long"]["stats"]["policy"]["round_caps"].values()) > 0


def test_a_request_joining_running_rows_drafts_from_its_first_round(tiny, tmp_path):
    """A short request whose own entry is off joins a long row that drafts: the round it first
    decodes in carries its prefill's last chunk, which ``_decide_round`` (running rows only) does
    not see, so it is admitted at the prefill rule's k, not at its entry's 0 (measured: one round
    more per request and 1.17x always-on sparsespec-l's TPOT at concurrency 4)."""
    rows = _one_joins_another(tiny, tmp_path, ("long", LONG, 48), ("short", SHORT, 16))  # contexts 248, 40 (-> 64)
    sp = rows["short"]["stats"]
    assert (sp["policy"]["method"], sp["policy"]["k"], sp["policy"]["batch"]) == ("ar", 0, 2)  # its entry: off
    assert sp["policy"]["first_round_cap"] == 2 == sp["k"]
    assert sp["policy"]["round_caps"].get("2", 0) >= 1 and sp["num_drafted"] > 0

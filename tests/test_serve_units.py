"""The Serve app's pure parts, without Ray: the args, the weighted sticky split, vLLM's
per-request speculation fields, and an arm's engine thread driven in-process (continuous
batching shares steps, an abandoned request frees its slot, outputs equal a fresh AR decode);
vLLM's server conventions (/health, /version, /tokenize, /detokenize, /metrics, unsupported
features refused), the routes driven over FastAPI's TestClient with in-process arms; an arm
that fails mid-request (its replica dies, its own code raises): the SSE stream ends with vLLM's
error event and ``data: [DONE]``, a non-streamed request gets a 5xx with the OpenAI error body,
and the stored row carries that status."""
import asyncio
import random
from collections import Counter

import pytest

from cluster.serve.endpoint import ArmServer, parse_args, pick_arm, session_point
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
        for events in results:  # the timings add up: chunk gaps span first token -> last token
            tm, st = events[-1]["timing"], None
            n_chunks = sum(1 for ev in events[1:] if ev.get("token_ids"))
            assert tm["num_chunks"] == n_chunks >= 2
            assert 0 < tm["queue_s"] < tm["ttft_s"] < tm["e2el_s"]
            assert tm["tpot_s"] == pytest.approx((tm["e2el_s"] - tm["ttft_s"]) / (40 - 1))
            assert tm["itl_p50_s"] <= tm["itl_p95_s"] <= tm["itl_p99_s"]
    finally:
        arm.shutdown()
    from cluster.results.store import open_store

    rows = open_store(f"sqlite:///{tmp_path}/r.db").serve_requests()
    assert sorted(r["request_id"] for r in rows) == ["r0", "r1"]
    assert all(r["status"] == 200 and r["output_tokens"] == 40 and r["ttft_s"] > 0 for r in rows)
    for r, events in zip(sorted(rows, key=lambda r: r["request_id"]), results):
        gaps = r["stats"]["chunk_gaps_s"]
        assert len(gaps) == r["stats"]["num_chunks"] - 1
        assert sum(gaps) == pytest.approx(r["e2el_s"] - r["ttft_s"], abs=1e-6)
        assert r["stats"]["num_drafted"] == events[-1]["speculation"]["num_draft_tokens"]


def test_an_abandoned_request_frees_its_slot(tiny, tmp_path):
    import time

    arm = ArmServer({"model": str(tiny), "arms": [{"method": "ar"}], "threads": 1, "max_num_seqs": 1,
                     "db": f"sqlite:///{tmp_path}/r.db", "device": "cpu", "max_model_len": 512,
                     "engine_factory": "cluster.sweep.testing:slow_engine_factory",
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
        from cluster.serve.endpoint import MetricsBoard  # vLLM's metrics count the abort as vLLM does

        board = MetricsBoard()
        board.update(arm.metrics_snapshot())
        f = _families(board.exposition()[0].decode())
        assert _value(f, "vllm:request_success_total", finished_reason="abort") == 1
        assert _value(f, "vllm:request_success_total", finished_reason="length") == 1
        assert _value(f, "vllm:prompt_tokens_total") == 4 + 3
    finally:
        arm.shutdown()
    from cluster.results.store import open_store

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
        one = asyncio.run(_collect(arm, _payload("one", [1, 2], 1)))[-1]  # done in its prefill step
        assert one["type"] == "final" and one["timing"]["max_batch"] == 1 and one["usage"]["completion_tokens"] == 1
        arm.check_health()
    finally:
        arm.shutdown()


# ---------------------------------------------------------------- the ingress's logic (Gateway)
KEY = "sk-unit"


@pytest.fixture(scope="module")
def gw(tiny):
    from transformers import AutoTokenizer

    from cluster.serve.endpoint import Gateway

    args = parse_args({"model": str(tiny), "arms": [{"method": "ar", "weight": 0.7},
                                                    {"method": "sparsespec-l", "options": {"k": 4}, "weight": 0.3}],
                       "default_max_tokens": 32})
    return Gateway(args, AutoTokenizer.from_pretrained(tiny), window=512, api_key=KEY, rng=random.Random(0))


def _auth(**h):
    return {"Authorization": f"Bearer {KEY}", **h}


def _prep(gw, body, chat=False, headers=None):
    import json as _json

    raw = body if isinstance(body, bytes) else _json.dumps(body).encode()
    return gw.prepare(headers if headers is not None else _auth(), raw, chat, "rid-1")


BAD = [
    (b"{not json", False, 400, None),
    (b"[1, 2]", False, 400, None),
    ({"prompt": "x"}, False, 400, "model"),
    ({"model": "M"}, False, 400, "prompt"),
    ({"model": "nosuch", "prompt": "x"}, False, 404, "model"),
    ({"model": "M:nosuch", "prompt": "x"}, False, 404, "model"),
    ({"model": "M", "prompt": "x", "temperature": -0.5}, False, 400, "temperature"),
    ({"model": "M", "prompt": "x", "top_p": 0}, False, 400, "top_p"),
    ({"model": "M", "prompt": "x", "top_p": 1.5}, False, 400, "top_p"),
    ({"model": "M", "prompt": "x", "top_k": -2}, False, 400, "top_k"),
    ({"model": "M", "prompt": "x", "n": 2}, False, 400, "n"),
    ({"model": "M", "prompt": "x", "best_of": 3}, False, 400, "best_of"),
    ({"model": "M", "prompt": "x", "echo": True}, False, 400, "echo"),
    ({"model": "M", "prompt": "x", "presence_penalty": 0.5}, False, 400, "presence_penalty"),
    ({"model": "M", "prompt": "x", "frequency_penalty": 0.5}, False, 400, "frequency_penalty"),
    ({"model": "M", "prompt": "x", "logit_bias": {"5": 1.0}}, False, 400, "logit_bias"),
    ({"model": "M", "prompt": "x", "max_tokens": 0}, False, 400, "max_tokens"),
    ({"model": "M", "prompt": "x", "max_tokens": 512}, False, 400, "max_tokens"),  # 1 prompt token + 512 > 512
    ({"model": "M", "prompt": [5] * 512, "max_tokens": 1}, False, 400, "prompt"),
    ({"model": "M", "prompt": [1, 10 ** 9]}, False, 400, "prompt"),
    ({"model": "M", "prompt": [-1, 3]}, False, 400, "prompt"),
    ({"model": "M", "prompt": [1, 49152]}, False, 400, "prompt"),  # == the vocabulary size (SmolLM2's)
    ({"model": "M", "prompt": ""}, False, 400, "prompt"),
    ({"model": "M", "prompt": []}, False, 400, "prompt"),
    ({"model": "M", "prompt": ["a", "b"]}, False, 400, "prompt"),
    ({"model": "M", "prompt": "x", "logprobs": 2}, False, 400, "logprobs"),
    ({"model": "M", "prompt": "x", "stop": [""]}, False, 400, "stop"),
    ({"model": "M", "prompt": "x", "max_tokens": 4, "min_tokens": 4}, False, 400, "min_tokens"),
    ({"model": "M", "prompt": "x", "seed": "abc"}, False, 400, "seed"),
    ({"model": "M", "messages": []}, True, 400, "messages"),
    ({"model": "M", "messages": [{"role": "wizard", "content": "x"}]}, True, 400, "messages.0.role"),
    ({"model": "M", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, True, 400,
     "messages.0.content"),
    ({"model": "M", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10 ** 6}, True, 400,
     "max_completion_tokens"),
    ({"model": "M", "messages": [{"role": "user", "content": "x"}], "logprobs": True}, True, 400, "logprobs"),
    ({"model": "M", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, True, 400,
     "tools"),
    # features we do not implement: a 400 naming the field, never silently ignored
    ({"model": "M", "prompt": "x", "response_format": {"type": "json_object"}}, False, 400, "response_format"),
    ({"model": "M", "messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}}}}, True, 400,
     "response_format"),
    ({"model": "M", "prompt": "x", "tools": [{"type": "function"}]}, False, 400, "tools"),
    ({"model": "M", "messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, True, 400, "tool_choice"),
    ({"model": "M", "messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}, True, 400,
     "functions"),
    ({"model": "M", "messages": [{"role": "user", "content": "x"}], "function_call": "auto"}, True, 400,
     "function_call"),
    ({"model": "M", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, True, 400, "top_logprobs"),
    ({"model": "M", "prompt": "x", "min_p": 0.1}, False, 400, "min_p"),
    ({"model": "M", "prompt": "x", "repetition_penalty": 1.2}, False, 400, "repetition_penalty"),
    ({"model": "M", "prompt": "x", "use_beam_search": True}, False, 400, "use_beam_search"),
    ({"model": "M", "prompt": "x", "include_stop_str_in_output": True}, False, 400, "include_stop_str_in_output"),
    ({"model": "M", "prompt": "x", "prompt_logprobs": 1}, False, 400, "prompt_logprobs"),
    ({"model": "M", "prompt": "x", "guided_json": {"type": "object"}}, False, 400, "guided_json"),
    ({"model": "M", "prompt": "x", "structured_outputs": {"regex": "a+"}}, False, 400, "structured_outputs"),
    ({"model": "M", "messages": [{"role": "user", "content": "x"}], "chat_template": "{{ x }}"}, True, 400,
     "chat_template"),
    ({"model": "M", "messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, True, 400,
     "continue_final_message"),  # with the default add_generation_prompt=true: vLLM refuses the pair
    ({"model": "M", "messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"]}, True, 400,
     "modalities"),
    ({"model": "M", "messages": [{"role": "user", "content": "x"}], "audio": {"voice": "x"}}, True, 400, "audio"),
    ({"model": "M", "messages": [{"role": "user", "content": "x"}], "reasoning_effort": "high"}, True, 400,
     "reasoning_effort"),
]


@pytest.mark.parametrize("body, chat, status, param", BAD)
def test_bad_input_is_refused_naming_the_field(gw, tiny, body, chat, status, param):
    from cluster.serve.endpoint import APIError

    if isinstance(body, dict) and isinstance(body.get("model"), str):
        body = {**body, "model": body["model"].replace("M", str(tiny), 1) if body["model"].startswith("M") else
                body["model"]}
    with pytest.raises(APIError) as e:
        _prep(gw, body, chat)
    assert (e.value.status, e.value.param) == (status, param), e.value.message
    resp = e.value.response()
    import json as _json

    err = _json.loads(resp.body)["error"]
    assert resp.status_code == status and err["param"] == param and err["message"] and err["type"] and err["code"]


def test_no_op_values_of_unsupported_fields_are_accepted(gw, tiny):
    m = str(tiny)
    msgs = [{"role": "user", "content": "x"}]
    for extra in ({"response_format": {"type": "text"}}, {"tool_choice": "none"}, {"top_logprobs": 0},
                  {"modalities": ["text"]}, {"repetition_penalty": 1.0, "min_p": 0.0}, {"logprobs": False},
                  {"tools": []}, {"guided_json": None}, {"min_p": None, "repetition_penalty": None}):
        assert _prep(gw, {"model": m, "messages": msgs, **extra}, chat=True)[1] in ("ar", "sparsespec-l"), extra
    assert _prep(gw, {"model": m, "prompt": "x", "response_format": {"type": "text"}})[2]["prompt_ids"]
    # vLLM's chat-template switches are honoured, not ignored
    tok = gw.tokenizer
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    ids = _prep(gw, {"model": m, "messages": msgs, "add_generation_prompt": False, "continue_final_message": True},
                chat=True)[2]["prompt_ids"]
    want = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    assert ids == tok(want, add_special_tokens=False).input_ids and tok.decode(ids).endswith("Hel")


def test_api_key(gw, tiny):
    from cluster.serve.endpoint import APIError

    body = {"model": str(tiny), "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}, {"authorization": f"bearer {KEY}"}):
        with pytest.raises(APIError) as e:
            _prep(gw, body, headers=headers)
        assert e.value.status == 401 and e.value.code == "invalid_api_key"
    assert _prep(gw, body, headers={"authorization": f"Bearer {KEY}"})[1] in ("ar", "sparsespec-l")


def test_routing_explicit_arms_and_sticky_sessions(gw, tiny):
    from cluster.serve.endpoint import APIError

    m = str(tiny)
    assert _prep(gw, {"model": f"{m}:sparsespec-l", "prompt": "x"})[1] == "sparsespec-l"
    assert _prep(gw, {"model": m, "prompt": "x"}, headers=_auth(**{"X-Arm": "sparsespec-l"}))[1] == "sparsespec-l"
    assert _prep(gw, {"model": f"{m}:ar", "prompt": "x"}, headers=_auth(**{"x-arm": "ar"}))[1] == "ar"
    with pytest.raises(APIError) as e:
        _prep(gw, {"model": f"{m}:ar", "prompt": "x"}, headers=_auth(**{"x-arm": "sparsespec-l"}))
    assert (e.value.status, e.value.param) == (400, "x-arm")
    with pytest.raises(APIError) as e:
        _prep(gw, {"model": m, "prompt": "x"}, headers=_auth(**{"x-arm": "nosuch"}))
    assert (e.value.status, e.value.param) == (404, "x-arm")
    weights = [("ar", 0.7), ("sparsespec-l", 0.3)]
    for s in (f"sess-{i}" for i in range(30)):
        want = pick_arm(weights, s)
        assert _prep(gw, {"model": m, "prompt": "x"}, headers=_auth(**{"X-Session-Id": s}))[1] == want
        assert _prep(gw, {"model": m, "prompt": "x", "user": s})[1] == want  # the OpenAI user field
        # the header wins over `user`
        other = next(o for o in (f"o{j}" for j in range(100)) if pick_arm(weights, o) != want)
        assert _prep(gw, {"model": m, "prompt": "x", "user": other}, headers=_auth(**{"x-session-id": s}))[1] == want
    got = Counter(_prep(gw, {"model": m, "prompt": "x"}, headers=_auth(**{"x-session-id": f"u{i}"}))[1]
                  for i in range(3000))
    assert abs(got["ar"] / 3000 - 0.7) < 0.04


def test_payload_prompt_and_sampling(gw, tiny):
    m = str(tiny)
    tok = gw.tokenizer
    _, arm, p = _prep(gw, {"model": m, "prompt": "Hello world", "temperature": 0.5, "top_p": 0.9, "top_k": -1,
                           "seed": 7, "stop": "\n", "ignore_eos": True, "min_tokens": 2, "stop_token_ids": [13],
                           "max_tokens": 9}, headers=_auth(**{"x-session-id": "abc"}))
    assert p["prompt_ids"] == tok("Hello world", add_special_tokens=True).input_ids
    assert p["sampling"] == {"max_new_tokens": 9, "temperature": 0.5, "top_p": 0.9, "top_k": 0, "seed": 7,
                             "stop": ("\n",), "ignore_eos": True, "min_new_tokens": 2, "stop_token_ids": (13,)}
    assert p["session"] == "abc" and p["endpoint"] == "completions" and p["request_id"] == "rid-1"
    # defaults: OpenAI's temperature 1; max_tokens = default_max_tokens, capped by the room left
    d = _prep(gw, {"model": m, "prompt": [3] * 500})[2]["sampling"]
    assert d["temperature"] == 1.0 and d["max_new_tokens"] == 12  # 512 - 500
    assert _prep(gw, {"model": m, "prompt": [3] * 5})[2]["sampling"]["max_new_tokens"] == 32
    assert _prep(gw, {"model": m, "prompt": [[4, 5, 6]]})[2]["prompt_ids"] == [4, 5, 6]
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    c = _prep(gw, {"model": m, "messages": msgs, "max_completion_tokens": 5}, chat=True)[2]
    want = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
                                   tokenize=False, add_generation_prompt=True)
    assert c["prompt_ids"] == tok(want, add_special_tokens=False).input_ids
    assert c["sampling"]["max_new_tokens"] == 5 and c["endpoint"] == "chat.completions"


def test_models_body(gw, tiny):
    m = str(tiny)
    data = gw.models_body()["data"]
    assert [d["id"] for d in data] == [m, f"{m}:ar", f"{m}:sparsespec-l"]
    assert data[2]["method"] == "sparsespec-l" and data[2]["options"] == {"k": 4} and data[1]["weight"] == 0.7


def _events(texts, final_text, spec=None):
    evs = [{"type": "delta", "text": t, "token_ids": [1], "finished": False} for t in texts]
    evs.append({"type": "final", "text": final_text, "token_ids": [1], "finish_reason": "length",
                "usage": {"prompt_tokens": 3, "completion_tokens": len(texts) + 1, "total_tokens": len(texts) + 4},
                "speculation": spec or {"num_draft_tokens": 0}, "timing": {"ttft_s": 0.1}})
    return evs


async def _agen(items):
    for x in items:
        yield x


def _drain(gen, stop_after=None):
    async def run():
        out = []
        async for chunk in gen:
            out.append(chunk)
            if stop_after is not None and len(out) >= stop_after:
                await gen.aclose()
                break
        return out
    return asyncio.run(run())


@pytest.mark.parametrize("chat", [False, True])
def test_sse_chunks_concatenate_to_the_text_and_end_with_done(gw, chat):
    import json as _json

    from cluster.serve.endpoint import Gateway

    abandoned = []
    chunks = _drain(Gateway.sse(_agen(_events(["Hel", "", "lo"], " world")), "id1", "m", "ar", "ar", chat, True,
                                on_abandon=lambda: abandoned.append(1)))
    assert chunks[-1] == "data: [DONE]\n\n" and all(c.startswith("data: ") and c.endswith("\n\n") for c in chunks)
    objs = [_json.loads(c[6:]) for c in chunks[:-1]]
    if chat:
        assert objs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(o["choices"][0]["delta"].get("content", "") for o in objs if o["choices"])
        assert all(o["object"] == "chat.completion.chunk" for o in objs)
    else:
        text = "".join(o["choices"][0]["text"] for o in objs if o["choices"])
        assert all(o["object"] == "text_completion" for o in objs)
    assert text == "Hello world"
    assert [o["choices"][0]["finish_reason"] for o in objs if o["choices"]][-1] == "length"
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["completion_tokens"] == 4 and objs[-1]["arm"] == "ar"
    assert "speculation" in objs[-1] and not abandoned
    no_usage = _drain(Gateway.sse(_agen(_events(["a"], "b")), "id1", "m", "ar", "ar", chat, False))
    assert all("usage" not in c for c in no_usage)


def test_sse_abandoned_midway_cancels_the_arm_call_and_errors_are_reported():
    import json as _json

    from cluster.serve.endpoint import Gateway

    abandoned = []
    got = _drain(Gateway.sse(_agen(_events(["a", "b", "c"], "d")), "i", "m", "ar", "ar", False, True,
                             on_abandon=lambda: abandoned.append(1)), stop_after=1)
    assert len(got) == 1 and abandoned == [1]
    err = _drain(Gateway.sse(_agen([{"type": "delta", "text": "x", "token_ids": [1], "finished": False},
                                    {"type": "error", "status": 500, "message": "engine died", "param": None}]),
                             "i", "m", "ar", "ar", False, True, on_abandon=lambda: abandoned.append(2)))
    assert _json.loads(err[-2][6:])["error"]["message"] == "engine died" and err[-1] == "data: [DONE]\n\n"
    assert abandoned == [1]


def test_full_body(gw):
    final = _events([], "Paris.")[-1]
    final.update(all_text="Paris.", finish_reason="stop")
    b = gw.full_body(final, "chatcmpl-1", "m", "sparsespec-l", "sparsespec-l", True)
    assert b["object"] == "chat.completion" and b["choices"][0]["message"] == {"role": "assistant", "content": "Paris."}
    assert b["choices"][0]["finish_reason"] == "stop" and b["arm"] == "sparsespec-l" and b["usage"]["prompt_tokens"] == 3
    c = gw.full_body(final, "cmpl-1", "m", "ar", "ar", False)
    assert c["object"] == "text_completion" and c["choices"][0]["text"] == "Paris." and c["method"] == "ar"


def test_refusal_row_fits_the_store(gw, tmp_path):
    from cluster.serve.endpoint import APIError
    from cluster.results.store import SERVE_REQUEST_FIELDS, open_store

    row = gw.refusal_row({"X-Session-Id": "s9"}, True, APIError(400, "temperature: bad", "temperature"))
    assert set(row) <= set(SERVE_REQUEST_FIELDS) and row["session"] == "s9" and row["arm"] is None
    assert row["status"] == 400 and row["endpoint"] == "chat.completions"
    busy = gw.refusal_row({}, False, APIError(503, "full"), None, "sparsespec-l", "cmpl-9")
    assert busy["arm"] == "sparsespec-l" and busy["method"] == "sparsespec-l" and busy["request_id"] == "cmpl-9"
    store = open_store(f"sqlite:///{tmp_path}/r.db")
    assert store.add_serve_requests([row, busy]) == 2


@pytest.mark.parametrize("value, warm", [(None, False), ("1", True), ("true", True), ("0", False), ("no", False),
                                         ("", False)])
def test_a_client_marked_warmup_reaches_the_payload_and_the_rows(gw, value, warm):
    from cluster.serve.endpoint import APIError

    headers = _auth() if value is None else _auth(**{"X-Sparsespec-Warmup": value})
    _, _, payload = _prep(gw, {"model": gw.args.model_id, "prompt": "Hello"}, headers=headers)
    assert payload["warmup"] is warm
    assert gw.refusal_row(headers, False, APIError(503, "full"))["warmup"] is warm


# ---------------------------------------------------------------- vLLM's server routes (Gateway)
def test_tokenize_and_detokenize_give_the_ids_the_routes_send(gw, tiny):
    import importlib.metadata
    import json as _json

    m, tok = str(tiny), gw.tokenizer
    t = gw.tokenize(_json.dumps({"model": m, "prompt": "Hello world"}).encode())
    assert set(t) == {"count", "max_model_len", "tokens", "token_strs"}  # vLLM's TokenizeResponse
    assert t["tokens"] == _prep(gw, {"model": m, "prompt": "Hello world"})[2]["prompt_ids"]
    assert t["count"] == len(t["tokens"]) and t["max_model_len"] == 512 and t["token_strs"] is None
    plain = gw.tokenize(_json.dumps({"prompt": "Hello world", "add_special_tokens": False,
                                     "return_token_strs": True}).encode())  # model is optional
    assert plain["tokens"] == tok("Hello world", add_special_tokens=False).input_ids
    assert plain["token_strs"] == tok.convert_ids_to_tokens(plain["tokens"])
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    c = gw.tokenize(_json.dumps({"model": f"{m}:ar", "messages": msgs}).encode())
    assert c["tokens"] == _prep(gw, {"model": m, "messages": msgs}, chat=True)[2]["prompt_ids"]
    no_gen = gw.tokenize(_json.dumps({"messages": msgs, "add_generation_prompt": False}).encode())
    assert c["tokens"][:no_gen["count"]] == no_gen["tokens"] and no_gen["count"] < c["count"]
    assert gw.detokenize(_json.dumps({"model": m, "tokens": plain["tokens"]}).encode()) == {"prompt": "Hello world"}
    assert gw.detokenize(b'{"tokens": []}') == {"prompt": ""}
    assert gw.version_body() == {"version": importlib.metadata.version("sparsespec")}


TOKENIZE_BAD = [
    ("tokenize", b"{not json", 400, None),
    ("tokenize", {}, 400, "prompt"),
    ("tokenize", {"prompt": 5}, 400, "prompt"),
    ("tokenize", {"model": "nosuch", "prompt": "x"}, 404, "model"),
    ("tokenize", {"messages": []}, 400, "messages"),
    ("tokenize", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, 400,
     "continue_final_message"),
    ("tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ x }}"}, 400, "chat_template"),
    ("tokenize", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400, "tools"),
    ("detokenize", {}, 400, "tokens"),
    ("detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("detokenize", {"tokens": [1, -1]}, 400, "tokens"),
    ("detokenize", {"tokens": [1, 49152]}, 400, "tokens"),  # == the vocabulary size
    ("detokenize", {"model": "M:nosuch", "tokens": [1]}, 404, "model"),
]


@pytest.mark.parametrize("route, body, status, param", TOKENIZE_BAD)
def test_tokenize_bad_input_is_refused_naming_the_field(gw, route, body, status, param):
    import json as _json

    from cluster.serve.endpoint import APIError

    raw = body if isinstance(body, bytes) else _json.dumps(body).encode()
    with pytest.raises(APIError) as e:
        getattr(gw, route)(raw)
    assert (e.value.status, e.value.param) == (status, param), e.value.message


# ---------------------------------------------------------------- vLLM's metrics (arm and board)
def _families(text):
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def _value(fams, name, **labels):
    got = [v for lab, v in fams.get(name, []) if all(lab.get(k) == str(x) for k, x in labels.items())]
    assert len(got) == 1, (name, labels, fams.get(name))
    return got[0]


def test_arm_metrics_count_rows_as_vllm_does():
    from cluster.serve.endpoint import MetricsBoard, VllmArmMetrics

    running = [2]
    m = VllmArmMetrics("M", "fast", "sparsespec-l", 512, 4, lambda: running[0], lambda: 1)
    stats = {"chunk_gaps_s": [0.02, 0.03, 0.5], "tpot_s": 0.04}
    m.observe({"status": 200, "finish_reason": "length", "prompt_tokens": 30, "output_tokens": 9, "max_tokens": 9,
               "ttft_s": 0.2, "e2el_s": 0.6, "queue_s": 0.01, "stats": stats},
              {"num_spec_steps": 3, "num_draft_tokens": 12, "num_accepted_draft_tokens": 6,
               "acceptance_histogram": [0, 1, 1, 1]})  # steps accepting 1, 2, 3 drafts
    m.observe({"status": 499, "prompt_tokens": 7, "output_tokens": 2, "ttft_s": 0.1})  # client went away
    m.observe({"status": 500, "prompt_tokens": 5})  # the engine failed
    m.observe({"status": 400, "prompt_tokens": 5})  # refused at the arm: never reached the engine
    m.observe({"status": 200, "finish_reason": "stop", "prompt_tokens": 4, "output_tokens": 1, "ttft_s": 0.05,
               "e2el_s": 0.05, "stats": {"chunk_gaps_s": [], "tpot_s": None}}, None)
    board = MetricsBoard()
    board.update({"arm": "fast", "replica": "r1", "families": m.snapshot()})
    body, ctype = board.exposition()
    assert ctype.startswith("text/plain; version=0.0.4")
    f = _families(body.decode())
    lab = {"model_name": "M", "arm": "fast", "method": "sparsespec-l"}
    reasons = {r: _value(f, "vllm:request_success_total", finished_reason=r, **lab)
               for r in ("stop", "length", "abort", "error")}
    assert reasons == {"stop": 1, "length": 1, "abort": 1, "error": 1}
    assert _value(f, "vllm:prompt_tokens_total", **lab) == 30 + 7 + 4
    assert _value(f, "vllm:generation_tokens_total", **lab) == 9 + 2 + 1
    assert _value(f, "vllm:time_to_first_token_seconds_count", **lab) == 3
    assert _value(f, "vllm:time_to_first_token_seconds_sum", **lab) == pytest.approx(0.35)
    assert _value(f, "vllm:inter_token_latency_seconds_count", **lab) == 3  # one per step gap
    assert _value(f, "vllm:inter_token_latency_seconds_bucket", le="0.025", **lab) == 1  # vLLM's buckets
    assert _value(f, "vllm:time_per_output_token_seconds_sum", **lab) == pytest.approx(0.55)
    assert _value(f, "vllm:request_time_per_output_token_seconds_count", **lab) == 1
    assert _value(f, "vllm:e2e_request_latency_seconds_count", **lab) == 2  # finished requests (200)
    assert "vllm:request_queue_time_seconds_sum" not in f  # queue_s is not vLLM's WAITING time
    assert _value(f, "vllm:request_prompt_tokens_bucket", le="50.0", **lab) == 2
    assert _value(f, "vllm:request_params_max_tokens_count", **lab) == 1
    assert _value(f, "vllm:spec_decode_num_drafts_total", **lab) == 3
    assert _value(f, "vllm:spec_decode_num_draft_tokens_total", **lab) == 12
    assert _value(f, "vllm:spec_decode_num_accepted_tokens_total", **lab) == 6
    per_pos = [_value(f, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=p, **lab) for p in range(4)]
    assert per_pos == [3, 2, 1, 0] and sum(per_pos) == 6  # steps accepting >= pos+1 drafts (vLLM's invariant)
    assert _value(f, "vllm:num_requests_running", **lab) == 2 and _value(f, "vllm:num_requests_waiting", **lab) == 1
    assert not any(n.endswith("_created") for n in f)
    ar = VllmArmMetrics("M", "ar", "ar", 512, 0, lambda: 0, lambda: 0)
    ar.observe({"status": 200, "finish_reason": "stop", "prompt_tokens": 3, "output_tokens": 2},
               {"num_spec_steps": 0, "num_draft_tokens": 0, "num_accepted_draft_tokens": 0})
    assert not any(fam[0].startswith("vllm:spec_decode") for fam in ar.snapshot())  # only arms that draft


def test_metrics_board_sums_replicas_and_drops_stale_gauges():
    from cluster.serve.endpoint import MetricsBoard, VllmArmMetrics

    now = [100.0]
    board = MetricsBoard(gauge_ttl_s=30.0, clock=lambda: now[0])
    reps = [VllmArmMetrics("M", "a", "ar", 512, 0, lambda: 1, lambda: 0) for _ in range(2)]
    for i, r in enumerate(reps):
        r.observe({"status": 200, "finish_reason": "stop", "prompt_tokens": 10 * (i + 1), "output_tokens": 1})
        board.update({"arm": "a", "replica": f"r{i}", "families": r.snapshot()})
    board.update({"arm": "a", "replica": "r0", "families": reps[0].snapshot()})  # a later scrape: replaced
    f = _families(board.exposition()[0].decode())
    assert _value(f, "vllm:prompt_tokens_total", arm="a") == 30  # r0 + r1, r0 not counted twice
    assert _value(f, "vllm:num_requests_running", arm="a") == 2
    now[0] += 31  # r1 has not answered for a while (gone); r0 answers again
    board.update({"arm": "a", "replica": "r0", "families": reps[0].snapshot()})
    f = _families(board.exposition()[0].decode())
    assert _value(f, "vllm:prompt_tokens_total", arm="a") == 30  # counters stay monotonic
    assert _value(f, "vllm:num_requests_running", arm="a") == 1  # a gone replica runs nothing
    assert board.exposition("application/openmetrics-text; version=1.0.0")[1].startswith(
        "application/openmetrics-text")


# ---------------------------------------------------------------- the HTTP routes, without Ray
class _Call:
    """A handle method's ``.remote()`` (awaitable) over a local function."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args, **kwargs):
        async def run():
            return self.fn(*args, **kwargs)
        return run()


class _Stream:
    """What ``handle.options(stream=True).generate.remote(...)`` returns, over a local ArmServer."""

    def __init__(self, agen):
        self.agen = agen

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.agen.__anext__()

    def cancel(self):
        asyncio.get_running_loop().create_task(self.agen.aclose())


class _LocalArm:
    """A stand-in for an arm's ``DeploymentHandle``: the real ``ArmServer``, in this process."""

    def __init__(self, server):
        self.server = server
        self.state = _Call(server.state)
        self.metrics_snapshot = _Call(server.metrics_snapshot)
        self.generate = type("G", (), {"remote": lambda _, payload: _Stream(server.generate(payload))})()

    def options(self, **_):
        return self


@pytest.fixture(scope="module")
def http(tiny):
    """The ``Router``'s FastAPI routes over a ``Gateway`` and two in-process arms (ar, sparsespec-l
    at k 4), served by FastAPI's TestClient; Serve's lookup of the current replica is pointed at
    this router."""
    from fastapi.testclient import TestClient
    from ray import serve
    from transformers import AutoTokenizer

    from cluster.serve.endpoint import Gateway, Router, fastapi_app

    common = {"model": str(tiny), "threads": 1, "db": "", "device": "cpu", "max_num_seqs": 2,
              "arms": [{"method": "ar"}, {"method": "sparsespec-l", "options": {"k": 4}}]}
    arms = {name: ArmServer(common, name) for name in ("ar", "sparsespec-l")}
    router_cls = next(c for c in Router.func_or_class.__mro__ if "_setup" in vars(c))  # the class Serve wraps
    router = object.__new__(router_cls)
    router._setup(Gateway(parse_args(common), AutoTokenizer.from_pretrained(tiny), window=512),
                  {n: _LocalArm(a) for n, a in arms.items()})
    mp = pytest.MonkeyPatch()
    mp.setattr(serve, "get_replica_context", lambda: type("Ctx", (), {"servable_object": router})())
    with TestClient(fastapi_app) as client:
        yield {"client": client, "arms": arms, "model": str(tiny), "router": router}
    mp.undo()
    for a in arms.values():
        a.shutdown()


def test_health_version_tokenize_routes(http):
    import importlib.metadata

    c, m = http["client"], http["model"]
    r = c.get("/health")
    assert r.status_code == 200 and r.content == b""
    assert c.get("/healthz").json()["status"] == "ok"  # kept as it was
    assert c.get("/version").json() == {"version": importlib.metadata.version("sparsespec")}
    t = c.post("/tokenize", json={"model": m, "prompt": "Hello world"})
    assert t.status_code == 200 and t.json()["count"] == len(t.json()["tokens"]) > 0
    assert c.post("/detokenize", json={"model": m, "tokens": t.json()["tokens"]}).json() == {"prompt": "Hello world"}
    for path, body, status, param in (("/tokenize", {"model": "nosuch", "prompt": "x"}, 404, "model"),
                                      ("/tokenize", {"model": m}, 400, "prompt"),
                                      ("/detokenize", {"tokens": [10 ** 9]}, 400, "tokens")):
        r = c.post(path, json=body)
        err = r.json()["error"]  # the OpenAI error body of the other routes
        assert r.status_code == status and err["param"] == param and err["message"] and err["type"] and err["code"]
    r = c.post("/v1/chat/completions", json={"model": m, "messages": [{"role": "user", "content": "x"}],
                                             "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    http["arms"]["ar"].dead = "engine thread died: test"
    try:
        r = c.get("/health")
        assert r.status_code == 503 and r.content == b""
    finally:
        http["arms"]["ar"].dead = None


def test_metrics_route_counts_what_the_requests_measured(http):
    c, m = http["client"], http["model"]
    bodies = {}
    for arm in ("ar", "sparsespec-l"):
        r = c.post("/v1/completions", json={"model": f"{m}:{arm}", "prompt": [5, 9, 200, 31, 7] * 6,
                                            "max_tokens": 24, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        bodies[arm] = r.json()
    r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    f = _families(r.text)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket", "vllm:time_per_output_token_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:spec_decode_num_drafts_total",
                 "vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_per_pos_total"):
        assert name in f, name
    assert all({"model_name", "arm", "method"} <= set(lab) for samples in f.values() for lab, _ in samples)
    for arm, b in bodies.items():
        lab = {"model_name": m, "arm": arm, "method": arm}
        assert _value(f, "vllm:request_success_total", finished_reason="length", **lab) == 1
        assert _value(f, "vllm:prompt_tokens_total", **lab) == b["usage"]["prompt_tokens"] == 30
        assert _value(f, "vllm:generation_tokens_total", **lab) == b["usage"]["completion_tokens"] == 24
        assert _value(f, "vllm:time_to_first_token_seconds_sum", **lab) == pytest.approx(b["timing"]["ttft_s"])
        assert _value(f, "vllm:e2e_request_latency_seconds_sum", **lab) == pytest.approx(b["timing"]["e2el_s"])
        assert _value(f, "vllm:inter_token_latency_seconds_count", **lab) == b["timing"]["num_chunks"] - 1
        assert _value(f, "vllm:num_requests_running", **lab) == 0 and _value(f, "vllm:num_requests_waiting", **lab) == 0
    spec, lab = bodies["sparsespec-l"]["speculation"], {"arm": "sparsespec-l"}
    assert spec["num_draft_tokens"] > 0  # it drafted: a real check
    assert _value(f, "vllm:spec_decode_num_drafts_total", **lab) == spec["num_spec_steps"]
    assert _value(f, "vllm:spec_decode_num_draft_tokens_total", **lab) == spec["num_draft_tokens"]
    assert _value(f, "vllm:spec_decode_num_accepted_tokens_total", **lab) == spec["num_accepted_draft_tokens"]
    per_pos = [_value(f, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=p, **lab) for p in range(4)]
    assert sum(per_pos) == spec["num_accepted_draft_tokens"] and per_pos == sorted(per_pos, reverse=True)
    assert not any(lab.get("arm") == "ar" for lab, _ in f["vllm:spec_decode_num_drafts_total"])


@pytest.mark.parametrize("chat", [False, True])
def test_stream_continuous_usage_stats_puts_usage_in_every_chunk(http, chat):
    """guidellm's streaming body (``stream_options`` with vLLM's ``continuous_usage_stats``,
    ``stop: null``, ``ignore_eos``): every chunk carries ``usage`` with the tokens so far, as
    vLLM sends it; without the flag only the last chunk has ``usage``."""
    import json as _json

    c, m = http["client"], http["model"]
    body = {"model": m, "max_tokens": 6, "stop": None, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    body.update({"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": [5, 9, 200, 31, 7]})
    path = "/v1/chat/completions" if chat else "/v1/completions"
    for continuous in (True, False):
        body["stream_options"]["continuous_usage_stats"] = continuous
        r = c.post(path, json=body)
        assert r.status_code == 200, r.text
        objs = [_json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]
        assert r.text.endswith("data: [DONE]\n\n") and objs[-1]["choices"] == []
        final = objs[-1]["usage"]
        assert final["completion_tokens"] == 6 and final["total_tokens"] == final["prompt_tokens"] + 6
        if not continuous:
            assert all("usage" not in o for o in objs[:-1])
            continue
        used = [o["usage"] for o in objs]
        assert all(u["prompt_tokens"] == final["prompt_tokens"] for u in used)
        assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in used)
        done = [u["completion_tokens"] for u in used]
        assert done == sorted(done) and done[-2] == 6  # the chunk with finish_reason has them all
        if chat:
            assert objs[0]["usage"]["completion_tokens"] == 0  # the role chunk, before any token


# ---------------------------------------------------------------- an arm that fails mid-request
class _DyingArm:
    """An arm handle whose replica dies during the request: it accepts it (``started``), sends
    ``n`` deltas, then its call raises ``exc`` (what a Serve handle raises when the replica
    process is killed: ``ActorDiedError``); ``n=None`` raises before ``started``."""

    def __init__(self, n, exc):
        async def gen(payload):
            if n is None:
                raise exc
            yield {"type": "started", "arm": "sparsespec-l", "method": "sparsespec-l", "pid": 0}
            for i in range(n):
                yield {"type": "delta", "text": f"t{i}", "token_ids": [7], "step": i + 1, "finished": False}
            raise exc

        self.generate = type("G", (), {"remote": lambda _, payload: _Stream(gen(payload))})()

    def options(self, **_):
        return self


def _actor_died():
    from ray.exceptions import ActorDiedError

    return ActorDiedError()  # built without a cluster, as the handle raises it


@pytest.fixture
def dying(http):
    """``install(n, exc)`` puts a ``_DyingArm`` in place of ``sparsespec-l``; the Router's rows go
    to the returned list."""
    mp = pytest.MonkeyPatch()
    rows = []
    mp.setattr(http["router"].log, "put", rows.append)

    def install(n, exc):
        mp.setitem(http["router"].arms, "sparsespec-l", _DyingArm(n, exc))
        return rows

    yield install
    mp.undo()


def _sse(text):
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), text
    return [e[len("data: "):] for e in events]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("n,exc", [(0, _actor_died), (2, _actor_died), (2, lambda: RuntimeError("boom")),
                                   (1, asyncio.CancelledError)])
def test_a_replica_dying_mid_stream_ends_the_stream_with_an_error_event_and_done(http, dying, chat, n, exc):
    import json as _json

    e = exc()
    rows = dying(n, e)
    m = http["model"]
    body = ({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    r = http["client"].post(f"/v1/{'chat/' if chat else ''}completions",
                            json={"model": f"{m}:sparsespec-l", "max_tokens": 8, "stream": True, **body})
    assert r.status_code == 200 and r.headers["x-sparsespec-arm"] == "sparsespec-l"
    data = _sse(r.text)
    assert data[-1] == "[DONE]"
    err = _json.loads(data[-2])["error"]
    assert err["code"] == 502 and err["type"] == "server_error" and err["param"] is None
    assert "failed mid-request" in err["message"] and type(e).__name__ in err["message"]
    chunks = [_json.loads(d) for d in data[:-2]]
    if chat:
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    else:
        text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == "".join(f"t{i}" for i in range(n))  # what was streamed before the failure
    [row] = rows
    assert row["status"] == 502 and row["finish_reason"] == "error" and row["arm"] == "sparsespec-l"
    assert row["request_id"] == r.headers["x-sparsespec-request-id"] and row["stream"] is True
    assert row["output_tokens"] == n and row["prompt_tokens"] > 0 and row["max_tokens"] == 8
    assert "failed mid-request" in row["error"]


@pytest.mark.parametrize("n,exc", [(0, _actor_died), (2, _actor_died), (1, asyncio.CancelledError)])
def test_a_replica_dying_mid_request_is_a_5xx_with_the_openai_error_body(http, dying, n, exc):
    rows = dying(n, exc())
    r = http["client"].post("/v1/completions", json={"model": f"{http['model']}:sparsespec-l", "prompt": "hi",
                                                     "max_tokens": 8})
    assert r.status_code == 502 and r.headers["x-sparsespec-arm"] == "sparsespec-l"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "server_error" and err["code"] == "arm_failed" and "failed mid-request" in err["message"]
    [row] = rows
    assert row["status"] == 502 and row["finish_reason"] == "error" and row["stream"] is False
    assert row["output_tokens"] == n and row["request_id"] == r.headers["x-sparsespec-request-id"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_replica_dead_before_it_accepts_the_request_is_a_503(http, dying, stream):
    rows = dying(None, _actor_died())
    r = http["client"].post("/v1/completions", json={"model": f"{http['model']}:sparsespec-l", "prompt": "hi",
                                                     "max_tokens": 8, "stream": stream})
    assert r.status_code == 503 and r.json()["error"]["code"] == "arm_unavailable"
    [row] = rows
    assert row["status"] == 503 and row["arm"] == "sparsespec-l" and "ActorDiedError" in row["error"]


@pytest.mark.parametrize("stream", [False, True])
def test_an_arm_whose_own_code_fails_mid_request_reports_a_500(http, stream, monkeypatch):
    """The real arm: its request code raises after tokens were produced. The arm stores the row
    (500, finish_reason error: vLLM's name) and counts it in vllm:request_success{error}; the
    client gets the error event and [DONE], or a 500 with the OpenAI body."""
    import json as _json

    import sparsespec.stats

    def broken(stats):
        raise RuntimeError("stats broke")

    c, m, arm = http["client"], http["model"], http["arms"]["ar"]
    before = _value(_families(c.get("/metrics").text), "vllm:request_success_total", arm="ar",
                    finished_reason="error")
    rows = []
    monkeypatch.setattr(arm.log, "put", rows.append)
    monkeypatch.setattr(http["router"].log, "put", rows.append)
    monkeypatch.setattr(sparsespec.stats, "spec_decode_metrics", broken)
    r = c.post("/v1/completions", json={"model": f"{m}:ar", "prompt": [5, 9, 200], "max_tokens": 4,
                                        "temperature": 0, "ignore_eos": True, "stream": stream})
    if stream:
        assert r.status_code == 200
        data = _sse(r.text)
        assert data[-1] == "[DONE]"
        err = _json.loads(data[-2])["error"]
        assert err["code"] == 500 and err["type"] == "server_error"
    else:
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["type"] == "server_error" and set(err) == {"message", "type", "param", "code"}
    assert "stats broke" in err["message"]
    [row] = rows
    assert row["status"] == 500 and row["finish_reason"] == "error" and row["output_tokens"] == 4
    after = _value(_families(c.get("/metrics").text), "vllm:request_success_total", arm="ar", finished_reason="error")
    assert after == before + 1
    assert arm.state()["open_streams"] == 0 and arm.state()["running"] == 0

"""The Serve A/B endpoint on local Ray with tiny random-weight models (plumbing, not speed):
routes, the split, streaming, bad input, the API key, overload, aborts, request rows, and a
killed replica. The real SmolLM2 run is the load test (benchmarks/RESULTS.md)."""
import json
import os
import signal
import socket
import threading
import time

import pytest

pytestmark = pytest.mark.slow

KEY = "sk-test-123"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(ray_session, tmp_path_factory):
    """Two apps on one Serve: ``ab`` (ar 0.7 / sparsespec-l 0.3, API key, 2 slots per arm) and
    ``slow`` under /slow (one ar arm whose steps sleep, 2 slots, tight Serve queue bounds)."""
    import httpx
    from ray import serve

    from cluster.serve.endpoint import build_app
    from helpers import tiny_model_like

    root = tmp_path_factory.mktemp("serve")
    model = tiny_model_like(root / "tiny", max_pos=512)
    db = f"sqlite:///{root}/serve.db"
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    common = {"model": str(model), "threads": 1, "arm_num_cpus": 0, "db": db, "device": "cpu"}
    serve.run(build_app({**common, "api_key": KEY, "max_num_seqs": 2, "experiment": "ab",
                         "arms": [{"method": "ar", "weight": 0.7},
                                  {"method": "sparsespec-l", "options": {"k": 4}, "weight": 0.3}]}),
              name="ab", route_prefix="/")
    serve.run(build_app({**common, "max_num_seqs": 2, "experiment": "slow", "max_ongoing_requests": 2,
                         "max_queued_requests": 1, "engine_factory": "cluster.sweep.testing:slow_engine_factory",
                         "factory_kwargs": {"step_sleep_s": 0.1}, "arms": [{"method": "ar"}]}),
              name="slow", route_prefix="/slow")
    base = f"http://127.0.0.1:{port}"
    client = httpx.Client(base_url=base, timeout=120, headers={"Authorization": f"Bearer {KEY}"})
    yield {"base": base, "client": client, "model": str(model), "db": db, "root": root}
    client.close()
    serve.delete("ab")
    serve.delete("slow")
    serve.shutdown()


def _complete(c, model, prompt="The quick brown fox", n=8, path="/v1/completions", **kw):
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, **kw}
    return c.post(path, json=body)


def _sse(text: str) -> list:
    events = [ln[len("data: "):] for ln in text.split("\n") if ln.startswith("data: ")]
    assert events and events[-1] == "[DONE]", text[-300:]
    return [json.loads(e) for e in events[:-1]]


def _rows(served, experiment="ab", wait_for=None):
    from cluster.results.store import open_store

    for _ in range(50):  # the writer flushes every 0.5 s
        rows = open_store(served["db"]).serve_requests(experiment)
        if wait_for is None or wait_for(rows):
            return rows
        time.sleep(0.2)
    return rows


def test_models_and_health(served):
    c, m = served["client"], served["model"]
    ids = [d["id"] for d in c.get("/v1/models").json()["data"]]
    assert ids == [m, f"{m}:ar", f"{m}:sparsespec-l"]
    h = c.get("/healthz")
    assert h.status_code == 200 and set(h.json()["arms"]) == {"ar", "sparsespec-l"}


def test_api_key_missing_or_wrong_is_401_and_reaches_no_engine(served):
    import httpx

    before = served["client"].get("/healthz").json()["arms"]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(served["base"] + "/v1/completions", headers=headers,
                       json={"model": served["model"], "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(served["base"] + "/v1/models").status_code == 401
    after = served["client"].get("/healthz").json()["arms"]
    assert all(after[a]["num_steps"] == before[a]["num_steps"] for a in after)


def test_sessions_are_sticky_and_the_split_is_weighted(served):
    from cluster.serve.endpoint import pick_arm

    c, m = served["client"], served["model"]
    weights = [("ar", 0.7), ("sparsespec-l", 0.3)]
    got = {}
    for i in range(40):
        s = f"user-{i}"
        r = c.post("/v1/completions", headers={"x-session-id": s},
                   json={"model": m, "prompt": "hi", "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200
        got[s] = r.headers["x-sparsespec-arm"]
        assert r.json()["arm"] == got[s] and r.headers["x-sparsespec-method"] == got[s]
        assert got[s] == pick_arm(weights, s)  # the server uses the session's fixed point
    share = sum(a == "ar" for a in got.values()) / len(got)
    assert 0.45 < share < 0.95 and set(got.values()) == {"ar", "sparsespec-l"}
    for s in ("user-1", "user-2", "user-3"):  # sticky: the same session, the same arm, every time
        for _ in range(3):
            r = c.post("/v1/completions", headers={"x-session-id": s},
                       json={"model": m, "prompt": "again", "max_tokens": 1})
            assert r.headers["x-sparsespec-arm"] == got[s]
    # the OpenAI `user` field is a session too
    arms = {c.post("/v1/completions", json={"model": m, "prompt": "u", "max_tokens": 1, "user": "user-7"}
                   ).headers["x-sparsespec-arm"] for _ in range(3)}
    assert arms == {got["user-7"]}


def test_an_explicit_arm_bypasses_the_split(served):
    c, m = served["client"], served["model"]
    from cluster.serve.endpoint import pick_arm

    s = next(f"s{i}" for i in range(100) if pick_arm([("ar", 0.7), ("sparsespec-l", 0.3)], f"s{i}") == "ar")
    r = c.post("/v1/completions", headers={"x-session-id": s},
               json={"model": f"{m}:sparsespec-l", "prompt": "x", "max_tokens": 2})
    assert r.headers["x-sparsespec-arm"] == "sparsespec-l"
    r = c.post("/v1/completions", headers={"x-session-id": s, "x-arm": "sparsespec-l"},
               json={"model": m, "prompt": "x", "max_tokens": 2})
    assert r.headers["x-sparsespec-arm"] == "sparsespec-l"
    r = c.post("/v1/completions", headers={"x-arm": "ar"}, json={"model": f"{m}:sparsespec-l", "prompt": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-arm"
    r = c.post("/v1/completions", headers={"x-arm": "nosuch"}, json={"model": m, "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "x-arm"


def test_greedy_is_lossless_through_the_server_and_streams_concatenate(served):
    import sparsespec

    c, m = served["client"], served["model"]
    prompt = [1, 17, 300, 42, 9, 9, 250, 17, 300, 42] * 3
    ref = sparsespec.Engine.from_pretrained(m).generate([prompt], method="ar", max_new_tokens=24, ignore_eos=True)[0]
    for arm in ("ar", "sparsespec-l"):
        full = _complete(c, f"{m}:{arm}", prompt, 24)
        assert full.status_code == 200
        body = full.json()
        assert body["choices"][0]["text"] == ref.text and body["usage"]["completion_tokens"] == 24
        assert body["object"] == "text_completion" and body["choices"][0]["finish_reason"] == "length"
        streamed = _complete(c, f"{m}:{arm}", prompt, 24, stream=True, stream_options={"include_usage": True})
        assert streamed.headers["content-type"].startswith("text/event-stream")
        chunks = _sse(streamed.text)
        assert "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"]) == ref.text
        last = chunks[-1]
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 24 and last["arm"] == arm
        spec = last["speculation"]
        assert set(spec) >= {"mean_acceptance_length", "draft_acceptance_rate", "num_draft_tokens",
                             "num_accepted_draft_tokens", "num_spec_steps", "acceptance_histogram"}
        if arm == "sparsespec-l":
            assert spec["num_draft_tokens"] > 0  # drafted: the equality above is a real check
            assert body["speculation"]["num_draft_tokens"] > 0
        else:
            assert spec["num_draft_tokens"] == 0
    # chat: the template is applied; stream and non-stream agree; the official client parses both
    import openai

    oc = openai.OpenAI(base_url=served["base"] + "/v1", api_key=KEY)
    msgs = [{"role": "user", "content": "Name three colours."}]
    text = oc.chat.completions.create(model=f"{m}:sparsespec-l", messages=msgs, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].message.content
    parts = [ch.choices[0].delta.content or "" for ch in oc.chat.completions.create(
        model=f"{m}:sparsespec-l", messages=msgs, max_tokens=12, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if ch.choices]
    assert "".join(parts) == text and text
    tok_prompt = sparsespec.Engine.from_pretrained(m).tokenizer.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=False)
    ref_chat = sparsespec.Engine.from_pretrained(m).generate(
        [sparsespec.Engine.from_pretrained(m).tokenizer(tok_prompt, add_special_tokens=False).input_ids],
        method="ar", max_new_tokens=12, ignore_eos=True)[0]
    assert text == ref_chat.text
    comp = oc.completions.create(model=m, prompt="Once upon", max_tokens=3, temperature=0)
    assert comp.choices[0].finish_reason in ("length", "stop") and comp.usage.completion_tokens >= 1


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"prompt": "x"}, 400, "model"),
    ({"model": "MODEL"}, 400, "prompt"),
    ({"model": "nosuch", "prompt": "x"}, 404, "model"),
    ({"model": "MODEL:nosuch", "prompt": "x"}, 404, "model"),
    ({"model": "MODEL", "prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ({"model": "MODEL", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": "MODEL", "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"model": "MODEL", "prompt": "x", "n": 2}, 400, "n"),
    ({"model": "MODEL", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "MODEL", "prompt": "x", "max_tokens": 600}, 400, "max_tokens"),
    ({"model": "MODEL", "prompt": [5] * 600, "max_tokens": 4}, 400, "prompt"),
    ({"model": "MODEL", "prompt": [1, 10 ** 9]}, 400, "prompt"),
    ({"model": "MODEL", "prompt": ""}, 400, "prompt"),
    ({"model": "MODEL", "prompt": "x", "logprobs": 2}, 400, "logprobs"),
    ({"model": "MODEL", "prompt": "x", "stop": [""]}, 400, "stop"),
    ({"model": "MODEL", "prompt": "x", "max_tokens": 4, "min_tokens": 4}, 400, "min_tokens"),
    ({"model": "MODEL", "prompt": "x", "seed": "abc"}, 400, "seed"),
    ({"model": "MODEL", "messages": []}, 400, "messages"),
    ({"model": "MODEL", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ({"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10 ** 6},
     400, "max_completion_tokens"),
])
def test_bad_input_is_4xx_naming_the_field_and_the_server_keeps_serving(served, body, status, param):
    c, m = served["client"], served["model"]
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    if isinstance(body, dict):
        body = {k: (v.replace("MODEL", m) if isinstance(v, str) and k == "model" else v) for k, v in body.items()}
        r = c.post(path, json=body)
    else:
        r = c.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"]
    ok = c.post("/v1/completions", json={"model": m, "prompt": "still here", "max_tokens": 2})
    assert ok.status_code == 200


def _fire(base, m, n, gap_s, max_tokens=12):
    import httpx

    results = []

    def send(i):
        results.append(httpx.post(base + "/v1/completions", timeout=120,
                                  json={"model": m, "prompt": f"p{i}", "max_tokens": max_tokens, "temperature": 0,
                                        "ignore_eos": True}))

    threads = [threading.Thread(target=send, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
        time.sleep(gap_s)
    for t in threads:
        t.join()
    return results


def test_two_concurrent_requests_share_engine_steps(served):
    # the slow arm: 0.1 s per step, 2 slots; the second request arrives while the first decodes
    results = _fire(served["base"] + "/slow", served["model"], 2, 0.3)
    assert [r.status_code for r in results] == [200, 200], [r.text[:200] for r in results]
    assert [r.json()["timing"]["max_batch"] for r in results] == [2, 2]  # decoded in the same forwards


def test_overload_is_503_and_the_arm_keeps_serving(served):
    import httpx

    base = served["base"] + "/slow"
    results = _fire(base, served["model"], 8, 0.02)
    codes = [r.status_code for r in results]
    # 2 in flight + 1 queued at the arm (Serve's bounds); the rest is refused at once, not queued
    assert codes.count(503) >= 1 and codes.count(200) >= 1 and set(codes) <= {200, 503}, codes
    assert all(r.json()["error"]["code"] == "overloaded" and r.headers["x-sparsespec-arm"] == "ar"
               for r in results if r.status_code == 503)
    assert httpx.get(base + "/healthz").status_code == 200
    assert _fire(base, served["model"], 1, 0)[0].status_code == 200


def test_a_disconnected_stream_frees_its_slot(served):
    import httpx

    base, m = served["base"] + "/slow", served["model"]
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", base + "/v1/completions",
                      json={"model": m, "prompt": "long", "max_tokens": 400, "stream": True, "ignore_eos": True,
                            "temperature": 0}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # one chunk, then hang up (400 tokens would take 40 s)
    for _ in range(100):
        st = httpx.get(base + "/healthz").json()["arms"]["ar"]
        if st["running"] == 0 and st["num_aborted"] >= 1:
            break
        time.sleep(0.1)
    assert st["running"] == 0 and st["num_aborted"] >= 1 and st["free_slots"] == 2
    rows = _rows(served, "slow", lambda rs: any(r["status"] == 499 for r in rs))
    gone = [r for r in rows if r["status"] == 499]
    assert gone and gone[0]["finish_reason"] == "abort" and gone[0]["output_tokens"] < 400


def test_request_rows_are_stored(served):
    c, m = served["client"], served["model"]
    r = c.post("/v1/completions", headers={"x-session-id": "rowtest", "x-arm": "sparsespec-l"},
               json={"model": m, "prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 24, "temperature": 0,
                     "ignore_eos": True})
    rid = r.headers["x-sparsespec-request-id"]
    c.post("/v1/completions", json={"model": m, "prompt": "x", "top_p": 7})
    # both rows: the writer may flush the refused request's row after the completed one's
    rows = _rows(served, "ab", lambda rs: any(x["request_id"] == rid for x in rs)
                 and any(x["status"] == 400 and "top_p" in (x["error"] or "") for x in rs))
    row = next(x for x in rows if x["request_id"] == rid)
    assert (row["arm"], row["method"], row["session"], row["status"]) == ("sparsespec-l", "sparsespec-l", "rowtest", 200)
    assert row["prompt_tokens"] == 6 and row["output_tokens"] == 24 and row["finish_reason"] == "length"
    assert 0 < row["ttft_s"] < row["e2el_s"] and row["stats"]["num_chunks"] >= 2
    assert row["stats"]["num_drafted"] == r.json()["speculation"]["num_draft_tokens"]
    assert row["stats"]["itl_p50_s"] is not None and row["stats"]["tpot_s"] > 0
    refused = [x for x in rows if x["status"] == 400 and "top_p" in (x["error"] or "")]
    assert refused and refused[-1]["arm"] is None and not row["warmup"]
    # a warm-up (cluster.serve.loadtest marks its own) is stored flagged and left out of the A/B views
    warm = c.post("/v1/completions", headers={"x-sparsespec-warmup": "1"},
                  json={"model": m, "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0})
    wid = warm.headers["x-sparsespec-request-id"]
    from cluster.results.store import open_store

    for _ in range(50):
        every = open_store(served["db"]).serve_requests("ab", warmups=True)
        if any(x["request_id"] == wid for x in every):
            break
        time.sleep(0.2)
    assert [x["warmup"] for x in every if x["request_id"] == wid] == [True]
    assert all(x["request_id"] != wid for x in _rows(served, "ab"))


def test_prometheus_metrics_are_exported_through_ray(served):
    import httpx

    port = os.environ.get("SPARSESPEC_TEST_METRICS_PORT")
    if not port:
        pytest.skip("the Ray of this session was not started by the test fixture (no known metrics port)")
    c, m = served["client"], served["model"]
    for _ in range(2):
        assert c.post("/v1/completions", json={"model": f"{m}:sparsespec-l", "prompt": "metrics", "max_tokens": 6,
                                               "temperature": 0, "ignore_eos": True}).status_code == 200
    found = {}
    for _ in range(60):
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith("ray_sparsespec_") and 'arm="sparsespec-l"' in line:
                found[line.split("{", 1)[0]] = float(line.rsplit(" ", 1)[1])
        if {"ray_sparsespec_requests_total", "ray_sparsespec_draft_tokens_total"} <= set(found):
            break
        time.sleep(0.5)
    assert found.get("ray_sparsespec_requests_total", 0) >= 2, found
    assert found.get("ray_sparsespec_output_tokens_total", 0) >= 12
    assert found.get("ray_sparsespec_draft_tokens_total", 0) > 0
    assert any(k.startswith("ray_sparsespec_tpot_seconds") for k in found)


def test_vllm_server_routes_and_metrics_through_serve(served):
    """vLLM's routes on the deployed app (the unit tests drive them without Ray): /health and
    /version need no key (vLLM guards /v1 only), and /metrics pulls each arm replica's counts
    over Serve: a request made between two scrapes moves them by exactly its own numbers."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    base, c, m = served["base"], served["client"], served["model"]
    h = httpx.get(base + "/health")
    assert h.status_code == 200 and h.content == b""
    assert httpx.get(base + "/version").json()["version"]
    tok = httpx.post(base + "/tokenize", json={"model": m, "prompt": "metrics"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == 512

    def scrape():
        r = httpx.get(base + "/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        return {(s.name, s.labels.get("arm"), s.labels.get("finished_reason")): s.value
                for fam in text_string_to_metric_families(r.text) for s in fam.samples
                if "position" not in s.labels and "le" not in s.labels}

    before = scrape()
    r = c.post("/v1/completions", json={"model": f"{m}:sparsespec-l", "prompt": tok["tokens"], "max_tokens": 6,
                                        "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200
    after = scrape()

    def moved(name, reason=None):
        key = (name, "sparsespec-l", reason)
        return after[key] - before.get(key, 0.0)

    assert moved("vllm:generation_tokens_total") == 6 and moved("vllm:prompt_tokens_total") == tok["count"]
    assert moved("vllm:request_success_total", "length") == 1
    assert moved("vllm:time_to_first_token_seconds_count") == 1
    assert moved("vllm:spec_decode_num_draft_tokens_total") == r.json()["speculation"]["num_draft_tokens"]
    assert ("vllm:num_requests_running", "ar", None) in after and ("vllm:spec_decode_num_drafts_total", "ar",
                                                                   None) not in after


def test_a_killed_replica_is_restarted_while_the_other_arm_answers(served):
    c, m = served["client"], served["model"]
    pid = c.get("/healthz").json()["arms"]["ar"]["pid"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.time() + 90
    other_ok = 0
    new_pid = None
    while time.time() < deadline:
        r = c.post("/v1/completions", json={"model": f"{m}:sparsespec-l", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200  # the other arm keeps answering throughout
        other_ok += 1
        h = c.get("/healthz")
        st = h.json()["arms"].get("ar", {})
        if h.status_code == 200 and st.get("pid") not in (None, pid):
            new_pid = st["pid"]
            break
        time.sleep(0.5)
    assert new_pid is not None, "Serve did not restart the killed arm"
    r = c.post("/v1/completions", json={"model": f"{m}:ar", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 200 and r.headers["x-sparsespec-arm"] == "ar" and other_ok >= 1

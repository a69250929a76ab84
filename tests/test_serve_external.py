"""The external arm (``ArmConfig.url``): an OpenAI-compatible server (``vllm serve``) as one arm of
the A/B, against a stand-in server (httpx's mock transport speaking vLLM's streaming format)."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from cluster.serve.endpoint import ExternalArmServer, parse_args

ARGS = {"model": "smollm2-135m", "db": "", "arms": [
    {"method": "ar", "weight": 0.5},
    {"method": "vllm:ngram", "url": "http://127.0.0.1:9/v1", "weight": 0.5, "served_model": "m"}]}


def test_external_arm_config_is_validated():
    a = parse_args(ARGS).arm("vllm-ngram")  # the default name: the label without ':'
    assert a.url == "http://127.0.0.1:9/v1" and a.method == "vllm:ngram"
    for arm, match in [({"method": "vllm:ar", "url": "127.0.0.1:8000"}, "http"),
                       ({"method": "vllm:ar", "url": "http://h/v1", "options": {"k": 2}}, "takes no options"),
                       ({"method": "ar", "served_model": "m"}, "served_model needs url")]:
        with pytest.raises(ValueError, match=match):
            parse_args({**ARGS, "arms": [arm]})


def sse(*chunks) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def arm_with(handler, rows):
    arm = ExternalArmServer(ARGS, "vllm-ngram")
    arm._client = httpx.AsyncClient(base_url=arm.arm.url, transport=httpx.MockTransport(handler))

    class Log:
        written = 0

        def put(self, row):
            rows.append(row)

        def close(self):
            pass

    arm.log = Log()
    return arm


def run(arm, payload):
    async def go():
        return [ev async for ev in arm.generate(payload)]

    return asyncio.run(go())


PAYLOAD = {"request_id": "r1", "prompt_ids": [5, 6, 7], "session": "s", "stream": True,
           "sampling": {"max_new_tokens": 3, "temperature": 0.0, "top_k": 0, "seed": 3, "min_new_tokens": 3,
                        "ignore_eos": True, "stop": ["\n\n"]}}


def test_external_arm_forwards_token_ids_and_records_the_row_like_ours():
    seen = {}

    def handler(request):
        seen["body"] = json.loads(request.content)
        seen["path"] = request.url.path
        spec = {"num_spec_steps": 1, "num_draft_tokens": 4, "num_accepted_draft_tokens": 2,
                "draft_acceptance_rate": 0.5, "mean_acceptance_length": 3.0, "acceptance_histogram": [0, 0, 1, 0, 0]}
        return httpx.Response(200, content=sse(
            {"choices": [{"index": 0, "text": "a", "token_ids": [11], "finish_reason": None}]},
            {"choices": [{"index": 0, "text": "bc", "token_ids": [12, 13], "finish_reason": "length"}]},
            {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
             "metrics": {"speculative_decoding": spec}}), headers={"content-type": "text/event-stream"})

    rows = []
    events = run(arm_with(handler, rows), PAYLOAD)
    body = seen["body"]
    assert seen["path"] == "/v1/completions"
    assert body["prompt"] == [5, 6, 7] and body["model"] == "m" and body["return_token_ids"] is True
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 3 and body["min_tokens"] == 3 and body["ignore_eos"] is True
    assert body["seed"] == 3 and body["stop"] == ["\n\n"] and "top_k" not in body
    assert [e["type"] for e in events] == ["started", "delta", "delta", "final"]
    assert events[0]["method"] == "vllm:ngram" and events[0]["arm"] == "vllm-ngram"
    final = events[-1]
    assert final["all_token_ids"] == [11, 12, 13] and final["all_text"] == "abc" and final["finish_reason"] == "length"
    assert final["speculation"]["num_accepted_draft_tokens"] == 2 and final["usage"]["completion_tokens"] == 3
    (row,) = rows
    assert row["warmup"] is False
    run(arm_with(handler, rows), {**PAYLOAD, "request_id": "r2", "warmup": True})
    assert rows[-1]["warmup"] is True and rows[-1]["status"] == 200
    assert row["status"] == 200 and row["arm"] == "vllm-ngram" and row["method"] == "vllm:ngram"
    assert row["output_tokens"] == 3 and row["ttft_s"] is not None and row["e2el_s"] >= row["ttft_s"]
    assert row["stats"]["num_drafted"] == 4 and row["stats"]["num_accepted"] == 2
    assert row["stats"]["num_chunks"] == 2 and len(row["stats"]["chunk_gaps_s"]) == 1


def test_external_arm_passes_on_a_refusal_and_reports_an_unreachable_server():
    rows = []
    refused = arm_with(lambda r: httpx.Response(400, json={"error": {"message": "max_tokens is too large"}}), rows)
    events = run(refused, PAYLOAD)
    assert [e["type"] for e in events] == ["error"] and events[0]["status"] == 400
    assert "max_tokens is too large" in events[0]["message"] and rows[-1]["status"] == 400

    def down(request):
        raise httpx.ConnectError("connection refused", request=request)

    events = run(arm_with(down, rows), PAYLOAD)
    assert events[0]["type"] == "error" and events[0]["status"] == 503 and rows[-1]["status"] == 503
    assert "connection refused" in events[0]["message"]

    def broken(request):  # a 500 from the server is a bad gateway here
        return httpx.Response(500, text="boom")

    events = run(arm_with(broken, rows), PAYLOAD)
    assert events[0]["status"] == 502 and rows[-1]["status"] == 502


def test_external_arm_asks_the_server_for_its_model_when_not_told():
    args = {**ARGS, "arms": [{"method": "vllm:ar", "url": "http://127.0.0.1:9/v1"}]}

    def handler(request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "served-id"}]})
        assert json.loads(request.content)["model"] == "served-id"
        return httpx.Response(200, content=sse(
            {"choices": [{"index": 0, "text": "x", "token_ids": [1], "finish_reason": "length"}]}))

    arm = ExternalArmServer(args, "vllm-ar")
    arm._client = httpx.AsyncClient(base_url=arm.arm.url, transport=httpx.MockTransport(handler))
    arm.log.close()
    rows = []
    arm.log = type("L", (), {"written": 0, "put": lambda self, r: rows.append(r), "close": lambda self: None})()
    events = run(arm, PAYLOAD)
    assert events[-1]["type"] == "final" and events[-1]["all_token_ids"] == [1] and rows[-1]["status"] == 200

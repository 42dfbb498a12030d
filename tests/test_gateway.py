"""The gateway end to end with the official `openai` client: real engine processes (a tiny scripted Qwen3,
see gateway_harness.py), real gateway processes (`render-service serve --engine/--prefill/--decode`).

Two engines with the NIXL connector serve both modes: the collocated gateway sends everything to the
decode engine; the disaggregated gateway prefills on one and decodes on the other. Every behaviour is
checked in both modes against the same expected answer, so greedy outputs are equal across modes.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import time

import httpx
import openai
import pytest

from tests.gateway_harness import (
    LOOP_SCRIPT,
    LOOP_START,
    PLAIN_SCRIPT,
    PLAIN_TEXT,
    TOOL_SCRIPT,
    engine_process,
    gateway_process,
    wait_until_idle,
    write_scripted_qwen3,
)

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    model = write_scripted_qwen3(tmp_path_factory.mktemp("gateway") / "tiny")
    procs = []
    try:
        prefill = engine_process(model, kv_engine_id="gw-prefill", wait=False)
        procs.append(prefill)
        decode = engine_process(model, kv_engine_id="gw-decode", wait=False)
        procs.append(decode)
        victim = engine_process(model, wait=False)  # killed by the failure test
        procs.append(victim)
        for p in (prefill, decode, victim):
            p.wait_healthy()
        colloc = gateway_process(model, ["--engine", decode.url])
        procs.append(colloc)
        disagg = gateway_process(model, ["--prefill", prefill.url, "--decode", decode.url])
        procs.append(disagg)
        yield {"model": model, "prefill": prefill, "decode": decode, "victim": victim, "collocated": colloc,
               "disaggregated": disagg}
    finally:
        for p in reversed(procs):
            p.stop()


@pytest.fixture(params=["collocated", "disaggregated"])
def mode(request):
    return request.param


def client(stack, mode) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack[mode].url + "/v1", api_key="unused", max_retries=0, timeout=120)


def fold_chat_stream(chunks) -> dict:
    """What a client reconstructs from chat chunks."""
    content, reasoning, calls, finish, usage, roles = [], [], {}, None, None, []
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            if delta.role:
                roles.append(delta.role)
            if delta.content:
                content.append(delta.content)
            extra = delta.model_extra or {}
            if extra.get("reasoning"):
                reasoning.append(extra["reasoning"])
            for tc in delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = tc.id or call["id"]
                if tc.function and tc.function.name:
                    call["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    call["arguments"] += tc.function.arguments
            if choice.finish_reason:
                finish = choice.finish_reason
    return {"content": "".join(content) or None, "reasoning": "".join(reasoning) or None,
            "calls": [calls[i] for i in sorted(calls)], "finish": finish, "usage": usage, "roles": roles}


# ----------------------------------------------------------------------------------------- chat


def test_chat_tool_call_with_reasoning(stack, mode):
    r = client(stack, mode).chat.completions.create(model="tiny", messages=USER, tools=TOOLS, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.model_extra["reasoning"] == "Need weather"
    assert not choice.message.content
    (call,) = choice.message.tool_calls
    # the model wrote {"city":"Paris"}; vLLM's parsers (and so a non-streamed answer) give json.dumps' spacing
    assert call.function.name == "get_weather" and call.function.arguments == '{"city": "Paris"}'
    assert call.id.startswith("chatcmpl-tool-")
    assert r.usage.completion_tokens == len(TOOL_SCRIPT) and r.usage.prompt_tokens > 50
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # what vllm serve adds: the tokens between <think> and </think>, the configuration fingerprint, and no
    # stop_reason for the model's own EOS (<|im_end|>; the engine names it, as vLLM's tokens-only engine does)
    assert r.usage.completion_tokens_details.reasoning_tokens == 2  # "Need", " weather"
    assert r.system_fingerprint.startswith("fp1-")
    assert choice.model_extra["stop_reason"] is None


def test_chat_stream_folds_to_the_non_streaming_answer(stack, mode):
    c = client(stack, mode)
    batch = c.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, temperature=0)
    chunks = list(c.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, temperature=0, stream=True))
    folded = fold_chat_stream(chunks)
    assert folded["roles"] == ["assistant"] and chunks[0].choices[0].delta.role == "assistant"
    assert folded["reasoning"] == batch.choices[0].message.model_extra["reasoning"]
    assert folded["finish"] == "tool_calls"
    (call,) = folded["calls"]
    batch_call = batch.choices[0].message.tool_calls[0]
    assert call["id"].startswith("chatcmpl-tool-")  # ids derive from the request id, which differs here
    # a stream carries the model's own argument text; the non-streamed answer the same JSON, re-serialized
    assert call["name"] == batch_call.function.name and call["arguments"] == '{"city":"Paris"}'
    assert json.loads(call["arguments"]) == json.loads(batch_call.function.arguments)
    assert len(chunks) > 3  # really streamed, not one chunk
    # vllm serve stamps the fingerprint on a choice's last chunk (no usage chunk here) and on no other
    assert [c.system_fingerprint for c in chunks] == [None] * (len(chunks) - 1) + [batch.system_fingerprint]
    assert chunks[-1].choices[0].model_extra["stop_reason"] is None


def test_plain_chat_with_usage_on_every_chunk(stack, mode):
    chunks = list(client(stack, mode).chat.completions.create(
        model="tiny", messages=USER, temperature=0, stream=True, extra_body=NO_THINKING,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    folded = fold_chat_stream(chunks)
    assert folded["content"] == PLAIN_TEXT and folded["reasoning"] is None and folded["finish"] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(PLAIN_SCRIPT)
    assert all(ch.usage is not None for ch in chunks)
    counts = [ch.usage.completion_tokens for ch in chunks[:-1]]
    assert counts == sorted(counts) and counts[-1] == len(PLAIN_SCRIPT)
    assert all(ch.usage.completion_tokens_details.reasoning_tokens == 0 for ch in chunks)  # thinking off
    # with a usage chunk, vllm serve stamps the fingerprint there only
    assert [ch.system_fingerprint is not None for ch in chunks] == [False] * (len(chunks) - 1) + [True]


def test_weight_versions_for_callers_that_ask(stack, mode):
    c = client(stack, mode)
    for stream in (False, True):
        for asked in (False, True):
            extra = {**NO_THINKING, **({"return_weight_versions": True} if asked else {})}
            if stream:
                chunks = list(c.chat.completions.create(model="tiny", messages=USER, temperature=0, stream=True,
                                                        extra_body=extra))
                spans = [ch.choices[0].model_extra.get("weight_versions") for ch in chunks if ch.choices]
                assert spans[:-1] == [None] * (len(spans) - 1)  # the last chunk of the choice only
                got = spans[-1]
            else:
                got = c.chat.completions.create(model="tiny", messages=USER, temperature=0,
                                                extra_body=extra).choices[0].model_extra["weight_versions"]
            assert got == ([{"version": "default", "start": 0, "end": len(PLAIN_SCRIPT)}] if asked else None)
    r = c.completions.create(model="tiny", prompt=[LOOP_START], max_tokens=3, temperature=0,
                             extra_body={"return_weight_versions": True})
    assert r.choices[0].model_extra["weight_versions"] == [{"version": "default", "start": 0, "end": 3}]
    assert r.choices[0].model_extra["stop_reason"] is None and r.usage.completion_tokens_details is None


def test_token_ids_for_callers_that_ask(stack, mode):
    c = client(stack, mode)
    r = c.chat.completions.create(model="tiny", messages=USER, temperature=0,
                                  extra_body={**NO_THINKING, "return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == PLAIN_SCRIPT
    prompt = r.model_extra["prompt_token_ids"]
    assert prompt[-1] == 271 and len(prompt) == r.usage.prompt_tokens
    chunks = list(c.chat.completions.create(model="tiny", messages=USER, temperature=0, stream=True,
                                            extra_body={**NO_THINKING, "return_token_ids": True}))
    assert chunks[0].model_extra["prompt_token_ids"] == prompt
    streamed = [t for ch in chunks for choice in ch.choices for t in (choice.model_extra.get("token_ids") or [])]
    assert streamed == PLAIN_SCRIPT


def test_chat_logprobs_carry_the_sampled_tokens(stack, mode):
    r = client(stack, mode).chat.completions.create(model="tiny", messages=USER, temperature=0, logprobs=True,
                                                    top_logprobs=2, extra_body=NO_THINKING)
    entries = r.choices[0].logprobs.content
    assert "".join(e.token for e in entries) == PLAIN_TEXT + "<|im_end|>"  # the stop token has a logprob too
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token for e in entries)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens_cuts_the_content(stack, mode, include):
    c = client(stack, mode)
    body = {**NO_THINKING, "include_stop_str_in_output": include}
    expected = "Hello world, the sky is" if include else "Hello world, the "
    r = c.chat.completions.create(model="tiny", messages=USER, temperature=0, stop=["sky is", "never"],
                                  extra_body=body)
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == "sky is"
    assert r.usage.completion_tokens < len(PLAIN_SCRIPT)  # the engine request ended early
    folded = fold_chat_stream(c.chat.completions.create(model="tiny", messages=USER, temperature=0, stop="sky is",
                                                        stream=True, extra_body=body))
    assert folded["content"] == expected and folded["finish"] == "stop"


def test_n_greater_than_one_gives_every_choice(stack, mode):
    r = client(stack, mode).chat.completions.create(model="tiny", messages=USER, temperature=0, n=3,
                                                    extra_body=NO_THINKING)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.message.content == PLAIN_TEXT and c.finish_reason == "stop" for c in r.choices)
    assert r.usage.completion_tokens == 3 * len(PLAIN_SCRIPT)
    chunks = list(client(stack, mode).chat.completions.create(model="tiny", messages=USER, temperature=0, n=2,
                                                              stream=True, extra_body=NO_THINKING))
    for index in (0, 1):
        mine = [ch for ch in chunks if ch.choices and ch.choices[0].index == index]
        assert fold_chat_stream(mine)["content"] == PLAIN_TEXT


def test_a_stop_string_ends_every_engine_stream_of_n_choices(stack, mode):
    """n = 2 is one engine stream collocated and two in P/D: each is aborted once its choice matched."""
    decode = stack["decode"].url
    before = _generation_tokens(decode)
    body = {"model": "tiny", "prompt": [LOOP_START], "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "n": 2, "stop": ["gamma"]}
    r = httpx.post(stack[mode].url + "/v1/completions", json=body, timeout=120).json()
    assert [(c["index"], c["text"], c["finish_reason"]) for c in r["choices"]] == [(0, " beta ", "stop"), (1, " beta ", "stop")]
    texts, finish = {0: "", 1: ""}, {}
    with httpx.stream("POST", stack[mode].url + "/v1/completions", json={**body, "stream": True}, timeout=120) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        for c in json.loads(event)["choices"]:
            texts[c["index"]] += c["text"]
            if c["finish_reason"]:
                finish[c["index"]] = c["finish_reason"]
    assert texts == {0: " beta ", 1: " beta "} and finish == {0: "stop", 1: "stop"}
    state = wait_until_idle(decode)
    assert state["num_free_blocks"] == state["num_blocks"] and state["num_running"] == 0
    assert _generation_tokens(decode) - before < 100  # 4 choices of up to 200 tokens each: stopped early


# ---------------------------------------------------------------------------------- completions


def test_completions_batch_stream_and_token_ids(stack, mode):
    c = client(stack, mode)
    prompt = [9707, LOOP_START]
    loop_text = " beta gamma delta beta gamma delta"
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, n=2, logprobs=1,
                             extra_body={"return_token_ids": True})
    assert [ch.text for ch in r.choices] == [loop_text, loop_text]
    assert all(ch.finish_reason == "length" for ch in r.choices)
    assert r.choices[0].model_extra["token_ids"] == LOOP_SCRIPT * 2
    assert r.choices[0].logprobs.tokens == [" beta", " gamma", " delta"] * 2
    assert r.choices[0].logprobs.text_offset[:3] == [0, 5, 11]
    assert r.usage.prompt_tokens == 2 and r.usage.completion_tokens == 12
    chunks = list(c.completions.create(model="tiny", prompt=[prompt, [LOOP_START]], max_tokens=4, temperature=0,
                                       stream=True, stop=[" delta"], stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    finish = {}
    for ch in chunks:
        for choice in ch.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    assert texts == {0: " beta gamma", 1: " beta gamma"} and finish == {0: "stop", 1: "stop"}
    assert chunks[-1].usage.prompt_tokens == 3


def test_greedy_outputs_are_equal_across_modes(stack):
    answers = []
    for mode in ("collocated", "disaggregated"):
        c = client(stack, mode)
        tool = c.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, temperature=0,
                                         extra_body={"return_token_ids": True})
        text = c.completions.create(model="tiny", prompt="Tell me more about alpha", max_tokens=9, temperature=0,
                                    extra_body={"return_token_ids": True})
        answers.append((tool.choices[0].model_extra["token_ids"], tool.choices[0].message.tool_calls[0].function.name,
                        text.choices[0].text, text.choices[0].model_extra["token_ids"]))
    assert answers[0] == answers[1]
    assert answers[0][0] == TOOL_SCRIPT


# ------------------------------------------------------------------------------------- failures


def test_engine_4xx_reaches_the_client_with_its_status(stack, mode):
    c = client(stack, mode)
    # the render tier passes structured_outputs through; the engine's grammar compiler refuses the regex with a
    # 400 (forced tool_choice itself works: tests/test_structured_outputs.py)
    bad = {"structured_outputs": {"regex": "(ab"}}
    with pytest.raises(openai.BadRequestError) as exc:
        c.chat.completions.create(model="tiny", messages=USER, extra_body=bad)
    assert "parenthesis" in exc.value.message and exc.value.body["param"] == "sampling_params.structured_outputs"
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="tiny", messages=USER, stream=True, extra_body=bad)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="no-such-model", messages=USER)


def test_bad_bodies_get_a_4xx_error_envelope(stack, mode):
    url = stack[mode].url
    for body in (b"{", b'{"messages": 3}', b'{"messages": [], "model": "tiny"}',
                 b'{"messages": [{"role": "user", "content": "x"}], "echo": true}', b'{"prompt": "x", "max_tokens": 0}',
                 b'{"prompt": "x", "kv_transfer_params": {"remote_host": "h"}}'):
        path = "/v1/completions" if b"prompt" in body else "/v1/chat/completions"
        r = httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
        assert 400 <= r.status_code < 500, (body, r.text)
        assert set(r.json()["error"]) >= {"message", "type", "param", "code"}


def test_client_disconnect_aborts_the_engine_request_and_frees_its_blocks(stack, mode):
    decode = stack["decode"].url
    before = _generation_tokens(decode)
    max_tokens = 200
    body = {"model": "tiny", "prompt": [LOOP_START], "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", stack[mode].url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    seen += 1
                if seen == 3:
                    break  # leaving the block closes the connection mid-stream
    state = wait_until_idle(decode)
    assert state["num_free_blocks"] == state["num_blocks"] and state["num_running"] == 0
    assert _generation_tokens(decode) - before < max_tokens  # stopped well before max_tokens
    if mode == "disaggregated":
        assert wait_until_idle(stack["prefill"].url)["num_held_by_connector"] == 0


def test_one_request_id_on_concurrent_requests_serves_both_and_a_disconnect_aborts_only_its_own(stack, mode):
    # RL callers sample one request k times under one id, clients retry with theirs: vLLM serves all of them.
    url = stack[mode].url + "/v1/completions"
    headers = {"x-request-id": f"shared-id-{mode}"}
    body = {"model": "tiny", "prompt": [LOOP_START], "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=60) as a, httpx.Client(timeout=60) as b:
        with b.stream("POST", url, json={**body, "max_tokens": 60}, headers=headers) as kept:
            assert kept.status_code == 200
            kept_lines = kept.iter_lines()
            assert next(line for line in kept_lines if line.startswith("data: {"))
            with a.stream("POST", url, json={**body, "max_tokens": 400}, headers=headers) as dropped:
                assert dropped.status_code == 200
                assert next(line for line in dropped.iter_lines() if line.startswith("data: {"))
            # the dropped one went away: the gateway aborts its engine request, not the other one's
            events = [json.loads(line[6:]) for line in kept_lines if line.startswith("data: {")]
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["length"], finishes
    assert events[-1]["usage"]["completion_tokens"] == 60
    state = wait_until_idle(stack["decode"].url)
    assert state["num_free_blocks"] == state["num_blocks"] and state["num_running"] == 0


def test_sagemaker_invocations_dispatch_on_the_body_shape_and_ping_answers(stack, mode):
    with httpx.Client(base_url=stack[mode].url, timeout=120) as http:
        assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200
        chat = http.post("/invocations", json={"model": "tiny", "messages": USER, "temperature": 0, **NO_THINKING})
        assert chat.status_code == 200, chat.text
        assert chat.json()["object"] == "chat.completion"
        assert chat.json()["choices"][0]["message"]["content"] == PLAIN_TEXT
        completion = http.post("/invocations", json={"model": "tiny", "prompt": [LOOP_START], "max_tokens": 3,
                                                     "temperature": 0})
        assert completion.status_code == 200, completion.text
        assert completion.json()["object"] == "text_completion"
        assert completion.json()["usage"]["completion_tokens"] == 3
        with http.stream("POST", "/invocations", json={"model": "tiny", "prompt": [LOOP_START], "max_tokens": 2,
                                                       "stream": True}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            assert r.read().endswith(b"data: [DONE]\n\n")
        neither = http.post("/invocations", json={"model": "tiny", "input": "hi"})
        assert neither.status_code == 400
        assert neither.json()["error"]["message"].startswith("Cannot find suitable handler for request.")
        bad_chat = http.post("/invocations", json={"model": "tiny", "messages": "not a list"})
        assert bad_chat.status_code == 400 and "messages" in bad_chat.json()["error"]["message"]


def test_a_client_that_reads_slowly_holds_back_its_stream_and_loses_nothing(stack, mode):
    """A client that stops reading fills the kernel's buffers, then the gateway's: the relay stops reading the
    engine until the client catches up (slow_client_waits counts it), and the stream the client finally
    reads is whole and in order."""
    url = stack[mode].url
    # 20 alternatives per token, with their bytes: ~1.5 KB a chunk, ~300 KB in all
    body = {"model": "tiny", "messages": USER, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 20, **NO_THINKING}
    expected = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
    waits_before = httpx.get(url + "/gateway/status", timeout=10).json()["stats"]["slow_client_waits"]
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    # Before connecting: a small receive window, and a small segment size, which keeps the gateway's
    # send buffer small too (on loopback it would otherwise take megabytes before the gateway sees anything).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.connect((host, int(port)))
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    sock.settimeout(30)
    conn.sock = sock
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps({**body, "stream": True}),
                     headers={"content-type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200
        deadline = time.monotonic() + 60
        while httpx.get(url + "/gateway/status", timeout=10).json()["stats"]["slow_client_waits"] == waits_before:
            assert time.monotonic() < deadline, "the gateway never waited for the client"
            time.sleep(0.05)  # the client reads nothing meanwhile
        raw = response.read().decode()
    finally:
        conn.close()
    events = [line[6:] for line in raw.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    tokens = [t["token"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
              for t in c["choices"][0]["logprobs"]["content"]]
    assert content == expected["message"]["content"]
    assert tokens == [t["token"] for t in expected["logprobs"]["content"]] and len(tokens) == 200
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_engine_killed_mid_stream_then_retried_then_all_down(stack):
    victim = stack["victim"]
    only_victim = gateway_process(stack["model"], ["--engine", victim.url])
    both = gateway_process(stack["model"], ["--engine", victim.url, stack["decode"].url,
                                            "--prefix-affinity-blocks", "0"])
    try:
        # 1. The engine dies after the first tokens: an OpenAI-style error event, then [DONE].
        body = {"model": "tiny", "prompt": [LOOP_START], "max_tokens": 200, "temperature": 0, "stream": True,
                "ignore_eos": True}
        events = []
        with httpx.stream("POST", only_victim.url + "/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 3:
                        victim.kill()
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 502 and "engine" in error["message"] and {"type", "param"} <= set(error)
        assert all(json.loads(e)["object"] == "text_completion" for e in events[:3])

        # 2. Before the first token, a killed engine is passed over: every request lands on the live one.
        c = openai.OpenAI(base_url=both.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for stream in (False, True, False, True):
            if stream:
                text = fold_chat_stream(c.chat.completions.create(
                    model="tiny", messages=USER, temperature=0, stream=True, extra_body=NO_THINKING))["content"]
            else:
                text = c.chat.completions.create(model="tiny", messages=USER, temperature=0,
                                                 extra_body=NO_THINKING).choices[0].message.content
            assert text == PLAIN_TEXT
        status = httpx.get(both.url + "/gateway/status", timeout=10).json()
        dead = next(r for r in status["pools"]["engine"] if r["url"] == victim.url)
        assert dead["failures"] >= 1 and status["stats"]["retries"] >= 1
        scrape = httpx.get(both.url + "/metrics", timeout=10).text
        assert re.search(r"^splitserve_gateway_engine_retries_total [1-9]", scrape, re.M)
        assert re.search(r'^splitserve_gateway_engine_failures_total\{pool="engine"\} [1-9]', scrape, re.M)

        # 3. No replica left: a 503 with the error envelope, not a hang.
        with pytest.raises(openai.APIStatusError) as exc:
            openai.OpenAI(base_url=only_victim.url + "/v1", api_key="unused", max_retries=0,
                          timeout=120).chat.completions.create(model="tiny", messages=USER)
        assert exc.value.status_code == 503
    finally:
        only_victim.stop()
        both.stop()


def _generation_tokens(engine_url: str) -> float:
    text = httpx.get(engine_url + "/metrics", timeout=10).text
    return sum(float(m) for m in re.findall(r'^vllm:generation_tokens_total\{[^}]*\} ([0-9.e+]+)$', text, re.M))


"""Render and derender against vLLM's own render servers (0.32 and 0.33, tests/vllm_peers.py), on the drop-in
edges of docs/compatibility.md: what our render emits equals what theirs does, and what theirs emits (or a
client sends them) ours accepts and reads the same way. Every test skips where its peer is not installed.

Ours runs in-process over HTTP (tests/render_harness.py), with the flags start.sh gives vLLM (qwen3 reasoning
parser, hermes tool parser, auto tool choice) on the same Qwen3 fixture.
"""

from __future__ import annotations

import json

import pytest

from tests.render_harness import RenderServer, qwen3_config
from tests.vllm_peers import MODEL, needs_vllm032, needs_vllm033

pytestmark = pytest.mark.slow  # each vLLM render server takes ~30-60 s to start on a shared 2-core machine

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
STRICT_WEATHER = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
USER = [{"role": "user", "content": "Weather in Oslo?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def ours():
    with RenderServer(qwen3_config(True)) as server:
        yield server


def render(server, path: str, body: dict) -> dict | list:
    r = server.client.post(path, json=body) if hasattr(server, "client") else server.post(path, body)
    assert r.status_code == 200, r.text
    return r.json()


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": USER, "max_tokens": 50, **fields}


def set_keys(structured: dict | None) -> dict | None:
    """vLLM serializes every StructuredOutputsParams field; the ones it set are what the engine reads."""
    if structured is None:
        return None
    return {k: v for k, v in structured.items() if not k.startswith("_") and v not in (None, False)}


def same_sampling_params(mine: dict, theirs: dict) -> None:
    """Equal, but for stop_token_ids (we add the bundle's EOS ids; docs/compatibility.md) and the null
    structured_outputs keys vLLM writes."""
    mine, theirs = dict(mine), dict(theirs)
    assert theirs.pop("stop_token_ids") == [] and mine.pop("stop_token_ids") == [151645, 151643]
    assert set_keys(mine.pop("structured_outputs", None)) == set_keys(theirs.pop("structured_outputs", None))
    assert mine == theirs


# ------------------------------------------------------------------------------- forced tool choice (2)


FORCED_CASES = {
    "required": chat(tools=[WEATHER, TIME], tool_choice="required"),
    "named": chat(tools=[WEATHER, TIME], tool_choice=NAMED),
    "required_one_call_strict": chat(tools=[STRICT_WEATHER, TIME], tool_choice="required", parallel_tool_calls=False),
    "auto_with_a_strict_tool": chat(tools=[STRICT_WEATHER, TIME], tool_choice="auto"),
    "auto_one_call": chat(tools=[WEATHER, TIME], parallel_tool_calls=False),
    "auto_strict_or_json": chat(tools=[STRICT_WEATHER], response_format={"type": "json_object"}),
    "named_over_a_format": chat(tools=[WEATHER], tool_choice=NAMED, response_format={"type": "json_object"}),
}


@needs_vllm032
@pytest.mark.parametrize("case", sorted(FORCED_CASES))
def test_tool_choice_constraints_equal_vllm_032s(vllm032_render, ours, case):
    body = FORCED_CASES[case]
    mine, theirs = render(ours, "/v1/chat/completions/render", body), render(vllm032_render,
                                                                             "/v1/chat/completions/render", body)
    assert mine["token_ids"] == theirs["token_ids"]
    same_sampling_params(mine["sampling_params"], theirs["sampling_params"])
    assert mine["reasoning_ended"] == theirs["reasoning_ended"]


@needs_vllm032
def test_vllms_derender_and_ours_read_a_forced_hermes_call_alike(vllm032_render, ours):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Oslo"}}\n</tool_call>'
    for choice in ("required", NAMED):
        request = chat(tools=[WEATHER, TIME], tool_choice=choice, chat_template_kwargs={"enable_thinking": False})
        gen = render(ours, "/v1/chat/completions/render", request)
        ids = ours.client.post("/tokenize", json={"model": MODEL, "prompt": call}).json()["tokens"]
        body = {"model": MODEL, "chat_request": request, "prompt_token_ids": gen["token_ids"],
                "generate_response": {"request_id": "g", "choices": [{"index": 0, "token_ids": ids,
                                                                       "finish_reason": "stop"}]}}
        mine = render(ours, "/v1/chat/completions/derender", body)["choices"][0]
        theirs = render(vllm032_render, "/v1/chat/completions/derender", body)["choices"][0]
        assert mine["message"]["content"] == theirs["message"]["content"] == ""
        assert [c["function"] for c in mine["message"]["tool_calls"]] == \
            [c["function"] for c in theirs["message"]["tool_calls"]] == \
            [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]  # json.dumps' spacing, both (item 9)


# ---------------------------------------------------------------------------- echo, greedy (5, 8)


SAMPLING_CASES = {
    "lm_eval_loglikelihood": ("/v1/completions/render", {"model": MODEL, "prompt": [[785, 6722], [40, 1075]],
                                                         "echo": True, "logprobs": 1, "max_tokens": 1,
                                                         "temperature": 0, "seed": 1234}),
    "echo_max_tokens_0": ("/v1/completions/render", {"model": MODEL, "prompt": "The capital of France is",
                                                     "echo": True, "logprobs": 1, "max_tokens": 0}),
    "echo_without_logprobs": ("/v1/completions/render", {"model": MODEL, "prompt": "Hi", "echo": True,
                                                         "max_tokens": 5}),
    "prompt_logprobs": ("/v1/completions/render", {"model": MODEL, "prompt": "Hi", "prompt_logprobs": 2,
                                                   "max_tokens": 5}),
    "chat_prompt_logprobs": ("/v1/chat/completions/render", chat(prompt_logprobs=2)),
    "greedy_chat": ("/v1/chat/completions/render", chat(temperature=0, top_k=5, top_p=0.5, min_p=0.1)),
    "greedy_completion": ("/v1/completions/render", {"model": MODEL, "prompt": "Hi", "temperature": 0,
                                                     "max_tokens": 5}),
}


def _sampling_parity(peer, ours, case: str) -> None:
    path, body = SAMPLING_CASES[case]
    mine, theirs = render(ours, path, body), render(peer, path, body)
    for m, t in zip(mine if isinstance(mine, list) else [mine], theirs if isinstance(theirs, list) else [theirs]):
        assert m["token_ids"] == t["token_ids"]
        same_sampling_params(m["sampling_params"], t["sampling_params"])


@needs_vllm032
@pytest.mark.parametrize("case", sorted(SAMPLING_CASES))
def test_echo_prompt_logprobs_and_greedy_sampling_params_equal_vllm_032s(vllm032_render, ours, case):
    _sampling_parity(vllm032_render, ours, case)


@needs_vllm033
@pytest.mark.parametrize("case", sorted(SAMPLING_CASES))
def test_echo_prompt_logprobs_and_greedy_sampling_params_equal_vllm_033s(vllm033_render, ours, case):
    _sampling_parity(vllm033_render, ours, case)


# ------------------------------------------------------------------------------- 0.33's shape (7)


@needs_vllm033
@pytest.mark.parametrize("body", [
    chat(kv_transfer_params={"do_remote_decode": True}, tools=[WEATHER]),
    chat(tool_choice=NAMED, tools=[WEATHER, TIME], parallel_tool_calls=False, include_reasoning=False,
         messages=[*USER, {"role": "assistant", "tool_calls": [
             {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
             {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]),
    chat(chat_template_kwargs={"enable_thinking": False}),
], ids=["kv_transfer_params", "named_with_history", "no_tools"])
def test_chat_render_has_vllm_033s_shape(vllm033_render, ours, body):
    mine = render(ours, "/v1/chat/completions/render", body)
    theirs = render(vllm033_render, "/v1/chat/completions/render", body)
    assert list(mine)[:len(theirs)] == list(theirs)  # every key 0.33 writes, in its order (ours adds at the end)
    assert mine["kv_transfer_params"] == theirs["kv_transfer_params"]
    assert "extra_args" not in mine["sampling_params"] and "extra_args" not in theirs["sampling_params"]
    expected = dict(theirs["parse_context"])
    expected["chat_template_kwargs"] = {k: v for k, v in expected["chat_template_kwargs"].items()
                                        if k != "cohere_format"}  # vLLM's Cohere default (compatibility.md)
    assert mine["parse_context"] == expected


@needs_vllm033
def test_completions_render_has_vllm_033s_shape(vllm033_render, ours):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 5, "kv_transfer_params": {"do_remote_decode": True}}
    [mine], [theirs] = render(ours, "/v1/completions/render", body), render(vllm033_render, "/v1/completions/render",
                                                                            body)
    assert list(mine)[:len(theirs)] == list(theirs)
    assert mine["kv_transfer_params"] == theirs["kv_transfer_params"] and mine["parse_context"] is None


@needs_vllm033
def test_derender_answers_carry_vllm_033s_keys(vllm033_render, ours):
    request = chat(chat_template_kwargs={"enable_thinking": False})
    choice = {"index": 0, "token_ids": [9707, 11], "finish_reason": "length",
              "weight_versions": [{"version": "v1", "start": 0, "end": 2}]}
    batch = {"model": MODEL, "chat_request": request, "generate_response": {"request_id": "g", "choices": [choice]}}
    stream = {"model": MODEL, "stream": True, "chat_request": request, "prompt_token_ids": [9707],
              "generate_chunk": {"request_id": "g", "choices": [choice], "kv_transfer_params": {"k": 1}}}
    for path, body, part in (("/v1/chat/completions/derender", batch, "choices"),
                             ("/v1/chat/completions/derender", stream, "chunk"),
                             ("/v1/completions/derender", {"generate_responses": [batch["generate_response"]]},
                              "choices")):
        mine, theirs = render(ours, path, body), render(vllm033_render, path, body)
        mine_keys = set(mine[part]["choices"][0] if part == "chunk" else mine["choices"][0])
        their_keys = set(theirs[part]["choices"][0] if part == "chunk" else theirs["choices"][0])
        assert their_keys <= mine_keys, their_keys - mine_keys
        if part == "chunk":
            assert set(theirs["chunk"]) <= set(mine["chunk"])
            assert mine["chunk"]["kv_transfer_params"] == {"k": 1}  # passed on (vLLM 0.33's derender: null)
    # weight_versions when the request asks (vLLM's own derender leaves them null either way)
    asked = {**batch, "chat_request": {**request, "return_weight_versions": True}}
    assert render(ours, "/v1/chat/completions/derender", asked)["choices"][0]["weight_versions"] == \
        choice["weight_versions"]


# ------------------------------------------------------------------------- ids past the tokenizer (4)


@needs_vllm032
@pytest.mark.parametrize("ids", [[9707, 151700, 11], [9707, 151935], [151700]])
def test_ids_past_the_tokenizer_decode_to_nothing_as_in_vllm(vllm032_render, ours, ids):
    request = chat(chat_template_kwargs={"enable_thinking": False})
    gen = {"request_id": "g", "choices": [{"index": 0, "token_ids": ids, "finish_reason": "length"}]}
    bodies = [
        ("/v1/chat/completions/derender", {"model": MODEL, "chat_request": request, "generate_response": gen}),
        ("/v1/chat/completions/derender", {"model": MODEL, "stream": True, "chat_request": request,
                                           "prompt_token_ids": [9707], "generate_chunk": gen}),
        ("/v1/completions/derender", {"model": MODEL, "stream": True, "generate_chunk": gen}),
    ]
    for path, body in bodies:
        mine, theirs = render(ours, path, body), render(vllm032_render, path, body)
        pick = (lambda r: r["chunk"]["choices"][0]) if body.get("stream") else (lambda r: r["choices"][0])
        for key in ("message", "delta", "text"):
            if key in pick(theirs):
                got, want = pick(mine)[key], pick(theirs)[key]
                if isinstance(want, dict):  # (a first chunk without text: vLLM "" content, ours null)
                    got = {k: got.get(k) or None for k in ("content", "reasoning")}
                    want = {k: want.get(k) or None for k in ("content", "reasoning")}
                assert got == want, (path, got, want)
    r = ours.client.post("/v1/chat/completions/derender", json={
        "model": MODEL, "chat_request": request,
        "generate_response": {"request_id": "g", "choices": [{"index": 0, "token_ids": [151936]}]}})
    assert r.status_code == 400 and "outside the model's vocabulary" in r.json()["error"]["message"]


# ------------------------------------------------------------------- mixed implementations (10)


@needs_vllm032
def test_a_stream_started_on_ours_continues_on_vllms_derender_with_the_history_flag(vllm032_render, monkeypatch):
    # SPLITSERVE_STREAM_STATE_VLLM_FIELDS=1: our stream_state carries vLLM's history fields, so a rolling migration
    # can move a stream to vLLM's derender mid-way; without them vLLM replays an empty history (the rest of a
    # tool call lands in reasoning)
    monkeypatch.setenv("SPLITSERVE_STREAM_STATE_VLLM_FIELDS", "1")
    request = chat(tools=[WEATHER, TIME])
    with RenderServer(qwen3_config(True)) as flagged:
        gen = render(flagged, "/v1/chat/completions/render", request)
        text = "<think>\nOk.\n</think>\n\n" + '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}' \
               "\n</tool_call>"
        ids = flagged.client.post("/tokenize", json={"model": MODEL, "prompt": text}).json()["tokens"]
        half = len(ids) // 2
        base = {"model": MODEL, "stream": True, "chat_request": request, "prompt_token_ids": gen["token_ids"]}

        def chunk(part, finish=None):
            return {"request_id": "g", "choices": [{"index": 0, "token_ids": part, "finish_reason": finish}]}

        def run(servers: list) -> dict:
            state, deltas = None, []
            for i, server in enumerate(servers):
                part = ids[:half] if i == 0 else ids[half:]
                for t in part:
                    answer = render(server, "/v1/chat/completions/derender",
                                    {**base, "generate_chunk": chunk([t]), "stream_state": state})
                    state = answer["stream_state"]
                    deltas.append(answer["chunk"]["choices"][0]["delta"])
            last = render(servers[-1], "/v1/chat/completions/derender",
                          {**base, "generate_chunk": chunk([], "stop"), "stream_state": state})
            deltas.append(last["chunk"]["choices"][0]["delta"])
            calls: dict = {}
            for d in deltas:
                for c in d.get("tool_calls") or []:
                    entry = calls.setdefault(c["index"], {"name": "", "arguments": ""})
                    entry["name"] += (c.get("function") or {}).get("name") or ""
                    entry["arguments"] += (c.get("function") or {}).get("arguments") or ""
            return {"reasoning": "".join(d.get("reasoning") or "" for d in deltas),
                    "calls": [(c["name"], json.loads(c["arguments"])) for c in calls.values()]}

        all_vllm = run([vllm032_render, vllm032_render])
        handed_over = run([flagged, vllm032_render])
        assert handed_over["calls"] == all_vllm["calls"] == [("get_weather", {"city": "Oslo"})]
        assert handed_over["reasoning"].strip() == all_vllm["reasoning"].strip() == "Ok."


# ------------------------------------------------------------------- stop strings at batch derender

def _ids(text: str) -> list[int]:
    from tests.render_harness import qwen3_bundle

    return list(qwen3_bundle().tokenizer.encode(text))


STOP_CASES = [  # (output text, request fields, finish_reason, stop_reason): vLLM 0.33's _decode_output is 0.34's
    ("Hello world. STOP here more text", {"stop": ["STOP"]}, "stop", None),
    ("Hello world. STOP here more text", {"stop": ["STOP"], "include_stop_str_in_output": True}, "stop", None),
    ("Go STOP a STOP b", {"stop": "STOP", "min_tokens": 2}, "stop", None),
    ("Hello world. STOP here more text", {"stop": ["lo wor", "here"]}, "stop", None),
    ("Hello world. STOP here more text", {"stop": ["STOP", "more"]}, "stop", "more"),
    ("Hello world. STOP here more text", {"stop": ["STOP"]}, "length", None),
    ("<think>\nI think STOP more\n</think>\n\nAnswer.", {"stop": ["STOP"]}, "stop", None),
    ('<think>\nok\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
     "\nDONE and more", {"stop": ["DONE"], "tools": [WEATHER]}, "stop", None),
]


@needs_vllm033
@pytest.mark.parametrize("text, fields, finish, stop_reason", STOP_CASES)
def test_batch_derender_cuts_at_stop_strings_as_vllm_033s(vllm033_render, ours, text, fields, finish, stop_reason):
    ids = _ids(text) + ([151645] if finish == "stop" and stop_reason is None else [])
    gen = {"request_id": "g", "choices": [{"index": 0, "token_ids": ids, "finish_reason": finish,
                                           "stop_reason": stop_reason}]}
    body = {"model": MODEL, "chat_request": chat(**fields), "generate_response": gen}
    mine, theirs = (render(s, "/v1/chat/completions/derender", body)["choices"][0] for s in (ours, vllm033_render))
    keys = ("finish_reason", "stop_reason")
    assert {k: mine[k] for k in keys} == {k: theirs[k] for k in keys}
    assert mine["message"].get("reasoning") == theirs["message"].get("reasoning")
    # whitespace-only content before a call: ours keeps it, vLLM drops it (a documented difference, not stops')
    mine_content = mine["message"]["content"]
    if mine["message"].get("tool_calls") and not (mine_content or "").strip():
        mine_content = None
    assert mine_content == theirs["message"]["content"]
    assert [c["function"] for c in mine["message"].get("tool_calls") or []] == \
        [c["function"] for c in theirs["message"].get("tool_calls") or []]
    if "tools" not in fields:  # completions: the same cut on plain text
        completion = {"model": MODEL, "completion_request": {"model": MODEL, "prompt": "Hi", **fields},
                      "generate_responses": [gen]}
        mine_c, theirs_c = (render(s, "/v1/completions/derender", completion)["choices"][0]
                            for s in (ours, vllm033_render))
        assert (mine_c["text"], mine_c["stop_reason"]) == (theirs_c["text"], theirs_c["stop_reason"])


@needs_vllm033
def test_vllm_033s_stream_derender_refuses_stop_strings_which_ours_cuts_as_its_batch_does(vllm033_render, ours):
    """docs/compatibility.md: vLLM 0.33 and 0.34 answer a streamed derender whose request has ``stop`` with a 400
    (text already sent cannot be cut); ours holds back what may start a stop string and cuts as batch does."""
    ids = _ids("Hello world. STOP here") + [151645]
    request = chat(stop=["STOP"], chat_template_kwargs={"enable_thinking": False})
    body = {"model": MODEL, "stream": True, "chat_request": request, "prompt_token_ids": [9707],
            "generate_chunk": {"request_id": "g", "choices": [{"index": 0, "token_ids": ids,
                                                                "finish_reason": "stop"}]}}
    theirs = vllm033_render.post("/v1/chat/completions/derender", body)
    assert theirs.status_code == 400 and "stop strings are not supported" in theirs.text
    mine = render(ours, "/v1/chat/completions/derender", body)["chunk"]["choices"][0]
    assert mine["delta"]["content"] == "Hello world. " and mine["stop_reason"] == "STOP"

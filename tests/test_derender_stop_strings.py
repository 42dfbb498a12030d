"""Stop strings at derender (vLLM 0.34's rule): the decoded text is cut at the request's stop string before any
parser, over HTTP with the real Qwen3 tokenizer, batch and streaming, chat and completions."""

from __future__ import annotations

from typing import Any

import pytest

from render_service.parsers.stop_strings import StopState, StopStrings
from tests.derender_http import (
    CHAT,
    COMPLETIONS,
    EOS,
    MODEL,
    WEATHER_TOOL,
    chat_request,
    encode,
    fold_chat_chunks,
    one_token_chunks,
    post_ok,
    server,
    stream_chat,
)

PARSERS = {"reasoning_parser": "qwen3", "tool_call_parser": "hermes", "enable_auto_tool_choice": True}
TEXT = "Hello world. STOP here more text"  # ' STOP' is one token: the cut leaves "Hello world."


def chunked(ids: list[int], size: int) -> list[list[int]]:
    return [ids[i:i + size] for i in range(0, len(ids), size)]


def batch_choice(client: Any, ids: list[int], req: dict | None, finish_reason: str = "stop",
                 stop_reason: Any = None) -> dict:
    body = {"model": MODEL, "chat_request": req, "generate_response": {"request_id": "gen-1", "choices": [
        {"index": 0, "token_ids": ids, "finish_reason": finish_reason, "stop_reason": stop_reason}]}}
    choice: dict = post_ok(client, CHAT, body)["choices"][0]
    return choice


def last_choice(chunks: list[dict]) -> dict:
    choice: dict = chunks[-1]["choices"][0]
    return choice


def test_plain_content_is_cut_at_the_stop_string_and_the_stream_folds_to_the_batch():
    ids = encode(TEXT) + [EOS]
    req = chat_request(stop=["nothing", "STOP"])
    with server() as client:
        batch = batch_choice(client, ids, req)
        streams = [stream_chat(client, chunked(ids, size), req) for size in (1, 2, 3, len(ids))]
    assert batch["message"]["content"] == "Hello world. "
    assert (batch["finish_reason"], batch["stop_reason"]) == ("stop", "STOP")
    for chunks in streams:
        fold = fold_chat_chunks(chunks)
        assert fold["content"] == "Hello world. " and fold["finish_reason"] == "stop"
        assert last_choice(chunks)["stop_reason"] == "STOP"
        assert all(c["choices"][0]["stop_reason"] is None for c in chunks[:-1])


def test_the_stream_holds_back_only_a_tail_that_could_start_a_stop_string():
    ids = encode(TEXT) + [EOS]
    with server() as client:
        chunks = stream_chat(client, one_token_chunks(ids), chat_request(stop="world. S"))
    contents = [c["choices"][0]["delta"].get("content") for c in chunks]
    # "Hello" is released at once (no stop string starts in it); " world" and "." wait as "world. S" may follow
    assert contents[0] == "Hello"
    assert contents[1] == " " and contents[2] is None
    assert "".join(c or "" for c in contents) == "Hello "
    assert last_choice(chunks)["stop_reason"] == "world. S"


def test_include_stop_str_in_output_keeps_the_stop_string():
    ids = encode(TEXT) + [EOS]
    req = chat_request(stop=["STOP"], include_stop_str_in_output=True)
    with server() as client:
        batch = batch_choice(client, ids, req)
        chunks = stream_chat(client, one_token_chunks(ids), req)
    assert batch["message"]["content"] == "Hello world. STOP"
    assert batch["stop_reason"] == "STOP"
    assert fold_chat_chunks(chunks)["content"] == "Hello world. STOP"


@pytest.mark.parametrize("min_tokens, content", [(1, "Go"), (2, "Go STOP a"), (3, "Go STOP a")])
def test_a_stop_string_counts_only_when_it_ends_past_the_first_min_tokens(min_tokens, content):
    ids = encode("Go STOP a STOP b") + [EOS]  # 'Go', ' STOP', ' a', ' STOP', ' b'
    req = chat_request(stop=["STOP"], min_tokens=min_tokens)
    with server() as client:
        batch = batch_choice(client, ids, req)
        streams = [stream_chat(client, chunked(ids, size), req) for size in (1, 2, len(ids))]
    assert batch["message"]["content"] == content + " "
    assert batch["stop_reason"] == "STOP"
    for chunks in streams:
        assert fold_chat_chunks(chunks)["content"] == content + " "


def test_a_stop_string_spanning_tokens_is_found():
    ids = encode(TEXT) + [EOS]
    assert not any("lo wor" in encode_piece for encode_piece in pieces(ids))
    req = chat_request(stop=["lo wor"])
    with server() as client:
        batch = batch_choice(client, ids, req)
        chunks = stream_chat(client, one_token_chunks(ids), req)
    assert batch["message"]["content"] == "Hel"
    assert fold_chat_chunks(chunks)["content"] == "Hel"
    assert last_choice(chunks)["stop_reason"] == "lo wor"


def pieces(ids: list[int]) -> list[str]:
    from tests.render_harness import qwen3_bundle

    return [qwen3_bundle().tokenizer.decode([t]) for t in ids]


def test_the_earliest_ending_stop_string_wins_whatever_the_chunking():
    ids = encode("The answer is 42 and more") + [EOS]
    req = chat_request(stop=["is 42 and", "answer is"])
    with server() as client:
        batch = batch_choice(client, ids, req)
        chunks = stream_chat(client, [ids], req)
    assert batch["message"]["content"] == "The " and batch["stop_reason"] == "answer is"
    assert fold_chat_chunks(chunks)["content"] == "The " and last_choice(chunks)["stop_reason"] == "answer is"


def test_stop_inside_reasoning_cuts_the_reasoning_as_vllm_cuts_the_text_before_parsing():
    ids = encode("<think>\nI think STOP more\n</think>\n\nAnswer.") + [EOS]
    req = chat_request(stop=["STOP"])
    with server(**PARSERS) as client:
        batch = batch_choice(client, ids, req)
        chunks = stream_chat(client, one_token_chunks(ids), req)
        uncut = batch_choice(client, ids, chat_request())
    assert uncut["message"]["reasoning"] == "\nI think STOP more\n" and uncut["message"]["content"] == "\n\nAnswer."
    assert batch["message"]["reasoning"] == "\nI think "
    assert batch["message"]["content"] is None
    assert (batch["finish_reason"], batch["stop_reason"]) == ("stop", "STOP")
    fold = fold_chat_chunks(chunks)
    assert (fold["reasoning"], fold["content"]) == ("\nI think ", None)
    assert last_choice(chunks)["stop_reason"] == "STOP"


def test_a_stop_string_after_a_tool_call_keeps_the_call_and_finish_reason_tool_calls():
    text = '<think>\nok\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\nDONE and more'
    ids = encode(text) + [EOS]
    req = chat_request(tools=[WEATHER_TOOL], stop=["DONE"])
    with server(**PARSERS) as client:
        batch = batch_choice(client, ids, req)
        chunks = stream_chat(client, one_token_chunks(ids), req)
    calls = batch["message"]["tool_calls"]
    assert batch["message"]["content"] == "\n\n"  # the text after the call is cut at the stop string
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert (batch["finish_reason"], batch["stop_reason"]) == ("tool_calls", "DONE")
    fold = fold_chat_chunks(chunks)
    assert [c["name"] for c in fold["tool_calls"]] == ["get_weather"]
    assert fold["finish_reason"] == "tool_calls" and last_choice(chunks)["stop_reason"] == "DONE"


def test_batch_cuts_only_when_the_engine_stopped_without_a_stop_token_as_vllm_does():
    ids = encode(TEXT)
    req = chat_request(stop=["STOP", "more"])
    with server() as client:
        length = batch_choice(client, ids, req, finish_reason="length")
        by_token = batch_choice(client, ids + [EOS], req, stop_reason=EOS)
        reported = batch_choice(client, ids, req, stop_reason="more")
    assert (length["message"]["content"], length["finish_reason"], length["stop_reason"]) == (TEXT, "length", None)
    assert (by_token["message"]["content"], by_token["stop_reason"]) == (TEXT, EOS)
    # a reported stop string is the one that cut the text, not the request's first match
    assert (reported["message"]["content"], reported["stop_reason"]) == ("Hello world. STOP here ", "more")


def test_a_stream_cut_at_a_stop_string_reports_stop_even_if_the_engine_went_on_to_length():
    ids = encode(TEXT)
    with server() as client:
        chunks = stream_chat(client, one_token_chunks(ids), chat_request(stop=["STOP"]), finish_reason="length")
    assert fold_chat_chunks(chunks)["content"] == "Hello world. "
    assert (last_choice(chunks)["finish_reason"], last_choice(chunks)["stop_reason"]) == ("stop", "STOP")


def test_a_held_tail_that_never_became_a_stop_string_is_released_at_the_end():
    ids = encode("Hello world. ST")
    req = chat_request(stop=["STOP"])
    with server() as client:
        batch = batch_choice(client, ids, req)
        chunks = stream_chat(client, one_token_chunks(ids), req, finish_reason="length")
    assert batch["message"]["content"] == "Hello world. ST" and batch["stop_reason"] is None
    assert fold_chat_chunks(chunks)["content"] == "Hello world. ST"
    assert last_choice(chunks)["stop_reason"] is None


def test_stop_strings_that_never_match_change_nothing():
    ids = encode(TEXT) + [EOS]
    with server(**PARSERS) as client:
        plain = batch_choice(client, ids, chat_request())
        with_stops = batch_choice(client, ids, chat_request(stop=["zzz"]))
        plain_chunks = stream_chat(client, one_token_chunks(ids), chat_request())
        stop_chunks = stream_chat(client, one_token_chunks(ids), chat_request(stop=["zzz"]))
    assert plain == with_stops
    assert fold_chat_chunks(plain_chunks) == fold_chat_chunks(stop_chunks)


def completion_body(ids: list[int], creq: dict, **choice: Any) -> dict:
    return {"model": MODEL, "completion_request": creq, "generate_responses": [{"request_id": "cmpl-1", "choices": [
        {"index": 0, "token_ids": ids, "finish_reason": "stop", **choice}]}]}


def test_completions_cut_at_the_stop_string_batch_and_stream():
    ids = encode(TEXT) + [EOS]
    creq = {"model": MODEL, "prompt": "Say hi", "stop": ["STOP"]}
    with server() as client:
        batch = post_ok(client, COMPLETIONS, completion_body(ids, creq))["choices"][0]
        state, texts, last = None, [], {}
        for k, t in enumerate(ids):
            body = {"stream": True, "model": MODEL, "stream_state": state, "completion_request": creq,
                    "generate_chunk": {"request_id": "cmpl-1", "choices": [
                        {"index": 0, "token_ids": [t], "finish_reason": "stop" if k == len(ids) - 1 else None}]}}
            answer = post_ok(client, COMPLETIONS, body)
            state, last = answer["stream_state"], answer["chunk"]["choices"][0]
            texts.append(last["text"])
    assert (batch["text"], batch["finish_reason"], batch["stop_reason"]) == ("Hello world. ", "stop", "STOP")
    assert "".join(texts) == "Hello world. "
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", "STOP")


def test_a_stream_state_written_without_stop_strings_is_refused_for_a_request_with_them():
    ids = encode(TEXT)
    with server() as client:
        first = post_ok(client, CHAT, {"stream": True, "model": MODEL, "chat_request": chat_request(),
                                       "generate_chunk": {"request_id": "g", "choices": [
                                           {"index": 0, "token_ids": ids[:2], "finish_reason": None}]}})
        r = client.post(CHAT, json={"stream": True, "model": MODEL, "stream_state": first["stream_state"],
                                    "chat_request": chat_request(stop=["STOP"]),
                                    "generate_chunk": {"request_id": "g", "choices": [
                                        {"index": 0, "token_ids": ids[2:], "finish_reason": "stop"}]}})
    assert r.status_code == 400, r.text


def test_an_oversized_stop_list_is_a_400():
    ids = encode(TEXT) + [EOS]
    with server() as client:
        r = client.post(CHAT, json={"model": MODEL, "chat_request": chat_request(stop=["x" * 5000]),
                                    "generate_response": {"request_id": "g", "choices": [
                                        {"index": 0, "token_ids": ids, "finish_reason": "stop"}]}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"


def test_the_stage_answers_the_same_for_every_split_of_the_text():
    text = "aXYa XYZ tail XY"
    stage = StopStrings(("XYZ", "Z t"), include_in_output=False)
    for split in range(1, len(text)):
        state = StopState()
        out = stage.feed(state, text[:split]) + stage.feed(state, text[split:])
        assert (out, state.matched) == ("aXYa ", "XYZ")
        assert len(state.held) <= stage.hold


# ------------------------------------------------------------------- vLLM-shaped history, hostile state

def in_process_stream(ids: list[int], req: dict, runtime_for_step: Any, vllm_client: bool) -> list[dict]:
    """Streaming chat derender in process; a vLLM client keeps only vLLM's fields (drops our key)."""
    import msgspec

    from render_service.derender.stream import derender_chat_stream
    from render_service.streaming_cache.session import STATE_KEY
    from render_service.wire.protocol import DerenderChatStreamRequest
    from tests.derender_http import config

    state: Any = {"output_token_ids": [], "output_chunk_lens": [], "role_sent": False} if vllm_client else None
    out = []
    for k, t in enumerate(ids):
        body = {"stream": True, "model": MODEL, "chat_request": req, "stream_state": state,
                "generate_chunk": {"request_id": "gen-1", "choices": [
                    {"index": 0, "token_ids": [t], "finish_reason": "stop" if k == len(ids) - 1 else None}]}}
        answer = msgspec.to_builtins(derender_chat_stream(msgspec.convert(body, DerenderChatStreamRequest),
                                                          config(**PARSERS), runtime_for_step(k)))
        state = answer["stream_state"]
        if vllm_client:
            state = {key: v for key, v in state.items() if key != STATE_KEY}
        out.append(answer["chunk"])
    return out


def test_a_vllm_client_that_drops_our_state_gets_the_same_cut_from_the_cache_and_from_replay():
    from render_service.streaming_cache.session import StreamRuntime

    ids = encode("<think>\nok\n</think>\n\n" + TEXT) + [EOS]
    req = chat_request(stop=["STOP"])
    rt = StreamRuntime()
    compact = fold_chat_chunks(in_process_stream(ids, req, lambda k: rt, vllm_client=False))
    cached = in_process_stream(ids, req, lambda k: rt, vllm_client=True)
    replayed = in_process_stream(ids, req, lambda k: StreamRuntime(), vllm_client=True)
    assert compact["content"] == "\n\nHello world. "
    assert fold_chat_chunks(cached) == compact == fold_chat_chunks(replayed)
    assert last_choice(replayed)["stop_reason"] == "STOP"


@pytest.mark.parametrize("stop, ok", [({"held": "ST"}, True), ({"held": "STOP"}, False),
                                      ({"held": "ST", "protected": 3}, False), ({"matched": "other"}, False),
                                      ({"held": "S", "matched": "STOP"}, False)])
def test_a_signed_state_whose_stop_part_this_request_could_not_have_written_is_a_400(stop, ok):
    import msgspec

    from render_service.derender.batch import pipeline_config, with_stops
    from render_service.derender.stream import derender_chat_stream
    from render_service.http.errors import ApiError
    from render_service.streaming_cache.codec import encode_state
    from render_service.streaming_cache.session import STATE_KEY, StreamRuntime, binding
    from render_service.wire.protocol import ChatCompletionRequest, DerenderChatStreamRequest
    from tests.derender_http import config

    req = chat_request(stop=["STOP"])
    cfg = config()
    pcfg = with_stops(pipeline_config(cfg, msgspec.convert(req, ChatCompletionRequest), request_id="gen-1",
                                      choice_index=0), msgspec.convert(req, ChatCompletionRequest))
    raw = {"detok": {"pending": b"", "window": [], "prefix_offset": 0, "read_offset": 0}, "tokens": 1, "stop": stop}
    runtime = StreamRuntime(secret="k")
    token = encode_state(raw, binding(pcfg, cfg.tokenizer), runtime.secret)
    body = {"stream": True, "model": MODEL, "chat_request": req, "stream_state": {STATE_KEY: token},
            "generate_chunk": {"request_id": "gen-1", "choices": [
                {"index": 0, "token_ids": encode(" more"), "finish_reason": None}]}}
    request = msgspec.convert(body, DerenderChatStreamRequest)
    if ok:  # the control: a state this request could have written continues (its held "ST" released)
        answer = derender_chat_stream(request, cfg, runtime)
        assert answer.chunk.choices[0].delta.content == "ST more"
        return
    with pytest.raises(ApiError) as err:
        derender_chat_stream(request, cfg, runtime)
    assert err.value.status == 400 and "stop-string state" in str(err.value)


def test_the_stream_state_stays_bounded_however_long_the_text_held_back():
    """The held tail is all the stage carries: a long stream that keeps nearly matching has a state of constant
    size (the chunk work is O(chunk) for the same reason: only the held tail is rescanned)."""
    from render_service.streaming_cache.session import STATE_KEY

    ids = encode("zz zzz " * 60)
    state: Any = None
    sizes = []
    with server() as client:
        for t in ids:
            answer = post_ok(client, CHAT, {"stream": True, "model": MODEL, "stream_state": state,
                                            "chat_request": chat_request(stop=["zzzzq"]),
                                            "generate_chunk": {"request_id": "g", "choices": [
                                                {"index": 0, "token_ids": [t], "finish_reason": None}]}})
            state = answer["stream_state"]
            sizes.append(len(state[STATE_KEY]))
    assert len(ids) > 100 and max(sizes[10:]) - min(sizes[10:]) <= 16


def test_a_plain_stream_that_lost_our_state_key_is_a_400_when_text_may_be_held_back():
    """vLLM's plain window cannot carry the held tail: dropping our key would lose text silently."""
    from render_service.streaming_cache.session import STATE_KEY

    ids = encode(TEXT)
    with server() as client:
        def step(state: Any, part: list[int], stop: list[str]) -> Any:
            return client.post(CHAT, json={"stream": True, "model": MODEL, "stream_state": state,
                                           "chat_request": chat_request(stop=stop),
                                           "generate_chunk": {"request_id": "g", "choices": [
                                               {"index": 0, "token_ids": part, "finish_reason": None}]}})

        vllm_empty = {"prev_tokens": [], "prefix_offset": 0, "read_offset": 0, "role_sent": False}
        for stop, status in ((["STOP"], 400), ([], 200)):
            first = step(vllm_empty, ids[:2], stop)
            assert first.status_code == 200, first.text
            echoed = {k: v for k, v in first.json()["stream_state"].items() if k != STATE_KEY}
            second = step(echoed, ids[2:], stop)
            assert second.status_code == status, second.text

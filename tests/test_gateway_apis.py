"""/v1/responses and /v1/messages through real gateway processes and real engine processes, with the official
`openai` and `anthropic` packages unchanged: tools, reasoning, streaming and not, collocated and P/D (NIXL),
stored responses (SQLite; PostgreSQL shared by two gateways where its server is installed), the thinking
budget, prefill continuation, each API's errors.

The engines run the scripted tiny Qwen3 of gateway_harness.py: a prompt ending in "\\n" (thinking on) makes it
think "Need weather" and call get_weather(city=Paris); "\\n\\n" (the closed think block of thinking off) makes
it say PLAIN_TEXT.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading

import anthropic
import httpx
import openai
import pytest

from tests.gateway_harness import PLAIN_TEXT, TOOL_SCRIPT, engine_process, gateway_process, write_scripted_qwen3
from tests.pg_harness import PostgresServer

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER}]
MESSAGES_TOOLS = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER}]
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("gateway_apis")
    model = write_scripted_qwen3(root / "tiny")
    procs, pg = [], None
    try:
        prefill = engine_process(model, kv_engine_id="api-prefill", wait=False)
        procs.append(prefill)
        decode = engine_process(model, kv_engine_id="api-decode", wait=False)
        procs.append(decode)
        for p in (prefill, decode):
            p.wait_healthy()
        try:
            pg = PostgresServer()
        except pytest.skip.Exception:
            pg = None
        sqlite_store = ["--responses-store-path", str(root / "r.sqlite3")]
        colloc = gateway_process(model, ["--engine", decode.url, *sqlite_store])
        procs.append(colloc)
        twin = gateway_process(model, ["--engine", decode.url, *sqlite_store])  # a second gateway on the file
        procs.append(twin)
        shared = ["--responses-store-dsn", pg.dsn] if pg else ["--responses-store-path", str(root / "d.sqlite3")]
        disagg = gateway_process(model, ["--prefill", prefill.url, "--decode", decode.url, *shared])
        procs.append(disagg)
        replica = gateway_process(model, ["--engine", decode.url, *shared]) if pg else None
        if replica:
            procs.append(replica)
        yield {"collocated": colloc, "twin": twin, "disaggregated": disagg, "replica": replica, "pg": pg,
               "sqlite": root / "r.sqlite3"}
    finally:
        for p in reversed(procs):
            p.stop()
        if pg is not None:
            pg.stop()


@pytest.fixture(params=["collocated", "disaggregated"])
def mode(request):
    return request.param


def oai(stack, name) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack[name].url + "/v1", api_key="unused", max_retries=0, timeout=120)


def claude(stack, name) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack[name].url, api_key="unused", max_retries=0, timeout=120)


def items(response, json_arguments: bool = False) -> list[dict]:
    """Output items without their per-response ids (item ids and call ids derive from the response id);
    ``json_arguments``: calls' arguments as the JSON value they hold."""
    out = []
    for item in response.output:
        d = item.to_dict()
        d.pop("id", None)
        d.pop("call_id", None)
        if json_arguments and "arguments" in d:
            d["arguments"] = json.loads(d["arguments"])
        out.append({k: v for k, v in d.items() if v is not None and not k.startswith("parsed")})
    return out


def blocks(message) -> list[dict]:
    """Content blocks without what derives from the message id (tool_use ids, thinking signatures)."""
    return [{k: v for k, v in b.to_dict().items() if k not in ("id", "signature")} for b in message.content]


# ------------------------------------------------------------------------------------------ Responses


def test_responses_tool_call_with_reasoning(stack, mode):
    r = oai(stack, mode).responses.create(model="tiny", input=ASK, tools=RESPONSES_TOOLS, temperature=0)
    assert r.status == "completed" and r.id.startswith("resp_")
    reasoning, call = r.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Need weather"
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert r.usage.output_tokens == len(TOOL_SCRIPT) and r.usage.input_tokens > 50


def test_responses_stream_folds_to_the_created_response(stack, mode):
    c = oai(stack, mode)
    batch = c.responses.create(model="tiny", input=ASK, tools=RESPONSES_TOOLS, temperature=0, store=False)
    with c.responses.stream(model="tiny", input=ASK, tools=RESPONSES_TOOLS, temperature=0, store=False) as stream:
        types = [event.type for event in stream]
        final = stream.get_final_response()
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert "response.reasoning_text.delta" in types and "response.function_call_arguments.delta" in types
    # the stream's arguments are the model's text as streamed; the whole answer's are re-serialized (as vLLM)
    assert [i.arguments for i in final.output if i.type == "function_call"] == ['{"city":"Paris"}']
    assert [i.arguments for i in batch.output if i.type == "function_call"] == ['{"city": "Paris"}']
    assert items(final, json_arguments=True) == items(batch, json_arguments=True)
    plain = c.responses.create(model="tiny", input="Hi", reasoning={"effort": "none"}, store=False)
    assert plain.output_text == PLAIN_TEXT
    assert plain.output[0].type == "message"


def test_responses_max_output_tokens_is_incomplete(stack):
    r = oai(stack, "collocated").responses.create(model="tiny", input="Hi", reasoning={"effort": "none"},
                                                  max_output_tokens=3, store=False)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == "Hello world,"


def test_responses_text_logprobs(stack, mode):
    c = oai(stack, mode)
    kwargs = dict(model="tiny", input="Hi", reasoning={"effort": "none"}, top_logprobs=2, store=False,
                  include=["message.output_text.logprobs"])
    part = c.responses.create(**kwargs).output[0].content[0]
    assert part.text == PLAIN_TEXT and "".join(lp.token for lp in part.logprobs) == PLAIN_TEXT
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in part.logprobs)
    deltas = []
    with c.responses.stream(**kwargs) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas += event.logprobs
        final = stream.get_final_response()
    assert [lp.token for lp in deltas] == [lp.token for lp in final.output[0].content[0].logprobs]
    assert [lp.token for lp in deltas] == [lp.token for lp in part.logprobs]


def test_stored_responses_continue_retrieve_and_delete(stack, mode):
    c = oai(stack, mode)
    first = c.responses.create(model="tiny", input=ASK, tools=RESPONSES_TOOLS)
    call = first.output[-1]
    assert c.responses.retrieve(first.id).output[-1].call_id == call.call_id
    follow = c.responses.create(model="tiny", previous_response_id=first.id, tools=RESPONSES_TOOLS,
                                input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert follow.previous_response_id == first.id
    assert follow.usage.input_tokens > first.usage.input_tokens + len(TOOL_SCRIPT)  # the history was rendered
    c.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as err:
        c.responses.create(model="tiny", previous_response_id=first.id, input="again")
    assert err.value.code == "previous_response_not_found" and err.value.param == "previous_response_id"
    unstored = c.responses.create(model="tiny", input="Hi", store=False)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unstored.id)


def test_streamed_response_is_stored(stack):
    c = oai(stack, "collocated")
    with c.responses.stream(model="tiny", input="Hi", reasoning={"effort": "none"}) as stream:
        final = stream.get_final_response()
    assert c.responses.retrieve(final.id).output_text == PLAIN_TEXT


def test_replicas_share_stored_responses_through_postgres(stack):
    if stack["pg"] is None:
        pytest.skip("PostgreSQL server binaries not installed (apt-get install postgresql)")
    first = oai(stack, "disaggregated").responses.create(model="tiny", input="Hi", reasoning={"effort": "none"})
    assert oai(stack, "replica").responses.retrieve(first.id).output_text == PLAIN_TEXT
    follow = oai(stack, "replica").responses.create(model="tiny", input="More?", previous_response_id=first.id,
                                                    reasoning={"effort": "none"})
    assert follow.usage.input_tokens > first.usage.input_tokens


class StoreLock:
    """Holds the response store's table locked from outside the gateways (a slow store), until released."""

    def __init__(self, stack, backend: str) -> None:
        self.backend, self.stack = backend, stack
        self.released = threading.Event()
        self.locked = threading.Event()
        self.thread = threading.Thread(target=self._hold, daemon=True)
        self.thread.start()
        assert self.locked.wait(30), "could not lock the store"

    def _hold(self) -> None:
        if self.backend == "sqlite":
            conn = sqlite3.connect(str(self.stack["sqlite"]), isolation_level=None, timeout=30)
            conn.execute("BEGIN EXCLUSIVE")  # WAL: writers wait, readers read
            self.locked.set()
            self.released.wait(60)
            conn.execute("ROLLBACK")
            conn.close()
            return

        async def hold() -> None:
            import asyncpg

            conn = await asyncpg.connect(self.stack["pg"].dsn)
            async with conn.transaction():
                await conn.execute("LOCK TABLE splitserve_owned_responses IN EXCLUSIVE MODE")  # writes wait
                self.locked.set()
                await asyncio.to_thread(self.released.wait, 60)
            await conn.close()

        asyncio.run(hold())

    def release(self) -> None:
        self.released.set()
        self.thread.join(30)


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_streamed_response_is_stored_before_its_last_event(stack, backend):
    """The store is slow (its table locked from outside): response.completed waits for it, and a read or a
    follow-up sent to another gateway on the same store right after that event finds the response. The lock is
    released once the client has seen the last event, or 3 s after the first text (time for the rest of this
    13-token answer and an early last event to arrive), whichever comes first."""
    if backend == "postgres" and stack["pg"] is None:
        pytest.skip("PostgreSQL server binaries not installed (apt-get install postgresql)")
    first, second = ("collocated", "twin") if backend == "sqlite" else ("disaggregated", "replica")
    oai(stack, first).responses.create(model="tiny", input="Hi", reasoning={"effort": "none"})  # the table exists
    lock = StoreLock(stack, backend)
    text_started, completed = threading.Event(), threading.Event()
    seen: dict = {}

    def client() -> None:
        body = {"model": "tiny", "input": "Hi", "reasoning": {"effort": "none"}, "stream": True}
        with httpx.stream("POST", stack[first].url + "/v1/responses", json=body, timeout=60) as r:
            for line in r.iter_lines():
                event = json.loads(line[6:]) if line.startswith("data: ") else {}
                if event.get("type") == "response.output_text.delta":
                    text_started.set()
                if event.get("type") == "response.completed":
                    seen["id"] = event["response"]["id"]
                    seen["released"] = lock.released.is_set()
                    seen["read"] = httpx.get(f"{stack[second].url}/v1/responses/{seen['id']}", timeout=30).status_code
                    completed.set()

    reader = threading.Thread(target=client, daemon=True)
    reader.start()
    try:
        assert text_started.wait(60)
        completed.wait(3.0)
    finally:
        lock.release()
    reader.join(60)
    assert seen["released"] and seen["read"] == 200, seen  # never ahead of the store
    follow = oai(stack, second).responses.create(model="tiny", input="More?", previous_response_id=seen["id"],
                                                 reasoning={"effort": "none"})
    assert follow.previous_response_id == seen["id"]


def test_responses_bad_input_is_an_openai_400(stack):
    c = oai(stack, "collocated")
    with pytest.raises(openai.BadRequestError) as err:
        c.responses.create(model="tiny", input=[{"type": "computer_call", "id": "x"}])
    assert "unknown input item type" in err.value.message
    with pytest.raises(openai.BadRequestError):
        c.responses.create(model="tiny", input=[{"type": "function_call_output", "call_id": "nope", "output": "x"}])


# ------------------------------------------------------------------------------------------- Messages


def test_messages_thinking_and_tool_use(stack, mode):
    c = claude(stack, mode)
    m = c.messages.create(model="tiny", max_tokens=64, messages=[{"role": "user", "content": ASK}],
                          tools=MESSAGES_TOOLS, thinking={"type": "enabled", "budget_tokens": 40})
    assert m.stop_reason == "tool_use" and m.id.startswith("msg_")
    thinking, tool = m.content
    assert thinking.type == "thinking" and thinking.thinking == "Need weather" and thinking.signature
    assert tool.type == "tool_use" and tool.name == "get_weather" and tool.input == {"city": "Paris"}
    assert m.usage.output_tokens == len(TOOL_SCRIPT)
    with c.messages.stream(model="tiny", max_tokens=64, messages=[{"role": "user", "content": ASK}],
                           tools=MESSAGES_TOOLS, thinking={"type": "enabled", "budget_tokens": 40}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert blocks(final) == blocks(m)
    assert final.stop_reason == "tool_use"
    # the tool's result goes back as a tool_result block: the conversation renders and the model answers
    again = c.messages.create(model="tiny", max_tokens=64, tools=MESSAGES_TOOLS, messages=[
        {"role": "user", "content": ASK}, {"role": "assistant", "content": [b.to_dict() for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool.id, "content": "sunny"}]}])
    assert again.usage.input_tokens > m.usage.input_tokens


def test_messages_text_stop_sequences_and_max_tokens(stack, mode):
    c = claude(stack, mode)
    m = c.messages.create(model="tiny", max_tokens=64, messages=[{"role": "user", "content": "Hi"}])
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == PLAIN_TEXT and m.stop_reason == "end_turn"
    m = c.messages.create(model="tiny", max_tokens=64, messages=[{"role": "user", "content": "Hi"}],
                          stop_sequences=["blue"])
    assert m.content[0].text == "Hello world, the sky is " and m.stop_reason == "stop_sequence"
    assert m.stop_sequence == "blue"
    m = c.messages.create(model="tiny", max_tokens=3, messages=[{"role": "user", "content": "Hi"}])
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3
    with c.messages.stream(model="tiny", max_tokens=64, messages=[{"role": "user", "content": "Hi"}],
                           stop_sequences=["blue"]) as stream:
        assert stream.get_final_text() == "Hello world, the sky is "


def test_messages_thinking_budget_ends_reasoning(stack, mode):
    """budget_tokens 2: the engine stops after "<think>Need"; the gateway closes the think block and continues
    (the scripted model answers PLAIN_TEXT after "</think>\\n\\n"), one message."""
    c = claude(stack, mode)
    kwargs = dict(model="tiny", max_tokens=40, messages=[{"role": "user", "content": ASK}], tools=MESSAGES_TOOLS,
                  thinking={"type": "enabled", "budget_tokens": 2})
    m = c.messages.create(**kwargs)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content] == [
        ("thinking", "Need"), ("text", PLAIN_TEXT)]
    assert m.stop_reason == "end_turn"
    with c.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert blocks(final) == blocks(m)


def test_messages_assistant_prefill_is_continued(stack):
    m = claude(stack, "collocated").messages.create(model="tiny", max_tokens=30, messages=[
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello world,"}])
    assert m.content[0].text == PLAIN_TEXT[len("Hello world,"):]  # the continuation, not a new turn


def test_count_tokens_and_anthropic_errors(stack):
    c = claude(stack, "collocated")
    n = c.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "Hi"}], tools=MESSAGES_TOOLS)
    m = c.messages.create(model="tiny", max_tokens=5, messages=[{"role": "user", "content": "Hi"}],
                          tools=MESSAGES_TOOLS)
    assert n.input_tokens == m.usage.input_tokens
    with pytest.raises(anthropic.BadRequestError) as err:
        c.messages.create(model="tiny", max_tokens=10, thinking={"type": "enabled", "budget_tokens": 10},
                          messages=[{"role": "user", "content": "Hi"}])
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError):
        c.messages.create(model="tiny", max_tokens=10, messages=[
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_missing", "content": "x"}]}])
    r = httpx.post(stack["collocated"].url + "/v1/messages", json={"max_tokens": 5, "messages": [
        {"role": "user", "content": "x"}], "kv_transfer_params": {"remote_host": "10.0.0.1"}}, timeout=30)
    assert r.status_code == 400 and r.json()["type"] == "error"

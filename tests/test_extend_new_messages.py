"""A turn that sends only its new messages (``previous_turn.messages: "new"``): the earlier messages are those kept
with its ``prompt_ref``, and the answer is what sending the whole conversation answers."""

from __future__ import annotations

import json
from typing import Any

import pytest

from render_service.extend.prompt_refs import ChatHistory, StoredPrompt, id_run
from tests import rollouts
from tests.harmony_fixtures import MODEL, gpt_oss_config
from tests.render_harness import RenderServer, qwen3_config
from tests.test_prompt_refs import CHAT, MASKS, SYSTEM, _post, _rollout_turns, harmony_search_turn

FIELDS = ("token_ids", "message_indices", "assistant_tokens_mask", "extend")


@pytest.mark.parametrize("answer", ["full", "appended"])
def test_a_rollout_sending_only_its_new_messages_answers_as_the_whole_conversation(answer):
    config = qwen3_config()
    with RenderServer(config) as server:
        head = _post(server, {"messages": SYSTEM, "return_prompt_ref": True, **MASKS})
        whole_ref = new_ref = head["prompt_ref"]
        sent = SYSTEM
        for messages, sampled in _rollout_turns(config):
            turn = {"completion_token_ids": sampled, "answer": answer}
            whole = _post(server, {"messages": messages, **MASKS, "return_prompt_ref": True,
                                   "previous_turn": {**turn, "prompt_ref": whole_ref}})
            new = _post(server, {"messages": messages[len(sent):], **MASKS, "return_prompt_ref": True,
                                 "previous_turn": {**turn, "prompt_ref": new_ref, "messages": "new"}})
            assert new["extend"]["extended"], new["extend"]
            for field in FIELDS:
                assert new[field] == whole[field], field
            whole_ref, new_ref, sent = whole["prompt_ref"], new["prompt_ref"], messages


def test_a_long_conversation_resumes_the_templates_loop_from_the_kept_messages():
    """A conversation whose first body the body store files (past 32 KiB), its messages coming through the memo:
    the turns that send only their new messages resume the template's loop where the previous render left it, as
    when the whole body is sent."""
    from bench.extend_bench import TOOLS, _conversation, _sampled_text

    config = qwen3_config()
    messages = _conversation(16384, config)
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    k, before = assistants[-1], assistants[-2]
    sampled = [config.tokenizer.encode(_sampled_text(messages[i])) for i in (before, k)]
    plain = {"tools": TOOLS, "tool_choice": "none"}
    with RenderServer(config) as server:
        def post(body: dict[str, Any]) -> dict[str, Any]:
            reply = server.client.post(CHAT, json={**plain, **body})
            assert reply.status_code == 200, reply.text
            return reply.json()

        whole_first = {"messages": messages[:before], "return_prompt_ref": True}
        assert len(json.dumps({**plain, **whole_first})) > 32 * 1024
        first = post(whole_first)
        middle = post({"messages": messages[before:k], "return_prompt_ref": True, "previous_turn": {
            "prompt_ref": first["prompt_ref"], "completion_token_ids": sampled[0], "messages": "new"}})
        records = config.template.loop_records
        resumed = records.resumed
        last = post({"messages": messages[k:], "previous_turn": {
            "prompt_ref": middle["prompt_ref"], "completion_token_ids": sampled[1], "messages": "new"}})
        assert records.resumed > resumed
        whole = post({"messages": messages, "previous_turn": {
            "prompt_token_ids": middle["token_ids"], "completion_token_ids": sampled[1]}})
    assert middle["extend"]["extended"] and last["extend"]["extended"]
    assert last["extend"]["method"] == "loop"
    assert last["token_ids"] == whole["token_ids"]
    assert last["token_ids"][:len(middle["token_ids"]) + len(sampled[1])] == middle["token_ids"] + sampled[1]


def test_messages_api_sends_only_its_new_messages():
    config = qwen3_config()
    completion = config.tokenizer.encode("<think>\nhm\n</think>\n\nThree.<|im_end|>")
    base = {"model": None, "max_tokens": 8, "system": "You are helpful."}
    question = {"role": "user", "content": "find cats"}
    then = [{"role": "assistant", "content": "Three."}, {"role": "user", "content": "ok"}]
    with RenderServer(config) as server:
        head = server.client.post("/v1/messages/render", json={
            **base, "messages": [question], "return_prompt_ref": True}).json()
        turn = {"prompt_ref": head["prompt_ref"], "completion_token_ids": completion}
        whole = server.client.post("/v1/messages/render", json={
            **base, "previous_turn": turn, "messages": [question, *then]})
        new = server.client.post("/v1/messages/render", json={
            "model": None, "max_tokens": 8, "previous_turn": {**turn, "messages": "new"}, "messages": then})
    assert whole.status_code == new.status_code == 200, new.text
    assert new.json()["token_ids"] == whole.json()["token_ids"]
    assert new.json()["token_ids"][:len(head["token_ids"]) + len(completion)] == head["token_ids"] + completion


def test_harmony_sends_only_its_new_messages():
    config = gpt_oss_config()
    sampled, new_messages = harmony_search_turn()
    with RenderServer(config) as server:
        head = _post(server, {"model": MODEL, "messages": SYSTEM, "return_prompt_ref": True})
        turn = {"prompt_ref": head["prompt_ref"], "completion_token_ids": sampled}
        whole = _post(server, {"model": MODEL, "messages": [*SYSTEM, *new_messages], "previous_turn": turn})
        new = _post(server, {"model": MODEL, "messages": new_messages, "previous_turn": {**turn, "messages": "new"}})
    assert new["extend"]["extended"] and new["extend"]["method"] == "harmony"
    assert new["token_ids"] == whole["token_ids"]


def test_what_cannot_be_put_together_is_a_400_or_404_naming_the_field():
    config = qwen3_config()
    (messages, sampled), *_ = _rollout_turns(config)
    new_messages = messages[len(SYSTEM):]
    with RenderServer(config) as server:
        ref = _post(server, {"messages": SYSTEM, "return_prompt_ref": True})["prompt_ref"]
        turn = {"prompt_ref": ref, "completion_token_ids": sampled, "messages": "new"}
        cases = [
            ({"prompt_token_ids": [1, 2], "completion_token_ids": sampled, "messages": "new"}, new_messages,
             400, "previous_turn.messages"),
            (turn, messages, 400, "previous_turn.messages"),  # the whole conversation again: starts with system
            (turn, new_messages[1:], 400, "previous_turn.messages"),  # the sampled turn left out
            ({**turn, "message_index": 0}, new_messages, 400, "previous_turn.messages"),
            ({**turn, "prompt_ref": "pr-unknown"}, new_messages, 404, "previous_turn.prompt_ref"),
        ]
        for previous_turn, sent, status, param in cases:
            reply = server.client.post(CHAT, json={"messages": sent, "tools": rollouts.TOOLS, "tool_choice": "none",
                                                   "previous_turn": previous_turn})
            assert reply.status_code == status, reply.text
            assert reply.json()["error"]["param"] == param
        # the sampled turn named by its index in the whole conversation is accepted
        out = _post(server, {"messages": new_messages, "previous_turn": {**turn, "message_index": len(SYSTEM)}})
        assert out["extend"]["extended"]


def test_a_kept_history_counts_against_the_references_bound():
    ids = id_run(list(range(1000)))
    bare = StoredPrompt(ids)
    kept = StoredPrompt(ids, history=ChatHistory(({"role": "user", "content": "x"},) * 3))
    assert kept.size == bare.size + 3 * 256 + 4 * 1000


def test_responses_api_extends_and_sends_only_its_new_items():
    config = qwen3_config()
    completion = config.tokenizer.encode("<think>\nhm\n</think>\n\nThree.<|im_end|>")
    question = {"role": "user", "content": "find cats"}
    then = [{"role": "assistant", "content": "Three."}, {"role": "user", "content": "ok"}]
    path = "/v1/responses/render"
    with RenderServer(config) as server:
        head = server.client.post(path, json={"instructions": "You are helpful.", "input": [question],
                                              "return_prompt_ref": True}).json()
        turn = {"prompt_ref": head["prompt_ref"], "completion_token_ids": completion}
        whole = server.client.post(path, json={"instructions": "You are helpful.", "input": [question, *then],
                                               "previous_turn": turn})
        new = server.client.post(path, json={"input": then, "previous_turn": {**turn, "messages": "new"}})
        # instructions are the conversation's first message: sent again with only the new items, they are refused
        again = server.client.post(path, json={"instructions": "You are helpful.", "input": then,
                                               "previous_turn": {**turn, "messages": "new"}})
    assert whole.status_code == new.status_code == 200, new.text
    assert whole.json()["extend"]["extended"] and new.json()["token_ids"] == whole.json()["token_ids"]
    assert new.json()["token_ids"][:len(head["token_ids"]) + len(completion)] == head["token_ids"] + completion
    assert again.status_code == 400 and again.json()["error"]["param"] == "previous_turn.messages"


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_a_chat_rollout_growing_by_user_turns_resumes_each_turn_sent_either_way(api):
    """Each turn adds the sampled answer and a user message, which moves Qwen3's last user turn: sent whole or as new
    messages, the turns answer the same ids (the bench asserts it) and the template's loop resumes every turn (a
    Messages or Responses rollout: every turn that sends only its new messages but the first, which prepares the
    kept ones)."""
    from bench.extend_bench import rollout_cpu

    config = qwen3_config()
    records = config.template.loop_records
    assert records is not None
    before = records.resumed
    rows = rollout_cpu(config, [2048], turns=3, rounds=2, shape="chat", api=api)
    assert rows[0]["shape"] == "chat" and rows[0]["api"] == api and rows[0]["turns"] == 3
    assert records.resumed - before >= (2 * 2 * 3 if api == "chat" else 2 * 2)


@pytest.mark.parametrize("api", ["messages", "responses"])
def test_a_messages_or_responses_rollout_sending_new_messages_resumes_the_loop_from_the_third_turn(api):
    """Their messages come through no memo: the kept ones get entries of their own, the second turn prepares them
    once, and from the third turn on the template's loop resumes from the record the turn before filed."""
    config = qwen3_config()
    records = config.template.loop_records
    assert records is not None
    path = "/v1/messages/render" if api == "messages" else "/v1/responses/render"
    system = {"system": "Be brief."} if api == "messages" else {"instructions": "Be brief."}
    turns = 6

    def body(items: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        own = {"max_tokens": 8, "messages": items} if api == "messages" else {"input": items}
        return {"model": None, **own, **extra} if api == "messages" else {**own, **extra}

    with RenderServer(config) as server:
        def post(payload: dict[str, Any]) -> dict[str, Any]:
            reply = server.client.post(path, json=payload)
            assert reply.status_code == 200, reply.text
            return reply.json()

        sent = [{"role": "user", "content": "question 0"}]
        ref = post(body(sent, **system, return_prompt_ref=True))["prompt_ref"]
        resumed = []
        for turn in range(1, turns + 1):
            answer = f"answer {turn - 1}"
            completion = config.tokenizer.encode(f"<think>\n\n</think>\n\n{answer}<|im_end|>")
            then = [{"role": "assistant", "content": answer}, {"role": "user", "content": f"question {turn}"}]
            previous = {"prompt_ref": ref, "completion_token_ids": completion}
            before = records.resumed
            new = post(body(then, return_prompt_ref=True, previous_turn={**previous, "messages": "new"}))
            resumed.append(records.resumed - before)
            whole = post(body([*sent, *then], **system, previous_turn=previous))
            assert new["extend"]["extended"] and new["token_ids"] == whole["token_ids"], turn
            ref, sent = new["prompt_ref"], [*sent, *then]
    assert resumed[2:] == [1] * (turns - 2), resumed  # (the whole renders' own resumes are not counted)


def test_a_harmony_chat_rollout_answers_the_same_sent_whole_or_as_new_messages():
    """gpt-oss turns that render only their new messages: sent whole or as new messages, every turn appends the same
    ids (the bench asserts it)."""
    from bench.extend_bench import rollout_cpu

    rows = rollout_cpu(gpt_oss_config(), [2048], turns=3, rounds=2, shape="chat")
    assert rows[0]["harmony"] and rows[0]["turns"] == 3

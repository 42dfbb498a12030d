"""Prompt references: a render keeps its prompt under the ``prompt_ref`` it answers, and the next turn's extend names
it instead of resending the ids. Same answer as sending the ids; scoped to the client that made it; bounded."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from render_service.bundle.model_bundle import load_bundle
from render_service.extend.prompt_refs import PromptRefs, StoredPrompt, id_run
from render_service.render.render_config import build_render_config
from render_service.tokenize.incremental_tokenizer import PromptIds
from tests import rollouts
from tests.harmony_fixtures import MODEL, gpt_oss_config
from tests.harmony_fixtures import encode as harmony_encode
from tests.render_harness import QWEN3_DIR, RenderServer, qwen3_config

CHAT = "/v1/chat/completions/render"
SYSTEM = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "find cats"}]
MASKS = {"return_assistant_tokens_mask": True, "return_message_indices": True}


def _post(server: RenderServer, body: dict[str, Any], key: str | None = None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    reply = server.client.post(CHAT, json={"tools": rollouts.TOOLS, "tool_choice": "none", **body}, headers=headers)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _rollout_turns(config) -> list[tuple[list[dict[str, Any]], list[int]]]:
    """Three agent turns as a model could sample them (Python booleans, reasoning the template drops later): the
    messages the client sends after each, and the sampled ids."""
    spec = rollouts.FAMILIES["qwen3"]
    text, call = rollouts.tool_turn(spec, 0, truncated=False)
    answer, message = rollouts.answer_turn(spec, "There are 3 cats.", reasoning="Counted them.")
    second, call2 = rollouts.tool_turn(spec, 1, truncated=True)
    first = [*SYSTEM, call, rollouts.tool_result("call_1", "3 cats\n")]
    then = [*first, message, {"role": "user", "content": "and dogs?"}]
    last = [*then, call2, rollouts.tool_result("call_2", "2 dogs\n")]
    encode = config.tokenizer.encode
    return [(first, encode(text)), (then, encode(answer)), (last, encode(second))]


def test_a_rollout_by_reference_answers_what_the_ids_answer():
    config = qwen3_config()
    with RenderServer(config) as server:
        head = _post(server, {"messages": SYSTEM, "return_prompt_ref": True, **MASKS})
        ref, prompt = head["prompt_ref"], head["token_ids"]
        assert ref.startswith("pr-")
        for messages, sampled in _rollout_turns(config):
            by_ids = _post(server, {"messages": messages, **MASKS, "previous_turn": {
                "prompt_token_ids": prompt, "completion_token_ids": sampled}})
            by_ref = _post(server, {"messages": messages, **MASKS, "return_prompt_ref": True, "previous_turn": {
                "prompt_ref": ref, "completion_token_ids": sampled}})
            assert by_ref["extend"]["extended"], by_ref["extend"]
            assert by_ref["token_ids"][:len(prompt) + len(sampled)] == prompt + sampled
            for field in ("token_ids", "message_indices", "assistant_tokens_mask", "extend"):
                assert by_ref[field] == by_ids[field], field
            assert -1 not in by_ref["message_indices"]  # the kept attribution covers the earlier prompt
            assert by_ref["prompt_ref"] != ref
            ref, prompt = by_ref["prompt_ref"], by_ref["token_ids"]
        # A reference made without masks extends too (the earlier prompt then attributed by a render of it).
        plain = _post(server, {"messages": SYSTEM, "return_prompt_ref": True})
        messages, sampled = _rollout_turns(config)[0]
        out = _post(server, {"messages": messages, **MASKS, "previous_turn": {
            "prompt_ref": plain["prompt_ref"], "completion_token_ids": sampled}})
        assert out["token_ids"][:len(plain["token_ids"])] == plain["token_ids"]
        assert len(out["message_indices"]) == len(out["token_ids"])


def test_an_answer_of_the_appended_ids_alone_is_the_full_answers_tail():
    """``previous_turn.answer: "appended"``: the ids after the kept ones, and the masks likewise; the prompt it keeps
    under its reference is still the whole prompt, and a turn that cannot extend answers in full."""
    config = qwen3_config()
    with RenderServer(config) as server:
        head = _post(server, {"messages": SYSTEM, "return_prompt_ref": True, **MASKS})
        ref = head["prompt_ref"]
        for messages, sampled in _rollout_turns(config):
            turn = {"prompt_ref": ref, "completion_token_ids": sampled}
            full = _post(server, {"messages": messages, **MASKS, "previous_turn": turn})
            short = _post(server, {"messages": messages, **MASKS, "return_prompt_ref": True,
                                   "previous_turn": {**turn, "answer": "appended"}})
            kept = short["extend"]["kept_tokens"]
            assert short["extend"] == full["extend"] and kept > 0
            for field in ("token_ids", "message_indices", "assistant_tokens_mask"):
                assert short[field] == full[field][kept:], field
            # what max_tokens leaves room for counts the whole prompt, and so do the block hashes
            assert short["sampling_params"]["max_tokens"] == full["sampling_params"]["max_tokens"]
            hashed = [_post(server, {"messages": messages, "return_block_hashes": True,
                                     "previous_turn": {**turn, "answer": answer}})["block_hashes"]
                      for answer in ("full", "appended")]
            assert hashed[0] == hashed[1] and len(hashed[0]) == len(full["token_ids"]) // 16
            ref = short["prompt_ref"]
        # the last answer's reference names its whole prompt: an extend by it starts with all of those ids
        messages, sampled = _rollout_turns(config)[0]
        by_ref = _post(server, {"messages": messages, "previous_turn": {"prompt_ref": ref,
                                                                        "completion_token_ids": sampled}})
        assert by_ref["token_ids"][:kept + len(short["token_ids"])] == full["token_ids"]
        # a turn that cannot be extended answers in full, whatever was asked
        continued = {"messages": [*SYSTEM, {"role": "assistant", "content": "Partial"}],
                     "continue_final_message": True, "add_generation_prompt": False}
        cont = _post(server, {**continued, "previous_turn": {"prompt_token_ids": head["token_ids"],
                                                             "completion_token_ids": [1, 2], "answer": "appended"}})
        assert cont["extend"]["extended"] is False
        assert cont["token_ids"] == _post(server, continued)["token_ids"]


def test_the_check_compares_the_whole_answer_only_where_asked():
    config = qwen3_config()
    (messages, sampled), *_ = _rollout_turns(config)
    with RenderServer(config) as server:
        head = _post(server, {"messages": SYSTEM, "return_prompt_ref": True})
        turn = {"prompt_ref": head["prompt_ref"], "completion_token_ids": sampled}
        quick = _post(server, {"messages": messages, "previous_turn": turn})["extend"]
        whole = _post(server, {"messages": messages, "previous_turn": {**turn, "check": "full"}})["extend"]
    assert quick["suffix_matches_full_render"] is whole["suffix_matches_full_render"] is True
    assert quick["matches_full_render"] is None and quick["differing_span"] is None
    # The sampled call's Python booleans are not what the template writes: the whole comparison says where.
    assert whole["matches_full_render"] is False and "False" in whole["differing_span"]["extended_text"]


def test_an_unknown_or_another_clients_reference_is_a_404_naming_the_field():
    config = qwen3_config()
    (messages, sampled), *_ = _rollout_turns(config)
    with RenderServer(config, api_key=["key-a", "key-b"]) as server:
        made = _post(server, {"messages": SYSTEM, "return_prompt_ref": True}, key="key-a")
        turn = {"prompt_ref": made["prompt_ref"], "completion_token_ids": sampled}
        for key, ref in (("key-b", made["prompt_ref"]), ("key-a", "pr-unknown")):
            reply = server.client.post(CHAT, headers={"Authorization": f"Bearer {key}"}, json={
                "messages": messages, "tools": rollouts.TOOLS, "tool_choice": "none",
                "previous_turn": {**turn, "prompt_ref": ref}})
            assert reply.status_code == 404, reply.text
            error = reply.json()["error"]
            assert error["param"] == "previous_turn.prompt_ref" and "prompt_token_ids" in error["message"]
        assert _post(server, {"messages": messages, "previous_turn": turn}, key="key-a")["extend"]["extended"]


@pytest.mark.parametrize("turn", [
    {"completion_token_ids": [1]},
    {"completion_token_ids": [1], "prompt_token_ids": [1], "prompt_ref": "pr-x"},
    {"completion_token_ids": [1], "check": "most"},
    {"completion_token_ids": [1], "prompt_token_ids": [1], "answer": "tail"},
    {"completion_token_ids": [1], "prompt_ref": "pr-x", "messages": "some"},
], ids=["no-prompt", "both", "unknown-check", "unknown-answer", "unknown-messages"])
def test_previous_turn_needs_exactly_one_prompt_and_a_known_check(turn):
    with RenderServer(qwen3_config()) as server:
        reply = server.client.post(CHAT, json={"messages": [*SYSTEM, {"role": "assistant", "content": "a"}],
                                               "previous_turn": turn})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["message"]


def test_messages_api_extends_by_reference():
    config = qwen3_config()
    completion = config.tokenizer.encode("<think>\nhm\n</think>\n\nThree.<|im_end|>")
    base = {"model": None, "max_tokens": 8, "system": "You are helpful."}
    with RenderServer(config) as server:
        head = server.client.post("/v1/messages/render", json={
            **base, "messages": [{"role": "user", "content": "find cats"}], "return_prompt_ref": True}).json()
        reply = server.client.post("/v1/messages/render", json={
            **base, "previous_turn": {"prompt_ref": head["prompt_ref"], "completion_token_ids": completion},
            "messages": [{"role": "user", "content": "find cats"}, {"role": "assistant", "content": "Three."},
                         {"role": "user", "content": "ok"}]})
    assert reply.status_code == 200, reply.text
    assert reply.json()["token_ids"][:len(head["token_ids"]) + len(completion)] == head["token_ids"] + completion


def harmony_search_turn() -> tuple[list[int], list[dict[str, Any]]]:
    """A gpt-oss turn as sampled (a search call in Harmony), and the messages a client sends after it."""
    sampled = harmony_encode("<|channel|>analysis<|message|>Need search.<|end|><|start|>assistant to=functions.search"
                             '<|channel|>commentary <|constrain|>json<|message|>{"q":"cats", "exact": false}<|call|>')
    assistant = {"role": "assistant", "content": "", "reasoning_content": "Need search.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"q": "cats"}'}}]}
    return sampled, [assistant, {"role": "tool", "tool_call_id": "c1", "content": "3 cats"}]


def test_harmony_extends_by_reference():
    config = gpt_oss_config()
    sampled, new_messages = harmony_search_turn()
    messages = [*SYSTEM, *new_messages]
    with RenderServer(config) as server:
        head = _post(server, {"model": MODEL, "messages": SYSTEM, "return_prompt_ref": True})
        turn = {"prompt_ref": head["prompt_ref"], "completion_token_ids": sampled}
        out = _post(server, {"model": MODEL, "messages": messages, "previous_turn": turn})
        short = _post(server, {"model": MODEL, "messages": messages, "previous_turn": {**turn, "answer": "appended"}})
    assert out["extend"]["extended"] and out["extend"]["method"] == "harmony"
    assert out["token_ids"][:len(head["token_ids"]) + len(sampled)] == head["token_ids"] + sampled
    assert short["token_ids"] == out["token_ids"][len(head["token_ids"]) + len(sampled):] != []


def test_a_server_without_render_caches_refuses_to_keep_a_prompt():
    config = build_render_config(load_bundle(str(QWEN3_DIR)), served_model_names=["m"], render_cache_bytes=0)
    with RenderServer(config) as server:
        reply = server.client.post(CHAT, json={"messages": SYSTEM, "return_prompt_ref": True})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "return_prompt_ref"


def _entry(count: int) -> StoredPrompt:
    return StoredPrompt(id_run(list(range(1000, 1000 + count))))


def test_each_client_holds_at_most_its_share_and_all_at_most_the_bound():
    size = _entry(100).size
    refs = PromptRefs(10 * size, client_bytes=4 * size)
    a = [refs.file("a", _entry(100)) for _ in range(6)]
    b = [refs.file("b", _entry(100)) for _ in range(3)]
    # "a" filed six but holds its newest four; "b" is untouched by "a"'s overflow.
    assert [refs.get("a", r) is not None for r in a] == [False, False, True, True, True, True]
    assert all(refs.get("b", r) is not None for r in b)
    assert refs.get("b", a[-1]) is None  # another client's reference names nothing
    c = [refs.file("c", _entry(100)) for _ in range(4)]
    # The whole bound: the least recently used go first, whoever filed them.
    assert refs.bytes <= refs.max_bytes and refs.stats().entries == 10
    assert all(refs.get("c", r) is not None for r in c)
    assert refs.file("a", _entry(1000)) is None  # larger than a client may hold: not kept
    assert refs.stats().evictions == 3


def test_an_extended_entry_shares_its_earlier_chunks_and_counts_them():
    first = id_run([5, 6, 7])
    grown = first.then([8]).then([9, 10])
    assert grown.tolist() == [5, 6, 7, 8, 9, 10] and grown.listed()[0][0] is first.listed()[0][0]
    assert bytes(grown.view().json_array()) == b"[5,6,7,8,9,10]"
    assert StoredPrompt(grown).size > StoredPrompt(first).size


def test_a_long_rollouts_run_appends_and_answers_its_tail_without_listing_the_earlier_chunks():
    head = id_run(PromptIds([[1, 2], [3]], [b"1,2", b"3"], 3))  # a full render's pieces: one link
    runs = [head]
    for turn in range(5000):  # two links a turn, as an extend appends the completion, then the new messages
        runs.append(runs[-1].then([turn]).then([-1, turn]))
    last = runs[-1]
    assert last.count == 3 + 3 * 5000 and last.before is not None and last.before.before is runs[-2]
    view = last.view()
    assert view[-4:] == [4998, 4999, -1, 4999] and len(view) == last.count
    assert view._chunks is None  # the tail came from the last links alone
    ids = last.tolist()
    assert ids[:5] == [1, 2, 3, 0, -1] and ids == list(itertools.chain.from_iterable(view.chunks))
    assert bytes(view.json_array()) == ("[" + ",".join(map(str, ids)) + "]").encode()
    del runs, last, view  # (a chain this long is freed without running out of stack)

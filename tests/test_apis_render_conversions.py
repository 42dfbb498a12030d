"""Messages and Responses requests render the conversation they mean: a mid-conversation system message is
its own paragraph, Responses' stop strings reach the engine, an encrypted-only reasoning item adds no turn."""

from __future__ import annotations

import pytest

from render_service.apis.messages import chat_messages, render_messages
from render_service.apis.messages_protocol import MessagesRequest
from render_service.apis.responses import input_messages, render_responses
from render_service.apis.responses_protocol import ResponsesRequest
from tests.render_harness import qwen3_config


@pytest.fixture(scope="module")
def config():
    return qwen3_config(parsers=True)


def test_messages_inline_system_message_is_a_separate_paragraph() -> None:
    req = MessagesRequest(max_tokens=10, system="Be brief.", messages=[
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": "Reminder: answer in French."},
        {"role": "user", "content": "Again"},
    ])
    system = chat_messages(req)[0]
    assert system == {"role": "system", "content": "Be brief.\n\nReminder: answer in French."}


def test_messages_system_blocks_are_still_joined_as_given() -> None:
    req = MessagesRequest(max_tokens=10, system=[{"type": "text", "text": "A. "}, {"type": "text", "text": "B."}],
                          messages=[{"role": "user", "content": "Hi"}])
    assert chat_messages(req)[0]["content"] == "A. B."


def test_messages_render_carries_the_separator(config) -> None:
    req = MessagesRequest(max_tokens=10, system="Be brief.", messages=[
        {"role": "user", "content": "Hi"}, {"role": "system", "content": "Reminder."}])
    gen, _ = render_messages(req, config)
    text = config.tokenizer.decode(gen.token_ids)
    assert "Be brief.\n\nReminder." in text


def test_responses_stop_reaches_the_sampling_params(config) -> None:
    gen, chat = render_responses(ResponsesRequest(input="Count", stop=["END", "STOP"], stop_token_ids=[7],
                                                  include_stop_str_in_output=True), config)
    assert gen.sampling_params.stop == ["END", "STOP"]
    assert 7 in gen.sampling_params.stop_token_ids  # with the model's own end ids
    assert gen.sampling_params.include_stop_str_in_output is True
    assert chat.stop == ["END", "STOP"]


def test_responses_encrypted_only_reasoning_adds_no_turn() -> None:
    items = [
        {"type": "message", "role": "user", "content": "Hi"},
        {"type": "reasoning", "summary": [], "encrypted_content": "gAAAAB..."},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
        {"type": "message", "role": "user", "content": "More"},
    ]
    assert input_messages(items) == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "More"},
    ]


def test_responses_readable_reasoning_still_renders() -> None:
    items = [{"type": "message", "role": "user", "content": "Hi"},
             {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}], "encrypted_content": "x"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]}]
    assert input_messages(items)[1] == {"role": "assistant", "content": "Hello", "reasoning": "think"}

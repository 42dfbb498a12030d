"""Shared test data: OpenAI-style chat requests (messages, tools, documents, template kwargs).

Each ``Conversation`` is what a client would send; run it through
``render_service.templates.chat_template.prepare_messages`` / ``prepare_tools`` before handing it to a template.
Other test files may import ``CONVERSATIONS`` or ``by_name``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from render_service.templates.chat_messages import prepare_messages, prepare_tools


@dataclass(frozen=True)
class Conversation:
    name: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None
    # Template arguments besides messages/tools/documents: add_generation_prompt, continue_final_message,
    # enable_thinking, ...
    kwargs: dict[str, Any] = field(default_factory=lambda: {"add_generation_prompt": True})


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search_web",
        "description": "Search the web.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}
UNICODE_TOOL = {
    "type": "function",
    "function": {
        "name": "traduire",
        "description": "Traduit un texte — 翻译文本 🌐",
        "parameters": {
            "type": "object",
            "properties": {
                "texte": {"type": "string", "description": "le texte « à traduire »"},
                "options": {
                    "type": "object",
                    "properties": {"formel": {"type": "boolean"}, "niveau": {"type": "integer", "minimum": 1}},
                },
                "langues": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["texte"],
        },
    },
}
# No description or parameters: vLLM hands the template explicit nulls for both.
BARE_TOOL = {"type": "function", "function": {"name": "get_time"}}

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
ASK_WEATHER = {"role": "user", "content": "What's the weather like in Seoul today?"}


def _call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


WEATHER_CALL_STR = _call("call_1", "get_weather", json.dumps({"city": "Seoul"}))
WEATHER_CALL_DICT = _call("call_1", "get_weather", {"city": "Seoul", "unit": "celsius"})
SEARCH_CALL = _call("call_2", "search_web", json.dumps({"query": "Seoul air quality"}))

NO_THINKING = {"add_generation_prompt": True, "enable_thinking": False}
THINKING = {"add_generation_prompt": True, "enable_thinking": True}
NO_PROMPT = {"add_generation_prompt": False}

CONVERSATIONS: list[Conversation] = [
    Conversation("single_user", [{"role": "user", "content": "Hello!"}]),
    Conversation("system_and_user", [SYSTEM, ASK_WEATHER]),
    Conversation("system_user_assistant_closed", [
        SYSTEM, ASK_WEATHER, {"role": "assistant", "content": "It is sunny in Seoul."},
    ], kwargs=NO_PROMPT),
    Conversation("multi_turn", [
        SYSTEM,
        {"role": "user", "content": "Name a prime number."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Another one?"},
        {"role": "assistant", "content": "11"},
        {"role": "user", "content": "And their sum?"},
    ]),
    Conversation("reasoning_content_last_assistant", [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Two plus two is four."},
    ], kwargs=NO_PROMPT),
    Conversation("reasoning_content_in_history", [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "\nTwo plus two is four.\n"},
        {"role": "user", "content": "And 3+3?"},
    ]),
    Conversation("reasoning_field_newer_name", [
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris.", "reasoning": "The capital of France is Paris."},
        {"role": "user", "content": "Of Italy?"},
        {"role": "assistant", "content": "Rome.", "reasoning": "Italy's capital is Rome."},
    ], kwargs=NO_PROMPT),
    Conversation("think_tags_inline_in_content", [
        {"role": "user", "content": "Say hi."},
        {"role": "assistant", "content": "<think>\nA greeting.\n</think>\n\nHi!"},
    ], kwargs=NO_PROMPT),
    Conversation("tools_declared", [ASK_WEATHER], tools=[WEATHER_TOOL, SEARCH_TOOL]),
    Conversation("tools_with_system", [SYSTEM, ASK_WEATHER], tools=[WEATHER_TOOL, SEARCH_TOOL]),
    Conversation("tool_call_arguments_json_string", [
        SYSTEM, ASK_WEATHER,
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "Need the weather tool.",
         "tool_calls": [WEATHER_CALL_STR]},
        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temp_c": 21})},
    ], tools=[WEATHER_TOOL, SEARCH_TOOL]),
    Conversation("tool_call_arguments_dict", [
        ASK_WEATHER,
        {"role": "assistant", "content": "Checking.", "tool_calls": [WEATHER_CALL_DICT]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21°C"},
    ], tools=[WEATHER_TOOL]),
    Conversation("tool_call_without_content", [
        ASK_WEATHER,
        {"role": "assistant", "content": None, "tool_calls": [WEATHER_CALL_STR]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
    ], tools=[WEATHER_TOOL]),
    Conversation("several_tool_calls_then_results_in_a_row", [
        SYSTEM, ASK_WEATHER,
        {"role": "assistant", "content": "", "tool_calls": [WEATHER_CALL_STR, SEARCH_CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21°C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "AQI 42 (good)"},
    ], tools=[WEATHER_TOOL, SEARCH_TOOL]),
    Conversation("three_tool_results_in_a_row", [
        {"role": "user", "content": "Weather in three cities?"},
        {"role": "assistant", "content": "", "tool_calls": [
            _call("a", "get_weather", '{"city": "Oslo"}'), _call("b", "get_weather", '{"city": "Lima"}'),
            _call("c", "get_weather", '{"city": "Pune"}'),
        ]},
        {"role": "tool", "tool_call_id": "a", "content": "-3°C"},
        {"role": "tool", "tool_call_id": "b", "content": "19°C"},
        {"role": "tool", "tool_call_id": "c", "content": "31°C"},
    ], tools=[WEATHER_TOOL], kwargs=NO_THINKING),
    Conversation("agent_loop_answer_then_follow_up", [
        SYSTEM, ASK_WEATHER,
        {"role": "assistant", "content": "", "reasoning_content": "Call the tool.", "tool_calls": [WEATHER_CALL_STR]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21°C"},
        {"role": "assistant", "content": "It is sunny and 21°C.", "reasoning_content": "Report it."},
        {"role": "user", "content": "And tomorrow?"},
    ], tools=[WEATHER_TOOL, SEARCH_TOOL]),
    Conversation("tool_result_then_no_thinking_prompt", [
        ASK_WEATHER,
        {"role": "assistant", "content": "", "tool_calls": [WEATHER_CALL_DICT]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
    ], tools=[WEATHER_TOOL], kwargs=NO_THINKING),
    Conversation("unicode_text", [
        {"role": "system", "content": "Réponds en français, s'il te plaît."},
        {"role": "user", "content": "日本語と中文、한국어, Ελληνικά, русский, עברית, العربية — ½ ≠ ∞"},
        {"role": "assistant", "content": "Très bien : voilà « la réponse »."},
        {"role": "user", "content": "Ｆｕｌｌｗｉｄｔｈ and combining: e\u0301 vs é; NFC matters"},
    ]),
    Conversation("emoji", [
        {"role": "user", "content": "Rate this 👍🏽 and 👨‍👩‍👧‍👦 and 🏳️‍🌈 and 🇰🇷!"},
        {"role": "assistant", "content": "🎉🎉🎉", "reasoning_content": "Emoji 🤔 galore"},
        {"role": "user", "content": "🙂"},
    ]),
    Conversation("empty_user_content", [SYSTEM, {"role": "user", "content": ""}]),
    Conversation("empty_assistant_content", [
        {"role": "user", "content": "Say nothing."}, {"role": "assistant", "content": ""},
        {"role": "user", "content": "Thanks."},
    ]),
    Conversation("content_as_text_parts", [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "First line."}, {"type": "text", "text": "Second."}]},
    ]),
    Conversation("content_parts_everywhere", [
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking"}, {"type": "text", "text": "now."}],
         "tool_calls": [WEATHER_CALL_STR]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "Sunny"},
                                                               {"type": "text", "text": "21°C"}]},
    ], tools=[WEATHER_TOOL]),
    Conversation("no_generation_prompt_after_user", [SYSTEM, ASK_WEATHER], kwargs=NO_PROMPT),
    Conversation("continue_final_message", [
        {"role": "user", "content": "Write a haiku about rain."},
        {"role": "assistant", "content": "Soft rain on the roof,"},
    ], kwargs={"continue_final_message": True}),
    Conversation("continue_final_message_trailing_space", [
        {"role": "user", "content": "Count to five."},
        {"role": "assistant", "content": "One, two, three, "},
    ], kwargs={"continue_final_message": True}),
    Conversation("enable_thinking_true", [SYSTEM, ASK_WEATHER], kwargs=THINKING),
    Conversation("enable_thinking_false", [SYSTEM, ASK_WEATHER], kwargs=NO_THINKING),
    Conversation("documents", [{"role": "user", "content": "What does the memo say?"}], documents=[
        {"title": "Memo", "text": "The office is closed on Friday."},
        {"title": "Note ✏️", "text": "Bring \"snacks\" & <drinks>."},
    ]),
    Conversation("special_characters_and_markup", [
        {"role": "user", "content": 'Quote " backslash \\ tab\t json {"a": [1, 2]} and <tool_call> literal'},
        {"role": "assistant", "content": "Line 1\n\n  indented line\n\n\ttabbed\r\nwindows"},
        {"role": "user", "content": "```python\ndef f(x):\n    return x ** 2\n```"},
    ]),
    Conversation("unicode_tool_schema", [
        {"role": "user", "content": "Traduis « bonjour » en japonais."},
        {"role": "assistant", "content": "", "tool_calls": [
            _call("t1", "traduire", {"texte": "bonjour", "langues": ["ja"], "options": {"formel": True}}),
        ]},
        {"role": "tool", "tool_call_id": "t1", "content": "こんにちは"},
    ], tools=[UNICODE_TOOL]),
    Conversation("bare_tool_without_description", [{"role": "user", "content": "Time?"}], tools=[BARE_TOOL]),
    Conversation("named_participants", [
        {"role": "system", "content": "Moderate the chat.", "name": "mod"},
        {"role": "user", "content": "hi all", "name": "alice"},
        {"role": "user", "content": "hello", "name": "bob"},
    ]),
    Conversation("invalid_json_arguments_become_empty_object", [
        ASK_WEATHER,
        {"role": "assistant", "content": "", "tool_calls": [_call("x", "get_weather", "{not json")]},
        {"role": "tool", "tool_call_id": "x", "content": "error"},
    ], tools=[WEATHER_TOOL]),
    Conversation("empty_tool_calls_list_dropped", [
        ASK_WEATHER, {"role": "assistant", "content": "No tool needed.", "tool_calls": []},
        {"role": "user", "content": "ok"},
    ], tools=[WEATHER_TOOL]),
    Conversation("system_message_later_in_conversation", [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "system", "content": "From now on, answer in one word."},
        {"role": "user", "content": "How are you?"},
    ], kwargs=NO_THINKING),
]


def by_name(name: str) -> Conversation:
    for conversation in CONVERSATIONS:
        if conversation.name == name:
            return conversation
    raise KeyError(name)


def template_inputs(conv: Conversation) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A conversation as a template receives it: prepared messages, and its kwargs with tools and documents."""
    kwargs = dict(conv.kwargs)
    if conv.tools is not None:
        kwargs["tools"] = prepare_tools(conv.tools)
    if conv.documents is not None:
        kwargs["documents"] = conv.documents
    return prepare_messages(conv.messages), kwargs

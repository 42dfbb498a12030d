"""Chat requests -> Harmony prompts for gpt-oss bundles.

The request is mapped to Harmony messages the way vLLM's gpt-oss path maps it (``harmony_utils``:
``build_harmony_preamble``, ``parse_chat_inputs_to_harmony_messages``, ``auto_drop_analysis_messages``):

- a system message: model identity, reasoning effort (``reasoning_effort``, else ``chat_template_kwargs``),
  knowledge cutoff, the conversation start date, and the valid channels (``commentary`` only when the
  request declares tools);
- a developer message when there are instructions (the first message, if it is system or developer) or
  tools (rendered by Harmony as its TypeScript-like ``namespace functions``);
- user turns; assistant turns as ``final`` text, ``analysis`` reasoning and ``commentary`` calls to
  ``functions.NAME``; tool results from ``functions.NAME`` to the assistant (the name found by
  ``tool_call_id``); analysis before the last final answer is dropped.

The messages are built here as Harmony's conversation JSON (msgspec, no pydantic) and openai-harmony's Rust
renderer turns them into token IDs: the reference rendering, so the ids are the reference's by construction
(tests/test_harmony_render.py checks the mapping against conversations built with openai-harmony's own
Python API). Forced tool choice and structured outputs are constrained as vLLM does: the prompt ends with
``<|start|>assistant`` and a structural tag shapes the whole reply (``harmony_structured_outputs``).
"""

from __future__ import annotations

import datetime
import functools
import os
from array import array
from collections.abc import Callable, Sequence
from typing import Any, cast

import msgspec

from render_service.harmony.encoding import (
    CALL,
    CHANNEL,
    CONSTRAIN,
    END,
    MESSAGE,
    START,
    harmony_encoding,
)
from render_service.harmony.kept_texts import kept_texts
from render_service.harmony.turn_records import (
    Part,
    TurnRecord,
    TurnRecords,
    cut,
    extended,
    first_record,
    turn_records,
)
from render_service.http.errors import bad_request
from render_service.render.render_config import RenderConfig, resolve_chat_template_kwargs
from render_service.render.response_format import requested_structured_outputs
from render_service.render.structural_tags import harmony_answer, structural_tag_text
from render_service.render.tool_choice import output_format, tool_call_constraint
from render_service.tokenize.incremental_tokenizer import PromptIds
from render_service.tokenize.tokenizer import TextTokenizer
from render_service.wire.message_memo import MemoMessages
from render_service.wire.protocol import ChatCompletionRequest

REASONING_EFFORTS = {"low": "Low", "medium": "Medium", "high": "High"}
# Where a deterministic conversation date comes from when the request names none (vLLM reads the second).
START_DATE_VARS = ("SPLITSERVE_SYSTEM_START_DATE", "VLLM_SYSTEM_START_DATE")
CHANNELS = ["analysis", "commentary", "final"]
# Message texts at least this long have their ids kept (harmony/kept_texts.py); shorter ones cost little to
# encode again. A kept text is counted at its characters, four bytes an id, and this much besides.
KEPT_TEXT_CHARS = 32
KEPT_TEXT_OVERHEAD = 160
# Header texts (roles, recipients, channels, content types) whose ids the renderer keeps: how many at most, and
# the longest (a tool name is the client's to choose).
HEADER_TEXTS = 4096
HEADER_TEXT_CHARS = 96
_JSON = msgspec.json.Encoder()


def _flatten(content: Any, where: str) -> str | None:
    """A message's text: a string, or its text parts joined (gpt-oss reads no images or audio)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content parts", "messages")
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"{where}: gpt-oss takes text only, not a {kind!r} content part", "messages")
    return "".join(texts)


def _tool_name(name: Any) -> str:
    # As vLLM's sanitize_harmony_tool_name: a name never smuggles Harmony markers into a header.
    if not isinstance(name, str):
        return ""
    text = name.strip()
    return text.split("<|", 1)[0].strip() if "<|" in text else text


def _text(role: str, text: str, **fields: Any) -> dict[str, Any]:
    return {"role": role, "content": [{"type": "text", "text": text}], **fields}


def reasoning_effort(req: ChatCompletionRequest, kwargs: dict[str, Any]) -> str | None:
    effort = req.reasoning_effort if req.reasoning_effort is not None else kwargs.get("reasoning_effort")
    if effort is None:
        return None
    if not (isinstance(effort, str) and effort in REASONING_EFFORTS):
        raise bad_request(f"reasoning_effort must be one of low, medium, high for gpt-oss, not {effort!r}",
                          "reasoning_effort")
    return REASONING_EFFORTS[effort]


def conversation_start_date(kwargs: dict[str, Any]) -> str:
    given = kwargs.get("conversation_start_date")
    if given is not None:
        if not isinstance(given, str) or len(given) > 64:
            raise bad_request("conversation_start_date must be a short string", "chat_template_kwargs")
        return given
    for var in START_DATE_VARS:
        if os.environ.get(var):
            return os.environ[var]
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")


def system_message(req: ChatCompletionRequest, kwargs: dict[str, Any], with_tools: bool) -> dict[str, Any]:
    content: dict[str, Any] = {
        "model_identity": "You are ChatGPT, a large language model trained by OpenAI.",
        "reasoning_effort": "Medium",
        "knowledge_cutoff": "2024-06",
    }
    for key in ("model_identity", "knowledge_cutoff"):
        value = kwargs.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise bad_request(f"chat_template_kwargs.{key} must be a string", "chat_template_kwargs")
            content[key] = value
    effort = reasoning_effort(req, kwargs)
    if effort is not None:
        content["reasoning_effort"] = effort
    content["conversation_start_date"] = conversation_start_date(kwargs)
    # vLLM: the commentary channel is announced only when custom tools may be called.
    channels = CHANNELS if with_tools else [c for c in CHANNELS if c != "commentary"]
    content["channel_config"] = {"valid_channels": channels, "channel_required": True}
    content["type"] = "system_content"
    return {"role": "system", "content": [content]}


def _function_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise bad_request(f"tools[{i}]: only function tools are supported", "tools")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"tools[{i}].function.name is required", "tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON Schema object", "tools")
        entry: dict[str, Any] = {"name": fn["name"], "description": fn.get("description") or ""}
        if params is not None:
            entry["parameters"] = params
        out.append(entry)
    return out


def developer_message(instructions: str | None, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    content: dict[str, Any] = {}
    if instructions is not None:
        content["instructions"] = instructions
    if tools:
        content["tools"] = {"functions": {"name": "functions", "tools": _function_tools(tools)}}
    content["type"] = "developer_content"
    return {"role": "developer", "content": [content]}


def conversation_messages(chat: list[dict[str, Any]], first: int = 0) -> list[dict[str, Any]]:
    """vLLM's parse_chat_inputs_to_harmony_messages, then its auto_drop_analysis_messages. ``first``: the request's
    index of ``chat[0]`` (errors name the request's message)."""
    return owned_conversation_messages(chat, first)[0]


def owned_conversation_messages(chat: list[dict[str, Any]], first: int = 0) -> tuple[list[dict[str, Any]], list[int]]:
    """``conversation_messages``, and the request's index of the chat message each Harmony message came from."""
    names = _call_names(chat)
    out: list[dict[str, Any]] = []
    owners: list[int] = []
    for i, msg in enumerate(chat, first):
        converted = _harmony_messages(msg, names, f"messages[{i}]")
        out.extend(converted)
        owners += [i] * len(converted)
    kept = _kept_indices(out)
    return [out[i] for i in kept], [owners[i] for i in kept]


def _call_names(chat: list[Any]) -> dict[Any, str]:
    """Call id (a client may send none) -> function name, over the messages' tool calls (a later call of the same
    id wins)."""
    names: dict[Any, str] = {}
    for msg in chat:
        calls = msg.get("tool_calls") if isinstance(msg, dict) else None
        for call in calls if isinstance(calls, list) else ():
            if isinstance(call, dict):
                fn, key = call.get("function"), call.get("id")
                if key is None or isinstance(key, str):  # (what else a call holds is refused where it is converted)
                    names[key] = _tool_name(fn.get("name") if isinstance(fn, dict) else None)
    return names


def _harmony_messages(msg: Any, names: dict[Any, str], where: str) -> list[dict[str, Any]]:
    if not isinstance(msg, dict):
        raise bad_request(f"{where} must be an object", "messages")
    role = msg.get("role")
    reasoning = msg.get("reasoning") if msg.get("reasoning") is not None else msg.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise bad_request(f"{where}.reasoning must be a string", "messages")
    if role == "assistant":
        out = []
        content = _flatten(msg.get("content"), where)
        calls = msg.get("tool_calls") or []
        if not isinstance(calls, list):
            raise bad_request(f"{where}.tool_calls must be an array", "messages")
        if calls:
            if content:  # a preamble: commentary without a recipient
                out.append(_text("assistant", content, channel="commentary"))
            if reasoning:
                out.append(_text("assistant", reasoning, channel="analysis"))
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict):
                    raise bad_request(f"{where}.tool_calls[{j}].function is required", "messages")
                if not isinstance(call.get("id"), (str, type(None))):
                    raise bad_request(f"{where}.tool_calls[{j}].id must be a string", "messages")
                arguments = fn.get("arguments") or ""
                if not isinstance(arguments, str):
                    raise bad_request(f"{where}.tool_calls[{j}].function.arguments must be a string", "messages")
                # vLLM writes content type "json" (not "<|constrain|>json") for earlier calls.
                out.append(_text("assistant", arguments, channel="commentary",
                                 recipient=f"functions.{_tool_name(fn.get('name'))}", content_type="json"))
            return out
        if reasoning:
            out.append(_text("assistant", reasoning, channel="analysis"))
        if content:
            out.append(_text("assistant", content, channel="final"))
        return out
    if role == "tool":
        call_id = msg.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise bad_request(f"{where}.tool_call_id must be a string", "messages")
        name = names.get(call_id, "")
        content = _flatten(msg.get("content"), where) or ""
        return [{"role": "tool", "name": f"functions.{name}", "content": [{"type": "text", "text": content}],
                 "channel": "commentary", "recipient": "assistant"}]
    if role in ("system", "developer"):
        # Only the first one is the preamble's instructions; later ones become developer instructions.
        instructions = _flatten(msg.get("content"), where)
        return [developer_message(instructions, None)] if instructions is not None else []
    if role == "user":
        return [_text("user", _flatten(msg.get("content"), where) or "")]
    raise bad_request(f"{where}.role {role!r} is not one of system, developer, user, assistant, tool", "messages")


def harmony_messages(req: ChatCompletionRequest, kwargs: dict[str, Any], with_tools: bool) -> list[dict[str, Any]]:
    chat = list(req.messages)
    messages = preamble_messages(req, kwargs, with_tools)
    lead = 1 if leads_with_instructions(chat) else 0
    messages.extend(conversation_messages(chat[lead:], lead))
    return messages


# MemoEntry.checks: the message converts to Harmony messages (what the conversion refuses depends on the message
# alone; the function names tool results take from calls only name, they never refuse)
CONVERTS = "harmony"


def check_conversation(chat: Sequence[Any], start: int, end: int) -> None:
    """Refuses what converting ``chat[start:end]`` (``conversation_messages``) refuses, in its order, without
    keeping what it converts to. A message the message memo decoded (``MemoMessages``, shared between requests)
    is converted once: an RL loop that sends the whole conversation every turn has its earlier messages checked by
    the turns before."""
    entries = chat.entries if type(chat) is MemoMessages else None
    for i in range(start, end):
        entry = entries[i] if entries is not None else None
        if entry is not None and CONVERTS in entry.checks:
            continue
        _harmony_messages(chat[i], {}, f"messages[{i}]")
        if entry is not None:
            entry.checks += (CONVERTS,)


def leads_with_instructions(chat: list[Any]) -> bool:
    """Whether the first message is a system or developer message (the developer message's instructions)."""
    return bool(chat) and isinstance(chat[0], dict) and chat[0].get("role") in ("system", "developer")


def preamble_messages(req: ChatCompletionRequest, kwargs: dict[str, Any], with_tools: bool) -> list[dict[str, Any]]:
    """The system message and, with instructions (a first system or developer message) or tools, the developer
    message: what ``HarmonyRenderer.preamble`` renders."""
    chat = req.messages
    instructions = _flatten(chat[0].get("content"), "messages[0]") if leads_with_instructions(chat) else None
    tools = req.tools if with_tools else None
    messages = [system_message(req, kwargs, with_tools)]
    if instructions or tools:
        messages.append(developer_message(instructions, tools))
    return messages


def turn_messages(chat: list[Any], k: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]] | None:
    """The Harmony messages of the sampled assistant turn ``chat[k]`` and of the messages after it (none of them an
    assistant's), as ``conversation_messages`` converts them in the whole conversation: a tool result takes its
    function's name from the sampled turn's calls, which no earlier call of the same id overrides, and only
    analysis before a final answer is dropped, which the messages after the turn never are. None where a tool
    result answers a call of an earlier turn (its name is the whole conversation's to find)."""
    sampled = chat[k]
    if not isinstance(sampled, dict):
        raise bad_request(f"messages[{k}] must be an object", "messages")
    names = _call_names([sampled])
    after: list[dict[str, Any]] = []
    for i in range(k + 1, len(chat)):
        msg = chat[i]
        if not isinstance(msg, dict):
            raise bad_request(f"messages[{i}] must be an object", "messages")
        if msg.get("role") == "tool" and msg.get("tool_call_id") not in names:
            return None
        after.extend(_harmony_messages(msg, names, f"messages[{i}]"))
    return _harmony_messages(sampled, names, f"messages[{k}]"), after


class HarmonyRenderer:
    """Token IDs for Harmony messages.

    System and developer messages (model identity, channels, the tools' TypeScript namespace) go through
    openai-harmony's renderer and are cached by their JSON: requests of one deployment repeat them. Every
    other message has a fixed shape that is assembled here from marker ids and the bundle's own tiktoken
    ``encode_ordinary`` (openai-harmony encodes ~4 us/token; ours is several times faster). Each text piece is
    encoded on its own, as openai-harmony does, and message text never becomes a marker, so a text's ids are the
    same wherever it sits: where the configuration keeps them (harmony/kept_texts.py), each text's are kept by the text
    (a conversation's earlier messages, resent every turn, are not encoded again). ``render_turn`` goes further for
    messages the message memo shares between requests: a turn renders only the messages after an earlier render's
    (harmony/turn_records.py).
    """

    def __init__(self, tokenizer: TextTokenizer, cache_size: int = 256) -> None:
        self.encoding = harmony_encoding(tokenizer)
        # encode_ordinary answers None only off the fast path
        self.ordinary: Callable[[str], list[int]] = (
            cast("Callable[[str], list[int]]", tokenizer.encode_ordinary) if tokenizer.fast_path
            else lambda text: self.encoding.encode(text, disallowed_special=()))
        self.encode_with_markers = tokenizer.encode
        self._cached = functools.lru_cache(maxsize=cache_size)(self._render_preamble)
        self.tokenizer = tokenizer
        self._headers: dict[str, tuple[int, ...]] = {}
        generation = self.generation_prompt()
        self._generation = (tuple(generation), _JSON.encode(generation)[1:-1])
        self.keeps_texts = True  # (benchmarks turn these off to compare)
        self.keeps_turns = True
        self.turns_proved = self._turn_records_proved()

    def text_ids(self, text: str) -> Sequence[int]:
        """``text`` encoded as plain text (added tokens included), from the kept texts where it is there."""
        texts = kept_texts(self.tokenizer) if self.keeps_texts else None
        if texts is None or len(text) < KEPT_TEXT_CHARS:
            return self.ordinary(text)
        ids = texts.get(text)
        if ids is None:
            ids = array("I", self.ordinary(text))
            texts.put(text, ids, KEPT_TEXT_OVERHEAD + len(text) + 4 * len(ids))
        return ids

    def _render_preamble(self, conversation_json: str) -> tuple[int, ...]:
        ids = self.encoding._inner.render_conversation(conversation_json=conversation_json,
                                                       config={"auto_drop_analysis": False})
        return tuple(ids)

    def preamble(self, messages: list[dict[str, Any]]) -> tuple[int, ...]:
        try:
            return self._cached(_JSON.encode({"messages": messages}).decode())
        except Exception as exc:  # openai_harmony.HarmonyError: say a schema Harmony cannot render
            raise bad_request(f"Harmony cannot render these instructions or tools: {exc}", "tools") from None

    def header_ids(self, text: str) -> Sequence[int]:
        """``text`` (a header's role, recipient, channel or content type) encoded as plain text; a few such texts
        recur in every message, so their ids are kept (at most ``HEADER_TEXTS``)."""
        ids = self._headers.get(text)
        if ids is None:
            ids = tuple(self.ordinary(text))
            if len(text) > HEADER_TEXT_CHARS:
                return ids
            if len(self._headers) >= HEADER_TEXTS:
                self._headers.clear()
            self._headers[text] = ids
        return ids

    def message(self, msg: dict[str, Any], out: list[int] | array[int]) -> None:
        role = msg["role"]
        if role in ("system", "developer"):
            out.extend(self.preamble([msg]))  # a later instructions message: openai-harmony renders it
            return
        header = self.header_ids
        out.append(START)
        out.extend(header(msg["name"] if role == "tool" else role))
        recipient = msg.get("recipient")
        if recipient is not None and recipient != "all":
            out.extend(header(f" to={recipient}"))
        channel = msg.get("channel")
        if channel is not None:
            out.append(CHANNEL)
            out.extend(header(channel))
        content_type = msg.get("content_type")
        if content_type is not None:
            if content_type.startswith("<|constrain|>"):
                out.extend(header(" "))
                out.append(CONSTRAIN)
                if content_type != "<|constrain|>":
                    out.extend(header(content_type[len("<|constrain|>"):]))
            else:
                out.extend(header(f" {content_type}"))
        out.append(MESSAGE)
        for part in msg["content"]:
            out.extend(self.text_ids(part["text"]))
        out.append(end_marker(msg))

    def rendered(self, messages: list[dict[str, Any]], out: list[int]) -> list[int]:
        """``messages`` rendered one after the other onto ``out``, as the plain render does; where each one's ids
        end, counted from the first of them."""
        start = len(out)
        ends = []
        for msg in messages:
            self.message(msg, out)
            ends.append(len(out) - start)
        return ends

    def parts(self, messages: list[dict[str, Any]]) -> list[Part]:
        """Each of ``messages`` rendered on its own, as a turn record keeps it."""
        out: list[int] = []
        ends = self.rendered(messages, out)
        chunks, json_parts = cut(array("I", out), ends)
        return [Part(ids, json, *_drop_flags(msg)) for ids, json, msg in zip(chunks, json_parts, messages, strict=True)]

    def generation_prompt(self) -> list[int]:
        """``<|start|>assistant``: how a render for completion ends."""
        return [START, *self.ordinary("assistant")]

    def render(self, messages: list[dict[str, Any]], prefix: str = "") -> list[int]:
        """The conversation for completion by the assistant (``<|start|>assistant`` + ``prefix``)."""
        split = 2 if len(messages) > 1 and messages[1]["role"] == "developer" else 1
        head = messages[:split]
        out = list(self.preamble(head))
        for msg in messages[split:]:
            self.message(msg, out)
        out += self.generation_prompt()
        if prefix:
            out.extend(self.encode_with_markers(prefix))
        return out

    def render_turn(self, req: ChatCompletionRequest, kwargs: dict[str, Any], with_tools: bool) -> Sequence[int]:
        """``render(harmony_messages(...))``: for messages the message memo decoded (shared between requests), by
        extending the turn record of an earlier render of their first messages (harmony/turn_records.py) and
        filing this one's."""
        records = turn_records(self.tokenizer) if self.keeps_turns and self.turns_proved else None
        chat = req.messages
        if records is None or type(chat) is not MemoMessages:
            return self.render(harmony_messages(req, kwargs, with_tools))
        shared = chat.shared_with[1] if chat.shared_with is not None else None
        return self.extend_turn(records, chat, shared, lambda: preamble_messages(req, kwargs, with_tools))

    def extend_turn(self, records: TurnRecords, chat: list[Any], shared: int | None,
                    preamble_of: Callable[[], list[dict[str, Any]]]) -> Sequence[int]:
        """The prompt of ``chat`` (``preamble_of()`` its system and developer messages): where a record holds its
        first messages (``shared``: how many the message memo found shared with an earlier body), a ``PromptIds``
        of the record's chunks and the new messages' alone; else the plain render's list. Either way the render's
        record is filed; errors are the plain render's, in its order."""
        preamble_messages_ = preamble_of()
        record = records.find(chat, shared)
        start = len(record.messages) if record is not None else 0
        lead = 1 if leads_with_instructions(chat) else 0
        new_names = _call_names(chat[max(start, lead):])
        if record is not None and any(record.names.get(key, name) != name for key, name in new_names.items()):
            record, start = None, 0  # a new call reuses an earlier call's id: earlier results would be renamed
        if record is None:
            new_names = _call_names(chat[lead:])
            names = new_names
        else:
            names = {**record.names, **new_names} if new_names else record.names
        converted = self._converted(chat, max(start, lead), names)
        preamble = self.preamble(preamble_messages_)
        if record is not None and record.preamble != preamble:
            record = None
            converted = self._converted(chat, lead, names)
        kept = _dropped_analysis(converted)  # (analysis before a new final answer: never rendered)
        generation, generation_json = self._generation
        if record is None:  # the plain render, and its record for the next turn
            out = list(preamble)
            ends = self.rendered(kept, out)
            records.put(first_record(tuple(chat), preamble, names, array("I", out)[len(preamble):], ends,
                                     [_drop_flags(msg) for msg in kept]), None)
            out += generation
            return out
        chunks, json_parts, open_at, analysis = extended(record, self.parts(kept))
        count = sum(map(len, chunks))
        preamble_json = record.preamble_json or _JSON.encode(preamble)[1:-1]
        records.put(TurnRecord(tuple(chat), preamble, names, count, open_at, analysis, chunks, json_parts,
                               preamble_json=preamble_json), record)
        records.extended += 1
        return PromptIds([preamble, *chunks, generation], [preamble_json, *json_parts, generation_json],
                         len(preamble) + count + len(generation))

    def _converted(self, chat: list[Any], start: int, names: dict[Any, str]) -> list[dict[str, Any]]:
        """The Harmony messages of ``chat[start:]``, before the drop rule."""
        out: list[dict[str, Any]] = []
        for i in range(start, len(chat)):
            out.extend(_harmony_messages(chat[i], names, f"messages[{i}]"))
        return out

    def _turn_records_proved(self) -> bool:
        """Whether a probe conversation, grown a message at a time and extended from each turn's record, renders
        the plain path's ids at every turn (its records kept apart from the requests')."""
        records = TurnRecords(1 << 24)
        conversation = probe_conversation()
        preamble = [system_message(ChatCompletionRequest(messages=[]), {"conversation_start_date": "2026-01-01"},
                                   True), developer_message("Be brief.", PROBE_TOOLS)]
        for end in range(2, len(conversation) + 1):
            chat = conversation[:end]
            plain = self.render(preamble + conversation_messages(chat[1:], 1))
            if list(self.extend_turn(records, chat, None, lambda: preamble)) != plain:
                return False
        return records.extended == len(conversation) - 2


PROBE_TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Find a fact.", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]


def probe_conversation() -> list[dict[str, Any]]:
    """A conversation with every kind of message the drop rule and the call names read: reasoning before calls and
    before answers, parallel calls, their results, a preamble, a later instructions message, a second answer."""
    def call(call_id: str, q: str) -> dict[str, Any]:
        return {"id": call_id, "type": "function", "function": {"name": "lookup", "arguments": f'{{"q": "{q}"}}'}}

    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Where is the tallest tower, and how tall is it?"},
        {"role": "assistant", "reasoning": "I should look both up.", "content": "Looking.",
         "tool_calls": [call("c1", "tallest tower"), call("c2", "its height")]},
        {"role": "tool", "tool_call_id": "c1", "content": "Dubai"},
        {"role": "tool", "tool_call_id": "c2", "content": "828 m"},
        {"role": "assistant", "reasoning": "One more check.", "tool_calls": [call("c3", "year built")]},
        {"role": "tool", "tool_call_id": "c3", "content": "2010"},
        {"role": "assistant", "reasoning": "I have it all now.", "content": "Dubai's Burj Khalifa, 828 m."},
        {"role": "system", "content": "Answer in French from now on."},
        {"role": "user", "content": "And the second tallest?"},
        {"role": "assistant", "reasoning": "Look it up.", "tool_calls": [call("c4", "second tallest")]},
        {"role": "tool", "tool_call_id": "c4", "content": "Merdeka 118"},
        {"role": "assistant", "reasoning": "Answer now.", "content": "Merdeka 118, à Kuala Lumpur."},
        {"role": "user", "content": "Merci."},
    ]


def _drop_flags(msg: dict[str, Any]) -> tuple[bool, bool]:
    """What the drop rule reads of a Harmony message: (an analysis message, an assistant's final answer)."""
    channel = msg.get("channel")
    return channel == "analysis", channel == "final" and msg["role"] == "assistant"


def _kept_indices(messages: list[dict[str, Any]]) -> list[int]:
    """vLLM's auto_drop_analysis_messages: the indices of the Harmony messages kept, every analysis message before
    the last final answer dropped."""
    flags = [_drop_flags(msg) for msg in messages]
    last_final = max((i for i, (_, final) in enumerate(flags) if final), default=-1)
    return [i for i, (analysis, _) in enumerate(flags) if not (i < last_final and analysis)]


def _dropped_analysis(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [messages[i] for i in _kept_indices(messages)]


def end_marker(msg: dict[str, Any]) -> int:
    """The marker a rendered message ends with: ``<|call|>`` after an assistant's call, else ``<|end|>``."""
    return CALL if msg["role"] == "assistant" and msg.get("recipient") is not None else END


_RENDERERS: dict[int, HarmonyRenderer] = {}


def renderer_for(tokenizer: TextTokenizer) -> HarmonyRenderer:
    renderer = _RENDERERS.get(id(tokenizer))
    if renderer is None or renderer.encode_with_markers != tokenizer.encode:
        renderer = _RENDERERS[id(tokenizer)] = HarmonyRenderer(tokenizer)
    return renderer


def render_harmony_chat(req: ChatCompletionRequest, tokenizer: TextTokenizer, kwargs: dict[str, Any],
                        tool_choice: str) -> list[int]:
    """The prompt's token IDs (``tool_choice`` as render's _check_tool_choice resolved it), ending with
    ``<|start|>assistant`` as vLLM's: a forced call or a structured answer is the constraint's to shape."""
    with_tools = bool(req.tools) and tool_choice != "none"
    return renderer_for(tokenizer).render(harmony_messages(req, kwargs, with_tools))


def render_harmony_request(req: ChatCompletionRequest, config: RenderConfig, tool_choice: str,
                           named: str | None = None) -> tuple[Sequence[int], dict[str, Any] | None]:
    """render_chat's Harmony branch: (prompt ids, the structured-outputs constraint)."""
    kwargs = resolve_chat_template_kwargs(req, config)
    # a gpt-oss bundle's tokenizer is always our TextTokenizer (o200k ranks and Harmony's markers)
    renderer = renderer_for(cast(TextTokenizer, config.tokenizer))
    ids = renderer.render_turn(req, kwargs, bool(req.tools) and tool_choice != "none")
    return ids, harmony_structured_outputs(req, config, tool_choice, named)


def harmony_structured_outputs(req: ChatCompletionRequest, config: RenderConfig, tool_choice: str,
                               named: str | None) -> dict[str, Any] | None:
    """vLLM's constraint for gpt-oss: a requested format becomes the final message of a reply that may reason
    first (render_service/render/structural_tags.py ``harmony_answer``), and the tool choice constrains the calls as
    for any parser (``tool_call_constraint`` with the Harmony family)."""
    requested = requested_structured_outputs(req)
    answer = output_format(requested) if requested is not None else None
    if answer is not None:
        requested = {"structural_tag": structural_tag_text(harmony_answer(answer))}
    return tool_call_constraint("openai", req.tools, tool_choice, named, req.parallel_tool_calls, requested,
                                config.tool_strict_level)


def prerendered_harmony_ids(req: ChatCompletionRequest, config: RenderConfig, tool_choice: str, named: str | None,
                            given: list[int]) -> tuple[list[int], dict[str, Any] | None]:
    """``given`` (a prompt rendered already, prerendered.py) in place of render_harmony_request's render. The
    request is still mapped to Harmony messages, so what render refuses is refused alike."""
    harmony_messages(req, resolve_chat_template_kwargs(req, config), bool(req.tools) and tool_choice != "none")
    return given, harmony_structured_outputs(req, config, tool_choice, named)

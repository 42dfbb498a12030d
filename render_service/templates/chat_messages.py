"""OpenAI request messages and tools -> what a chat template receives, as vLLM prepares them: content shaped
for the template's content format (text parts only), tool calls with mapping arguments, tools in vLLM's
model_dump shape, and the developer role folded into system where the template lacks it."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import msgspec

from render_service.templates.chat_template import PlainMessages, PlainTools, plain_copy, template_form
from render_service.templates.sandbox import TemplateError
from render_service.wire.message_memo import MemoMessages, MemoTools

if TYPE_CHECKING:
    from render_service.templates.chat_template import ChatTemplate

# The key of a memo entry's template form (``chat_template.template_form``) beside its prepared form.
_TEMPLATE_FORM = "template:"

# Text-only render tier: these content part types carry text; anything else is refused.
_TEXT_PART_FIELDS = {
    "text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking",
}


def prepare_messages(openai_messages: Iterable[Any], content_format: str = "string") -> list[dict[str, Any]]:
    """OpenAI chat messages -> template messages, as vLLM 0.32 prepares them.

    ``content_format="string"`` (templates that treat content as text, like Qwen's): text parts are
    joined with "\\n" and a missing content becomes "". ``"openai"`` (templates that loop over parts,
    see ``detect_content_format``): content stays a list of ``{"type": "text", "text": ...}`` parts.
    Tool-call arguments become a mapping (a JSON-object string is parsed; anything else is {}), an
    empty ``tool_calls`` list is dropped, ``reasoning`` (or the older ``reasoning_content``) is set
    under both names, ``name``, ``task`` and a tool's ``tool_call_id`` are kept. Non-text parts are
    refused: the render tier is text-only.

    Every value is a plain copy (``templates.plain_copy``): the render takes them without copying again
    (``templates.PlainMessages``). Messages decoded through the memo (``message_memo.MemoMessages``) come out as
    prepared before, shared and read-only; the others, fresh.
    """
    if content_format not in ("string", "openai"):
        raise TemplateError(f"Unknown chat template content format {content_format!r}")
    if type(openai_messages) is MemoMessages:
        return _prepare_memo_messages(openai_messages, content_format)
    if not isinstance(openai_messages, (list, tuple)):
        raise TemplateError("messages must be a list of message objects")
    out = PlainMessages()
    for index, message in enumerate(openai_messages):
        if type(message) is not dict and not isinstance(message, Mapping):
            raise TemplateError(f"messages[{index}] must be an object")
        out.append(_prepare_message(message, index, content_format))
    return out


def _prepare_memo_messages(messages: MemoMessages, content_format: str) -> PlainMessages:
    """Each message's prepared form for ``content_format``, made once per distinct message JSON (its index
    only ever shows in an error's text, and errors are not kept). The forms of the messages a stored body shares
    with this one (``MemoMessages.shared_with``) are taken from that body's list as its render left it: the same
    entries, whose forms, once made, never change."""
    out = PlainMessages()
    forms = []
    entries = messages.entries
    form_key = _TEMPLATE_FORM + content_format
    start = 0
    developer = False
    stored, common = messages.shared_with or (None, 0)
    kept_list = stored.prepared.get(content_format) if stored is not None and stored.prepared is not None else None
    # the ids of the messages taken from the list, where it is taken whole (its messages are distinct objects)
    kept_ids: set[int] | None = None
    if kept_list is not None:
        start = min(common, len(kept_list.out))
        out.extend(kept_list.out[:start])
        forms = kept_list.forms[:start]
        developer = kept_list.developer_before(start)
        if start == len(kept_list.out):
            kept_ids = kept_list.ids
    for index in range(start, len(entries)):
        entry = entries[index]
        kept = entry.prepared
        prepared = kept.get(content_format)
        if prepared is None:
            prepared = kept[content_format] = _prepare_message(entry.value, index, content_format)
            kept[form_key] = template_form(prepared)
            for call in prepared.get("tool_calls") or ():  # what templates write with tojson every turn
                function = call.get("function") if type(call) is dict else None
                if type(function) is dict and type(function.get("arguments")) is dict:
                    entry.lend(function["arguments"])
        out.append(prepared)
        forms.append(kept[form_key])
        developer = developer or prepared.get("role") == "developer"
    ids = set(map(id, out)) if kept_ids is None else kept_ids.union(map(id, itertools.islice(out, start, None)))
    if len(ids) < len(out):
        # The same message twice: a template sees two objects, as without the memo (``is sameas`` tells them
        # apart)
        seen: set[int] = set()
        for at, prepared in enumerate(out):
            if id(prepared) in seen:
                out[at] = plain_copy(prepared)
            seen.add(id(prepared))
    else:  # (each shared message's template form, kept with it: a render need not make them again)
        out.template_forms = forms
        if messages.filed is not None and messages.filed.prepared is not None:
            messages.filed.prepared[content_format] = PreparedLineage(out, forms, developer, ids)
    out.shared = True
    out.has_developer = developer
    return out


class PreparedLineage:
    """A stored body's messages as prepared for one content format (the list a render got, each message's template
    form), and where the first developer message is (-1: none), so the next turn's preparation need not walk them."""

    __slots__ = ("out", "forms", "first_developer", "ids")

    def __init__(self, out: list[dict[str, Any]], forms: list[dict[str, Any]], developer: bool, ids: set[int]
                 ) -> None:
        self.out = list(out)
        self.forms = forms
        self.ids = ids  # of the messages in ``out``, each a distinct object
        self.first_developer = next((i for i, m in enumerate(out) if m.get("role") == "developer"), -1) \
            if developer else -1

    def developer_before(self, end: int) -> bool:
        return 0 <= self.first_developer < end


def _text(value: str) -> str:
    return value if type(value) is str else str.__str__(value)  # a str subclass as the plain str it holds


def _prepare_message(message: Mapping[str, Any], index: int, content_format: str) -> dict[str, Any]:
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise TemplateError(f"messages[{index}].role must be a non-empty string")
    role = _text(role)
    content = message.get("content")
    if type(content) is str and role != "system":
        texts = [content]  # the usual message: no parts to pick, no header to drop
    else:
        texts = _content_texts(content, index)
        if role == "system":
            texts = _without_billing_header(texts)
    if content_format == "string":
        prepared: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
    else:
        prepared = {"role": role, "content": [{"type": "text", "text": _text(t)} for t in texts]}
    if role == "assistant":
        tool_calls = message.get("tool_calls")
        if tool_calls is not None:
            calls = _prepare_tool_calls(tool_calls, index)
            if calls:  # vLLM drops an empty list: the template takes the plain assistant path
                prepared["tool_calls"] = calls
        reasoning = message.get("reasoning")
        if reasoning is None:
            reasoning = message.get("reasoning_content")
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise TemplateError(f"messages[{index}].reasoning must be a string")
            reasoning = _text(reasoning)
            prepared["reasoning"] = reasoning
            prepared["reasoning_content"] = reasoning
    elif role == "tool" and "tool_call_id" in message:
        prepared["tool_call_id"] = plain_copy(message["tool_call_id"])
        if content_format == "openai":
            # vLLM flattens a tool result's text parts for every template: most expect a string there.
            prepared["content"] = "\n".join(texts)
    if isinstance(message.get("name"), str):
        prepared["name"] = _text(message["name"])
    if isinstance(message.get("task"), str):
        prepared["task"] = _text(message["task"])
    if role == "developer":
        prepared["tools"] = plain_copy(message.get("tools"))
    return prepared


def _content_texts(content: Any, index: int) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, (list, tuple)):
        raise TemplateError(f"messages[{index}].content must be a string or a list of content parts")
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
            continue
        if type(part) is not dict and not isinstance(part, Mapping):
            raise TemplateError(f"messages[{index}].content parts must be objects")
        kind = part.get("type")
        if kind not in _TEXT_PART_FIELDS:
            raise TemplateError(
                f"Unsupported content part type {kind!r} in messages[{index}]: this server is text-only "
                f"(supported: {', '.join(sorted(_TEXT_PART_FIELDS))})"
            )
        text = part.get(_TEXT_PART_FIELDS[kind])
        if text is None:
            continue  # vLLM skips a text part with no text
        if not isinstance(text, str):
            raise TemplateError(f"messages[{index}].content part text must be a string")
        texts.append(text)
    return texts


_CLAUDE_BILLING_HEADER = "x-anthropic-billing-header"


def _without_billing_header(texts: list[str]) -> list[str]:
    # vLLM 0.32 drops Claude Code's per-request attribution line from system text: it changes on
    # every request and would defeat prefix caching.
    out = []
    for text in texts:
        if text.startswith(_CLAUDE_BILLING_HEADER):
            text = text.partition("\n")[2]
            if not text:
                continue
        out.append(text)
    return out


def _prepare_tool_calls(tool_calls: Any, index: int) -> list[dict[str, Any]]:
    if not isinstance(tool_calls, (list, tuple)):
        raise TemplateError(f"messages[{index}].tool_calls must be a list")
    prepared = []
    for call in tool_calls:
        if type(call) is not dict and not isinstance(call, Mapping):
            raise TemplateError(f"messages[{index}]: assistant tool_calls entries must be objects.")
        function = call.get("function")
        if call.get("type", "function") != "function" or (
                type(function) is not dict and not isinstance(function, Mapping)):
            raise TemplateError(f"messages[{index}]: chat completions only support assistant tool_calls of type "
                                "'function'.")
        if not isinstance(function.get("name"), str):
            raise TemplateError(f"messages[{index}].tool_calls[].function.name must be a string")
        given = function.get("arguments")
        arguments = _arguments_mapping(given)
        entry = plain_copy(call)  # the call's keys in their order, its function copied as a dict among them
        if arguments is not given:  # parsed from their JSON text (fresh, plain) or {}; else copied just now
            entry["function"]["arguments"] = arguments
        prepared.append(entry)
    return prepared


# Arguments with fewer brackets than this are parsed by msgspec; more, by json.loads (see _parse_arguments).
_MSGSPEC_MAX_OPENERS = 256
_decode_json = msgspec.json.decode


def _arguments_mapping(arguments: Any) -> dict[str, Any]:
    # Templates expect a mapping (HF's convention). As vLLM 0.32 does, anything that is not a JSON
    # object (empty, malformed, an array, a number) becomes {} so that the conversation can go on.
    if isinstance(arguments, str) and arguments:
        try:
            arguments = _parse_arguments(arguments)
        except json.JSONDecodeError:
            return {}
    return arguments if isinstance(arguments, dict) and arguments else {}


def _parse_arguments(text: str) -> Any:
    """``json.loads(text)``, the same value or error, at msgspec's speed where that is provably the same: every
    text msgspec decodes, json.loads decodes to an equal value of the same types (ints, floats correctly rounded,
    duplicate keys last-wins); what msgspec refuses (NaN, surrogates, out-of-range numbers, bad syntax) goes
    to json.loads for its own answer. Nesting: msgspec gets only texts too shallow for either decoder to hit the
    recursion limit, so where json.loads raises RecursionError it still does (an agent's history holds dozens
    of calls a turn: json.loads was ~4x the cost)."""
    if text.count("[") + text.count("{") < _MSGSPEC_MAX_OPENERS:
        try:
            return _decode_json(text)
        except (msgspec.DecodeError, ValueError):  # ValueError: a lone surrogate in the text, which msgspec
            pass                                   # cannot take as UTF-8
    return json.loads(text)


def prepare_tools(openai_tools: Any) -> list[dict[str, Any]] | None:
    """OpenAI tool declarations -> what the template receives, in vLLM 0.32's shape.

    vLLM hands templates ``tool.model_dump()``: ``{"type": "function", "function": {"name",
    "description", "parameters"}}`` with None where absent, ``strict``/``defer_loading`` only when
    given, other keys dropped.
    """
    if openai_tools is None:
        return None
    if type(openai_tools) is MemoTools:  # decoded through the memo: prepared once, shared and read-only
        memo = openai_tools.entry
        prepared: list[dict[str, Any]] | None = memo.prepared.get("tools")
        if prepared is None:
            prepared = memo.prepared["tools"] = prepare_tools(memo.value)
            for tool in prepared or ():
                memo.lend(tool)
        return prepared
    if not isinstance(openai_tools, (list, tuple)):
        raise TemplateError("tools must be a list")
    prepared = PlainTools()  # plain copies: the render takes them as they are
    for index, tool in enumerate(openai_tools):
        if not isinstance(tool, Mapping):
            raise TemplateError(f"tools[{index}] must be an object")
        if tool.get("type", "function") != "function":
            raise TemplateError(f"tools[{index}].type must be 'function'")
        function = tool.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise TemplateError(f"tools[{index}].function.name must be a string")
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise TemplateError(f"tools[{index}].function.description must be a string")
        if function.get("parameters") is not None and not isinstance(function["parameters"], Mapping):
            raise TemplateError(f"tools[{index}].function.parameters must be an object")
        fn = {"name": _text(function["name"]), "description": plain_copy(function.get("description")),
              "parameters": plain_copy(function.get("parameters"))}
        defer_loading = function.get("defer_loading", tool.get("defer_loading"))
        for key, value in (("strict", function.get("strict")), ("defer_loading", defer_loading)):
            if value is not None:
                if not isinstance(value, bool):
                    raise TemplateError(f"tools[{index}].function.{key} must be a boolean")
                fn[key] = value
        entry: dict[str, Any] = {"type": "function", "function": fn}
        if tool.get("defer_loading") is not None:
            entry["defer_loading"] = plain_copy(tool["defer_loading"])
        prepared.append(entry)
    return prepared


def convert_developer_role(messages: list[dict[str, Any]], template: ChatTemplate) -> list[dict[str, Any]]:
    """For templates that do not know the developer role, vLLM turns it into one leading system message."""
    if template.supports_developer_role:
        return messages
    known = getattr(messages, "has_developer", None)  # (PlainMessages from the memo: found while preparing)
    if known is False or (known is None and not any(m.get("role") == "developer" for m in messages)):
        return messages
    converted = []
    for m in messages:
        if m.get("role") == "developer":
            m = {k: v for k, v in m.items() if k != "tools"}
            m["role"] = "system"
        converted.append(m)
    system_texts: list[str] = []
    others = []
    needs_merge = False
    for i, m in enumerate(converted):
        if m["role"] != "system":
            others.append(m)
            continue
        if i > 0 or system_texts:
            needs_merge = True
        content = m.get("content", "")
        if isinstance(content, list):
            content = "\n".join(
                p["text"] if isinstance(p, dict) else p
                for p in content if isinstance(p, str) or (isinstance(p, dict) and "text" in p)
            )
        if content:
            system_texts.append(content)
    # Built from the messages' own values: plain copies stay so.
    kind = PlainMessages if type(messages) is PlainMessages else list
    if not needs_merge:
        return kind(converted)
    return kind([{"role": "system", "content": "\n\n".join(system_texts)}, *others])

"""Chat templates rendered the way Hugging Face's ``apply_chat_template`` does.

Facts carried over from transformers (5.x, ``utils/chat_template_utils.py``) and vLLM's renderer:
- an ``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with the ``loopcontrols``
  extension and a ``{% generation %}`` block tag (assistant masks);
- ``tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`` (no HTML escaping),
  the globals ``raise_exception``, ``strftime_now``, a call-only ``dict`` and a ``namespace`` that refuses
  underscore attributes;
- messages: keys whose value is None are dropped, reasoning is aliased (``reasoning_content``/``thinking``/
  ``reasoning``), everything the template sees is a fresh plain copy;
- the tokenizer's named special tokens (``ModelBundle.template_special_tokens``) are template variables,
  request kwargs override them;
- ``continue_final_message`` tags the final message, renders, and cuts the text at the tag.
"""

from __future__ import annotations

import json
import re
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from importlib import resources
from typing import Any, Iterable, Mapping

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(ValueError):
    """The template failed to render this conversation (a client error: 400)."""


# Names a message's reasoning may arrive under; templates read the first one.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "

# Text-only render tier: these content part types carry text; anything else is refused.
_TEXT_PART_FIELDS = {
    "text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking",
}


# --------------------------------------------------------------------------- the Jinja environment

# (rendered blocks so far, generation spans) while a render with spans is running.
_GENERATION_TRACKER: ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = ContextVar(
    "generation_tracker", default=None
)


class GenerationBlocks(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body and records its character span."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_mark_generation"), [], [], body).set_lineno(lineno)

    def _mark_generation(self, caller: Any) -> str:
        text = caller()
        tracking = _GENERATION_TRACKER.get()
        if tracking is not None:
            # Same rule as HF: the span starts after everything emitted before the block.
            blocks, spans = tracking
            start = sum(len(b) for b in blocks)
            spans.append((start, start + len(text)))
        return text


def _raise_exception(message: Any) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; HF's does not, and exposes these options.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _CallOnlyDict:
    # `dict(...)` in templates without handing the sandbox the dict type itself.
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _SafeNamespace(jinja2.utils.Namespace):
    # Underscore attributes on a namespace are a route to CPython internals.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _SafeNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}."
            )


_DICT_ATTRIBUTES = frozenset(dir(dict))


# Bounds on what one render may build: a template (a request's own, or a model's) must not be able to
# exhaust memory with `'x' * 10**12` or `2 ** 10**9`. HF has no such bounds; real templates never
# come near them.
MAX_RENDERED_CHARS = 64 * 1024 * 1024
_MAX_POWER_EXPONENT = 4096


class ChatSandbox(ImmutableSandboxedEnvironment):
    """HF's sandbox, with shortcuts that give the same answers faster, and bounds on runaway output."""

    _attribute_safety: dict[tuple[type, str], bool] = {}
    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(count, int) \
                        and len(seq) * count > MAX_RENDERED_CHARS:
                    raise jinja2.exceptions.SecurityError("the template builds a sequence that is too large")
        elif operator == "**" and isinstance(right, int) and abs(right) > _MAX_POWER_EXPONENT \
                and isinstance(left, int) and abs(left) > 1:
            raise jinja2.exceptions.SecurityError("the template computes a number that is too large")
        return super().call_binop(context, operator, left, right)

    def getattr(self, obj: Any, attribute: str) -> Any:
        # A plain dict has no attributes beyond dict's own, so Jinja's getattr would fail and fall back
        # to obj[attribute]; all template data is rebuilt as plain dicts, so go there directly.
        if type(obj) is dict and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except KeyError:
                return self.undefined(obj=obj, name=attribute)
        return super().getattr(obj, attribute)

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        # The sandbox's verdict depends only on the object's type and the attribute's name (isinstance
        # tests and name rules), so remember it: loops ask about loop.index0 or str.startswith each turn.
        key = (type(obj), attr)
        safe = self._attribute_safety.get(key)
        if safe is None:
            safe = super().is_safe_attribute(obj, attr, value)
            if len(self._attribute_safety) < 4096:  # `|attr(name)` can make names from data: stay bounded
                self._attribute_safety[key] = safe
        return safe


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ChatSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlocks, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _CallOnlyDict()
    env.globals["namespace"] = _SafeNamespace
    return env


_ENVIRONMENT = _make_environment()


@lru_cache(maxsize=64)
def compile_template(source: str) -> jinja2.Template:
    """Compile once per distinct source string (requests may name their own template)."""
    try:
        return _ENVIRONMENT.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"Invalid chat template (line {exc.lineno}): {exc.message}") from exc


@lru_cache(maxsize=64)
def template_variables(source: str) -> frozenset[str]:
    """Variables the template reads from its context (what chat_template_kwargs can reach)."""
    return frozenset(jinja2.meta.find_undeclared_variables(_ENVIRONMENT.parse(source)))


def _strip_wrappers(node: jinja2.nodes.Node) -> jinja2.nodes.Node:
    # `messages | reverse`, `messages is defined`, `messages[1:]` still refer to messages.
    while True:
        if isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) and node.node is not None:
            node = node.node
        elif isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
            node = node.node
        else:
            return node


def _names(node: jinja2.nodes.Node, names: set[str]) -> bool:
    node = _strip_wrappers(node)
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name in names


def _field_of(node: jinja2.nodes.Node, names: set[str], key: str) -> bool:
    node = _strip_wrappers(node)
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == key and _names(node.node, names)
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key and _names(node.node, names)
    return False


@lru_cache(maxsize=64)
def detect_content_format(source: str) -> str:
    """"openai" when the template loops over a message's content parts, else "string" (vLLM's rule).

    Followed: names assigned from ``messages``, loops over them, then loops over ``message.content``
    (directly, through a macro parameter that receives it, or a top-level loop over a name ``content``).
    """
    try:
        root = _ENVIRONMENT.parse(source)
    except jinja2.TemplateSyntaxError:
        return "string"
    aliases = {"messages"}
    grew = True
    while grew:
        grew = False
        for assign in root.find_all(jinja2.nodes.Assign):
            target = assign.target
            if isinstance(target, jinja2.nodes.Name) and target.name not in aliases and _names(assign.node, aliases):
                aliases.add(target.name)
                grew = True
    message_vars = {
        loop.target.name for loop in root.find_all(jinja2.nodes.For)
        if isinstance(loop.target, jinja2.nodes.Name) and _names(loop.iter, aliases)
    }
    macro_loops: set[int] = set()
    content_params: dict[int, set[str]] = {}
    for macro in root.find_all(jinja2.nodes.Macro):
        params = [arg.name for arg in macro.args]
        receiving: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            receiving.update(params[i] for i, arg in enumerate(call.args[:len(params)])
                             if _field_of(arg, message_vars, "content"))
            receiving.update(kw.key for kw in call.kwargs
                             if kw.key in params and _field_of(kw.value, message_vars, "content"))
        for loop in macro.find_all(jinja2.nodes.For):
            macro_loops.add(id(loop))
            if receiving:
                content_params[id(loop)] = receiving
    for loop in root.find_all(jinja2.nodes.For):
        if _field_of(loop.iter, message_vars, "content"):
            return "openai"
        if isinstance(loop.iter, jinja2.nodes.Name):
            if loop.iter.name in content_params.get(id(loop), ()):
                return "openai"
            if id(loop) not in macro_loops and loop.iter.name == "content":
                return "openai"
    return "string"


# --------------------------------------------------------------------------- plain data

def _plain(value: Any) -> Any:
    """A fresh copy built from JSON types only; anything else becomes an inert ``<TypeName>``."""
    kind = type(value)
    if kind is str or value is None or kind is int or kind is bool or kind is float:
        return value
    if kind is dict:
        return {k if type(k) is str else _plain(k): _plain(v) for k, v in value.items()}
    if kind is list:
        return [_plain(v) for v in value]
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{kind.__name__}>"


def _alias_reasoning(message: dict) -> dict:
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    # Key order as HF builds it: templates that iterate a message see the same order.
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _template_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, (list, tuple)):
        raise TemplateError("messages must be a list of message objects")
    if not messages:
        raise TemplateError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    out = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TemplateError(f"Chat messages should be objects, but got {message!r}.")
        # Keys with a None value are dropped: templates handle a missing key but print "None".
        plain = _plain({k: v for k, v in message.items() if v is not None})
        out.append(_alias_reasoning(plain))
    return out


# --------------------------------------------------------------------------- the template

@dataclass
class RenderedChat:
    """A rendered prompt and the character spans of its ``{% generation %}`` blocks."""

    text: str
    generation_spans: list[tuple[int, int]] = field(default_factory=list)


class ChatTemplate:
    """One chat template, compiled once; ``render`` follows HF's apply_chat_template(tokenize=False)."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        if not isinstance(source, str) or not source.strip():
            raise TemplateError("The chat template is empty.")
        self.source = source
        self._template = compile_template(source)
        self._special = dict(special_tokens or {})

    @property
    def variables(self) -> frozenset[str]:
        return template_variables(self.source)

    @property
    def content_format(self) -> str:
        """How vLLM would hand this template message content: "string" or "openai" (parts)."""
        return detect_content_format(self.source)

    @property
    def has_generation_blocks(self) -> bool:
        return re.search(r"\{%-?\s*generation\s*-?%\}", self.source) is not None

    @property
    def supports_developer_role(self) -> bool:
        # vLLM's test: the template names the role in quotes.
        return '"developer"' in self.source or "'developer'" in self.source

    def render(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        """The prompt text alone: ``render_with_spans`` (same keyword arguments) without tracking spans."""
        return self.render_with_spans(messages, track_generation=False, **kwargs).text

    def render_with_spans(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        track_generation: bool = True,
        **kwargs: Any,
    ) -> RenderedChat:
        """Render, and (when ``track_generation``) record the ``{% generation %}`` spans for assistant masks."""
        if continue_final_message:
            if add_generation_prompt:
                raise TemplateError(
                    "continue_final_message and add_generation_prompt are not compatible. Use "
                    "continue_final_message when you want the model to continue the final message, and "
                    "add_generation_prompt when you want to add a header that will prompt it to start a new "
                    "assistant message instead."
                )
            if track_generation:
                raise TemplateError("continue_final_message is not compatible with return_assistant_tokens_mask.")
        chat = _template_messages(messages)
        tools = _check_tools(tools)
        if documents is not None and (
            not isinstance(documents, (list, tuple)) or not all(isinstance(d, Mapping) for d in documents)
        ):
            raise TemplateError("Documents should be a list of objects with 'title' and 'text' keys.")
        context = _plain({**self._special, **kwargs})
        context.update(
            messages=chat, tools=_plain(tools), documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
        )
        final_text = None
        if continue_final_message:
            final_text = self._tag_final_message(chat, continue_final_message)
        text, spans = self._run(context, track_generation)
        if final_text is not None:
            text = _cut_at_continue_tag(text, final_text)
        return RenderedChat(text, spans)

    def _tag_final_message(self, chat: list[dict], continue_final_message: bool | str) -> str:
        key = continue_final_message if isinstance(continue_final_message, str) else "content"
        final = chat[-1].get(key)
        if final is None:
            raise TemplateError(f'continue_final_message is set but the final message has no "{key}" to continue!')
        fields = [key]
        if key in REASONING_FIELDS:
            # Reasoning sits under several names: tag each copy, whichever the template reads.
            fields = [f for f in REASONING_FIELDS if chat[-1].get(f) == final]
        if not any(f in self.source for f in fields):
            raise TemplateError(
                f'continue_final_message is set to "{key}" but this is not an accepted field in the chat_template'
            )
        if isinstance(final, (list, tuple)):
            for part in reversed(final):
                if isinstance(part, dict) and "text" in part:
                    final_text = part["text"]
                    part["text"] = part["text"] + _CONTINUE_TAG
                    return final_text
            raise TemplateError(
                "continue_final_message is set but we could not find any text to continue in the final message!"
            )
        if not isinstance(final, str):
            raise TemplateError(f'continue_final_message needs the final message\'s "{key}" to be text.')
        for f in fields:
            chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
        return final

    def _run(self, context: dict, track_generation: bool) -> tuple[str, list[tuple[int, int]]]:
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        token = _GENERATION_TRACKER.set((blocks, spans) if track_generation else None)
        try:
            size = 0
            for block in self._template.generate(context):
                blocks.append(block)
                size += len(block)
                if size > MAX_RENDERED_CHARS:
                    raise TemplateError(f"The rendered prompt exceeds {MAX_RENDERED_CHARS} characters.")
        except TemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise TemplateError(str(exc.message if exc.message is not None else exc)) from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError,
                RecursionError) as exc:
            # A template bug on this input: the client's request cannot be rendered, not a server fault.
            raise TemplateError(f"Chat template failed: {type(exc).__name__}: {exc}") from exc
        finally:
            _GENERATION_TRACKER.reset(token)
        return "".join(blocks), spans


def _cut_at_continue_tag(text: str, final_text: str) -> str:
    marker = _CONTINUE_TAG.strip()
    if final_text.strip() not in text or marker not in text:
        raise TemplateError(
            "continue_final_message is set but the final message does not appear in the chat after applying "
            "the chat template! This can happen if the chat template deletes portions of the final message."
        )
    at = text.rindex(marker)
    if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    # The template trimmed the message's trailing whitespace (and our tag's space with it).
    return text[:at].rstrip()


def _check_tools(tools: Any) -> list | None:
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)) or not all(isinstance(t, Mapping) for t in tools):
        raise TemplateError("Tools should be a list of JSON schema objects.")
    return list(tools)


# --------------------------------------------------------------------------- request preparation

def prepare_messages(openai_messages: Iterable[Any], content_format: str = "string") -> list[dict[str, Any]]:
    """OpenAI chat messages -> template messages, as vLLM 0.32 prepares them.

    ``content_format="string"`` (templates that treat content as text, like Qwen's): text parts are
    joined with "\\n" and a missing content becomes "". ``"openai"`` (templates that loop over parts,
    see ``detect_content_format``): content stays a list of ``{"type": "text", "text": ...}`` parts.
    Tool-call arguments become a mapping (a JSON-object string is parsed; anything else is {}), an
    empty ``tool_calls`` list is dropped, ``reasoning`` (or the older ``reasoning_content``) is set
    under both names, ``name``, ``task`` and a tool's ``tool_call_id`` are kept. Non-text parts are
    refused: the render tier is text-only.
    """
    if content_format not in ("string", "openai"):
        raise TemplateError(f"Unknown chat template content format {content_format!r}")
    if not isinstance(openai_messages, (list, tuple)):
        raise TemplateError("messages must be a list of message objects")
    out = []
    for index, message in enumerate(openai_messages):
        if not isinstance(message, Mapping):
            raise TemplateError(f"messages[{index}] must be an object")
        out.append(_prepare_message(message, index, content_format))
    return out


def _prepare_message(message: Mapping[str, Any], index: int, content_format: str) -> dict[str, Any]:
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise TemplateError(f"messages[{index}].role must be a non-empty string")
    texts = _content_texts(message.get("content"), index)
    if role == "system":
        texts = _without_billing_header(texts)
    if content_format == "string":
        prepared: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
    else:
        prepared = {"role": role, "content": [{"type": "text", "text": t} for t in texts]}
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
            prepared["reasoning"] = reasoning
            prepared["reasoning_content"] = reasoning
    elif role == "tool" and "tool_call_id" in message:
        prepared["tool_call_id"] = message["tool_call_id"]
        if content_format == "openai":
            # vLLM flattens a tool result's text parts for every template: most expect a string there.
            prepared["content"] = "\n".join(texts)
    if isinstance(message.get("name"), str):
        prepared["name"] = message["name"]
    if isinstance(message.get("task"), str):
        prepared["task"] = message["task"]
    if role == "developer":
        prepared["tools"] = message.get("tools")
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
        if not isinstance(part, Mapping):
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
        if not isinstance(call, Mapping):
            raise TemplateError(f"messages[{index}]: assistant tool_calls entries must be objects.")
        if call.get("type", "function") != "function" or not isinstance(call.get("function"), Mapping):
            raise TemplateError(f"messages[{index}]: chat completions only support assistant tool_calls of type "
                                "'function'.")
        function = dict(call["function"])
        if not isinstance(function.get("name"), str):
            raise TemplateError(f"messages[{index}].tool_calls[].function.name must be a string")
        function["arguments"] = _arguments_mapping(function.get("arguments"))
        prepared.append({**call, "function": function})
    return prepared


def _arguments_mapping(arguments: Any) -> dict:
    # Templates expect a mapping (HF's convention). As vLLM 0.32 does, anything that is not a JSON
    # object (empty, malformed, an array, a number) becomes {} so that the conversation can go on.
    if isinstance(arguments, str) and arguments:
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return {}
    return arguments if isinstance(arguments, dict) and arguments else {}


def prepare_tools(openai_tools: Any) -> list[dict[str, Any]] | None:
    """OpenAI tool declarations -> what the template receives, in vLLM 0.32's shape.

    vLLM hands templates ``tool.model_dump()``: ``{"type": "function", "function": {"name",
    "description", "parameters"}}`` with None where absent, ``strict``/``defer_loading`` only when
    given, other keys dropped.
    """
    if openai_tools is None:
        return None
    if not isinstance(openai_tools, (list, tuple)):
        raise TemplateError("tools must be a list")
    prepared = []
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
        fn = {"name": function["name"], "description": function.get("description"),
              "parameters": function.get("parameters")}
        defer_loading = function.get("defer_loading", tool.get("defer_loading"))
        for key, value in (("strict", function.get("strict")), ("defer_loading", defer_loading)):
            if value is not None:
                if not isinstance(value, bool):
                    raise TemplateError(f"tools[{index}].function.{key} must be a boolean")
                fn[key] = value
        entry: dict[str, Any] = {"type": "function", "function": fn}
        if tool.get("defer_loading") is not None:
            entry["defer_loading"] = tool["defer_loading"]
        prepared.append(entry)
    return prepared


def convert_developer_role(messages: list[dict[str, Any]], template: ChatTemplate) -> list[dict[str, Any]]:
    """For templates that do not know the developer role, vLLM turns it into one leading system message."""
    if template.supports_developer_role or not any(m.get("role") == "developer" for m in messages):
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
    if not needs_merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(system_texts)}, *others]


def assistant_token_mask(token_offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token overlapping a generation span (HF's rule), given tokens' character offsets."""
    mask = [0] * len(token_offsets)
    span = 0
    for i, (start, end) in enumerate(token_offsets):
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        if span == len(spans):
            break
        if end > spans[span][0]:
            mask[i] = 1
    return mask


def default_template_source() -> str:
    """Our own ChatML template (Qwen3 special tokens, tools, <think> reasoning, enable_thinking)."""
    return resources.files("render_service").joinpath("default_template.jinja").read_text(encoding="utf-8")

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

import itertools
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.utils

from render_service.caches.budget import LOOP_RECORDS_MAX_BYTES
from render_service.templates.analysis import detect_content_format
from render_service.templates.budget import (
    DEADLINE,
    DEFAULT_RENDER_SECONDS,
    MAX_RENDERED_CHARS,
    WALL_CLOCK_BELOW_DEADLINE,
)
from render_service.templates.loop_resume import SESSION, LoopOutput, LoopRecords, LoopSession, finish
from render_service.templates.sandbox import (
    _GENERATION_TRACKER,
    MAX_TEMPLATE_SOURCE_CHARS,
    TemplateError,
    compile_template,
)

# Names a message's reasoning may arrive under; templates read the first one.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_GENERATION_TAG = re.compile(r"\{%[-+]?\s*generation\b")
_WITHIN_BOUND = MAX_RENDERED_CHARS.__ge__



# --------------------------------------------------------------------------- plain data

class PlainMessages(list[dict[str, Any]]):
    """Messages each a dict whose values are plain copies (``plain_copy``), as ``chat_messages.prepare_messages``
    builds them (fresh, or shared read-only between requests by ``message_memo``): the render drops their None
    values and aliases their reasoning (``template_message``) without copying them again, and never changes
    them. ``shared``: the message memo's own objects, which later requests carrying the same messages get
    again, so a render of them files a loop record for those requests (loop_resume.py)."""

    shared: bool = False
    # each message's template form (``template_form``), made once per shared message by whoever built the list
    template_forms: list[dict[str, Any]] | None = None
    # whether a message has the developer role (None: not looked at), found by whoever built the list
    has_developer: bool | None = None


class PlainTools(list[dict[str, Any]]):
    """Tools that are plain copies (``plain_copy``), as ``chat_messages.prepare_tools`` builds them (fresh, or
    shared read-only by ``message_memo``): the render takes them as they are, and never changes them."""


def plain_copy(value: Any) -> Any:
    """A fresh copy built from JSON types only; anything else becomes an inert ``<TypeName>``."""
    kind = type(value)
    if kind is str or value is None or kind is int or kind is bool or kind is float:
        return value
    if kind is dict:
        # Text keys and values (most of a conversation) are taken as they are, without a call each.
        return {k if type(k) is str else plain_copy(k): v if type(v) is str else plain_copy(v)
                for k, v in value.items()}
    if kind is list:
        return [v if type(v) is str else plain_copy(v) for v in value]
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_copy(k): plain_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_copy(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_copy(v) for v in value)
    return f"<{kind.__name__}>"


def template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """One message as templates see it: a plain copy without the keys whose value is None (templates handle a
    missing key but print "None"), its reasoning under every name templates read (``_alias_reasoning``)."""
    if type(message) is dict:
        plain = {k if type(k) is str else plain_copy(k): v if type(v) is str else plain_copy(v)
                 for k, v in message.items() if v is not None}
    else:
        plain = plain_copy({k: v for k, v in message.items() if v is not None})
    return _alias_reasoning(plain)


def template_form(message: dict[str, Any]) -> dict[str, Any]:
    """A plain copy's form as templates see it: what is left of ``template_message`` (it is copied already); the
    message itself where nothing changes."""
    if None in message.values():
        message = {k: v for k, v in message.items() if v is not None}
    if "reasoning_content" in message or "thinking" in message or "reasoning" in message:
        message = _alias_reasoning(message)
    return message


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    for name in REASONING_FIELDS:
        reasoning = message.get(name)
        if reasoning is not None:
            # Key order as HF builds it: templates that iterate a message see the same order.
            return {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _template_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, (list, tuple)):
        raise TemplateError("messages must be a list of message objects")
    if not messages:
        raise TemplateError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    if type(messages) is PlainMessages:
        forms = messages.template_forms
        if forms is not None and len(forms) == len(messages):
            return list(forms)
        # (a message dict is the render's to hand on, not to change: the final message is copied before
        # continue_final_message tags it)
        return [template_form(message) for message in messages]
    out = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TemplateError(f"Chat messages should be objects, but got {message!r}.")
        out.append(template_message(message))
    return out


# Conversations a template's resumed renders are proved on (ChatTemplate._loop_records_proved), each rendered
# turn by turn: plain chat, and an agent's tool calls with their results.
LOOP_PROOF: tuple[tuple[dict[str, Any], ...], ...] = (
    ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
     {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Tell me more"},
     {"role": "assistant", "content": "Sure: more."}, {"role": "user", "content": "Thanks"}),
    ({"role": "user", "content": "What is the weather in Paris?"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
     {"role": "assistant", "content": "Let me check Lyon too.", "tool_calls": [
         {"id": "call_2", "type": "function", "function": {"name": "weather", "arguments": {"city": "Lyon"}}},
         {"id": "call_3", "type": "function", "function": {"name": "weather", "arguments": {"city": "Nice"}}}]},
     {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
     {"role": "tool", "tool_call_id": "call_3", "content": "fog"},
     {"role": "assistant", "content": "Sunny in Paris, rain in Lyon, fog in Nice."}),
)


# --------------------------------------------------------------------------- the template

@dataclass
class RenderedChat:
    """A rendered prompt and the character spans of its ``{% generation %}`` blocks."""

    text: str
    generation_spans: list[tuple[int, int]] = field(default_factory=list)


class ChatTemplate:
    """One chat template, compiled once; ``render`` follows HF's apply_chat_template(tokenize=False)."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None,
                 time_limit_s: float = DEFAULT_RENDER_SECONDS, from_request: bool = False,
                 loop_record_bytes: int = LOOP_RECORDS_MAX_BYTES) -> None:
        """``from_request``: a client's own template (--trust-request-chat-template), run in the stricter
        sandbox (template_sandbox.RequestTemplateSandbox). ``loop_record_bytes``: the bound on the records that
        let a grown conversation render only its new messages (loop_resume.py; 0: off)."""
        if not isinstance(source, str) or not source.strip():
            raise TemplateError("The chat template is empty.")
        if from_request and len(source) > MAX_TEMPLATE_SOURCE_CHARS:
            raise TemplateError(f"The chat template is longer than {MAX_TEMPLATE_SOURCE_CHARS} characters.")
        self.source = source
        self._template = compile_template(source, from_request)
        self._special = dict(special_tokens or {})
        self.time_limit_s = time_limit_s  # one render's CPU time (template_budget)
        self.loop_records = LoopRecords(loop_record_bytes) if loop_record_bytes and not from_request else None
        if self.loop_records is not None and not self._loop_records_proved():
            self.loop_records = None

    @cached_property
    def content_format(self) -> str:
        """How vLLM would hand this template message content: "string" or "openai" (parts)."""
        return detect_content_format(self.source)

    @cached_property
    def marks_generation(self) -> bool:
        """Whether the template has ``{% generation %}`` blocks: only a render with spans finds any."""
        return _GENERATION_TAG.search(self.source) is not None

    @cached_property
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
        context = self._context(messages, tools, documents, add_generation_prompt, kwargs)
        chat = context["messages"]
        final_text = None
        if continue_final_message:
            final_text = self._tag_final_message(chat, continue_final_message)
        session = None
        if self.loop_records is not None and not track_generation and not continue_final_message \
                and type(messages) is PlainMessages:
            # Messages the render's caller holds read-only: their identity says they are the same messages.
            record, same = self.loop_records.find(messages)
            if record is not None or messages.shared:
                session = LoopSession([], record, same)
        if session is not None:
            return RenderedChat(self._run_session(context, session, messages).text(), [])
        text, spans = self._run(context, track_generation)
        if final_text is not None:
            text = _cut_at_continue_tag(text, final_text)
        return RenderedChat(text, spans)

    def render_output(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        resume: bool = True,
        **kwargs: Any,
    ) -> LoopOutput | None:
        """``render``'s output as blocks, with where each message's iteration starts (``LoopOutput``), resumed
        from a loop record where one applies (``resume``) and filing its own as ``render`` does; None where no
        loop session can run (loop records off, messages not ``PlainMessages``, ``continue_final_message``) or
        the template ran no message loop."""
        if self.loop_records is None or type(messages) is not PlainMessages or continue_final_message:
            return None
        context = self._context(messages, tools, documents, add_generation_prompt, kwargs)
        record, same = self.loop_records.find(messages) if resume else (None, 0)
        output = self._run_session(context, LoopSession([], record, same), messages)
        return output if output.starts is not None else None

    def _context(self, messages: Any, tools: Any, documents: Any, add_generation_prompt: bool,
                 kwargs: dict[str, Any]) -> dict[str, Any]:
        """The template's variables: the special tokens, the request's kwargs, and plain copies of the rest."""
        chat = _template_messages(messages)
        template_tools = list(tools) if type(tools) is PlainTools else plain_copy(_check_tools(tools))
        if documents is not None and (
            not isinstance(documents, (list, tuple)) or not all(isinstance(d, Mapping) for d in documents)
        ):
            raise TemplateError("Documents should be a list of objects with 'title' and 'text' keys.")
        context: dict[str, Any] = plain_copy({**self._special, **kwargs})
        context.update(
            messages=chat, tools=template_tools, documents=plain_copy(documents),
            add_generation_prompt=add_generation_prompt,
        )
        return context

    def _tag_final_message(self, chat: list[dict[str, Any]], continue_final_message: bool | str) -> str:
        key = continue_final_message if isinstance(continue_final_message, str) else "content"
        # The render's own copy of the final message: the messages it was given stay as they were.
        message = chat[-1] = dict(chat[-1])
        final = message.get(key)
        if final is None:
            raise TemplateError(f'continue_final_message is set but the final message has no "{key}" to continue!')
        fields = [key]
        if key in REASONING_FIELDS:
            # Reasoning sits under several names: tag each copy, whichever the template reads.
            fields = [f for f in REASONING_FIELDS if message.get(f) == final]
        if not any(f in self.source for f in fields):
            raise TemplateError(
                f'continue_final_message is set to "{key}" but this is not an accepted field in the chat_template'
            )
        if isinstance(final, (list, tuple)):
            for at in range(len(final) - 1, -1, -1):
                part = final[at]
                if isinstance(part, dict) and "text" in part:
                    final_text: str = part["text"]
                    parts = [*final]
                    parts[at] = {**part, "text": part["text"] + _CONTINUE_TAG}
                    tagged = tuple(parts) if isinstance(final, tuple) else parts
                    # Every name the part list sits under (reasoning's aliases) sees the tagged part.
                    for name in [name for name, value in message.items() if value is final]:
                        message[name] = tagged
                    return final_text
            raise TemplateError(
                "continue_final_message is set but we could not find any text to continue in the final message!"
            )
        if not isinstance(final, str):
            raise TemplateError(f'continue_final_message needs the final message\'s "{key}" to be text.')
        for f in fields:
            message[f] = message[f] + _CONTINUE_TAG
        return final

    def _loop_records_proved(self) -> bool:
        """Resumed renders proved on this template before they serve: growing conversations of each shape in
        ``LOOP_PROOF`` render, turn by turn, exactly as without records, and at least one of them was resumed.
        A shape the template refuses either way proves nothing; a template with no resumable loop files no
        record, and the records are then off."""
        records = self.loop_records
        assert records is not None
        resumed = False
        for conversation in LOOP_PROOF:
            for end in range(2, len(conversation) + 1):
                messages = PlainMessages(conversation[:end])
                messages.shared = True
                self.loop_records = None  # the plain render
                try:
                    plain = self.render(messages, add_generation_prompt=True)
                except Exception:
                    break  # this shape is not one the template renders (its own checks): the next shape
                finally:
                    self.loop_records = records
                try:
                    before = records.resumed
                    if self.render(messages, add_generation_prompt=True) != plain:
                        return False
                    resumed = resumed or records.resumed > before
                except Exception:
                    return False
        records.clear()
        return resumed

    def _run_session(self, context: dict[str, Any], session: LoopSession, messages: list[dict[str, Any]]
                     ) -> LoopOutput:
        """``_run`` under a loop session: the message loop starts where the session's record allows, and this
        render's own record is filed for the next."""
        token = SESSION.set(session)
        try:
            self._run(context, False, session.blocks)
        finally:
            SESSION.reset(token)
        output, record = finish(session, tuple(messages))
        if session.resumed_at > 0 and self.loop_records is not None:
            self.loop_records.resumed += 1
        if session.scans_shortened and self.loop_records is not None:
            self.loop_records.scans_shortened += session.scans_shortened
        if output.chars > MAX_RENDERED_CHARS:
            raise TemplateError(f"The rendered prompt exceeds {MAX_RENDERED_CHARS} characters.")
        # A render of a shorter head of the conversation it resumed (an earlier turn rendered again: a retry, a
        # rewound rollout) files nothing: that record serves whatever would find this one, and filing and later
        # dropping it walks every message.
        resume = session.resume
        head_only = resume is not None and session.same >= len(messages) and len(messages) < len(resume.messages)
        if record is not None and self.loop_records is not None and getattr(messages, "shared", False) \
                and not head_only:
            self.loop_records.put(record, resume)
        return output

    def _run(self, context: dict[str, Any], track_generation: bool, into: list[str] | None = None
             ) -> tuple[str, list[tuple[int, int]]]:
        """The render's text and generation spans; ``into``: the blocks are collected there (a loop session's
        list, which the session reads as the loop starts), and the text is left to the caller."""
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        token = _GENERATION_TRACKER.set((blocks, spans) if track_generation else None)
        # The wall clock read first: from then on it runs at least as far as the CPU clock read after it.
        wall_bound = WALL_CLOCK_BELOW_DEADLINE.set(time.perf_counter() + self.time_limit_s)
        deadline = DEADLINE.set(time.thread_time() + self.time_limit_s)  # CPU time (template_budget)
        kept: Iterator[str] | None = None
        try:
            # The compiled template's own generator (Jinja's generate() adds a layer that only rewrites the
            # traceback of an error, which is answered below by its type and message).
            template = self._template
            stream = template.root_render_func(template.new_context(context))
            if track_generation or into is not None:  # {% generation %} reads the blocks rendered so far
                collected = blocks if into is None else into
                size = 0
                for block in stream:
                    collected.append(block)
                    size += len(block)
                    if size > MAX_RENDERED_CHARS:
                        raise TemplateError(f"The rendered prompt exceeds {MAX_RENDERED_CHARS} characters.")
                text = "".join(blocks) if into is None else ""
            else:
                # The same bound, block by block, counted in C: the running size of each block rendered, and
                # the first that passes the bound stops the render there.
                stream, kept = itertools.tee(stream)
                if next(itertools.dropwhile(_WITHIN_BOUND, itertools.accumulate(map(len, stream))), None):
                    raise TemplateError(f"The rendered prompt exceeds {MAX_RENDERED_CHARS} characters.")
                text = "".join(kept)
        except TemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise TemplateError(str(exc.message if exc.message is not None else exc)) from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError,
                RecursionError) as exc:
            # A template bug on this input: the client's request cannot be rendered, not a server fault.
            raise TemplateError(f"Chat template failed: {type(exc).__name__}: {exc}") from exc
        except MemoryError:
            # Whatever the bounds let through, an allocation that fails is this request's: never a 500.
            blocks.clear()
            if into is not None:
                into.clear()
            kept = None
            raise TemplateError("The chat template needs more memory than this server allows") from None
        finally:
            DEADLINE.reset(deadline)
            WALL_CLOCK_BELOW_DEADLINE.reset(wall_bound)
            _GENERATION_TRACKER.reset(token)
        return text, spans


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


def _check_tools(tools: Any) -> list[Any] | None:
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)) or not all(isinstance(t, Mapping) for t in tools):
        raise TemplateError("Tools should be a list of JSON schema objects.")
    return list(tools)


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

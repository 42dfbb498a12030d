"""llama3_json: ``{"name": "f", "parameters": {...}}`` (or ``"arguments"``), optionally after ``<|python_tag|>``,
several calls separated by ``;``.

Tool mode is decided by the start of the output, as vLLM's parsers do: an output that begins with ``{`` or
``<|python_tag|>`` (leading whitespace allowed) is calls, anything else is content; and, as vLLM 0.34's parser
engine does, a ``<|python_tag|>`` later in the content starts calls there (the text before it stays content).
An object is a call once its name and its arguments key are read (``{"name": "John", "age": 30}`` is text, as
vLLM 0.34's batch path reads it). Arguments stream as the model's raw text, guarded (``json_guard``) so they
always end as a JSON object. Text after the calls (and after a call that broke off) is content: nothing the
model wrote is dropped.
"""

from __future__ import annotations

from enum import IntEnum
from typing import ClassVar, cast

import msgspec

from render_service.parsers.base import Piece
from render_service.parsers.call_object import (
    CALL_KEYS,
    DONE,
    MAX_UNANNOUNCED,
    MORE,
    CallKeys,
    CallObject,
    feed_call_object,
    finish_call_object,
)
from render_service.parsers.tags import find_tag, skip_whitespace
from render_service.parsers.tools_common import Count, HeldTextToolParser, PieceSink, require

PYTHON_TAG = "<|python_tag|>"
PYTHON_TAGS = (PYTHON_TAG,)
ARG_KEYS = ("parameters", "arguments")


class Llama3JsonMode(IntEnum):
    """Where a llama3_json stream is. Travels in stream_state as its int."""

    START = 0
    OBJECT = 1
    SEPARATOR = 2
    CONTENT_ONLY = 3
    DROP = 4  # no longer entered (text after the calls is content); a state that has it reads as CONTENT_ONLY


(
    START, OBJECT, SEPARATOR, CONTENT_ONLY, DROP
) = Llama3JsonMode  # module-level names: the hot loops compare against globals


class Llama3JsonState(msgspec.Struct, omit_defaults=True):
    mode: Llama3JsonMode = START
    held: str = ""
    calls: Count = 0
    # leading whitespace, the python tag and the current object's text until it is announced
    raw: str = ""
    call: CallObject | None = None

    def __post_init__(self) -> None:
        require((self.mode == OBJECT) == (self.call is not None), "a call object exactly while in one")
        require(len(self.raw) <= MAX_UNANNOUNCED + 4096, "unannounced call text within bounds")


class Llama3JsonToolParser(HeldTextToolParser):
    name: ClassVar[str] = "llama3_json"
    State: ClassVar[type[msgspec.Struct]] = Llama3JsonState
    # a JSON array of calls (``[{...}, {...}]``) is calls too: the brackets and commas are markup (the families
    # that write their calls as a list inside their own tags: Jamba, Phi-4-mini, xLAM)
    LIST: ClassVar[bool] = False
    ARG_KEYS: ClassVar[tuple[str, ...]] = ARG_KEYS
    # how the call object is spelled; a bare object is a call only with an arguments key (vLLM 0.34's batch rule)
    KEYS: ClassVar[CallKeys] = CallKeys(announce_at_args=True)
    # a <|python_tag|> inside content opens calls (Llama's own marker; not for the readers inside other tags)
    TAG_IN_CONTENT: ClassVar[bool] = True

    def finish(self, state: Llama3JsonState) -> list[Piece]:
        sink = PieceSink()
        if state.mode == OBJECT:
            if finish_call_object(cast(CallObject, state.call), sink, state.calls):
                state.calls += 1
                sink.content(state.held)
            else:
                sink.content(state.raw + state.held)
        else:
            sink.content(state.raw + state.held)
        state.held = ""
        state.raw = ""
        state.call = None
        state.mode = CONTENT_ONLY
        return sink.pieces

    def _release(self, state: Llama3JsonState, sink: PieceSink) -> None:
        """Not a call after all: what was held is content, and so is the rest."""
        sink.content(state.raw)
        state.mode = CONTENT_ONLY
        state.raw = ""
        state.call = None

    def _start_object(self, state: Llama3JsonState) -> None:
        state.mode = OBJECT
        state.call = CallObject()

    def _run(self, state: Llama3JsonState, buf: str, sink: PieceSink) -> None:
        pos, n = 0, len(buf)
        while pos < n:
            mode = state.mode
            if mode == CONTENT_ONLY or mode == DROP:
                if not self.TAG_IN_CONTENT:
                    sink.content(buf[pos:])
                    return
                at, tag = find_tag(buf, pos, PYTHON_TAGS)
                sink.content(buf[pos:at])
                if tag is None:
                    state.held = buf[at:]  # may be the start of the tag
                    return
                # held as raw text until a call's name is read: a tag that opens no call is given back
                state.raw = PYTHON_TAG
                state.mode = SEPARATOR
                pos = at + len(PYTHON_TAG)
                continue
            if mode == START:
                start = pos
                pos = skip_whitespace(buf, pos)
                state.raw += buf[start:pos]
                if pos >= n:
                    return
                if buf.startswith(PYTHON_TAG, pos):
                    state.raw += PYTHON_TAG
                    pos += len(PYTHON_TAG)
                    state.mode = SEPARATOR
                elif PYTHON_TAG.startswith(buf[pos:]):
                    state.held = buf[pos:]
                    return
                elif buf[pos] == "{":
                    self._start_object(state)
                elif self.LIST and buf[pos] == "[":
                    state.raw += "["
                    pos += 1
                    state.mode = SEPARATOR
                else:
                    self._release(state, sink)
            elif mode == SEPARATOR:
                start = pos
                pos = skip_whitespace(buf, pos)
                opening = state.calls == 0 or state.raw != ""  # before the first call, or after a tag in content
                if opening:
                    state.raw += buf[start:pos]
                if pos >= n:
                    return
                if not opening and (buf[pos] == ";" or (self.LIST and buf[pos] == ",")):
                    pos += 1
                elif self.LIST and buf[pos] == "]" and not opening:
                    pos += 1
                    state.mode = CONTENT_ONLY  # the list is over: what follows is the model's text
                elif buf[pos] == "{":
                    self._start_object(state)
                else:
                    self._release(state, sink)  # the text after the calls is content
            else:
                call = cast(CallObject, state.call)  # the state's __post_init__ requires it in this mode
                stop, outcome = feed_call_object(call, buf, pos, n, sink, state.calls, self.ARG_KEYS, False,
                                                 self.KEYS)
                state.raw = "" if call.name_emitted else state.raw + buf[pos:stop]
                pos = stop
                if not call.name_emitted and len(state.raw) > MAX_UNANNOUNCED:
                    self._release(state, sink)
                elif outcome == MORE:
                    if stop < n:
                        state.held = buf[pos:]
                        return
                elif not call.name_emitted:
                    self._release(state, sink)
                else:
                    finish_call_object(call, sink, state.calls)  # completes a call that broke off
                    state.calls += 1
                    state.call = None
                    state.raw = ""
                    # a complete call may be followed by more; one that broke off leaves the rest to content
                    state.mode = SEPARATOR if outcome == DONE else CONTENT_ONLY


class JsonListToolParser(Llama3JsonToolParser):
    """The calls as a JSON list or objects, ``{"name": ..., "arguments"|"parameters": ...}`` each: the inner
    parser of the families that wrap such a list in their own tags (``tools_wrapped``)."""

    name: ClassVar[str] = "json_list"
    LIST: ClassVar[bool] = True
    TAG_IN_CONTENT: ClassVar[bool] = False
    KEYS: ClassVar[CallKeys] = CALL_KEYS


class JsonObjectsToolParser(Llama3JsonToolParser):
    """llama3_json's reader of ``;``-separated call objects without Llama's tag rule: the inner parser of the
    families that wrap such objects in their own tags (``tools_wrapped``)."""

    name: ClassVar[str] = "json_objects"
    TAG_IN_CONTENT: ClassVar[bool] = False
    KEYS: ClassVar[CallKeys] = CALL_KEYS


class XLamToolParser(JsonListToolParser):
    """xlam (Salesforce xLAM): the output is the calls, a JSON list (or objects) of ``{"name", "arguments"}``
    (llama3_json's rule: calls only when the output starts with them). Upstream also looks for the list inside
    a code fence, after ``[TOOL_CALLS]`` or in ``<tool_call>`` tags; those spellings are content here."""

    name: ClassVar[str] = "xlam"

"""One streaming engine for the XML-style call formats whose values are text (GLM, MiniMax-M2, Seed-OSS,
Qwen3 XML). A family is a ``XmlFormat``: its tags and a few rules; the state machine is shared.

    content  BLOCK_OPEN  [CALL_OPEN] NAME HEAD_END  (KEY_OPEN key KEY_END [VALUE_OPEN] value VALUE_END)*
             CALL_END  [more calls]  BLOCK_END  content ...

Streaming rules (both invariants of docs/tool_parsers.md hold for every chunking):

* arguments are ``json.dumps``-shaped: ``{`` with the name, ``"key": value`` per parameter, ``}`` at the call's
  end; a string-typed value streams as it arrives (escaped per character), any other value is held until its
  end tag and converted by the tool's schema (``tool_schema``). A call cut off by the end of output is closed
  (open string quoted, ``}``), so every call's arguments are a JSON object and equal the concatenated deltas;
* a value ends at VALUE_END only when what follows (after whitespace) is structural: the next key, the call's
  or block's end, another call, or the end of output. Otherwise the tag is part of the value (a coding agent
  writing XML). A value missing its VALUE_END is closed by a structural CALL_END;
* nothing generated is lost: text before, between and after calls is content (whitespace right after a call
  is layout), a block or call that turns out not to be one is returned as content, stray text between
  parameters is content. Only the markup itself and layout whitespace disappear.

Work per feed is O(new text + held suffix): the held suffix is a possible partial tag, an unfinished name or
key (bounded), the whitespace-and-tag lookahead after a value's end tag (bounded), or trailing whitespace of a
value that the trim rule may drop.
"""

from __future__ import annotations

import functools
import re
from enum import IntEnum
from typing import ClassVar

import msgspec

from render_service.parsers import tool_schema
from render_service.parsers.base import Piece, ToolParserConfig
from render_service.parsers.json_scan import dumps, json_string_fragment
from render_service.parsers.tags import find_tag, is_partial_tag, skip_layout, skip_whitespace
from render_service.parsers.tools_common import (
    MAX_NAME_CHARS,
    WHITESPACE,
    Count,
    PieceSink,
    require,
    tools_by_name,
)


class XmlMode(IntEnum):
    """Where an XML-family stream is. Travels in stream_state as its int."""

    CONTENT = 0  # outside any call
    BLOCK = 1  # inside a block opener, between calls
    HEAD = 2  # reading a call's name
    CALL = 3  # inside a call, between parameters
    KEY = 4  # reading a parameter's key
    VALUE_OPEN = 5  # between a key and its value's opening tag (GLM)
    VALUE = 6  # inside a value
    OPAQUE = 7  # inside a span whose text is the model's, calls quoted in it included (Seed-OSS's thinking)


CONTENT, BLOCK, HEAD, CALL, KEY, VALUE_OPEN, VALUE, OPAQUE = XmlMode  # the hot loop compares against globals
_IN_CALL = (CALL, KEY, VALUE_OPEN, VALUE)

MAX_KEY_CHARS = 256
# Whitespace (and the call opener) allowed between a block opener and its first call.
MAX_BLOCK_LAYOUT = 512
# Trailing whitespace of a value that "strip" trimming may still drop (held back while streaming).
MAX_TRAILING_WS = 64
# Whitespace allowed between a value's end tag and the structural tag that confirms it.
MAX_LOOKAHEAD_WS = 64

YES, NO, WAIT = range(3)

# XmlCallState.value_kind: how the current value reads (DSML's string attribute; by the schema otherwise)
BY_SCHEMA, STRING_ATTR, JSON_ATTR = range(3)


@functools.lru_cache(maxsize=8)
def _key_with_attr(attr: str) -> re.Pattern[str]:
    """A quoted key name followed by ``attr="value"`` (DSML's ``string="true"``, Kimi K3's ``type="string"``)."""
    return re.compile(rf"""\s*(["']?)(.*?)\1\s+{re.escape(attr)}\s*=\s*["']?([^"'\s]*)["']?\s*""", re.DOTALL)

_NOT_IN_NAME = re.compile(r"[<>\n]")


class XmlFormat(msgspec.Struct, frozen=True):
    """The tags and rules of one family."""

    block_open: str
    block_end: str
    call_open: str | None  # None: the block is the call (GLM), the name follows the block opener
    head_ends: tuple[str, ...]  # what ends the name
    head_consumed: tuple[str, ...]  # which of head_ends belong to the name's markup (others start the body)
    call_end: str
    key_open: str
    key_end: str
    value_open: str | None
    value_end: str
    # "none": values keep every character; "newline": one leading and one trailing newline are layout;
    # "strip": leading and trailing whitespace are layout (typed values are always read stripped)
    trim: str = "newline"
    # a parameter the schema does not declare: "string" (raw text) or "json" (a literal if it parses)
    undeclared: str = "string"
    bare_call_open: bool = False  # a CALL_OPEN outside any block starts a call (Qwen3's fallback)
    quoted_names: bool = False  # name="x" / name='x'
    skip_escaped_newlines: bool = False  # GLM-4.7 may write a literal \n between </arg_key> and <arg_value>
    # the key carries string="true|false" after its quoted name (DeepSeek's DSML): true is raw text, false JSON
    string_attr: bool = False
    # the attribute string_attr reads and its value that means raw text; a key without it reads as raw text
    # when string_attr_default_raw (Kimi K3: type="string", the default) and as JSON otherwise (DSML)
    string_attr_raw: tuple[str, str] = ("string", "true")
    string_attr_default_raw: bool = False
    # (open, close): a span that is content whatever it holds, e.g. a thinking block the reasoning parser did
    # not take out (a call the model quotes while thinking is not a call)
    opaque: tuple[str, str] | None = None

    @property
    def content_openers(self) -> tuple[str, ...]:
        openers = (self.block_open, self.call_open) if self.bare_call_open and self.call_open else (self.block_open,)
        return openers + (self.opaque[:1] if self.opaque else ())

    @property
    def value_terms(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((self.value_end, self.call_end, self.block_end)))

    def followers(self, tag: str) -> tuple[str, ...]:
        """What may follow ``tag`` when it really ends a value (besides the end of output)."""
        openers = tuple(t for t in (self.block_open, self.call_open) if t)
        if tag == self.value_end:
            return tuple(dict.fromkeys((self.key_open, self.call_end, self.block_end) + openers))
        if tag == self.call_end and self.call_end != self.block_end:
            return tuple(dict.fromkeys((self.block_end, self.key_open) + openers))
        return openers


class XmlCallState(msgspec.Struct):
    mode: XmlMode = CONTENT
    held: str = ""
    calls: Count = 0  # calls started so far; the index of the call in progress
    raw: str = ""  # markup since the block opener, kept until the block's first call is named
    block_calls: Count = 0  # calls in the current block
    after_call: bool = False  # whitespace right after a call or block is layout
    function: str = ""
    params: Count = 0
    keys: list[str] = []  # the keys of the call in progress (a repeated one is quoted text, not a key)
    key: str = ""
    string_value: bool = True  # the current value streams as a JSON string (else held in value_parts)
    value_started: bool = False  # the value's leading layout is behind us
    value_parts: list[str] = []
    stray: bool = False  # inside text between parameters that is not markup (content up to the next "<")
    value_kind: int = msgspec.field(default=BY_SCHEMA)  # BY_SCHEMA, STRING_ATTR or JSON_ATTR
    # forced tool choice: the call opening that render put at the end of the prompt, read before the output
    prefix: str = ""

    def __post_init__(self) -> None:
        require(len(self.held) <= 65536 and len(self.raw) <= 65536 and len(self.prefix) <= 1024,
                "held text within bounds")
        require(self.mode not in _IN_CALL or bool(self.function), "a call in progress has a name")
        require(len(self.keys) <= 4096 and sum(map(len, self.keys)) <= 65536, "keys within bounds")
        require(not self.value_parts or (self.mode == VALUE and not self.string_value), "a held value only inside one")
        require(self.value_kind in (BY_SCHEMA, STRING_ATTR, JSON_ATTR), "a known value kind")


_ATTRIBUTE = re.compile(r"""\s*[\w:.\-]+\s*=\s*(?:"[^"]*"|'[^']*'|[^\s"'>]+)""")


def _after_first_attribute(text: str) -> str:
    """What a tag holds after its first attribute that is not ``key="value"`` attributes: the model's text (a
    stray word or quoted string beside the name is not markup). After a bare first word holding ``<`` (no name
    does: the model opened another tag there) nothing is taken for an attribute."""
    if text[:1] in ("\"", "'"):
        end = text.find(text[0], 1)
        rest = text[end + 1:] if end != -1 else ""
    else:
        parts = text.split(None, 1)
        rest = parts[1] if len(parts) > 1 else ""
        if parts and "<" in parts[0]:
            return rest.strip()
    return _ATTRIBUTE.sub("", rest).strip()


def _first_attribute(text: str) -> str:
    """The value of a tag's first attribute, quoted or bare: what follows it (``description="..."``, ``type=``)
    is another attribute, not part of the name."""
    if text[:1] in ("\"", "'"):
        end = text.find(text[0], 1)
        return text[1:end] if end != -1 else text[1:]
    return text.split(None, 1)[0] if text else text


class XmlToolParser:
    """Base for the families; subclasses set ``name`` and ``FORMAT``."""

    name: ClassVar[str]
    FORMAT: ClassVar[XmlFormat]
    State: ClassVar[type[msgspec.Struct]] = XmlCallState
    FORCED_REQUIRED: ClassVar[str]
    FORCED_NAMED: ClassVar[str]  # str.format template with {name}
    # a "required" / named call may have been opened in the prompt (False: this family's never were)
    native_forced_choice: ClassVar[bool] = True

    def __init__(self, config: ToolParserConfig) -> None:
        self.tools = tools_by_name(config.tools if config is not None else [])
        f = self.FORMAT
        self._content_openers = f.content_openers
        self._value_terms = f.value_terms
        self._block_tags = tuple(t for t in (f.call_open, f.block_end, f.block_open) if t)
        self._call_tags = tuple(dict.fromkeys(
            t for t in (f.key_open, f.call_end, f.block_end, f.call_open, f.block_open) if t))
        self._followers = {tag: f.followers(tag) for tag in self._value_terms}

    def initial_state(self) -> XmlCallState:
        return XmlCallState()

    # forced tool choice opened in the prompt ---------------------------------------------------------------
    # Our earlier renders ended the prompt with the opening of a forced call for these families (render now
    # constrains the output with vLLM's structural tag instead); a request rendered that way still derenders:
    # the parser starts as if it had read that opening.

    @classmethod
    def forced_call_prefix(cls, name: str | None) -> str:
        """The text an earlier render appended to the prompt: a block opener ("required") or a named call's head."""
        return cls.FORCED_REQUIRED if name is None else cls.FORCED_NAMED.format(name=name)

    def forced_state(self, name: str | None) -> XmlCallState:
        return XmlCallState(prefix=self.forced_call_prefix(name))

    def _coerce(self, state: XmlCallState) -> None:
        """A client-sent state in a mode this family does not have (the state struct is shared) is read as
        the nearest one it has, so a forged state never makes the parser raise."""
        if (state.mode == BLOCK and self.FORMAT.call_open is None) or (
                state.mode == OPAQUE and self.FORMAT.opaque is None):
            state.mode = CONTENT
        elif state.mode == VALUE_OPEN and self.FORMAT.value_open is None:
            state.mode = VALUE

    def feed(self, state: XmlCallState, text: str) -> list[Piece]:
        self._coerce(state)
        sink = PieceSink()
        buf = state.held + text if state.held else text
        state.held = ""
        if state.prefix:
            buf, state.prefix = state.prefix + buf, ""
        self._run(state, buf, sink, final=False)
        return sink.pieces

    def finish(self, state: XmlCallState) -> list[Piece]:
        self._coerce(state)
        sink = PieceSink()
        buf, state.held = state.prefix + state.held, ""
        state.prefix = ""
        self._run(state, buf, sink, final=True)
        rest, state.held = state.held, ""
        mode = state.mode
        if mode in (CONTENT, CALL, OPAQUE):
            sink.content(rest)
        elif mode == BLOCK:
            sink.content((state.raw if state.block_calls == 0 else "") + rest)
        elif mode == HEAD:
            sink.content(state.raw + rest)  # a call cut off before its name is complete is not a call
        elif mode == KEY:
            sink.content(rest)  # an unfinished key: its text is kept, as content
        elif mode == VALUE_OPEN:
            self._start_value(state, sink)
            self._end_value(state, sink)
            sink.content(rest)
        elif mode == VALUE:
            self._value_text(state, sink, rest)
            self._end_value(state, sink)
        if mode in _IN_CALL:
            self._end_call(state, sink)
        state.mode = CONTENT
        state.raw = ""
        return sink.pieces

    # -----------------------------------------------------------------------------------------------------

    def _call_name(self, name: str) -> str:
        """The call's name as announced (a family may map the model's spelling to a declared tool)."""
        return name

    def _types(self, state: XmlCallState) -> frozenset[str] | None:
        tool = self.tools.get(state.function)
        return tool_schema.param_types(tool.parameters if tool else None, state.key)

    def _end_call(self, state: XmlCallState, sink: PieceSink) -> None:
        state.stray = False
        sink.arguments(state.calls, "}")
        state.calls += 1
        state.block_calls += 1
        state.raw = ""
        state.function = ""
        state.key = ""

    def _release(self, state: XmlCallState, sink: PieceSink) -> None:
        """The opener was not a call after all: its text is content, and scanning goes on from here."""
        sink.content(state.raw)
        state.raw = ""
        state.mode = CONTENT
        state.after_call = False

    def _verify(self, state: XmlCallState, buf: str, at: int, tag: str, final: bool) -> int:
        """Is the end tag ending at ``at`` structural? YES, NO, or WAIT for more text.

        A value's end tag is structural when what follows is: a key this call has not used yet (a key it
        already has means the value quotes a call), the call's end followed in turn by structure (the block's
        end, another call, the end of output), the block's end or another call.
        """
        pos = skip_whitespace(buf, at)
        if pos - at > MAX_LOOKAHEAD_WS:
            return YES
        if pos >= len(buf):
            return YES if final else WAIT
        rest = buf[pos:pos + 64]
        followers = self._followers[tag]
        f = self.FORMAT
        if tag == f.value_end:
            if rest.startswith(f.key_open):
                return self._fresh_key(state, buf, pos + len(f.key_open), final)
            if f.call_end != f.block_end and rest.startswith(f.call_end):
                return self._verify(state, buf, pos + len(f.call_end), f.call_end, final)
        if any(rest.startswith(t) for t in followers):
            return YES
        if not final and is_partial_tag(rest, followers):
            return WAIT
        return NO

    def _fresh_key(self, state: XmlCallState, buf: str, at: int, final: bool) -> int:
        """A key opener at ``at``: YES when it names a key this call has not used yet."""
        end = buf.find(self.FORMAT.key_end, at, at + MAX_KEY_CHARS)
        if end == -1:
            return WAIT if not final and len(buf) - at < MAX_KEY_CHARS else YES
        return NO if self._key_text(buf[at:end].strip())[0] in state.keys else YES

    def _key_text(self, key: str) -> tuple[str, int]:
        """(the key, how its value reads) from the text between the key opener and its end."""
        f = self.FORMAT
        if f.string_attr:
            # no attribute reads as string="false" (JSON, else its text), as upstream's engine parser
            name, raw = f.string_attr_raw
            attr = _key_with_attr(name).fullmatch(key)
            if attr is not None:
                return attr.group(2), STRING_ATTR if attr.group(3) == raw else JSON_ATTR
            return ((_first_attribute(key).strip() if f.quoted_names else key),
                    STRING_ATTR if f.string_attr_default_raw else JSON_ATTR)
        return (_first_attribute(key).strip() if f.quoted_names else key), BY_SCHEMA

    def _trim_tail(self, text: str) -> str:
        trim = self.FORMAT.trim
        if trim == "newline":
            return text[:-1] if text.endswith("\n") else text
        if trim == "strip":
            # at most MAX_TRAILING_WS characters are layout: what streaming holds back stays bounded
            run = len(text) - len(text.rstrip(WHITESPACE))
            return text[:len(text) - min(run, MAX_TRAILING_WS)]
        return text

    def _start_value(self, state: XmlCallState, sink: PieceSink) -> None:
        types = self._types(state)
        if state.value_kind != BY_SCHEMA and types is None:
            # the schema decides a declared parameter; DSML's string attribute decides an undeclared one
            state.string_value = state.value_kind == STRING_ATTR
        else:
            undeclared_text = types is None and self.FORMAT.undeclared == "string"
            state.string_value = undeclared_text or tool_schema.streams_as_string(types)
        state.value_started = False
        state.value_parts = []
        if state.string_value:
            sink.arguments(state.calls, self._key_prefix(state) + '"')

    def _key_prefix(self, state: XmlCallState) -> str:
        return (", " if state.params else "") + dumps(state.key) + ": "

    def _value_text(self, state: XmlCallState, sink: PieceSink, text: str) -> None:
        if not text:
            return
        if state.string_value:
            sink.arguments(state.calls, json_string_fragment(text))
        else:
            state.value_parts.append(text)

    def _end_value(self, state: XmlCallState, sink: PieceSink) -> None:
        if state.string_value:
            sink.arguments(state.calls, '"')
        else:
            text = "".join(state.value_parts)
            types = self._types(state)
            if types is None:
                undeclared = "json" if state.value_kind == JSON_ATTR else self.FORMAT.undeclared
                value = tool_schema.convert(text, None, undeclared)
            else:
                value = tool_schema.convert(text if types & {"string"} else text.strip(), types)
            sink.arguments(state.calls, self._key_prefix(state) + dumps(value))
            state.value_parts = []
        state.params += 1
        state.keys.append(state.key)
        state.string_value = True
        state.value_kind = BY_SCHEMA

    def _run(self, state: XmlCallState, buf: str, sink: PieceSink, final: bool) -> None:
        f = self.FORMAT
        pos, n = 0, len(buf)
        while pos < n:
            mode = state.mode
            if mode == CONTENT:
                if state.after_call:
                    pos = skip_layout(state, buf, pos)
                    if pos >= n:
                        return
                at, tag = find_tag(buf, pos, self._content_openers)
                sink.content(buf[pos:at])
                if tag is None:
                    state.held = buf[at:]
                    return
                pos = at + len(tag)
                if f.opaque is not None and tag == f.opaque[0]:
                    sink.content(tag)
                    state.mode = OPAQUE
                    continue
                state.raw = tag
                state.block_calls = 0
                state.mode = HEAD if (f.call_open is None or tag == f.call_open) else BLOCK
            elif mode == OPAQUE:
                close = f.opaque[1] if f.opaque is not None else ""
                at, tag = find_tag(buf, pos, (close,))
                if tag is None:
                    sink.content(buf[pos:at])
                    state.held = buf[at:]
                    return
                sink.content(buf[pos:at + len(tag)])
                pos = at + len(tag)
                state.mode = CONTENT
            elif mode == BLOCK:
                start = pos
                pos = skip_whitespace(buf, pos)
                if state.block_calls == 0:
                    state.raw += buf[start:pos]
                    if len(state.raw) > MAX_BLOCK_LAYOUT:
                        # an opener followed by a page of whitespace is not a block: its text is content
                        # (decided before the next text is read, so every chunking decides alike)
                        self._release(state, sink)
                        continue
                if pos >= n:
                    return
                if f.call_open and buf.startswith(f.call_open, pos):
                    state.raw += f.call_open if state.block_calls == 0 else ""
                    pos += len(f.call_open)
                    state.mode = HEAD
                elif buf.startswith(f.block_end, pos):
                    pos += len(f.block_end)  # an empty block is markup only
                    state.raw = ""
                    state.mode = CONTENT
                    state.after_call = True
                elif buf.startswith(f.block_open, pos):
                    if state.block_calls == 0:
                        state.raw += f.block_open
                    pos += len(f.block_open)
                elif is_partial_tag(buf[pos:pos + 64], self._block_tags):
                    state.held = buf[pos:]
                    return
                elif state.block_calls == 0:
                    self._release(state, sink)
                else:
                    state.mode = CONTENT  # text after the block's calls without its end tag: content
            elif mode == HEAD:
                at, tag = find_tag(buf, pos, f.head_ends)
                if _NOT_IN_NAME.search(buf, pos, at) is not None:
                    # a name never holds these: prose after an opener is content at once, not after a wait
                    self._release(state, sink)
                    continue
                if tag is None or at - pos > MAX_NAME_CHARS:
                    if at - pos > MAX_NAME_CHARS or n - pos > MAX_NAME_CHARS + 64:
                        self._release(state, sink)
                        continue
                    state.held = buf[pos:]
                    return
                name = buf[pos:at].strip()
                stray = ""
                if f.quoted_names:
                    name, stray = _first_attribute(name).strip(), _after_first_attribute(name)
                if not name or any(c in name for c in "<>\n"):
                    self._release(state, sink)
                    continue
                pos = at + len(tag) if tag in f.head_consumed else at
                name = self._call_name(name)
                state.raw = ""
                state.function = name
                state.params = 0
                state.keys = []
                state.mode = CALL
                sink.name(state.calls, name)
                sink.arguments(state.calls, "{")
                sink.content(stray)
            elif mode == CALL:
                if state.stray:
                    # stray text runs to the next "<", its whitespace included, however it is chunked
                    lt = buf.find("<", pos)
                    stop = n if lt == -1 else lt
                    sink.content(buf[pos:stop])
                    pos = stop
                    state.stray = lt == -1
                    continue
                pos = skip_whitespace(buf, pos)
                if pos >= n:
                    return
                if buf.startswith(f.key_open, pos):
                    pos += len(f.key_open)
                    state.mode = KEY
                elif buf.startswith(f.call_end, pos) or buf.startswith(f.block_end, pos):
                    closes_block = buf.startswith(f.block_end, pos)
                    pos += len(f.block_end) if closes_block else len(f.call_end)
                    self._end_call(state, sink)
                    if closes_block or f.call_open is None:
                        state.mode = CONTENT
                        state.after_call = True
                    else:
                        state.mode = BLOCK
                elif (f.call_open and buf.startswith(f.call_open, pos)) or buf.startswith(f.block_open, pos):
                    # the next call begins without this one's end tag: this one ends here
                    self._end_call(state, sink)
                    state.mode = BLOCK if f.call_open and buf.startswith(f.call_open, pos) else CONTENT
                elif is_partial_tag(buf[pos:pos + 64], self._call_tags):
                    state.held = buf[pos:]
                    return
                else:
                    # stray text between parameters is the model's, not markup: content
                    sink.content(buf[pos])
                    pos += 1
                    state.stray = True
            elif mode == KEY:
                at, tag = find_tag(buf, pos, (f.key_end,))
                if (tag is None and n - pos > MAX_KEY_CHARS) or (tag is not None and at - pos > MAX_KEY_CHARS):
                    sink.content(f.key_open)  # not a key after all: the text goes on as the call's body
                    state.mode = CALL
                    continue
                if tag is None:
                    state.held = buf[pos:]
                    return
                key = buf[pos:at].strip()
                state.key, kind = self._key_text(key)
                if f.quoted_names:
                    sink.content(_after_first_attribute(key))
                if f.string_attr:
                    state.value_kind = kind
                pos = at + len(tag)
                if f.value_open is None:
                    state.mode = VALUE
                    self._start_value(state, sink)
                else:
                    state.mode = VALUE_OPEN
            elif mode == VALUE_OPEN:
                while True:
                    pos = skip_whitespace(buf, pos)
                    if f.skip_escaped_newlines and buf.startswith("\\n", pos):
                        pos += 2
                        continue
                    break
                if pos >= n:
                    return
                value_open = f.value_open or ""
                if buf.startswith(value_open, pos):
                    pos += len(value_open)
                    state.mode = VALUE
                    self._start_value(state, sink)
                elif is_partial_tag(buf[pos:pos + 64], (value_open, "\\n")):
                    state.held = buf[pos:]
                    return
                else:
                    # a key without its value: an empty value, and the text goes on as the call's body
                    self._start_value(state, sink)
                    self._end_value(state, sink)
                    state.mode = CALL
            else:  # VALUE
                if not state.value_started:
                    if f.trim == "newline":
                        state.value_started = True
                        if buf[pos] == "\n":
                            pos += 1
                            continue
                    elif f.trim == "strip":
                        pos = skip_whitespace(buf, pos)
                        if pos >= n:
                            return
                        state.value_started = True
                    else:
                        state.value_started = True
                at, tag = find_tag(buf, pos, self._value_terms)
                if tag is None:
                    if final:
                        self._value_text(state, sink, self._trim_tail(buf[pos:]))
                        self._end_value(state, sink)
                        state.mode = CALL
                        return
                    safe = pos + len(self._trim_tail(buf[pos:at]))  # trailing layout may still be dropped
                    self._value_text(state, sink, buf[pos:safe])
                    state.held = buf[safe:]
                    return
                verdict = self._verify(state, buf, at + len(tag), tag, final)
                if verdict == NO:
                    self._value_text(state, sink, buf[pos:at + len(tag)])
                    pos = at + len(tag)
                    continue
                body = buf[pos:at]
                kept = self._trim_tail(body)
                if verdict == WAIT:
                    self._value_text(state, sink, kept)
                    state.held = buf[pos + len(kept):]
                    return
                self._value_text(state, sink, kept)
                self._end_value(state, sink)
                state.mode = CALL
                pos = at + len(tag) if tag == f.value_end else at

"""hf and beam: reasoning and tool calls read by the checkpoint's own ``response_template``.

A checkpoint may describe its reply in tokenizer_config.json's ``response_template`` (Hugging Face's response
parsing metadata; vLLM 0.34 serves it as ``hf``, and as ``beam`` for Beam checkpoints). Gemma 4's, for one::

    {"start_anchor": ["<|turn>model\\n", "<tool_response|>"], "fields": {
        "thinking":   {"open": "<|channel>thought\\n", "close": "<channel|>"},
        "content":    {"close": ["<turn|>", "<|tool_response>", "<eos>"]},     # no opener: the default region
        "tool_calls": {"open_pattern": "<\\\\|tool_call>call:(?P<name>\\\\w+)", "close": "<tool_call|>",
                       "content": "json", "content_args": {"unquoted_keys": true, "string_delims": [..]},
                       "repeats": true, "transform": {"type": "function",
                                                      "function": {"name": "{name}", "arguments": "{content}"}}}}}

The template is declared into the two stages every family has: the thinking field's delimiters are a think-tag
reasoning parser's tags (a block the model opens, or one the prompt left open after its last start anchor), and
the tool field is a region held to its closer (bounded) and read whole, as upstream reads it when it closes, with
the template's content parser, transform and the tools' schemas. The other fields' delimiters are markup.
Upstream's ``regex`` partial matching decides when a pattern delimiter may still grow, as it does upstream.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Annotated, Any, ClassVar

import msgspec

from render_service.parsers.base import Piece, TextPiece, ToolCallPiece, ToolParserConfig
from render_service.parsers.reasoning_families import ExplicitThinkReasoningParser
from render_service.parsers.response_template_content import coerce_arguments, parse_region

THINKING, CONTENT, TOOLS = "thinking", "content", "tool_calls"
_FIELDS = frozenset({THINKING, CONTENT, TOOLS})
_FIELD_KEYS = frozenset({"open", "open_pattern", "close", "close_pattern", "content", "content_args", "repeats",
                         "join", "optional", "transform", "transform_each"})
_CONTENT_PARSERS = frozenset({"text", "int", "float", "bool", "json", "xml-inline", "kv-lines"})
MAX_REGION_CHARS = 60_000  # a tool region longer than this is the model's text (as minimax_m3's held call)
MAX_HELD_CHARS = 4096  # a delimiter still open to growth after this many characters is not one


class TemplateField(msgspec.Struct, frozen=True):
    name: str
    open: tuple[str, ...] = ()  # literals, longest first
    open_pattern: str | None = None
    close: tuple[str, ...] = ()
    close_pattern: str | None = None
    content: str = "text"
    content_args: dict[str, Any] = {}
    transform: Any = None
    transform_each: bool = False


class ResponseTemplate(msgspec.Struct, frozen=True):
    fields: dict[str, TemplateField]
    start_anchors: tuple[str, ...] = ()


def _literals(scope: str, value: Any) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(s, str) and s for s in items):
        raise ValueError(f"response_template {scope}: a delimiter is a non-empty string or a list of them")
    return tuple(sorted(dict.fromkeys(items), key=len, reverse=True))


def _pattern(scope: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"response_template {scope}: a pattern is a string")
    import regex  # only a template with pattern delimiters needs it

    try:
        regex.compile(value, regex.DOTALL)
    except regex.error as exc:
        raise ValueError(f"response_template {scope}: invalid pattern: {exc}") from exc
    return value


def _field(name: str, raw: Any) -> TemplateField:
    scope = f"field {name!r}"
    if not isinstance(raw, dict):
        raise ValueError(f"response_template {scope} must be an object")
    if unknown := set(raw) - _FIELD_KEYS:
        raise ValueError(f"response_template {scope}: unknown keys {sorted(unknown)}")
    for a, b in (("open", "open_pattern"), ("close", "close_pattern")):
        if a in raw and b in raw:
            raise ValueError(f"response_template {scope}: both {a!r} and {b!r}")
    content = raw.get("content", "text")
    if content not in _CONTENT_PARSERS:
        raise ValueError(f"response_template {scope}: unknown content parser {content!r}")
    args = raw.get("content_args", {})
    if not isinstance(args, dict):
        raise ValueError(f"response_template {scope}: content_args must be an object")
    field = TemplateField(
        name=name,
        open=_literals(scope, raw["open"]) if "open" in raw else (),
        open_pattern=_pattern(scope, raw["open_pattern"]) if "open_pattern" in raw else None,
        close=_literals(scope, raw["close"]) if "close" in raw else (),
        close_pattern=_pattern(scope, raw["close_pattern"]) if "close_pattern" in raw else None,
        content=content, content_args=args, transform=raw.get("transform"),
        transform_each=bool(raw.get("transform_each", False)))
    if name in (THINKING, CONTENT):
        # upstream's serving adapter streams these two as text: no structure, no rewriting
        if content != "text" or field.transform is not None or raw.get("join") is not None:
            raise ValueError(f"response_template {scope}: only plain text can be streamed")
        if field.open_pattern is not None or field.close_pattern is not None:
            raise ValueError(f"response_template {scope}: pattern delimiters are served for tool_calls only")
    return field


def load_response_template(spec: Any) -> ResponseTemplate:
    """The serving form of a checkpoint's ``response_template`` (ValueError naming what cannot be served)."""
    if not isinstance(spec, dict):
        raise ValueError("response_template must be an object")
    if spec.get("version", 1) != 1:
        raise ValueError(f"unsupported response_template version {spec.get('version')!r}")
    if unknown := set(spec) - {"version", "defaults", "fields", "start_anchor", "start_anchor_pattern"}:
        raise ValueError(f"unknown keys in response_template: {sorted(unknown)}")
    defaults = spec.get("defaults", {})
    if not isinstance(defaults, dict) or set(defaults) - {"role"}:
        raise ValueError("response_template defaults other than the role cannot be served")
    raw_fields = spec.get("fields")
    if not isinstance(raw_fields, dict) or not raw_fields:
        raise ValueError("response_template fields must be a non-empty object")
    if unsupported := set(raw_fields) - _FIELDS:
        raise ValueError(f"response_template fields {sorted(unsupported)} cannot be served; served: "
                         f"{sorted(_FIELDS)}")
    fields = {name: _field(name, raw) for name, raw in raw_fields.items()}
    if sum(1 for f in fields.values() if not f.open and f.open_pattern is None) > 1:
        raise ValueError("response_template: at most one field may have no opener")
    if "start_anchor" in spec:
        anchors = _literals("start_anchor", spec["start_anchor"])
    elif "start_anchor_pattern" in spec:
        _pattern("start_anchor_pattern", spec["start_anchor_pattern"])
        anchors = ()  # a pattern anchor: the prompt tail is read whole (upstream's fallback too)
    else:
        raise ValueError("response_template must define start_anchor or start_anchor_pattern")
    return ResponseTemplate(fields=fields, start_anchors=anchors)


def template_of(tokenizer: Any, flag: str, field: str) -> str:
    """The bundle's template for ``flag`` (a parser name), which needs ``field``, as its canonical JSON (the key
    the bound classes are cached under); ValueError otherwise."""
    raw = getattr(tokenizer, "response_template", None)
    if raw is None:
        raise ValueError(f"{flag} requires response_template metadata in the tokenizer configuration")
    key = json.dumps(raw, sort_keys=True)
    if field not in _cached_template(key).fields:
        raise ValueError(f"{flag} requires a response_template with a {field} field")
    return key


@functools.lru_cache(maxsize=16)
def _cached_template(raw: str) -> ResponseTemplate:
    return load_response_template(json.loads(raw))


# ------------------------------------------------------------------------------------------------ reasoning


class ResponseTemplateReasoningParser(ExplicitThinkReasoningParser):
    """The thinking field as a think-tag parser, bound to a bundle's template (``bind``): with an opener the
    block is the model's to open, unless the prompt left it open; without one the reply starts in it."""

    name = "hf"
    start_tag = ""
    end_tag = ""
    TEMPLATE: ClassVar[ResponseTemplate | None] = None

    @classmethod
    def enable_thinking_from(cls, chat_template_kwargs: dict[str, Any] | None) -> bool:
        return True  # upstream reads the template's structure whatever the switch says

    @classmethod
    def bind(cls, tokenizer: Any) -> type[ResponseTemplateReasoningParser]:
        template = template_of(tokenizer, f"--reasoning-parser {cls.name}", THINKING)
        return _bound_reasoning(cls, template)

    def _explicit_only(self) -> bool:
        return bool(self.start_tag) and self.config.reasoning_open_at_start is not True

    @classmethod
    def reasoning_open_in_prompt(cls, prompt_token_ids: Any, tokenizer: Any) -> bool:
        """Whether the prompt, after its last start anchor, left the thinking block open (upstream feeds the
        prompt through the template's parser for this). Without an opener the reply starts in it."""
        if not cls.start_tag:
            return True
        if not prompt_token_ids:
            return False
        tail = tokenizer.decode(list(prompt_token_ids[-64:]), skip_special_tokens=False)
        template = cls.TEMPLATE
        anchors = template.start_anchors if template is not None else ()
        cut = max((tail.rfind(a) + len(a) for a in anchors if a in tail), default=0)
        tail = tail[cut:]
        opened = tail.rfind(cls.start_tag)
        return opened >= 0 and all(tail.find(c, opened) < 0 for c in (cls.end_tag, *cls.implicit_end_markers))


_BOUND: dict[tuple[type, str], Any] = {}  # (parser class, template key) -> the class bound to that template


def _bound_reasoning(base: type[ResponseTemplateReasoningParser], key: str) -> type[ResponseTemplateReasoningParser]:
    bound: type[ResponseTemplateReasoningParser] | None = _BOUND.get((base, key))
    if bound is not None:
        return bound
    template = _cached_template(key)
    thinking = template.fields[THINKING]
    if len(thinking.open) > 1:
        raise ValueError("response_template thinking field: one opener is served (a list has several)")
    if not thinking.close:
        raise ValueError("response_template thinking field: a closer is needed")
    attrs = {"start_tag": thinking.open[0] if thinking.open else "", "end_tag": thinking.close[0],
             "implicit_end_markers": thinking.close[1:], "TEMPLATE": template,
             "starts_in_content": bool(thinking.open), "__module__": __name__}
    bound = _BOUND[(base, key)] = type(base.__name__, (base,), attrs)
    return bound


# ---------------------------------------------------------------------------------------------------- tools


class TemplateToolState(msgspec.Struct, omit_defaults=True):
    in_region: bool = False
    held: str = ""  # text that may still be (part of) a delimiter
    opener: str = ""  # the open region's opener as written (given back as text if the region is)
    body: str = ""
    captures: dict[str, str] = {}
    calls: Annotated[int, msgspec.Meta(ge=0)] = 0


class _Delimiter(msgspec.Struct, frozen=True):
    literals: tuple[str, ...] = ()
    pattern: Any = None  # a compiled ``regex`` pattern
    # the characters any match starts with (None: a pattern whose first character is not a literal): text
    # without them holds no delimiter and no start of one, the per-token case
    firsts: str | None = ""

    def absent(self, text: str) -> bool:
        return self.firsts is not None and not any(c in text for c in self.firsts)

    def search(self, buf: str, pos: int, final: bool) -> tuple[Any, int]:
        """(the earliest complete match that cannot grow, or None; where a pending match starts, else len)."""
        hold = len(buf)
        best: tuple[int, int, dict[str, str]] | None = None
        for lit in self.literals:
            at = buf.find(lit, pos)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, at + len(lit), {})
            if not final:
                for k in range(min(len(lit) - 1, len(buf) - pos), 0, -1):
                    if lit.startswith(buf[len(buf) - k:]):
                        hold = min(hold, len(buf) - k)
                        break
        if self.pattern is not None:
            m = self.pattern.search(buf, pos, partial=not final)
            if m is not None and m.end() > m.start():
                if not final and (m.partial or m.end() == len(buf)):
                    hold = min(hold, m.start())
                elif best is None or m.start() < best[0]:
                    best = (m.start(), m.end(), {k: v for k, v in m.groupdict().items() if v is not None})
        if best is not None and best[0] >= hold:
            best = None
        return best, hold


def _delimiter(literals: tuple[str, ...], pattern: str | None) -> _Delimiter | None:
    if not literals and pattern is None:
        return None
    firsts: str | None = "".join(sorted({lit[0] for lit in literals}))
    if pattern is None:
        return _Delimiter(literals, None, firsts)
    import regex  # partial matching: whether a match at the end of the text may still grow

    first = None if _BARE_BAR.search(pattern) else _LITERAL_FIRST.match(pattern)  # "a|b" may start with b
    firsts = None if first is None or firsts is None else firsts + (first.group(1) or first.group(2))
    return _Delimiter(literals, regex.compile(pattern, regex.DOTALL), firsts)


# a pattern's first character when it is a literal one (escaped, or plain and not an operator)
_BARE_BAR = re.compile(r"(?:^|[^\\])(?:\\\\)*\|")
_LITERAL_FIRST = re.compile(r"(?:\\([^A-Za-z0-9])|([^\\\[\](){}.*+?|^$]))(?![*?{])")


class ResponseTemplateToolParser:
    """The tool field as a region: its text is held to the closer and read whole into calls; text between
    regions is content, the other fields' delimiters dropped. A region that does not read as calls, or that
    the output cut before its closer, is given back as text (upstream drops the first and reads the second)."""

    name: ClassVar[str] = "hf"
    State: ClassVar[type[msgspec.Struct]] = TemplateToolState
    TEMPLATE: ClassVar[ResponseTemplate | None] = None
    OPEN: ClassVar[_Delimiter | None] = None
    CLOSE: ClassVar[_Delimiter | None] = None
    MARKUP: ClassVar[_Delimiter | None] = None

    @classmethod
    def bind(cls, tokenizer: Any) -> type[ResponseTemplateToolParser]:
        return _bound_tools(cls, template_of(tokenizer, f"--tool-call-parser {cls.name}", TOOLS))

    def __init__(self, config: ToolParserConfig) -> None:
        if self.TEMPLATE is None:
            raise ValueError(f"tool parser {self.name} reads the bundle's response_template: bind it first")
        self.config = config
        self.field = self.TEMPLATE.fields[TOOLS]
        self.schemas = {t.name: t.parameters for t in config.tools}

    def initial_state(self) -> TemplateToolState:
        return TemplateToolState()

    def feed(self, state: TemplateToolState, text: str) -> list[Piece]:
        if not state.held:  # the per-token case: text that holds no delimiter goes where it is
            if not state.in_region and self._content_only(text):
                return [TextPiece("content", text)] if text else []
            if state.in_region and self.CLOSE is not None and self.CLOSE.absent(text) \
                    and len(state.body) + len(text) <= MAX_REGION_CHARS:
                state.body += text
                return []
        return self._run(state, state.held + text, final=False)

    def _content_only(self, text: str) -> bool:
        return (self.OPEN is None or self.OPEN.absent(text)) and (self.MARKUP is None or self.MARKUP.absent(text))

    def finish(self, state: TemplateToolState) -> list[Piece]:
        out = self._run(state, state.held, final=True)
        if state.in_region:
            if self.CLOSE is None:  # a region that runs to the end of the output by design
                out.extend(self._close(state))
            else:  # cut before its closer: the model's text
                out.append(TextPiece("content", state.opener + state.body))
                state.in_region, state.opener, state.body = False, "", ""
        return out

    def _run(self, state: TemplateToolState, buf: str, final: bool) -> list[Piece]:
        state.held = ""
        out: list[Piece] = []
        pos = 0
        while True:
            if state.in_region:
                if self.CLOSE is None:
                    state.body += buf[pos:]
                    self._bound(state, out)
                    return out
                found, hold = self.CLOSE.search(buf, pos, final)
                if found is None:
                    state.body += buf[pos:hold]
                    state.held = buf[hold:]
                    self._bound(state, out)
                    return out
                start, end, _ = found
                state.body += buf[pos:start]
                closer = buf[start:end]
                pos = end
                out.extend(self._close(state, closer))
                continue
            found_open, hold_open = self.OPEN.search(buf, pos, final) if self.OPEN is not None else (None, len(buf))
            found_mark, hold_mark = self.MARKUP.search(buf, pos, final) if self.MARKUP is not None \
                else (None, len(buf))
            hold = min(hold_open, hold_mark)
            candidates = [f for f in (found_open, found_mark) if f is not None and f[0] < hold]
            if not candidates:
                if len(buf) - hold > MAX_HELD_CHARS:  # an opener pattern still growing past any name: text
                    out.append(TextPiece("content", buf[pos:hold + 1]))
                    pos = hold + 1
                    continue
                if hold > pos:
                    out.append(TextPiece("content", buf[pos:hold]))
                state.held = buf[hold:]
                return out
            start, end, captures = min(candidates, key=lambda f: (f[0], f[0] - f[1]))
            if start > pos:
                out.append(TextPiece("content", buf[pos:start]))
            if found_open is not None and (start, end) == found_open[:2]:
                state.in_region, state.opener, state.body, state.captures = True, buf[start:end], "", captures
            pos = end

    def _bound(self, state: TemplateToolState, out: list[Piece]) -> None:
        if len(state.body) > MAX_REGION_CHARS:  # not a call any model writes: the model's text
            out.append(TextPiece("content", state.opener + state.body))
            state.in_region, state.opener, state.body = False, "", ""

    def _close(self, state: TemplateToolState, closer: str = "") -> list[Piece]:
        text = state.opener + state.body + closer
        body, captures = state.body, state.captures
        state.in_region, state.opener, state.body, state.captures = False, "", "", {}
        try:
            calls = _tool_calls(parse_region(body, self.field, captures))
        except (KeyError, TypeError, ValueError, RecursionError):  # RecursionError: JSON nested past the stack
            calls = []
        if not calls:
            return [TextPiece("content", text)]
        out: list[Piece] = []
        for name, arguments in calls:
            if isinstance(arguments, dict):
                arguments = coerce_arguments(arguments, self.schemas.get(name))
            args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
            out.append(ToolCallPiece(index=state.calls, name=name, arguments=args))
            state.calls += 1
        return out


def _tool_calls(value: Any) -> list[tuple[str, Any]]:
    """(name, arguments) of each call in a region's value; none if any is incomplete (upstream's rule)."""
    calls: list[tuple[str, Any]] = []
    for item in value if isinstance(value, list) else [value]:
        function = item.get("function") if isinstance(item, dict) else None
        if not isinstance(function, dict):
            return []
        name, arguments = function.get("name"), function.get("arguments")
        if not isinstance(name, str) or not name or arguments is None:
            return []
        if isinstance(arguments, str):
            try:
                decoded = json.loads(arguments)
            except ValueError:
                return []  # arguments that are not a JSON object are not a call
            arguments = decoded
        if not isinstance(arguments, dict):
            return []
        calls.append((name, arguments))
    return calls


def _bound_tools(base: type[ResponseTemplateToolParser], key: str) -> type[ResponseTemplateToolParser]:
    bound: type[ResponseTemplateToolParser] | None = _BOUND.get((base, key))
    if bound is not None:
        return bound
    template = _cached_template(key)
    tools = template.fields[TOOLS]
    if not tools.open and tools.open_pattern is None:
        raise ValueError("response_template tool_calls field: an opener is needed (a reply cannot start in calls)")
    markup = tuple(sorted({d for name in (THINKING, CONTENT) if name in template.fields
                           for d in (*template.fields[name].open, *template.fields[name].close)},
                          key=len, reverse=True))
    attrs = {"TEMPLATE": template, "OPEN": _delimiter(tools.open, tools.open_pattern),
             "CLOSE": _delimiter(tools.close, tools.close_pattern), "MARKUP": _delimiter(markup, None),
             "__module__": __name__}
    bound = _BOUND[(base, key)] = type(base.__name__, (base,), attrs)
    return bound


class BeamReasoningParser(ResponseTemplateReasoningParser):
    name = "beam"  # Beam checkpoints: the same reading; upstream also builds a grammar from the template


class BeamToolParser(ResponseTemplateToolParser):
    name: ClassVar[str] = "beam"


def bind_parser(cls: Any, tokenizer: Any) -> Any:
    """A parser class made for the bundle when it reads the bundle's metadata (hf, beam), else ``cls``."""
    bind = getattr(cls, "bind", None)
    return bind(tokenizer) if bind is not None else cls



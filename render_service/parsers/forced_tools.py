"""Tool parsers for ``tool_choice`` "required" and named, where a grammar shaped the output.

* named (``{"type": "function", "function": {"name": F}}``): the model emitted only the arguments object;
  the whole content is call 0's arguments, streamed raw (as vLLM does).
* "required": the model emitted a JSON array ``[{"name": ..., "parameters": {...}}, ...]``; each element
  becomes one call, its ``parameters`` value streamed as the raw argument text (JSON-equal to vLLM's
  ``json.dumps(parameters)``; byte-equal between our batch and stream because batch is the stream's fold).

Both scan each character once (a small JSON lexer state), so work is O(new text).

* either shape (``EitherShapeToolChoice``): a forced call is read in the family's own syntax (vLLM's render
  constrains the structural-tag families to it, mistral to its ``[{"name", "arguments"}]`` array) or in the
  JSON shapes above (what our earlier renders asked for), whichever the output starts with.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, ClassVar

import msgspec

from render_service.parsers.base import Piece, ToolCallPiece, ToolParserConfig


class NamedToolState(msgspec.Struct):
    started: bool = False


class NamedToolChoiceParser:
    name: ClassVar[str] = "named_tool_choice"
    State: ClassVar[type[msgspec.Struct]] = NamedToolState

    def __init__(self, config: ToolParserConfig, function_name: str) -> None:
        self.config = config
        self.function_name = function_name

    def initial_state(self) -> NamedToolState:
        return NamedToolState()

    def feed(self, state: NamedToolState, text: str) -> list[Piece]:
        if not text:
            return []
        if not state.started:
            state.started = True
            return [ToolCallPiece(index=0, name=self.function_name, arguments=text)]
        return [ToolCallPiece(index=0, arguments=text)]

    def finish(self, state: NamedToolState) -> list[Piece]:
        if not state.started:
            # An empty argument text still is a call to the forced function.
            state.started = True
            return [ToolCallPiece(index=0, name=self.function_name, arguments="")]
        return []


class RequiredToolState(msgspec.Struct):
    depth: int = 0  # JSON nesting depth: 1 = inside the array, 2 = inside an element object
    in_string: bool = False
    escape: bool = False
    index: int = -1  # current element
    key_text: str = ""  # element text at depth 2 (keys, the name value), parameters value excluded
    in_params: bool = False
    params_depth: int = 0  # nesting inside the parameters value
    name_sent: bool = False
    unsent_args: str = ""  # parameters text seen before the name was known


_PARAMS_KEY = re.compile(r'"(?:parameters|arguments)"\s*:\s*$')
_NAME = re.compile(r'"name"\s*:\s*("(?:[^"\\]|\\.)*")')


class RequiredToolChoiceParser:
    name: ClassVar[str] = "required_tool_choice"
    State: ClassVar[type[msgspec.Struct]] = RequiredToolState

    def __init__(self, config: ToolParserConfig) -> None:
        self.config = config

    def initial_state(self) -> RequiredToolState:
        return RequiredToolState()

    def feed(self, st: RequiredToolState, text: str) -> list[Piece]:
        out: list[Piece] = []
        args: list[str] = []
        for ch in text:
            if st.in_params:
                if self._params_char(st, ch, args):
                    continue
                # the character ended a scalar value: fall through and treat it at key level
            if st.in_string:
                if st.depth == 2:
                    st.key_text += ch
                if st.escape:
                    st.escape = False
                elif ch == "\\":
                    st.escape = True
                elif ch == '"':
                    st.in_string = False
                continue
            if ch == '"':
                st.in_string = True
                if st.depth == 2:
                    st.key_text += ch
            elif ch in "{[":
                st.depth += 1
                if st.depth == 2 and ch == "{":
                    self._flush_args(st, args, out)
                    st.index += 1
                    st.key_text, st.name_sent, st.unsent_args = "", False, ""
            elif ch in "}]":
                if st.depth == 2:
                    self._flush_args(st, args, out)
                    self._maybe_name(st, out, force=True)
                st.depth = max(st.depth - 1, 0)
            elif st.depth == 2:
                st.key_text += ch
                if ch == ":" and _PARAMS_KEY.search(st.key_text):
                    self._maybe_name(st, out)
                    st.in_params, st.params_depth = True, 0
        self._flush_args(st, args, out)
        return out

    def finish(self, st: RequiredToolState) -> list[Piece]:
        out: list[Piece] = []
        if st.index >= 0 and not st.name_sent:
            self._maybe_name(st, out, force=True)
        return out

    # ------------------------------------------------------------------------------------------------

    def _params_char(self, st: RequiredToolState, ch: str, args: list[str]) -> bool:
        """Consume one character of the parameters value; False when it ended a scalar value."""
        if st.params_depth == 0 and not st.in_string:
            if ch in " \t\r\n" and not args and not st.unsent_args:
                return True  # whitespace before the value
            if ch in ",}" and (args or st.unsent_args):
                st.in_params = False  # end of a scalar value
                return False
        args.append(ch)
        if st.in_string:
            if st.escape:
                st.escape = False
            elif ch == "\\":
                st.escape = True
            elif ch == '"':
                st.in_string = False
        elif ch == '"':
            st.in_string = True
        elif ch in "{[":
            st.params_depth += 1
        elif ch in "}]":
            st.params_depth -= 1
            if st.params_depth == 0:
                st.in_params = False
        return True

    def _flush_args(self, st: RequiredToolState, args: list[str], out: list[Piece]) -> None:
        if not args:
            return
        text = "".join(args)
        args.clear()
        if st.name_sent:
            out.append(ToolCallPiece(index=st.index, arguments=text))
        else:
            st.unsent_args += text
            self._maybe_name(st, out)

    def _maybe_name(self, st: RequiredToolState, out: list[Piece], force: bool = False) -> None:
        if st.name_sent or st.index < 0:
            return
        m = _NAME.search(st.key_text)
        if m is None and not force:
            return
        # The name must be complete before it is sent (parameters may come first: they wait).
        if m is None and st.in_params:
            return
        try:
            name = json.loads(m.group(1)) if m else ""
        except ValueError:
            name = ""
        if m is None and not st.unsent_args:
            return
        st.name_sent = True
        out.append(ToolCallPiece(index=st.index, name=name, arguments=st.unsent_args or None))
        st.unsent_args = ""


# Tool parsers whose own call syntax starts with neither "[" nor "{": a forced call in that syntax (vLLM's
# structural tags) is told apart from our JSON shapes by its first character. seed_oss is here for the calls our
# earlier renders opened in the prompt (vLLM constrains its forced calls to JSON, which this reads too).
CALL_SYNTAX_PARSERS = frozenset({"hermes", "qwen3_json", "qwen3_coder", "qwen3_xml", "step5", "deepseek_v31",
                                 "kimi_k2", "glm45", "glm47", "minimax_m2", "seed_oss", "deepseek_v32", "deepseek_v4"})
# Llama's JSON calls start with "{" too: vLLM's forced call is ``{"name": N, "parameters": ...}``, a named one
# that exact text, where our earlier renders wrote the arguments object (named) or an array ("required").
LLAMA_JSON_PARSERS = frozenset({"llama3_json", "llama4_json"})

UNDECIDED, JSON_SHAPE, CALL_SYNTAX = 0, 1, 2
MAX_UNDECIDED = 4096  # held text before the shape is known (a forced name's prefix at most)


def by_first_character(text: str, final: bool) -> int:
    """The default: the family's syntax unless the output starts like JSON."""
    return JSON_SHAPE if text[0] in "[{" else CALL_SYNTAX


def array_is_call_syntax(text: str, final: bool) -> int:
    """Families whose forced calls are a JSON array (vLLM's mistral, Llama's "required" after our old render
    wrote "[", decided the other way round): "[" is the family's, anything else the other shape."""
    return CALL_SYNTAX if text[0] == "[" else JSON_SHAPE


def llama_required(text: str, final: bool) -> int:
    """Our earlier JSON array or Llama's own calls (anything else, read as under "auto")."""
    return JSON_SHAPE if text[0] == "[" else CALL_SYNTAX


def llama_named(name: str) -> Callable[[str, bool], int]:
    """Llama's forced call begins with exactly this text (the tag's begin); anything else is our earlier
    render's arguments object. Undecided while the text is still a prefix of it."""
    opening = '{"name": "' + name + '", "parameters": '

    def decide(text: str, final: bool) -> int:
        if text.startswith(opening):
            return CALL_SYNTAX
        if opening.startswith(text) and not final:
            return UNDECIDED
        return CALL_SYNTAX if opening.startswith(text) and len(text) > 1 else JSON_SHAPE

    return decide


class EitherShapeState(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """(unknown fields refused: a state of the JSON-only parsers from before is a 400, never read as a fresh start)"""

    mode: int = UNDECIDED
    held: str = ""  # text until its start decides the shape (leading whitespace, a forced name's prefix)
    inner: Any = None  # the deciding parser's state


class EitherShapeToolChoice:
    """A forced call ("required" or named) in whichever shape the model wrote it: the family's own call syntax
    (what vLLM's render asks for; parsed as under "auto") or our JSON (``[{"name", "parameters"}, ...]`` or the
    named tool's arguments object, what earlier renders of ours asked for). The start of the text after any
    whitespace decides (``decide``, by default its first character); until then nothing is emitted."""

    name: ClassVar[str] = "either_shape_tool_choice"
    State: ClassVar[type[msgspec.Struct]] = EitherShapeState

    def __init__(self, native: Any, as_json: NamedToolChoiceParser | RequiredToolChoiceParser,
                 decide: Callable[[str, bool], int] = by_first_character) -> None:
        self.native = native
        self.as_json = as_json
        self.decide = decide

    def initial_state(self) -> EitherShapeState:
        return EitherShapeState()

    def opened_state(self, inner: Any) -> EitherShapeState:
        """The call was opened in the prompt (our earlier render's XML families): the family's forced state."""
        return EitherShapeState(mode=CALL_SYNTAX, inner=inner)

    def restore_inner(self, state: EitherShapeState) -> None:
        """Typed inner state after a stream_state round trip (raises msgspec.ValidationError)."""
        if state.mode == UNDECIDED:
            held = state.held.lstrip()
            if state.inner is not None or len(state.held) > MAX_UNDECIDED or (
                    held and self.decide(held, False) != UNDECIDED):
                raise msgspec.ValidationError("undecided forced-call state holds text that decides its shape")
            return
        if state.mode not in (JSON_SHAPE, CALL_SYNTAX) or state.held:
            raise msgspec.ValidationError("invalid forced-call state")
        parser = self.as_json if state.mode == JSON_SHAPE else self.native
        state.inner = msgspec.convert(state.inner, parser.State)

    def _parser(self, state: EitherShapeState) -> Any:
        return self.as_json if state.mode == JSON_SHAPE else self.native

    def feed(self, state: EitherShapeState, text: str) -> list[Piece]:
        if state.mode == UNDECIDED:
            buf = state.held + text
            stripped = buf.lstrip()
            mode = self.decide(stripped, False) if stripped else UNDECIDED
            if mode == UNDECIDED and len(buf) > MAX_UNDECIDED:
                mode = self.decide(stripped, True)
            if mode == UNDECIDED:
                state.held = buf
                return []
            state.mode, state.held = mode, ""
            state.inner = self._parser(state).initial_state()
            text = stripped  # whitespace before the call (either shape) is layout
        out: list[Piece] = self._parser(state).feed(state.inner, text)
        return out

    def finish(self, state: EitherShapeState) -> list[Piece]:
        out: list[Piece] = []
        if state.mode == UNDECIDED:
            stripped = state.held.lstrip()
            # nothing but whitespace: the JSON parsers' end (a named call with empty arguments)
            state.mode = self.decide(stripped, True) if stripped else JSON_SHAPE
            state.held, state.inner = "", self._parser(state).initial_state()
            if stripped:
                out += self._parser(state).feed(state.inner, stripped)
        out += self._parser(state).finish(state.inner)
        return out

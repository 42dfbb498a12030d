"""One derender pipeline per request choice.

    token IDs -> IncrementalDetokenizer -> [stop strings] -> reasoning parser -> tool parser -> ChoiceDelta

The stop-string stage (``parsers.stop_strings``) is there only when the request has ``stop``.

Streaming derender feeds each engine chunk; batch derender feeds every token at once and finishes: one
code path, so batch equals the concatenated stream by construction. The whole pipeline state is one small
msgspec struct (``PipelineState``) that ``streaming_cache.codec`` serializes into ``stream_state``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from render_service.parsers.base import (
    Piece,
    ReasoningParserConfig,
    TextPiece,
    ToolCallPiece,
    ToolParserConfig,
    ToolSpec,
)
from render_service.parsers.detokenizer import DetokenizerConfig, DetokenizerState, IncrementalDetokenizer
from render_service.parsers.forced_tools import (
    CALL_SYNTAX_PARSERS,
    LLAMA_JSON_PARSERS,
    EitherShapeToolChoice,
    NamedToolChoiceParser,
    RequiredToolChoiceParser,
    array_is_call_syntax,
    llama_named,
    llama_required,
)
from render_service.parsers.harmony import HarmonyParser
from render_service.parsers.muse_channels import MuseReasoningParser
from render_service.parsers.reasoning import CONTENT, ThinkReasoningParser, reasoning_open_at_prompt_end
from render_service.parsers.reasoning_count import (
    HarmonyTokenCounter,
    MuseTokenCounter,
    ReasoningCount,
    ThinkTokenCounter,
    TokenCounter,
)
from render_service.parsers.registry import get_reasoning_parser, get_tool_parser
from render_service.parsers.response_template import bind_parser
from render_service.parsers.stop_strings import StopState, StopStrings

if TYPE_CHECKING:
    from render_service.tokenize.tokenizer import RenderTokenizer

# How the request's tool_choice reaches the pipeline (derender.pipeline_config resolves it).
ToolChoiceMode = Literal["none", "auto", "required", "named"]


class PipelineConfig(msgspec.Struct, frozen=True):
    """Everything a pipeline needs that is not token IDs; derived from the chat request each call."""

    request_id: str = ""
    choice_index: int = 0
    reasoning_parser: str | None = None
    tool_parser: str | None = None
    tools: list[ToolSpec] = []
    tool_choice: ToolChoiceMode = "none"  # "named": named_function holds the forced name
    named_function: str | None = None
    enable_thinking: bool = True
    include_reasoning: bool = True
    parallel_tool_calls: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    hidden_token_ids: frozenset[int] = frozenset()
    # stop strings applied to the decoded text before any parser (render_service.parsers.stop_strings)
    stops: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    min_tokens: int = 0


# PipelineConfig fields left out of its encoding (``config_bytes``) while at their defaults, so a stream without
# them keeps the state binding it had before they existed
_OPTIONAL_CONFIG = {"stops": (), "include_stop_str_in_output": False, "min_tokens": 0}


def config_bytes(config: PipelineConfig) -> bytes:
    """The configuration as bytes, for binding a stream state to it."""
    fields = msgspec.structs.asdict(config)
    for name, default in _OPTIONAL_CONFIG.items():
        if fields[name] == default:
            del fields[name]
    return msgspec.msgpack.encode(fields)


class PipelineState(msgspec.Struct, omit_defaults=True):
    """Plain data only: this is what stream_state carries (no token history)."""

    detok: DetokenizerState
    reasoning: Any = None
    tools: Any = None
    role_sent: bool = False
    tool_calls: int = 0  # calls started so far (their indexes are 0..tool_calls-1)
    model_call_ids: list[str] = []  # ids the model's own format supplied, by call index ("" = minted)
    tokens: int = 0  # completion tokens fed so far
    reasoning_count: ReasoningCount | None = None  # with a reasoning parser: its tokens (parsers/reasoning_count.py)
    finished: bool = False
    # streaming logprobs: the last sampled ids (U+FFFD repair across chunks) and the completions text offset
    logprob_context: list[int] = []
    logprob_text_offset: int = 0
    stop: StopState | None = None  # with stop strings configured


# One per token: untracked by the garbage collector (gc=False: its tool-call dicts never refer back to it), so the
# per-token allocations do not drive collections.
class ChoiceDelta(msgspec.Struct, gc=False):
    """What one feed produced for one choice, in OpenAI delta terms."""

    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = []

    def is_empty(self) -> bool:
        return self.content is None and self.reasoning is None and not self.tool_calls


def merge_deltas(a: ChoiceDelta, b: ChoiceDelta) -> ChoiceDelta:
    """Concatenate two deltas of one chunk (a feed and the finish flush)."""
    if b.is_empty():
        return a
    if a.is_empty():
        return b
    calls = [dict(c, function=dict(c["function"])) for c in a.tool_calls]
    for tc in b.tool_calls:
        prev = next((c for c in calls if c["index"] == tc["index"]), None)
        if prev is None:
            calls.append(tc)
            continue
        if "id" in tc:
            prev["id"], prev["type"] = tc["id"], "function"
        fn = tc.get("function", {})
        if fn.get("name") is not None:
            prev["function"]["name"] = fn["name"]
        if fn.get("arguments") is not None:
            prev["function"]["arguments"] = prev["function"].get("arguments", "") + fn["arguments"]
    return ChoiceDelta(
        content=(a.content or "") + b.content if b.content is not None else a.content,
        reasoning=(a.reasoning or "") + b.reasoning if b.reasoning is not None else a.reasoning,
        tool_calls=calls,
    )


_ALNUM = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def tool_call_id(request_id: str, choice_index: int, call_index: int, style: str = "openai") -> str:
    """Deterministic id: batch and stream agree, and a retried chunk keeps its id.

    ``style`` is the tool parser's ``call_id_style``: "mistral" gives 9 alphanumerics (Mistral chat templates
    refuse any other id when the calls come back in the next turn), else ``chatcmpl-tool-<32 hex>``.
    """
    digest = hashlib.sha256(f"{request_id}\x00{choice_index}\x00{call_index}".encode()).digest()
    if style == "mistral":
        number = int.from_bytes(digest[:8], "big")
        chars = []
        for _ in range(9):
            number, rest = divmod(number, 62)
            chars.append(_ALNUM[rest])
        return "".join(chars)
    return f"chatcmpl-tool-{digest.hex()[:32]}"


def native_forced_tool_choice(tool_parser: str | None, tool_choice: str) -> bool:
    """Whether a "required" / named call of this family may have been opened in the prompt
    (``forced_call_prefix``): our earlier renders did that for the XML families; derender still reads it."""
    if tool_choice not in ("required", "named") or tool_parser is None:
        return False
    cls = get_tool_parser(tool_parser)
    return hasattr(cls, "forced_call_prefix") and getattr(cls, "native_forced_choice", True)


def call_id_style(tool_parser: str | None) -> str:
    """The configured parser family's id style; forced tool choice on that server uses it too."""
    if not tool_parser:
        return "openai"
    return getattr(get_tool_parser(tool_parser), "call_id_style", "openai")


def _channel_tool_stage(config: PipelineConfig, tcfg: ToolParserConfig) -> Any:
    """Muse's tool stage (parsers/tools_muse.py), which reads the messages a Muse reasoning stage passes on: run
    after that stage whatever the tool choice, and for any tool choice when it is the configured tool parser (its
    calls are read in the model's own markup, as upstream's, never as forced JSON). Calls only when tools may be
    called. None for the other families."""
    family: Any = get_tool_parser(config.tool_parser) if config.tool_parser else None
    calls = family is not None and bool(config.tools) and config.tool_choice != "none"
    if family is None or not getattr(family, "channel_stage", False):
        companion = getattr(get_reasoning_parser(config.reasoning_parser), "tool_stage", None) \
            if config.reasoning_parser else None
        if companion is None:
            return None
        family, calls = get_tool_parser(companion), False
    return family(tcfg, calls=calls)


class Pipeline:
    def __init__(self, tokenizer: RenderTokenizer, config: PipelineConfig) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.detok = IncrementalDetokenizer(
            tokenizer,
            DetokenizerConfig(
                skip_special_tokens=config.skip_special_tokens,
                spaces_between_special_tokens=config.spaces_between_special_tokens,
                hidden_token_ids=config.hidden_token_ids,
            ),
        )
        self.reasoning_cls = bind_parser(get_reasoning_parser(config.reasoning_parser), tokenizer) \
            if config.reasoning_parser else None
        self.reasoning: ThinkReasoningParser | HarmonyParser | None = (
            self.reasoning_cls(ReasoningParserConfig(enable_thinking=config.enable_thinking))
            if self.reasoning_cls
            else None
        )
        self.tools = self._make_tool_parser(config)
        self.counter: TokenCounter | None = None
        if self.reasoning_cls is HarmonyParser:
            # one stage for reasoning and calls (gpt-oss's Harmony: render_service/parsers/harmony.py)
            self.reasoning, self.tools = HarmonyParser.for_pipeline(config), None
            self.counter = HarmonyTokenCounter(tokenizer)
        elif self.reasoning_cls is not None and issubclass(self.reasoning_cls, MuseReasoningParser):
            # Muse's channels (parsers/muse_channels.py): reasoning is the bodies of some recipients' messages
            self.counter = MuseTokenCounter(tokenizer, self.reasoning_cls.REASONING_RECIPIENTS)
        elif self.reasoning_cls is not None and issubclass(self.reasoning_cls, ThinkReasoningParser):
            self.counter = ThinkTokenCounter(self.reasoning_cls, tokenizer)
        self.think_counter = self.counter if isinstance(self.counter, ThinkTokenCounter) else None
        self.id_style = call_id_style(config.tool_parser)
        # a whole (non-streamed) answer keeps the tool stage's input, so a call cut off by max_tokens can be
        # given back as text (render_service.parsers.cut_calls); a stream never keeps it
        self.tool_text: list[str] | None = None
        self.closed_at_finish: int | None = None  # the call the tool parser had to close at the end of output
        self.stop = StopStrings(config.stops, config.include_stop_str_in_output) if config.stops else None

    def _make_tool_parser(self, config: PipelineConfig) -> Any:
        tcfg = ToolParserConfig(tools=list(config.tools))
        channels = _channel_tool_stage(config, tcfg)
        if channels is not None:
            return channels
        named = config.named_function if config.tool_choice == "named" else None
        forced = config.tool_choice in ("required", "named")
        if forced and (config.tool_parser in CALL_SYNTAX_PARSERS or config.tool_parser in LLAMA_JSON_PARSERS):
            as_json = NamedToolChoiceParser(tcfg, named) if named else RequiredToolChoiceParser(tcfg)
            native = get_tool_parser(config.tool_parser)(tcfg)
            if config.tool_parser in LLAMA_JSON_PARSERS:
                return EitherShapeToolChoice(native, as_json, llama_named(named) if named else llama_required)
            return EitherShapeToolChoice(native, as_json)
        if named and config.tool_parser == "mistral":
            # vLLM's mistral constrains a named call to its array of one {"name", "arguments"}; ours did to the
            # arguments object
            return EitherShapeToolChoice(RequiredToolChoiceParser(tcfg), NamedToolChoiceParser(tcfg, named),
                                         array_is_call_syntax)
        if config.tool_parser is not None and native_forced_tool_choice(config.tool_parser, config.tool_choice):
            return get_tool_parser(config.tool_parser)(tcfg)
        if config.tool_choice == "named" and config.named_function:
            return NamedToolChoiceParser(tcfg, config.named_function)
        if config.tool_choice == "required":
            return RequiredToolChoiceParser(tcfg)
        if config.tool_choice == "auto" and config.tool_parser and config.tools:
            return bind_parser(get_tool_parser(config.tool_parser), self.tokenizer)(tcfg)
        return None

    # state ------------------------------------------------------------------------------------------

    def initial_state(
        self, prompt_token_ids: Sequence[int] | None = None, reasoning_open_at_start: bool | None = None
    ) -> PipelineState:
        """``reasoning_open_at_start``: a render-side hint; otherwise derived from the prompt tail."""
        reasoning_state: msgspec.Struct | None = None
        named = self.config.named_function if self.config.tool_choice == "named" else None
        forced = native_forced_tool_choice(self.config.tool_parser, self.config.tool_choice) and \
            self._prompt_opened_call(prompt_token_ids, named)
        if forced:
            reasoning_open_at_start = False  # render closed reasoning and opened the call in the prompt
        think_cls = self.reasoning_cls
        if isinstance(self.reasoning, HarmonyParser):
            reasoning_state = self.reasoning.initial_state(prompt_token_ids, self.tokenizer)
        elif self.reasoning is not None and think_cls is not None and not issubclass(think_cls, HarmonyParser):
            is_open = reasoning_open_at_start
            in_prompt = getattr(think_cls, "reasoning_open_in_prompt", None)  # a family that reads the prompt's text
            if is_open is None and in_prompt is not None:
                is_open = in_prompt(prompt_token_ids, self.tokenizer)
            elif is_open is None:
                is_open = reasoning_open_at_prompt_end(prompt_token_ids, self.tokenizer, think_cls)
            parser = self.reasoning
            if is_open is not None:
                parser = think_cls(
                    ReasoningParserConfig(reasoning_open_at_start=is_open, enable_thinking=self.config.enable_thinking)
                )
            reasoning_state = parser.initial_state()
        tools_state = None
        if isinstance(self.tools, EitherShapeToolChoice):
            tools_state = self.tools.opened_state(self.tools.native.forced_state(named)) if forced \
                else self.tools.initial_state()
        elif self.tools is not None:
            tools_state = self.tools.forced_state(named) if forced else self.tools.initial_state()
        return PipelineState(
            detok=self.detok.initial_state(prompt_token_ids),
            reasoning=reasoning_state,
            reasoning_count=self.counter.initial(reasoning_state) if self.counter is not None else None,
            tools=tools_state,
            stop=StopState() if self.stop is not None else None,
        )

    def _prompt_opened_call(self, prompt_token_ids: Sequence[int] | None, named: str | None) -> bool:
        """Whether the prompt ends with the family's forced-call opening (our earlier renders wrote it for the XML
        families; vLLM's render, and ours now, constrain the output instead). Without the prompt it did not."""
        if not prompt_token_ids or self.config.tool_parser is None:
            return False
        family: Any = get_tool_parser(self.config.tool_parser)
        prefix = family.forced_call_prefix(named)
        tail = self.tokenizer.decode(list(prompt_token_ids[-(len(prefix) + 8):]), skip_special_tokens=False)
        return bool(tail.endswith(prefix))

    def restore_state(self, raw: Any) -> PipelineState:
        """Typed, validated state from decoded plain data (raises msgspec.ValidationError)."""
        state = msgspec.convert(raw, PipelineState)
        if self.reasoning_cls is not None:
            if state.reasoning is None:
                raise msgspec.ValidationError("stream state lacks the reasoning parser state")
            state.reasoning = msgspec.convert(state.reasoning, self.reasoning_cls.State)
            if state.reasoning_count is None and self.counter is not None:
                # a state from before the count existed: count from here on (usage only; the output is the same)
                state.reasoning_count = self.counter.initial(state.reasoning)
        elif state.reasoning is not None or state.reasoning_count is not None:
            raise msgspec.ValidationError("stream state has reasoning state but no reasoning parser is configured")
        if self.tools is not None:
            if state.tools is None:
                raise msgspec.ValidationError("stream state lacks the tool parser state")
            state.tools = msgspec.convert(state.tools, type(self.tools).State)
            if isinstance(self.tools, EitherShapeToolChoice):
                self.tools.restore_inner(state.tools)
        elif state.tools is not None:
            raise msgspec.ValidationError("stream state has tool parser state but no tool parser is active")
        if self.stop is not None:
            if state.stop is None or not self.stop.check(state.stop):
                raise msgspec.ValidationError("stream state's stop-string state does not fit the request's stop")
        elif state.stop is not None:
            raise msgspec.ValidationError("stream state has stop-string state but the request has no stop")
        return state

    # feeding ----------------------------------------------------------------------------------------

    def feed(self, state: PipelineState, token_ids: list[int]) -> ChoiceDelta:
        state.tokens += len(token_ids)
        count = state.reasoning_count
        think: ThinkTokenCounter | None = None  # the think-tag counter while it tracks: in step with the text stage
        if count is not None and count.tracking:
            think = self.think_counter
            if think is None:
                self.counter.feed(count, token_ids)  # type: ignore[union-attr]  # set with the count
            elif count.open and len(token_ids) == 1 and token_ids[0] not in think.markers:
                # the per-token case, an ordinary token inside reasoning: ThinkTokenCounter.feed's branch for it,
                # without the call
                count.reasoning += 1
                if count.since_marker >= 0:
                    count.since_marker += 1
            elif len(token_ids) > 1 and think.spelled_tags:
                # tags of ordinary sub-tokens: the text stage says which token ended reasoning; feed it each
                counted = self._counted_per_token(state, count, token_ids)
                return self._delta(state, self._through_tools(state, counted)) if counted else ChoiceDelta()
            else:
                think.feed(count, token_ids)
        text = (self.detok.step(state.detok, token_ids) if self.stop is None
                else self._stopped_text(state, token_ids, state.tokens - len(token_ids)))
        if not text:
            return ChoiceDelta()
        pieces: Sequence[Piece]
        if self.reasoning is None:
            pieces = [TextPiece("content", text)]
        else:
            pieces = self.reasoning.feed(state.reasoning, text)
            if think is not None and count is not None and count.tracking:
                mode = state.reasoning.mode
                if (mode == CONTENT) if count.open else think.needs_sync(count, mode):
                    think.sync(count, state.reasoning)  # reasoning opened or ended by text alone
        if self.tools is None and len(pieces) == 1:
            # The per-token common case (one channel's text, no tool parser): what _delta would build.
            (p,) = pieces
            if type(p) is not TextPiece:  # a call (Harmony's stage emits them); not isinstance: StructMeta's is slow
                return self._delta(state, pieces)
            if p.channel == "content":
                return ChoiceDelta(content=p.text)
            return ChoiceDelta(reasoning=p.text) if self.config.include_reasoning else ChoiceDelta()
        return self._delta(state, self._through_tools(state, pieces))

    def _stopped_text(self, state: PipelineState, token_ids: list[int], before: int) -> str:
        """The detokenizer's text through the stop-string stage (``before``: output tokens ahead of these). The
        text of tokens among the first min_tokens is fed apart: a stop string must end past it."""
        stop, stop_state = self.stop, state.stop
        assert stop is not None and stop_state is not None  # set together (initial_state, restore_state)
        if stop_state.matched is not None:
            self.detok.step(state.detok, token_ids)  # keeps the detokenizer in step; the text is past the stop
            return ""
        head = min(len(token_ids), max(0, self.config.min_tokens - before))
        if head == 0:
            return stop.feed(stop_state, self.detok.step(state.detok, token_ids))
        released = stop.feed(stop_state, self.detok.step(state.detok, token_ids[:head]), protected=True)
        if head < len(token_ids):
            released += stop.feed(stop_state, self.detok.step(state.detok, token_ids[head:]))
        return released

    def _counted_per_token(self, state: PipelineState, count: ReasoningCount, token_ids: list[int]) -> list[Piece]:
        """The detokenizer and reasoning stages one token at a time (the same text: both are incremental), so the
        reasoning count does not depend on how tokens were chunked."""
        counter, reasoning = self.think_counter, self.reasoning
        assert counter is not None and reasoning is not None
        pieces: list[Piece] = []
        before = state.tokens - len(token_ids)
        for i, token in enumerate(token_ids):
            if count.tracking:
                counter.feed(count, [token])
            text = (self.detok.step(state.detok, [token]) if self.stop is None
                    else self._stopped_text(state, [token], before + i))
            if text:
                pieces.extend(reasoning.feed(state.reasoning, text))
                if count.tracking and counter.needs_sync(count, state.reasoning.mode):
                    counter.sync(count, state.reasoning)
        return pieces

    def finish(self, state: PipelineState) -> ChoiceDelta:
        """End of output: flush every stage. Idempotent."""
        if state.finished:
            return ChoiceDelta()
        state.finished = True
        pieces: list[Piece] = []
        if self.stop is not None and state.stop is not None:
            held = self.stop.finish(state.stop)
            if held:
                pieces.extend(self.reasoning.feed(state.reasoning, held) if self.reasoning is not None
                              else [TextPiece("content", held)])
        if self.reasoning is not None:
            pieces.extend(self.reasoning.finish(state.reasoning))
        if self.tools is None:
            return self._delta(state, pieces)
        flushed = list(self._through_tools(state, pieces))
        closing = self.tools.finish(state.tools)
        for p in closing:
            if type(p) is ToolCallPiece and p.arguments:
                self.closed_at_finish = p.index  # the model did not close this call's arguments
        flushed.extend(closing)
        return self._delta(state, flushed)

    def _through_tools(self, state: PipelineState, pieces: Sequence[Piece]) -> Sequence[Piece]:
        if self.tools is None:
            return pieces
        out: list[Piece] = []
        for p in pieces:
            if isinstance(p, TextPiece) and p.channel == "content":
                if self.tool_text is not None:
                    self.tool_text.append(p.text)
                out.extend(self.tools.feed(state.tools, p.text))
            else:
                out.append(p)
        return out

    def _delta(self, state: PipelineState, pieces: Sequence[Piece]) -> ChoiceDelta:
        content: list[str] = []
        reasoning: list[str] = []
        calls: dict[int, dict[str, Any]] = {}
        cfg = self.config
        for p in pieces:
            if isinstance(p, TextPiece):
                if p.channel == "content":
                    content.append(p.text)
                elif cfg.include_reasoning:
                    reasoning.append(p.text)
                continue
            if not cfg.parallel_tool_calls and p.index > 0:
                continue
            entry = calls.get(p.index)
            if entry is None:
                entry = calls[p.index] = {"index": p.index, "function": {}}
            if p.name is not None:
                entry["id"] = self._call_id(state, p)
                entry["type"] = "function"
                entry["function"]["name"] = p.name
            if p.arguments is not None:
                fn = entry["function"]
                fn["arguments"] = fn.get("arguments", "") + p.arguments
        delta = ChoiceDelta()
        if content:
            delta.content = "".join(content)
        if reasoning:
            delta.reasoning = "".join(reasoning)
        if calls:
            # id/type first in the entry, the way OpenAI and vLLM order the keys
            delta.tool_calls = [_ordered_call(calls[i]) for i in sorted(calls)]
        return delta

    def _call_id(self, state: PipelineState, piece: ToolCallPiece) -> str:
        while len(state.model_call_ids) <= piece.index:
            state.model_call_ids.append("")
        state.tool_calls = max(state.tool_calls, piece.index + 1)
        if piece.id:
            state.model_call_ids[piece.index] = piece.id
            return piece.id
        return self.call_id_for(state, piece.index)

    def call_id_for(self, state: PipelineState, index: int) -> str:
        """The id call ``index`` was (or will be) announced with."""
        if index < len(state.model_call_ids) and state.model_call_ids[index]:
            return state.model_call_ids[index]
        return tool_call_id(self.config.request_id, self.config.choice_index, index, self.id_style)

    @staticmethod
    def stop_reason(state: PipelineState, engine_stop_reason: int | str | None) -> int | str | None:
        """The stop string that cut the text, else what the engine reported."""
        if state.stop is not None and state.stop.matched is not None:
            return state.stop.matched
        return engine_stop_reason

    # usage ------------------------------------------------------------------------------------------

    @staticmethod
    def reasoning_tokens(state: PipelineState) -> int:
        """Output tokens of reasoning text so far (OpenAI's ``reasoning_tokens``)."""
        count = state.reasoning_count
        return count.reasoning if count is not None else 0

    @staticmethod
    def thinking_tokens(state: PipelineState) -> int:
        """Reasoning tokens and their delimiters (Anthropic's ``thinking_tokens``)."""
        count = state.reasoning_count
        return count.reasoning + count.delimiters if count is not None else 0

    # finish_reason ----------------------------------------------------------------------------------

    def finish_reason(self, state: PipelineState, engine_reason: str | None) -> str | None:
        """``tool_calls`` when a call was made and the engine stopped normally; ``length`` stays ``length``. Text cut
        at a stop string stopped normally."""
        if engine_reason is not None and state.stop is not None and state.stop.matched is not None:
            engine_reason = "stop"
        if engine_reason == "stop" and state.tool_calls > 0 and self.config.tool_choice != "named":
            return "tool_calls"
        return engine_reason


def _ordered_call(entry: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"index": entry["index"]}
    if "id" in entry:
        out["id"] = entry["id"]
        out["type"] = "function"
    out["function"] = entry["function"]
    return out


class MessageAccumulator:
    """Concatenates ChoiceDeltas into a chat message: what a client reconstructs from the stream."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}

    def add(self, delta: ChoiceDelta) -> None:
        if delta.content is not None:
            self.content.append(delta.content)
        if delta.reasoning is not None:
            self.reasoning.append(delta.reasoning)
        for tc in delta.tool_calls:
            call = self.calls.setdefault(
                tc["index"], {"id": None, "type": "function", "function": {"name": None, "arguments": ""}})
            if "id" in tc:
                call["id"] = tc["id"]
            fn = tc.get("function", {})
            if fn.get("name") is not None:
                call["function"]["name"] = fn["name"]
            if fn.get("arguments") is not None:
                call["function"]["arguments"] += fn["arguments"]

    def message(self, forced_tool_choice: bool = False) -> dict[str, Any]:
        content = "".join(self.content) or None
        if content is None and forced_tool_choice:
            content = ""  # vLLM: named/required tool choice gives "" instead of null
        return {
            "role": "assistant",
            "content": content,
            "reasoning": "".join(self.reasoning) or None,
            "tool_calls": [self.calls[i] for i in sorted(self.calls)],
        }


def derender_all(pipeline: Pipeline, token_ids: list[int], prompt_token_ids: list[int] | None = None,
                 reasoning_open_at_start: bool | None = None,
                 engine_finish: str | None = None) -> tuple[dict[str, Any], PipelineState]:
    """Batch derender of one choice: the fold of the streaming pipeline over all tokens, except that a call cut
    off by ``max_tokens`` (``engine_finish == "length"``) is given back as text (``cut_calls``)."""
    from render_service.parsers.cut_calls import withdraw_cut_call  # imports this module

    state = pipeline.initial_state(prompt_token_ids, reasoning_open_at_start)
    pipeline.tool_text = []
    acc = MessageAccumulator()
    acc.add(pipeline.feed(state, token_ids))
    acc.add(pipeline.finish(state))
    message = acc.message(pipeline.config.tool_choice in ("named", "required"))
    return withdraw_cut_call(pipeline, message, engine_finish), state

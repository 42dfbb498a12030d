"""Engine token events -> OpenAI chunks and responses, one derender pipeline per choice, in-process.

The pipeline (detokenizer -> reasoning parser -> tool parser) and its configuration are the ones the
/derender endpoints use (``derender.pipeline_config``), fed directly: no stream_state round trip per
chunk. Stop strings are matched on each choice's content as it leaves the pipeline. The streaming
path turns each engine event into zero or more chunks; the non-streaming path folds the same deltas
into one message, so the two agree by construction.

What ``vllm serve`` adds over derender is added here too: ``system_fingerprint`` (the render configuration's
fingerprint) on non-streamed responses and on a stream's last chunk(s), ``completion_tokens_details.
reasoning_tokens`` when a reasoning parser is configured (the pipeline's count, parsers/reasoning_count.py),
``stop_reason`` null when the model's own EOS token ended a choice, and per-choice ``weight_versions`` when the
request asks for them (``return_weight_versions``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from render_service.derender.batch import pipeline_config
from render_service.derender.choice_shapes import chat_message, completion_pipeline_config, delta_message, put_reasoning
from render_service.derender.logprobs import (
    PromptLogprobs,
    extend_completion_logprobs,
    resolve_chat_logprobs,
    resolve_completion_logprobs,
    tokens_as_token_ids,
)
from render_service.gateway.stop_strings import StopMatcher, stop_list
from render_service.parsers.cut_calls import withdraw_cut_call
from render_service.parsers.pipeline import ChoiceDelta, MessageAccumulator, Pipeline, merge_deltas
from render_service.render.render import completion_prompts
from render_service.render.render_config import RenderConfig
from render_service.render.tool_choice import forces_a_call
from render_service.wire.protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogprob,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    GeneratePromptLogprobs,
    GenerateRequest,
    GenerateStreamChoice,
    UsageInfo,
)

_encode = msgspec.json.Encoder().encode


def sse(payload: Any) -> bytes:
    """One SSE event: ``data: <json>`` and the blank line."""
    return b"data: " + _encode(payload) + b"\n\n"


class ChoiceOutput:
    """One choice: its pipeline state, stop-string matcher, token count and finish."""

    def __init__(self, pipeline: Pipeline, prompt_ids: Sequence[int], stops: list[str], include_stop: bool,
                 keep_token_ids: bool, eos_token_id: int | None = None) -> None:
        self.pipeline = pipeline
        self.state = pipeline.initial_state(prompt_ids)
        self.matcher = StopMatcher(stops, include_stop) if stops else None
        self.tokens = 0
        self.token_ids: list[int] | None = [] if keep_token_ids else None
        self.logprob_context: list[int] = []
        self.text_offset = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.done = False
        self.eos_token_id = eos_token_id  # vllm serve reports no stop_reason when the model's EOS stopped it
        self.weight_versions: list[dict[str, Any]] | None = None

    def step(self, ids: list[int], engine_finish: str | None, engine_stop_reason: Any = None) -> ChoiceDelta:
        """Feed one engine event of this choice; sets ``done`` and the finish when the choice ends."""
        pipeline, state = self.pipeline, self.state
        self.tokens += len(ids)
        if self.token_ids is not None:
            self.token_ids.extend(ids)
        delta = pipeline.feed(state, ids) if ids else ChoiceDelta()
        if engine_finish is not None:
            delta = merge_deltas(delta, pipeline.finish(state))
        if self.matcher is not None:
            if delta.content is not None:
                released, match = self.matcher.feed(delta.content)
                if match is not None:
                    # Everything after the stop string is dropped, the pipeline's held-back tail included.
                    delta.content = match.text or None
                    self._finish(pipeline.finish_reason(state, "stop"), match.stop)
                    return delta
                delta.content = released or None
            if engine_finish is not None:
                tail = self.matcher.flush()
                if tail:
                    delta.content = (delta.content or "") + tail
        if engine_finish is not None:
            if engine_stop_reason is not None and engine_stop_reason == self.eos_token_id:
                engine_stop_reason = None  # tokens-only engines name the EOS id; vllm serve says null
            self._finish(pipeline.finish_reason(state, engine_finish), engine_stop_reason)
        return delta

    def _finish(self, reason: str | None, stop_reason: Any) -> None:
        self.done = True
        self.finish_reason = reason
        self.stop_reason = stop_reason


def _usage(prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None = None) -> UsageInfo:
    usage = UsageInfo.counted(prompt_tokens, completion_tokens)
    if reasoning_tokens is not None:
        usage.completion_tokens_details = {"reasoning_tokens": reasoning_tokens}
    return usage


def primary_eos_token_id(config: RenderConfig) -> int | None:
    """The tokenizer's own EOS token (tokenizer_config.json's eos_token), which vLLM checks before stop_token_ids."""
    eos = config.template_special_tokens.get("eos_token")
    return config.tokenizer.token_to_id(eos) if eos else None


class _Responder:
    """What chat and completions share: choices per prompt, usage, the finished test."""

    stream_response: type[ChatCompletionStreamResponse] | type[CompletionStreamResponse]  # the endpoint's chunk
    stops: list[str]  # the request's stop strings

    def __init__(self, gens: list[GenerateRequest], config: RenderConfig, model: str, response_id: str,
                 stream_options: Any) -> None:
        self.gens = gens
        self.config = config
        self.model = model
        self.response_id = response_id
        self.created = int(time.time())
        self.n = gens[0].sampling_params.n or 1
        self.prompt_tokens = sum(len(g.token_ids) for g in gens)
        self.include_usage = bool(stream_options is not None and stream_options.include_usage)
        self.continuous = self.include_usage and bool(stream_options.continuous_usage_stats)
        self.return_token_ids = bool(gens[0].return_token_ids)
        self.choices: dict[int, ChoiceOutput] = {}
        self.all_done = False  # finished(), kept up to date by the streaming paths as choices end
        self.fingerprint = config.fingerprint
        self.eos_token_id = primary_eos_token_id(config)
        self.counts_reasoning = False  # chat with a reasoning parser: usage has completion_tokens_details
        self.weight_versions = False
        self.prompt_logprobs: dict[int, PromptLogprobs] = {}  # prompt index -> its resolved prompt logprobs

    def choice(self, prompt_index: int, index: int) -> tuple[int, ChoiceOutput, bool]:
        """(global choice index, its output, whether it is new)."""
        key = prompt_index * self.n + index
        out = self.choices.get(key)
        if out is not None:
            return key, out, False
        out = self.choices[key] = self.new_choice(self.gens[prompt_index], key)
        return key, out, True

    def new_choice(self, gen: GenerateRequest, key: int) -> ChoiceOutput:
        raise NotImplementedError

    def span_done(self, prompt_index: int, first: int, count: int) -> bool:
        """Choices ``first .. first+count-1`` of this prompt have all finished (a stop string may end
        one before the engine does)."""
        base = prompt_index * self.n + first
        choices = self.choices
        for i in range(count):  # called on every engine event: a plain loop, no generator
            out = choices.get(base + i)
            if out is None or not out.done:
                return False
        return True

    def finished(self) -> bool:
        """Every choice of every prompt has finished: nothing but usage and [DONE] is left to send."""
        choices = self.choices
        if len(choices) < self.n * len(self.gens):
            return False
        for out in choices.values():
            if not out.done:
                return False
        return True

    def stream_batch(self, items: list[tuple[int, GenerateStreamChoice]]) -> bytes:
        """The SSE events for what one engine read brought in. Without stop strings, the events of one
        choice are derendered as one (fewer, larger deltas; the pipeline folds any chunking the same);
        with stop strings each event stays apart, so that tokens after a match are never counted."""
        if len(items) > 1 and not self.stops:
            items = coalesce(items)
        if len(items) == 1:
            return self.stream_events(*items[0])
        return b"".join([self.stream_events(prompt_index, choice) for prompt_index, choice in items])

    def stream_events(self, prompt_index: int, choice: GenerateStreamChoice) -> bytes:
        raise NotImplementedError

    def completion_tokens(self) -> int:
        return sum(c.tokens for c in self.choices.values())

    def reasoning_tokens(self, outputs: Iterable[ChoiceOutput]) -> int | None:
        if not self.counts_reasoning:
            return None
        return sum(c.pipeline.reasoning_tokens(c.state) for c in outputs)

    def final_usage(self) -> UsageInfo:
        return _usage(self.prompt_tokens, self.completion_tokens(), self.reasoning_tokens(self.choices.values()))

    def choice_usage(self, prompt_tokens: int, out: ChoiceOutput) -> UsageInfo:
        """``continuous_usage_stats``: one choice's counts so far."""
        return _usage(prompt_tokens, out.tokens, self.reasoning_tokens([out]))

    def prompt_logprobs_from(self, raw: dict[int, GeneratePromptLogprobs | None],
                             request: ChatCompletionRequest | CompletionRequest | None = None) -> None:
        """The engines' prompt logprobs of the prompts that asked for them, resolved to token text."""
        for prompt_index, entries in raw.items():
            self.prompt_logprobs[prompt_index] = PromptLogprobs(
                entries, self.gens[prompt_index].token_ids, self.config.tokenizer,
                tokens_as_token_ids(request, self.config))

    def finished_choice(self, out: ChoiceOutput, choice: GenerateStreamChoice) -> None:
        """What the engine's last event of a choice carries beyond tokens."""
        if self.weight_versions:
            out.weight_versions = choice.weight_versions

    def last_chunk_fingerprint(self) -> str | None:
        """vllm serve stamps system_fingerprint on a choice's last chunk, or on the usage chunk when there is one."""
        return None if self.include_usage else self.fingerprint

    def usage_chunk(self) -> ChatCompletionStreamResponse | CompletionStreamResponse | None:
        """The stream's usage-only chunk (stream_options.include_usage), in the endpoint's chunk type."""
        if not self.include_usage:
            return None
        return self.stream_response(id=self.response_id, created=self.created, model=self.model, choices=[],
                                    usage=self.final_usage(), system_fingerprint=self.fingerprint)


class ChatResponder(_Responder):
    stream_response = ChatCompletionStreamResponse

    def __init__(self, gen: GenerateRequest, req: ChatCompletionRequest, config: RenderConfig) -> None:
        super().__init__([gen], config, gen.model or config.model_name, gen.request_id or "", gen.stream_options)
        self.req = req
        self.stops = stop_list(req.stop)
        self.forced_tools = forces_a_call(req)
        self.counts_reasoning = config.reasoning_parser is not None
        self.weight_versions = req.return_weight_versions
        self.accumulators: dict[int, MessageAccumulator] = {}
        self.logprobs: dict[int, list[ChatLogprob]] = {}
        self.first_chunk = True
        # (choice index, "content" or "reasoning") -> the pre-encoded chunk around that text, in parts
        self._envelopes: dict[tuple[int, str], list[bytes]] = {}

    def new_choice(self, gen: GenerateRequest, key: int) -> ChoiceOutput:
        pcfg = pipeline_config(self.config, self.req, request_id=gen.request_id or "", choice_index=key)
        return ChoiceOutput(Pipeline(self.config.tokenizer, pcfg), gen.token_ids, self.stops,
                            self.req.include_stop_str_in_output, self.return_token_ids, self.eos_token_id)

    def _logprobs(self, out: ChoiceOutput, choice: GenerateStreamChoice) -> ChatLogprobs | None:
        if choice.logprobs is None or not self.req.logprobs:
            return None
        return resolve_chat_logprobs(choice.logprobs, self.config.tokenizer, out.logprob_context,
                                     tokens_as_token_ids(self.req, self.config))

    # streaming ------------------------------------------------------------------------------------

    def stream_events(self, prompt_index: int, choice: GenerateStreamChoice) -> bytes:
        """The SSE events (``data: ...`` framed, concatenated) for one engine choice event."""
        key = prompt_index * self.n + choice.index
        out = self.choices.get(key)
        if out is None or self.return_token_ids or self.continuous or choice.logprobs is not None:
            return b"".join(map(sse, self.stream_chunks(prompt_index, choice)))
        if out.done:
            return b""
        delta = out.step(choice.token_ids or [], choice.finish_reason, choice.stop_reason)
        if out.done:
            self.all_done = self.finished()
            self.finished_choice(out, choice)
        content, reasoning = delta.content, delta.reasoning
        if out.done or delta.tool_calls or (content is not None and reasoning is not None):
            message = _delta_message(delta, self.config.reasoning_field)
            if not out.done:
                return sse(self._chunk(key, message, out)) if message is not None else b""
            chunk = self._chunk(key, message or DeltaMessage(), out)
            self._ending(chunk, out)
            return sse(chunk)
        # The per-token common case, text on one channel: only the text is encoded; the chunk around it
        # is the bytes the full chunk struct encodes to (tests/test_gateway_sse_encoding.py holds them equal).
        if content is not None:
            text, channel = content, "content"
        elif reasoning is not None:
            text, channel = reasoning, "reasoning"
        else:
            return b""
        parts = self._envelopes.get((key, channel))
        if parts is None:
            parts = self._envelopes[(key, channel)] = _envelope(self, key, channel)
        return _encode(text).join(parts)

    def stream_chunks(self, prompt_index: int, choice: GenerateStreamChoice) -> list[ChatCompletionStreamResponse]:
        key, out, new = self.choice(prompt_index, choice.index)
        if out.done:
            return []
        chunks = []
        if new:
            chunks.append(self._chunk(key, DeltaMessage(role="assistant", content=""), out))
        ids = choice.token_ids or []
        delta = out.step(ids, choice.finish_reason, choice.stop_reason)
        if out.done:
            self.all_done = self.finished()
            self.finished_choice(out, choice)
        logprobs = self._logprobs(out, choice)
        message = _delta_message(delta, self.config.reasoning_field)
        if out.done or message is not None or logprobs is not None:
            chunk = self._chunk(key, message or DeltaMessage(), out, logprobs)
            c = chunk.choices[0]
            if out.done:
                self._ending(chunk, out)
            if self.return_token_ids:
                c.token_ids = list(ids)
            chunks.append(chunk)
        elif self.return_token_ids and ids:
            chunk = self._chunk(key, DeltaMessage(), out)
            chunk.choices[0].token_ids = list(ids)
            chunks.append(chunk)
        return chunks

    def _chunk(self, key: int, delta: DeltaMessage, out: ChoiceOutput, logprobs: ChatLogprobs | None = None
               ) -> ChatCompletionStreamResponse:
        if delta.reasoning is None:  # role and empty deltas: the same null key(s) as every other chunk
            put_reasoning(delta, None, self.config.reasoning_field)
        chunk = ChatCompletionStreamResponse(
            id=self.response_id, created=self.created, model=self.model,
            choices=[ChatCompletionStreamChoice(index=key, delta=delta, logprobs=logprobs)],
        )
        if self.continuous:
            chunk.usage = self.choice_usage(self.prompt_tokens, out)
        if self.first_chunk:
            self.first_chunk = False
            if self.return_token_ids:
                chunk.prompt_token_ids = list(self.gens[0].token_ids)
        return chunk

    def prompt_logprobs_from(self, raw: dict[int, GeneratePromptLogprobs | None],
                             request: ChatCompletionRequest | CompletionRequest | None = None) -> None:
        super().prompt_logprobs_from(raw, self.req)

    def _ending(self, chunk: ChatCompletionStreamResponse, out: ChoiceOutput) -> None:
        c = chunk.choices[0]
        c.finish_reason, c.stop_reason, c.weight_versions = out.finish_reason, out.stop_reason, out.weight_versions
        chunk.system_fingerprint = self.last_chunk_fingerprint()

    # non-streaming --------------------------------------------------------------------------------

    def accumulate(self, prompt_index: int, choice: GenerateStreamChoice) -> None:
        key, out, _ = self.choice(prompt_index, choice.index)
        if out.done:
            return
        if out.pipeline.tool_text is None:
            out.pipeline.tool_text = []  # a whole answer: a call cut off by max_tokens is given back as text
        delta = out.step(choice.token_ids or [], choice.finish_reason, choice.stop_reason)
        if out.done:
            self.finished_choice(out, choice)
        self.accumulators.setdefault(key, MessageAccumulator()).add(delta)
        logprobs = self._logprobs(out, choice)
        if logprobs is not None:
            self.logprobs.setdefault(key, []).extend(logprobs["content"])

    def response(self) -> ChatCompletionResponse:
        choices = []
        for key in sorted(self.choices):
            out = self.choices[key]
            fields = self.accumulators.get(key, MessageAccumulator()).message(self.forced_tools)
            fields = withdraw_cut_call(out.pipeline, fields, out.finish_reason)
            message = chat_message(fields, out.pipeline.config, self.config.reasoning_field)
            logprobs: ChatLogprobs | None = None
            if self.req.logprobs:
                logprobs = {"content": self.logprobs.get(key, []), "refusal": None}
            choices.append(ChatCompletionChoice(index=key, message=message, logprobs=logprobs,
                                                finish_reason=out.finish_reason, stop_reason=out.stop_reason,
                                                token_ids=out.token_ids, weight_versions=out.weight_versions))
        prompt = self.prompt_logprobs.get(0)
        return ChatCompletionResponse(
            id=self.response_id, created=self.created, model=self.model, choices=choices, usage=self.final_usage(),
            system_fingerprint=self.fingerprint,
            prompt_logprobs=prompt.response_entries() if prompt is not None else None,
            prompt_token_ids=list(self.gens[0].token_ids) if self.return_token_ids else None,
        )


class CompletionResponder(_Responder):
    stream_response = CompletionStreamResponse

    def __init__(self, gens: list[GenerateRequest], req: CompletionRequest, config: RenderConfig,
                 response_id: str) -> None:
        super().__init__(gens, config, gens[0].model or config.model_name, response_id, gens[0].stream_options)
        self.req = req
        self.stops = stop_list(req.stop)
        self.weight_versions = req.return_weight_versions
        # echo: each choice starts with its prompt; max_tokens 0 (lm-eval's loglikelihood shape) keeps only that
        self.echo = bool(req.echo)
        self.echo_only = self.echo and req.max_tokens == 0
        self.echoed: set[int] = set()
        self.texts: dict[int, list[str]] = {}
        self.logprobs: dict[int, CompletionLogprobs] = {}
        self.first_of_prompt: set[int] = set()

    def new_choice(self, gen: GenerateRequest, key: int) -> ChoiceOutput:
        pcfg = completion_pipeline_config(self.config, self.req, request_id=gen.request_id or "", choice_index=key)
        return ChoiceOutput(Pipeline(self.config.tokenizer, pcfg), gen.token_ids, self.stops,
                            self.req.include_stop_str_in_output, self.return_token_ids, self.eos_token_id)

    def prompt_logprobs_from(self, raw: dict[int, GeneratePromptLogprobs | None],
                             request: ChatCompletionRequest | CompletionRequest | None = None) -> None:
        super().prompt_logprobs_from(raw, self.req)

    def _logprobs(self, out: ChoiceOutput, choice: GenerateStreamChoice) -> CompletionLogprobs | None:
        if choice.logprobs is None or self.req.logprobs is None:
            return None
        resolved = resolve_completion_logprobs(choice.logprobs, self.config.tokenizer, out.logprob_context,
                                               out.text_offset, tokens_as_token_ids(self.req, self.config))
        if resolved and resolved["tokens"]:
            out.text_offset = resolved["text_offset"][-1] + len(resolved["tokens"][-1])
        return resolved

    def _echo(self, key: int, prompt_index: int, out: ChoiceOutput, text: str, logprobs: CompletionLogprobs | None
              ) -> tuple[str, CompletionLogprobs | None]:
        """The first output of a choice with ``echo``: its prompt's text (and logprobs) before the model's (vLLM's
        rule: the text prompt as sent, a token prompt decoded); with max_tokens 0 the prompt's alone."""
        if not self.echo or key in self.echoed:
            return ("", None) if self.echo_only else (text, logprobs)
        self.echoed.add(key)
        prompt = completion_prompts(self.req.prompt)[prompt_index]
        prompt_text = prompt if isinstance(prompt, str) else self.config.tokenizer.decode(prompt,
                                                                                         skip_special_tokens=False)
        if self.req.logprobs is None:
            return prompt_text + ("" if self.echo_only else text), None
        resolved = self.prompt_logprobs.get(prompt_index)
        head = resolved.echoed(self.req.logprobs) if resolved is not None else None
        if head is None or self.echo_only:
            return prompt_text + ("" if self.echo_only else text), head if self.echo_only else logprobs
        # the model's tokens follow the prompt's: their offsets (these and every later event's) move past it
        shift = head["text_offset"][-1] + len(head["tokens"][-1]) if head["tokens"] else 0
        out.text_offset += shift
        if logprobs is not None:
            extend_completion_logprobs(head, {**logprobs, "text_offset": [o + shift for o in logprobs["text_offset"]]})
        return prompt_text + text, head

    def stream_events(self, prompt_index: int, choice: GenerateStreamChoice) -> bytes:
        return b"".join(map(sse, self.stream_chunks(prompt_index, choice)))

    def stream_chunks(self, prompt_index: int, choice: GenerateStreamChoice) -> list[CompletionStreamResponse]:
        key, out, _ = self.choice(prompt_index, choice.index)
        if out.done:
            return []
        ids = choice.token_ids or []
        delta = out.step(ids, choice.finish_reason, choice.stop_reason)
        if out.done:
            self.all_done = self.finished()
            self.finished_choice(out, choice)
        logprobs = self._logprobs(out, choice)
        text, logprobs = self._echo(key, prompt_index, out, delta.content or "", logprobs)
        if not (text or out.done or logprobs is not None or (self.return_token_ids and ids)):
            return []
        c = CompletionStreamChoice(index=key, text=text, logprobs=logprobs)
        if out.done:
            c.finish_reason, c.stop_reason, c.weight_versions = out.finish_reason, out.stop_reason, out.weight_versions
        if self.return_token_ids:
            c.token_ids = list(ids)
            if key not in self.first_of_prompt:
                self.first_of_prompt.add(key)
                c.prompt_token_ids = list(self.gens[prompt_index].token_ids)
        chunk = CompletionStreamResponse(id=self.response_id, created=self.created, model=self.model, choices=[c])
        if out.done:
            chunk.system_fingerprint = self.last_chunk_fingerprint()
        if self.continuous:
            chunk.usage = self.choice_usage(len(self.gens[prompt_index].token_ids), out)
        return [chunk]

    def accumulate(self, prompt_index: int, choice: GenerateStreamChoice) -> None:
        key, out, _ = self.choice(prompt_index, choice.index)
        if out.done:
            return
        if out.pipeline.tool_text is None:
            out.pipeline.tool_text = []  # a whole answer: a call cut off by max_tokens is given back as text
        delta = out.step(choice.token_ids or [], choice.finish_reason, choice.stop_reason)
        if out.done:
            self.finished_choice(out, choice)
        text, logprobs = self._echo(key, prompt_index, out, delta.content or "", self._logprobs(out, choice))
        if text:
            self.texts.setdefault(key, []).append(text)
        if logprobs is not None:
            acc = self.logprobs.get(key)
            if acc is None:  # the first event's lists, built for it alone, take the rest
                self.logprobs[key] = logprobs
            else:
                extend_completion_logprobs(acc, logprobs)

    def response(self) -> CompletionResponse:
        choices = []
        for key in sorted(self.choices):
            out = self.choices[key]
            prompt_index = key // self.n
            logprobs: CompletionLogprobs | None = None
            if self.req.logprobs is not None:
                logprobs = self.logprobs.get(key, {"text_offset": [], "token_logprobs": [], "tokens": [],
                                                   "top_logprobs": []})
            prompt = self.prompt_logprobs.get(prompt_index)
            choices.append(CompletionChoice(
                index=key, text="".join(self.texts.get(key, [])), logprobs=logprobs, finish_reason=out.finish_reason,
                stop_reason=out.stop_reason, token_ids=out.token_ids,
                prompt_logprobs=prompt.response_entries() if prompt is not None else None,
                prompt_token_ids=list(self.gens[prompt_index].token_ids) if self.return_token_ids else None,
                weight_versions=out.weight_versions,
            ))
        return CompletionResponse(id=self.response_id, created=self.created, model=self.model, choices=choices,
                                  usage=self.final_usage(), system_fingerprint=self.fingerprint)


def coalesce(items: list[tuple[int, GenerateStreamChoice]]) -> list[tuple[int, GenerateStreamChoice]]:
    """Each choice's events as one event (token ids joined in order, the last event's finish). Events
    with logprobs stay apart (their lists are per event), as does anything after a finish."""
    merged: dict[tuple[int, int], int] = {}  # (prompt index, choice index) -> position of its open event
    out: list[tuple[int, GenerateStreamChoice]] = []
    for prompt_index, choice in items:
        key = (prompt_index, choice.index)
        at = merged.get(key)
        if at is not None and choice.logprobs is None:
            prev = out[at][1]
            out[at] = (prompt_index, GenerateStreamChoice(
                index=choice.index, token_ids=(prev.token_ids or []) + (choice.token_ids or []),
                finish_reason=choice.finish_reason, stop_reason=choice.stop_reason,
                weight_versions=choice.weight_versions))
        else:
            out.append((prompt_index, choice))
            at = len(out) - 1
        if choice.finish_reason is None and choice.logprobs is None:
            merged[key] = at
        else:
            merged.pop(key, None)
    return out


def _delta_message(delta: ChoiceDelta, reasoning_field: str) -> DeltaMessage | None:
    return None if delta.is_empty() else delta_message(delta, reasoning_field)



# The chunk around one channel's text, as ChatCompletionStreamResponse encodes it with every other field at its
# default: built once per choice and channel, so a text token costs one string encode instead of a chunk's.
_MARK = "\x00text\x00"


def _envelope(responder: ChatResponder, key: int, channel: str) -> list[bytes]:
    """The SSE event of a delta carrying only ``channel`` text, split where the text goes (twice for
    reasoning under ``--reasoning-field both``): ``encoded_text.join(parts)`` is the event."""
    delta = ChoiceDelta(content=_MARK) if channel == "content" else ChoiceDelta(reasoning=_MARK)
    message = delta_message(delta, responder.config.reasoning_field)
    chunk = ChatCompletionStreamResponse(id=responder.response_id, created=responder.created, model=responder.model,
                                         choices=[ChatCompletionStreamChoice(index=key, delta=message)])
    return sse(chunk).split(_encode(_MARK))

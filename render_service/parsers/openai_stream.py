"""OpenAI ``chat.completion.chunk`` stream from engine token events, one pipeline per choice.

For the gateway (engine SSE in, OpenAI SSE out), following parser-semantics.md §3:

* a role chunk per choice first (``{"role": "assistant", "content": ""}``);
* delta chunks with ``content`` / ``reasoning`` / ``tool_calls``; a step whose parsers produced nothing
  sends no chunk (unless logprobs must be delivered);
* the finishing step's delta and ``finish_reason`` in one chunk, with ``stop_reason``;
* with ``stream_options.include_usage`` a final usage chunk (``choices: []``), and with
  ``continuous_usage_stats`` cumulative usage on every chunk;
* n > 1: each chunk carries one choice, indexed; every choice has its own pipeline, role and finish.

The reasoning field is ``reasoning`` (vLLM >= 0.11); ``reasoning_field="reasoning_content"`` switches to
the older name for clients that still read it, and ``"both"`` sends both.
"""

from __future__ import annotations

from typing import Any, Callable, Literal

from render_service.parsers.pipeline import ChoiceDelta, Pipeline, PipelineConfig, PipelineState
from render_service.render import reasoning_keys

ReasoningField = Literal["reasoning", "reasoning_content", "both"]


class ChatStreamAssembler:
    """Feed engine steps per choice; get OpenAI chunk dicts back."""

    def __init__(
        self,
        tokenizer: Any,
        config_for_choice: Callable[[int], PipelineConfig],
        *,
        response_id: str,
        model: str,
        created: int,
        prompt_tokens: int = 0,
        prompt_token_ids: list[int] | None = None,
        reasoning_open_at_start: bool | None = None,
        include_usage: bool = False,
        continuous_usage_stats: bool = False,
        reasoning_field: ReasoningField = "reasoning",
    ) -> None:
        self.tokenizer = tokenizer
        self.config_for_choice = config_for_choice
        self.response_id = response_id
        self.model = model
        self.created = created
        self.prompt_tokens = prompt_tokens
        self.prompt_token_ids = prompt_token_ids
        self.reasoning_open_at_start = reasoning_open_at_start
        self.include_usage = include_usage
        self.continuous = include_usage and continuous_usage_stats
        self.reasoning_field = reasoning_field
        self._choices: dict[int, tuple[Pipeline, PipelineState]] = {}
        self._completion_tokens: dict[int, int] = {}

    # ------------------------------------------------------------------------------------------------

    def _choice(self, index: int) -> tuple[Pipeline, PipelineState, list[dict[str, Any]]]:
        """The choice's pipeline; the role chunk goes out the first time a choice is seen."""
        out: list[dict[str, Any]] = []
        entry = self._choices.get(index)
        if entry is None:
            pipeline = Pipeline(self.tokenizer, self.config_for_choice(index))
            state = pipeline.initial_state(self.prompt_token_ids, self.reasoning_open_at_start)
            state.role_sent = True
            entry = self._choices[index] = (pipeline, state)
            self._completion_tokens[index] = 0
            out.append(self._chunk(index, {"role": "assistant", "content": ""}))
        return entry[0], entry[1], out

    def step(
        self,
        index: int,
        token_ids: list[int],
        finish_reason: str | None = None,
        stop_reason: int | str | None = None,
        logprobs: Any = None,
    ) -> list[dict[str, Any]]:
        """One engine step of choice ``index``: zero or more chunks."""
        pipeline, state, out = self._choice(index)
        self._completion_tokens[index] += len(token_ids)
        delta = pipeline.feed(state, token_ids) if token_ids else ChoiceDelta()
        if finish_reason is not None:
            tail = pipeline.finish(state)
            delta = _merge(delta, tail)
        body = self._delta_body(delta)
        if finish_reason is not None:
            chunk = self._chunk(index, body, pipeline.finish_reason(state, finish_reason), logprobs)
            chunk["choices"][0]["stop_reason"] = stop_reason
            out.append(chunk)
        elif body or logprobs is not None:
            out.append(self._chunk(index, body, None, logprobs))
        return out

    def usage_chunk(self) -> dict[str, Any] | None:
        """The final ``choices: []`` chunk when include_usage is on."""
        if not self.include_usage:
            return None
        return {"id": self.response_id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": [], "usage": self._usage(None)}

    # ------------------------------------------------------------------------------------------------

    def _delta_body(self, delta: ChoiceDelta) -> dict[str, Any]:
        body: dict[str, Any] = {}
        if delta.reasoning is not None:
            for key in reasoning_keys(self.reasoning_field):
                body[key] = delta.reasoning
        if delta.content is not None:
            body["content"] = delta.content
        if delta.tool_calls:
            body["tool_calls"] = delta.tool_calls
        return body

    def _usage(self, index: int | None) -> dict[str, int]:
        completion = self._completion_tokens[index] if index is not None else sum(self._completion_tokens.values())
        return {"prompt_tokens": self.prompt_tokens, "total_tokens": self.prompt_tokens + completion,
                "completion_tokens": completion}

    def _chunk(self, index: int, delta: dict[str, Any], finish_reason: str | None = None,
               logprobs: Any = None) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.response_id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
        }
        if self.continuous:
            chunk["usage"] = self._usage(index)
        return chunk


def _merge(a: ChoiceDelta, b: ChoiceDelta) -> ChoiceDelta:
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


merge_deltas = _merge

"""Responses requests -> the equivalent chat request -> ``render_chat``: one render path for every API.

The mapping is what OpenAI's Responses API means by each field (and what vLLM's ``/v1/responses`` does):
``instructions`` become the system message, input items become chat messages (consecutive reasoning, assistant
message and ``function_call`` items fold into one assistant turn; ``function_call_output`` becomes a tool
message), function tools and ``tool_choice`` become chat's, ``text.format`` becomes ``response_format``.
Anything the render tier cannot honour (non-function tools, files, background mode) is a 400 in OpenAI's
error shape. ``previous_response_id`` is resolved by the gateway (its store) before this runs; the stateless
``/v1/responses/render`` refuses it, as upstream does.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import msgspec

from render_service.apis.converted_memo import ConvertedItems
from render_service.apis.errors import coded
from render_service.apis.responses_protocol import ResponsesRequest
from render_service.apis.text_logprobs import wants_logprobs
from render_service.derender.logprobs import MAX_TOP_LOGPROBS
from render_service.harmony.render import REASONING_EFFORTS
from render_service.http.errors import ApiError, bad_request
from render_service.render.render import render_chat, requested_id
from render_service.render.render_config import RenderConfig
from render_service.render.response_format import json_schema_format
from render_service.wire.message_memo import KeptEntry, MemoEntry, MemoMessages
from render_service.wire.protocol import ChatCompletionRequest, GenerateRequest, StreamOptions

TEXT_PART_TYPES = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
MESSAGE_ROLES = ("user", "assistant", "system", "developer")


def new_response_id(given: str | None = None) -> str:
    """``resp_<hex>`` (vLLM: ``resp_`` + random_uuid()); a caller's id is kept as it is."""
    return given if given else f"resp_{os.urandom(16).hex()}"


def _parts(content: Any, where: str, images: bool = False) -> list[str | dict[str, Any]]:
    """The text of a content value (a string, or a list of text parts) and, with ``images`` (a user message),
    its ``input_image`` parts in place; anything else is refused."""
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", where)
    out: list[str | dict[str, Any]] = []
    for i, part in enumerate(content):
        if not isinstance(part, dict):
            raise bad_request(f"{where}[{i}] must be an object", where)
        kind = part.get("type")
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            out.append(part["refusal"])
        elif kind in TEXT_PART_TYPES and isinstance(part.get("text"), str):
            out.append(part["text"])
        elif kind == "input_image" and images:
            out.append(part)  # kept as it is: the image path reads it (multimodal.sources)
        elif kind == "input_image":
            raise bad_request(f"{where}[{i}]: input_image is only supported in a user message's content", where)
        elif kind in ("input_file", "input_audio"):
            raise bad_request(f"{where}[{i}]: {kind} is not supported", where)
        else:
            raise bad_request(f"{where}[{i}] has unknown content part type {kind!r}", where)
    return out


def _texts(content: Any, where: str) -> list[str]:
    return [text for text in _parts(content, where) if isinstance(text, str)]


def _content(content: Any, where: str, images: bool = False) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    parts = _parts(content, where, images)
    if any(isinstance(part, dict) for part in parts):
        return [part if isinstance(part, dict) else {"type": "text", "text": part} for part in parts]
    texts = [part for part in parts if isinstance(part, str)]
    return texts[0] if len(texts) == 1 else [{"type": "text", "text": t} for t in texts]


class _Turns:
    """Chat messages being built; assistant-side items fold into the open assistant turn."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.assistant: dict[str, Any] | None = None
        self.call_ids: set[str] = set()

    def _turn(self, fresh: bool) -> dict[str, Any]:
        if self.assistant is None or fresh:
            self.flush()
            self.assistant = {"role": "assistant", "content": ""}
        return self.assistant

    def flush(self) -> None:
        if self.assistant is not None:
            self.messages.append(self.assistant)
            self.assistant = None

    def reasoning(self, text: str) -> None:
        turn = self.assistant
        fresh = turn is None or bool(turn["content"]) or "tool_calls" in turn or "reasoning" in turn
        self._turn(fresh)["reasoning"] = text

    def assistant_text(self, content: str | list[dict[str, Any]]) -> None:
        turn = self.assistant
        fresh = turn is None or bool(turn["content"]) or "tool_calls" in turn
        self._turn(fresh)["content"] = content

    def call(self, call_id: str, name: str, arguments: str) -> None:
        self._turn(False).setdefault("tool_calls", []).append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        self.call_ids.add(call_id)

    def other(self, message: dict[str, Any]) -> None:
        self.flush()
        self.messages.append(message)

    def add(self, item: Any, i: int) -> None:
        """Input item ``i``; 400 for an unknown item or an orphan tool output."""
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise bad_request(f"{where}.role must be one of {', '.join(MESSAGE_ROLES)}, got {role!r}", where)
            content = _content(item.get("content"), f"{where}.content", images=role == "user")
            if role == "assistant":
                self.assistant_text(content)
            else:
                self.other({"role": role, "content": content})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            text = "".join(_texts(parts, f"{where}.content"))
            if text or not item.get("encrypted_content"):
                self.reasoning(text)
            # only encrypted content (another provider's, sent back by agents such as Codex): nothing this tier
            # can read, so no turn (an empty assistant turn would change what the model sees)
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "")
            if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(arguments, str):
                raise bad_request(f"{where}: a function_call needs string call_id, name and arguments", where)
            self.call(call_id, name, arguments)
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or call_id not in self.call_ids:
                raise bad_request(f"No tool call found for function call output with call_id {call_id!r}.", where)
            output = item.get("output")
            text = "".join(_texts(output, f"{where}.output")) if not isinstance(output, str) else output
            self.other({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            raise bad_request(f"{where} has unknown input item type {kind!r}", where)


def input_messages(items: Any, known_call_ids: set[str] | None = None) -> list[dict[str, Any]]:
    """Responses input (a string or items) as chat messages; 400 for unknown items or orphan tool outputs."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise bad_request("input must be a string or a list of input items", "input")
    turns = _Turns()
    if known_call_ids:
        turns.call_ids |= known_call_ids
    for i, item in enumerate(items):
        turns.add(item, i)
    turns.flush()
    return turns.messages


def remembered_input_messages(items: ConvertedItems, instructions: str | None) -> MemoMessages | None:
    """``input_messages``' answer (with the instructions' system message first) from the memo: the chat messages
    of the items a filed body shares, up to the last item after which no assistant turn was open, as that body's
    render converted them; the others converted now. None where the plain conversion must answer (an item that
    does not convert)."""
    system = items.system_entry(instructions) if instructions else None
    entries = items.entries
    chat: list[MemoEntry] = []
    ends: list[int] = []  # after each item: how many chat messages there are, -1 where an assistant turn is open
    turns = _Turns()
    start = 0
    shared = None
    earlier = items.earlier_conversion(system)
    if earlier is not None:
        conversion, common = earlier
        start = common
        while start and conversion.ends[start - 1] < 0:
            start -= 1
        if start:  # (the items up to there as converted before, the call ids they hold known)
            shared = (conversion.chat, conversion.ends[start - 1])
            chat += conversion.chat.entries[:shared[1]]
            ends += conversion.ends[:start]
            turns.call_ids |= conversion.known if start == len(conversion.ends) else \
                {call["id"] for entry in chat for call in entry.value.get("tool_calls") or ()}
    if shared is None and system is not None:
        chat.append(system)
    try:
        for i in range(start, len(entries)):
            turns.add(entries[i].value, i)
            if turns.assistant is None:
                chat += map(_entry, turns.messages)
                turns.messages.clear()
                ends.append(len(chat))
            else:
                ends.append(-1)
        turns.flush()
    except ApiError:
        return None
    chat += map(_entry, turns.messages)
    return items.file_conversion(chat, ends, turns.call_ids, system, shared)


def _entry(message: dict[str, Any]) -> MemoEntry:
    return KeptEntry(message)  # (in no memo: nothing would take back a tojson text it kept)


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad_request(f"tools[{i}]: only function tools are supported, not {kind!r}", "tools")
        if not isinstance(tool.get("name"), str):
            raise bad_request(f"tools[{i}].name must be a string", "tools")
        fn = {"name": tool["name"], "description": tool.get("description"), "parameters": tool.get("parameters")}
        if isinstance(tool.get("strict"), bool):
            fn["strict"] = tool["strict"]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}",
                      "tool_choice")


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if not fmt:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("text.format must be an object", "text")
    kind = fmt.get("type")
    if kind == "json_schema":
        schema = json_schema_format(fmt, "text.format", "text")
        return {"type": "json_schema", "json_schema": {"name": fmt["name"], "schema": schema}}
    if kind in ("json_object", "text"):
        return {"type": kind}
    raise bad_request(f"Unsupported text.format type {kind!r}", "text")


def _check(req: ResponsesRequest) -> None:
    if req.background:
        raise bad_request("background responses are not supported", "background")
    if req.prompt is not None:
        raise bad_request("prompt templates are not supported", "prompt")
    if req.conversation is not None:
        raise bad_request("conversations are not supported; use previous_response_id", "conversation")
    if req.input is None:
        raise bad_request("input is required", "input")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise bad_request("max_output_tokens must be at least 1", "max_output_tokens")
    if req.truncation not in (None, "auto", "disabled"):
        raise bad_request("truncation must be 'auto' or 'disabled'", "truncation")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", "top_logprobs")


def to_chat(req: ResponsesRequest, config: RenderConfig, history: list[dict[str, Any]] | None = None
            ) -> ChatCompletionRequest:
    """The chat request a Responses request means (``history``: the stored conversation it continues)."""
    _check(req)
    messages: list[dict[str, Any]] | None = None
    if history is None and type(req.input) is ConvertedItems:
        messages = remembered_input_messages(req.input, req.instructions)
    if messages is None:
        known = {c["id"] for m in history or () for c in m.get("tool_calls") or () if isinstance(c, dict)}
        messages = [*(history or ()), *input_messages(req.input, known)]
        if req.instructions:
            messages.insert(0, {"role": "system", "content": req.instructions})
    kwargs = dict(req.chat_template_kwargs or {})
    effort = (req.reasoning or {}).get("effort")
    if effort == "none" and config.reasoning_parser_cls is not None and not config.harmony:
        kwargs.setdefault(config.reasoning_parser_cls.thinking_kwarg, False)  # no thinking asked for
        effort = None
    if config.harmony and effort is not None and not (isinstance(effort, str) and effort in REASONING_EFFORTS):
        raise bad_request(f"reasoning.effort must be one of {', '.join(REASONING_EFFORTS)} for gpt-oss (it always "
                          f"reasons), not {effort!r}", "reasoning.effort")
    return ChatCompletionRequest(
        messages=messages,
        model=req.model,
        tools=chat_tools(req.tools),
        tool_choice=chat_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
        max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        repetition_penalty=req.repetition_penalty,
        seed=req.seed,
        ignore_eos=req.ignore_eos,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        include_stop_str_in_output=req.include_stop_str_in_output,
        # message.output_text.logprobs: the engine's logprobs with top_logprobs alternatives (OpenAI's semantics:
        # top_logprobs alone asks for nothing)
        logprobs=wants_logprobs(req.include),
        top_logprobs=(req.top_logprobs or 0) if wants_logprobs(req.include) else 0,
        response_format=response_format(req.text),
        stream=bool(req.stream),
        stream_options=StreamOptions(include_usage=True) if req.stream else None,
        chat_template_kwargs=kwargs or None,
        reasoning_effort=effort if isinstance(effort, str) else None,
        truncate_prompt_tokens=-1 if req.truncation == "auto" else None,
        cache_salt=req.cache_salt,
        priority=req.priority,
        kv_transfer_params=req.kv_transfer_params,
        user=req.user,
        previous_turn=req.previous_turn,
        return_assistant_tokens_mask=req.return_assistant_tokens_mask,
        return_message_indices=req.return_message_indices,
        return_prompt_ref=req.return_prompt_ref,
    )


def check_stateless(req: ResponsesRequest) -> None:
    if req.previous_response_id is not None:
        raise coded(bad_request("previous_response_id is not supported by the stateless render endpoint; inline "
                                "the conversation's items in input", "previous_response_id"),
                    "unsupported_parameter")


def render_responses(req: ResponsesRequest, config: RenderConfig, *, request_id: str | None = None,
                     history: list[dict[str, Any]] | None = None, stateless: bool = True,
                     prepared: ChatCompletionRequest | None = None,
                     expand_prompt: Callable[[list[int]], list[int]] | None = None, client: str = "",
                     ids_view: bool = False,
                     ) -> tuple[GenerateRequest, ChatCompletionRequest]:
    """The engine request for a Responses request and the chat request it was rendered as.

    ``stateless`` (/v1/responses/render): ``previous_response_id`` is refused, as upstream's render does.
    ``prepared``: ``to_chat``'s answer, already made (the image path rewrites its messages); ``expand_prompt``:
    as ``render_chat``'s; ``client`` and ``ids_view``: as ``render_chat``'s."""
    if stateless:
        check_stateless(req)
    chat = prepared or to_chat(req, config, history)
    gen = render_chat(chat, config, expand_prompt=expand_prompt, ids_view=ids_view, client=client)
    gen = msgspec.structs.replace(gen, request_id=new_response_id(requested_id(request_id, req.request_id)),
                                  kv_transfer_params=req.kv_transfer_params)
    return gen, chat

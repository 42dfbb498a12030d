"""Anthropic Messages requests -> the equivalent chat request -> ``render_chat``.

The content-block mapping is vLLM's (``/v1/messages`` and ``/v1/messages/render``), so prompts render to the same
token IDs as upstream's: system text blocks joined, ``tool_use`` blocks as assistant tool calls, ``tool_result``
blocks as tool messages ahead of the user's remaining text, ``thinking`` blocks as the assistant's reasoning.
Two places follow Anthropic's semantics instead of upstream's (docs/apis.md):

* an assistant message last in ``messages`` is a **prefill**: the model continues it (the chat request sets
  ``continue_final_message``), where upstream closes that turn and opens a new one;
* ``thinking`` switches the template's thinking (absent or ``disabled``: off; ``enabled``/``adaptive``: on) and
  ``budget_tokens`` is a real budget: it rides to the gateway, which ends reasoning when it is spent
  (``gateway/thinking_budget.py``); upstream only records it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from render_service.apis.converted_memo import ConvertedItems
from render_service.apis.message_memo_anthropic import MemoAnthropicTools
from render_service.apis.messages_protocol import CountTokensRequest, MessagesRequest
from render_service.http.errors import ApiError, bad_request
from render_service.render.render import render_chat, render_chat_prompt, requested_id
from render_service.render.render_config import RenderConfig
from render_service.wire.message_memo import MemoEntry, MemoMessages, MemoTools
from render_service.wire.protocol import ChatCompletionRequest, GenerateRequest, StreamOptions

BILLING_HEADER = "x-anthropic-billing-header"


def new_message_id(given: str | None = None) -> str:
    return given if given else f"msg_{os.urandom(12).hex()}"


SYSTEM_SEPARATOR = "\n\n"


def _system_text(system: Any, messages: Sequence[Any]) -> str:
    """Top-level system (a string or text blocks) and any system-role messages, joined as vLLM joins them."""
    parts: list[str] = []
    if isinstance(system, str):
        parts.append(system)
    elif isinstance(system, list):
        for i, block in enumerate(system):
            if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                raise bad_request(f"system[{i}] must be a text block", "system")
            if not block["text"].startswith(BILLING_HEADER):  # per-request hash: would defeat prefix caching
                parts.append(block["text"])
    elif system is not None:
        raise bad_request("system must be a string or a list of text blocks", "system")
    prompt = "".join(parts)
    for message in messages:
        if isinstance(message, dict) and message.get("role") == "system":
            texts = _block_texts(message.get("content"), "messages")
            text = "".join(t for t in texts if not t.startswith(BILLING_HEADER))
            # a system message from the middle of the conversation (a per-turn reminder) is its own paragraph:
            # vLLM glues it to the prompt's last word
            prompt = f"{prompt}{SYSTEM_SEPARATOR}{text}" if prompt and text else prompt + text
    return prompt


def _block_texts(content: Any, where: str) -> list[str]:
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise bad_request(f"{where}: content must be a string or a list of content blocks", where)
    out = []
    for i, block in enumerate(content):
        if not isinstance(block, dict):
            raise bad_request(f"{where}[{i}] must be a content block object", where)
        if block.get("type") == "text" and isinstance(block.get("text"), str):
            out.append(block["text"])
        elif block.get("type") in ("image", "document"):
            raise bad_request(f"{where}[{i}]: {block['type']} blocks are only supported in a user message's content",
                              where)
        else:
            raise bad_request(f"{where}[{i}] must be a text block", where)
    return out


def _tool_result(block: dict[str, Any], where: str, known: set[str] | None, needs: list[str]) -> dict[str, Any]:
    tool_use_id = block.get("tool_use_id")
    if not isinstance(tool_use_id, str) or (known is not None and tool_use_id not in known):
        raise bad_request(f"{where}: tool_result block(s) provided without a matching tool_use block "
                          f"(tool_use_id {tool_use_id!r})", where)
    needs.append(tool_use_id)
    content = block.get("content")
    text = "" if content is None else "\n".join(_block_texts(content, f"{where}.content"))
    return {"role": "tool", "tool_call_id": tool_use_id, "content": text}


def chat_messages(req: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    """The chat messages a Messages request means (vLLM's conversion, checked)."""
    if not isinstance(req.messages, list) or not req.messages:
        raise bad_request("messages: at least one message is required", "messages")
    if type(req.messages) is ConvertedItems:
        remembered = remembered_chat_messages(req.messages, req.system)
        if remembered is not None:
            return remembered
    out: list[dict[str, Any]] = []
    system = _system_text(req.system, req.messages)
    if system:
        out.append({"role": "system", "content": system})
    known: set[str] = set()
    for m, message in enumerate(req.messages):
        out += message_to_chat(message, m, known, [])
    return out


def remembered_chat_messages(messages: ConvertedItems, system: Any) -> MemoMessages | None:
    """``chat_messages``' answer from the memo: each message as converted the first time it was seen (converted
    now where it was not), as memo entries. None where the plain conversion must answer: a message that does not
    convert or has the system role, a tool_result whose tool_use is not in a message before it."""
    chat: list[MemoEntry] = []
    ends: list[int] = []  # how many chat messages there are after each message
    known: set[str] = set()
    start = 0
    shared = None
    entries = messages.entries
    try:
        text = _system_text(system, ())
        system_entry = messages.system_entry(text) if text else None
        earlier = messages.earlier_conversion(system_entry)
        if earlier is not None:  # the messages a filed body shares: as its render converted and checked them
            conversion, start = earlier
            shared = (conversion.chat, conversion.ends[start - 1])
            chat += conversion.chat.entries[:shared[1]]
            ends += conversion.ends[:start]
            known.update(conversion.known if start == len(conversion.ends) else
                         (ids for entry in entries[:start] for ids in entry.adds))
        elif system_entry is not None:
            chat.append(system_entry)
        for m in range(start, len(entries)):
            entry = entries[m]
            if entry.chat is None:
                value = entry.value
                if not isinstance(value, dict) or value.get("role") == "system":
                    return None
                needs: list[str] = []
                entry.converted(message_to_chat(value, m, None, needs), needs)
            assert entry.chat is not None
            if not entry.needs <= known:
                return None
            if entry.adds:
                known |= entry.adds
            chat += entry.chat
            ends.append(len(chat))
    except ApiError:
        return None
    return messages.file_conversion(chat, ends, known, system_entry, shared)


def message_to_chat(message: Any, m: int, known: set[str] | None, needs: list[str]) -> list[dict[str, Any]]:
    """Message ``m``'s chat messages (none for a system message: ``_system_text`` takes those). ``known``: the
    tool_use ids of the messages before it (its own are added); None: not checked, every tool_result's id listed
    in ``needs`` instead (the message converted once for any place, message_memo_anthropic.py)."""
    where = f"messages[{m}]"
    if not isinstance(message, dict):
        raise bad_request(f"{where} must be an object", where)
    role = message.get("role")
    if role == "system":
        return []
    if role not in ("user", "assistant"):
        raise bad_request(f"{where}.role must be 'user' or 'assistant', got {role!r}", where)
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content blocks", where)
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    parts: list[dict[str, Any]] = []  # text and image parts in order, for a message that carries images
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for b, block in enumerate(content):
        at = f"{where}.content[{b}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            if block["text"]:
                texts.append(block["text"])
                parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and role == "user":
            parts.append(block)  # kept as it is: the image path reads its source (multimodal.sources)
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
                    or not isinstance(block.get("input", {}), dict):
                raise bad_request(f"{at}: tool_use needs a string id and name and an object input", at)
            if known is not None:
                known.add(block["id"])
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input") or {})}})
        elif kind == "tool_result" and role == "user":
            out.append(_tool_result(block, at, known, needs))
        elif kind == "thinking" and role == "assistant" and isinstance(block.get("thinking"), str):
            reasoning.append(block["thinking"])
        elif kind == "redacted_thinking" and role == "assistant":
            pass  # opaque by design: nothing to render
        elif kind == "image":
            raise bad_request(f"{at}: image blocks are only supported in user messages", at)
        elif kind == "document":
            raise bad_request(f"{at}: document blocks are not supported", at)
        else:
            raise bad_request(f"{at}: content block type {kind!r} is not valid in a {role} message", at)
    msg: dict[str, Any] = {"role": role}
    if reasoning:
        msg["reasoning"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    if len(parts) > len(texts):
        msg["content"] = parts
    elif texts:
        msg["content"] = texts[0] if len(texts) == 1 else [{"type": "text", "text": t} for t in texts]
    elif not calls and not reasoning:
        return out  # only tool results or nothing: as vLLM, no empty message
    out.append(msg)
    return out


def thinking_switch(req: MessagesRequest | CountTokensRequest) -> tuple[bool, int | None]:
    """(thinking on, its token budget). Anthropic's semantics: thinking is opt-in."""
    thinking = req.thinking
    if thinking is None:
        return False, None
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind == "disabled":
        return False, None
    if kind == "adaptive":
        return True, None
    if kind != "enabled":
        raise bad_request("thinking.type must be 'enabled', 'disabled' or 'adaptive'", "thinking")
    budget = thinking.get("budget_tokens")
    if type(budget) is not int or budget < 1:
        raise bad_request("thinking.budget_tokens must be a positive integer", "thinking.budget_tokens")
    max_tokens = getattr(req, "max_tokens", None)
    if max_tokens is not None and budget >= max_tokens:
        raise bad_request(f"`max_tokens` must be greater than `thinking.budget_tokens` ({budget} >= {max_tokens})",
                          "thinking.budget_tokens")
    return True, budget


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    if type(tools) is MemoAnthropicTools:  # converted once per distinct tools array (a 400 is not kept)
        entry = tools.entry
        if entry.chat is None:
            converted = chat_tools(list(tools))
            assert converted is not None  # (the list is not empty)
            entry.converted(converted)
        assert entry.chat is not None
        return MemoTools(entry.chat[0])
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad_request(f"tools[{i}]: only client tools (name, input_schema) are supported, not {kind!r}",
                              "tools")
        if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
            raise bad_request(f"tools[{i}] needs a string name and an object input_schema", "tools")
        schema = dict(tool["input_schema"])
        schema.setdefault("type", "object")
        out.append({"type": "function", "function": {
            "name": tool["name"], "description": tool.get("description"), "parameters": schema}})
    return out


def chat_tool_choice(choice: dict[str, Any] | None, tools: list[Any] | None) -> tuple[Any, bool]:
    """(chat tool_choice, parallel tool calls)."""
    if choice is None:
        return ("auto" if tools else None), True
    if not isinstance(choice, dict):
        raise bad_request("tool_choice must be an object", "tool_choice")
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise bad_request("tool_choice.type must be 'auto', 'any', 'tool' (with a name) or 'none'", "tool_choice")


def shows_thinking(thinking: bool, config: RenderConfig) -> bool:
    """Whether thinking blocks are output. gpt-oss always reasons (Harmony has no switch): with thinking off its
    analysis is generated but not shown, as Anthropic's API shows no thinking unless asked."""
    return thinking or not config.harmony


def _template_kwargs(req: MessagesRequest | CountTokensRequest, config: RenderConfig, thinking: bool
                     ) -> dict[str, Any] | None:
    kwargs = dict(req.chat_template_kwargs or {})
    cls = config.reasoning_parser_cls
    if cls is not None and not config.harmony:
        kwargs.setdefault(cls.thinking_kwarg, thinking)
    return kwargs or None


def _prefill(messages: list[dict[str, Any]]) -> bool:
    """An assistant message last is a prefill to continue (Anthropic's semantics)."""
    last = messages[-1]
    if last["role"] != "assistant":
        return False
    if last.get("tool_calls") or not last.get("content"):
        raise bad_request("the final assistant message must end with text to be continued", "messages")
    content = last["content"]
    text = content if isinstance(content, str) else content[-1]["text"]
    if text != text.rstrip():
        raise bad_request("final assistant content cannot end with trailing whitespace", "messages")
    return True


def to_chat(req: MessagesRequest, config: RenderConfig) -> tuple[ChatCompletionRequest, int | None]:
    """(the chat request, the thinking budget)."""
    if req.max_tokens is None:
        raise bad_request("max_tokens: Field required", "max_tokens")
    if req.max_tokens < 1:
        raise bad_request("max_tokens must be at least 1", "max_tokens")
    thinking, budget = thinking_switch(req)
    messages = chat_messages(req)
    prefill = _prefill(messages)
    choice, parallel = chat_tool_choice(req.tool_choice, req.tools)
    response_format = None
    fmt = (req.output_config or {}).get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
        response_format = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    effort = (req.output_config or {}).get("effort")
    chat = ChatCompletionRequest(
        messages=messages,
        model=req.model,
        tools=chat_tools(req.tools),
        tool_choice=choice,
        parallel_tool_calls=parallel,
        max_tokens=req.max_tokens,
        stop=list(req.stop_sequences) if req.stop_sequences else None,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        ignore_eos=req.ignore_eos,
        response_format=response_format,
        stream=bool(req.stream),
        stream_options=StreamOptions(include_usage=True) if req.stream else None,
        chat_template_kwargs=_template_kwargs(req, config, thinking),
        reasoning_effort=effort if isinstance(effort, str) else None,
        add_generation_prompt=not prefill,
        continue_final_message=prefill,
        kv_transfer_params=req.kv_transfer_params,
        include_reasoning=shows_thinking(thinking, config),
        previous_turn=req.previous_turn,
        return_assistant_tokens_mask=req.return_assistant_tokens_mask,
        return_message_indices=req.return_message_indices,
        return_prompt_ref=req.return_prompt_ref,
    )
    return chat, budget


def render_messages(req: MessagesRequest, config: RenderConfig, *, request_id: str | None = None,
                    prepared: tuple[ChatCompletionRequest, int | None] | None = None,
                    expand_prompt: Callable[[list[int]], list[int]] | None = None, client: str = "",
                    ids_view: bool = False,
                    ) -> tuple[GenerateRequest, ChatCompletionRequest]:
    """The engine request (``sampling_params.thinking_token_budget`` set from the budget) and its chat request.
    ``prepared``: ``to_chat``'s answer, already made (the image path rewrites its messages); ``expand_prompt``:
    as ``render_chat``'s; ``client`` and ``ids_view``: as ``render_chat``'s."""
    chat, budget = prepared or to_chat(req, config)
    gen = render_chat(chat, config, expand_prompt=expand_prompt, ids_view=ids_view, client=client)
    params = gen.sampling_params
    if budget is not None:
        params = msgspec.structs.replace(params, thinking_token_budget=budget)
    gen = msgspec.structs.replace(gen, request_id=new_message_id(requested_id(request_id, req.request_id)),
                                  sampling_params=params, kv_transfer_params=req.kv_transfer_params)
    return gen, chat


def count_tokens(req: CountTokensRequest, config: RenderConfig, *, prepared: ChatCompletionRequest | None = None,
                 expand_prompt: Callable[[list[int]], list[int]] | None = None) -> int:
    """The prompt's token count, rendered exactly as a Messages request with these fields would be.
    ``prepared``: ``count_chat``'s answer, already made (the image path rewrites its messages); ``expand_prompt``:
    as ``render_chat``'s (each image's placeholder run)."""
    ids, _ = render_chat_prompt(prepared or count_chat(req, config), config)
    return len(expand_prompt(list(ids)) if expand_prompt is not None else ids)


def count_chat(req: CountTokensRequest, config: RenderConfig) -> ChatCompletionRequest:
    """The chat request count_tokens renders (a Messages request's, without its sampling fields)."""
    thinking, _ = thinking_switch(req)
    messages = chat_messages(req)
    prefill = messages[-1]["role"] == "assistant" and _prefill(messages)
    choice, parallel = chat_tool_choice(req.tool_choice, req.tools)
    return ChatCompletionRequest(
        messages=messages, model=req.model, tools=chat_tools(req.tools), tool_choice=choice,
        parallel_tool_calls=parallel, chat_template_kwargs=_template_kwargs(req, config, thinking),
        add_generation_prompt=not prefill, continue_final_message=prefill,
    )

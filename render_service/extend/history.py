"""A turn that sends only its new messages: the conversation is the messages its ``prompt_ref``'s render was made
from, kept with the reference, followed by the request's (``previous_turn.messages: "new"``).

An agent's request otherwise resends the whole conversation every turn, and the render server reads all of it (a
212k-token conversation is about 0.5 MB of JSON to scan and compare). Here the request holds the sampled
assistant turn and what follows it; the earlier messages are the very objects the previous render used, so the
template's loop record (templates/loop_resume.py) and their prepared forms (templates/chat_messages.py) are found
as when the whole body is sent and its head matches a stored body, and the turn costs what it adds.
"""

from __future__ import annotations

from typing import Any

import msgspec

from render_service.extend.chat import previous_prompt
from render_service.extend.prompt_refs import ChatHistory, StoredPrompt
from render_service.http.errors import bad_request
from render_service.render.render_config import RenderConfig
from render_service.wire.body_prefix_store import StoredBody
from render_service.wire.message_memo import KeptEntry, MemoMessages, entry_counts
from render_service.wire.protocol import ChatCompletionRequest

_PARAM = "previous_turn.messages"


def kept_history(messages: list[Any]) -> ChatHistory:
    """What a prompt reference keeps of the messages its render was made from: the values, and where they came
    through the message memo, the body store's filing of them without the body (the body store's own tuples where
    it filed the body, else copied once)."""
    if type(messages) is not MemoMessages:
        return ChatHistory(tuple(messages))
    filed = messages.filed
    if filed is not None:
        return ChatHistory(filed.values, filed._replace(body=b"", starts=(), ends=()))
    values = tuple(messages)
    return ChatHistory(values, _unfiled(values, tuple(messages.entries)))


def _unfiled(values: tuple[Any, ...], entries: tuple[Any, ...]) -> StoredBody:
    """Messages and their entries as the body store files a body, for messages no body filed (no body, no prepared
    forms yet, their tool calls and image messages counted)."""
    return StoredBody(b"", (), (), entries, None, values, *entry_counts(entries))


def with_history(req: ChatCompletionRequest, config: RenderConfig, client: str
                 ) -> tuple[ChatCompletionRequest, StoredPrompt]:
    """The request with its conversation whole (the kept messages, then its own), and the previous prompt it
    names; a 400 where the turn cannot be put together, a 404 where the reference is not known."""
    turn = req.previous_turn
    assert turn is not None and turn.messages == "new"
    if turn.prompt_ref is None:
        raise bad_request('previous_turn.messages "new" needs previous_turn.prompt_ref: the earlier messages are '
                          "those kept with it", _PARAM)
    previous = previous_prompt(turn, config, client)
    history = previous.history
    if history is None:
        raise bad_request("previous_turn.prompt_ref keeps no messages (its render held images, whose features a "
                          'turn must send again): send the whole conversation with previous_turn.messages "all"',
                          _PARAM)
    own = req.messages
    if not own or not isinstance(own[0], dict) or own[0].get("role") != "assistant":
        raise bad_request('with previous_turn.messages "new", messages must start with the sampled assistant turn',
                          _PARAM)
    k = len(history.values)
    if turn.message_index is not None and turn.message_index != k:
        raise bad_request(f'with previous_turn.messages "new", the sampled turn is message {k} of the conversation '
                          f"(the {k} kept before it); previous_turn.message_index may only name it", _PARAM)
    messages = _joined(history, own)
    return msgspec.structs.replace(req, messages=messages,
                                   previous_turn=msgspec.structs.replace(turn, message_index=k)), previous


def _joined(history: ChatHistory, own: list[Any]) -> list[Any]:
    """The kept messages and the request's as one ``MemoMessages`` whose first messages are shared with the
    previous render's (their prepared forms taken as that render left them) and which files its own for the next
    turn, as a body that starts with a stored body is. Messages that did not come through the memo (a Messages or
    Responses request's) get entries of their own (``KeptEntry``): this turn prepares the kept ones once, and the
    turn after it shares their prepared forms as a memo body's."""
    kept = history.memo
    if kept is None:
        kept = _unfiled(history.values, tuple(map(KeptEntry, history.values)))
    own_entries = own.entries if type(own) is MemoMessages else tuple(map(KeptEntry, own))
    entries = (*kept.entries, *own_entries)
    values = (*history.values, *own)
    filed = StoredBody(b"", (), (), entries, {}, values, *entry_counts(entries, kept))
    return MemoMessages(entries, values, (kept, len(history.values)) if kept.prepared is not None else None, filed)

"""A chat render that extends a previous turn's sampled ids, or that attributes tokens to messages (loss masks).

``turn_render`` is what ``render.render_chat`` calls when a request carries ``previous_turn`` or asks for
``return_assistant_tokens_mask`` / ``return_message_indices``: the token ids, and what the answer says about
them (``ExtendInfo``, the masks). An extend that is impossible falls back to the full render and says why, or
is refused (``mode: "extend_only"``).
"""

from __future__ import annotations

import array
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import numpy as np

from render_service.extend.attributions import attribution_key
from render_service.extend.bridge import (
    Bridge,
    ExtendImpossible,
    differing_span,
    drop_sampled_marker,
    loop_bridge,
    template_bridge,
)
from render_service.extend.prompt_refs import IdRun, StoredPrompt, id_run
from render_service.extend.protocol import ExtendInfo, PreviousTurn
from render_service.extend.turns import BlockText, close_end, strided_probes, text_turns
from render_service.harmony.encoding import CALL, END, RETURN
from render_service.harmony.render import (
    check_conversation,
    end_marker,
    harmony_messages,
    leads_with_instructions,
    owned_conversation_messages,
    preamble_messages,
    render_harmony_chat,
    renderer_for,
    turn_messages,
)
from render_service.http.errors import bad_request, not_found
from render_service.render.chat_prompt import (
    chat_template_inputs,
    check_prompt_bound,
    encode_prompt,
    template_errors_answered,
)
from render_service.render.render_config import RenderConfig
from render_service.templates.chat_template import RenderedChat
from render_service.tokenize.char_spans import char_span_array
from render_service.tokenize.tokenizer import TextTokenizer
from render_service.wire.protocol import ChatCompletionRequest


@dataclass
class TurnRender:
    """The prompt ids, the tools the template got, and the answer's extra fields (None where not asked);
    ``stored``: the prompt as a prompt reference keeps it (with its masks where they were made)."""

    token_ids: Sequence[int]
    tools: list[dict[str, Any]] | None
    extend: ExtendInfo | None = None
    message_indices: Sequence[int] | None = None
    assistant_tokens_mask: Sequence[int] | None = None
    stored: StoredPrompt | None = None


def sampled_turn_index(req: ChatCompletionRequest, turn: PreviousTurn) -> int:
    """Which message is the sampled assistant turn: the one named, else the last assistant message."""
    messages = req.messages
    if turn.message_index is not None:
        k = turn.message_index
        if not 0 <= k < len(messages) or messages[k].get("role") != "assistant":
            raise bad_request("previous_turn.message_index must name an assistant message", "previous_turn")
        return k
    for k in range(len(messages) - 1, -1, -1):
        if isinstance(messages[k], dict) and messages[k].get("role") == "assistant":
            return k
    raise bad_request("previous_turn needs the sampled turn as an assistant message in messages", "previous_turn")


def check_turn(turn: PreviousTurn, config: RenderConfig) -> None:
    if (turn.prompt_token_ids is None) == (turn.prompt_ref is None):
        raise bad_request("previous_turn needs exactly one of prompt_token_ids and prompt_ref", "previous_turn")
    if turn.prompt_token_ids is not None and not turn.prompt_token_ids:
        raise bad_request("previous_turn.prompt_token_ids must not be empty", "previous_turn")
    vocab = config.tokenizer.vocab_size
    for name in ("prompt_token_ids", "completion_token_ids"):
        ids = getattr(turn, name)
        if ids and not _within_vocab(ids, vocab):
            bad = next(t for t in ids if not 0 <= t < vocab)
            raise bad_request(f"previous_turn.{name}: token id {bad} is out of vocabulary", "previous_turn")


def previous_prompt(turn: PreviousTurn, config: RenderConfig, client: str) -> StoredPrompt:
    """The previous turn's prompt: kept under its ``prompt_ref`` for this client, or the ids given."""
    if turn.prompt_ref is None:
        return StoredPrompt(id_run(cast(list[int], turn.prompt_token_ids)))
    found = config.prompt_refs.get(client, turn.prompt_ref) if config.prompt_refs is not None else None
    if found is None:
        raise not_found("previous_turn.prompt_ref is not known here (it expired, or another replica or client made "
                        "it): send previous_turn.prompt_token_ids instead", "previous_turn.prompt_ref")
    return found


def _within_vocab(ids: list[int], vocab: int) -> bool:
    """Every id in [0, vocab): the list copied once into 32-bit unsigned items (a negative or huge id cannot be
    one) and its largest read in C, about a third of ``min`` and ``max`` over the Python ints."""
    if array.array("I").itemsize != 4:  # (no platform we build for)
        return min(ids) >= 0 and max(ids) < vocab
    try:
        packed = array.array("I", ids)
    except OverflowError:
        return False
    return int(np.frombuffer(packed, dtype=np.uint32).max()) < vocab


def turn_render(req: ChatCompletionRequest, config: RenderConfig, kwargs: dict[str, Any], client: str = "",
                previous: StoredPrompt | None = None) -> TurnRender:
    """``client``: whose prompt references ``previous_turn.prompt_ref`` may name (prompt_refs.py); ``previous``:
    the previous prompt, where the caller looked it up already (extend/history.py)."""
    masks = req.return_assistant_tokens_mask or req.return_message_indices
    turn = req.previous_turn
    if turn is not None:
        check_turn(turn, config)
        k = sampled_turn_index(req, turn)
        if previous is None:
            previous = previous_prompt(turn, config, client)
        try:
            if req.continue_final_message:
                raise ExtendImpossible("continue_final_message continues a message instead of adding a turn")
            if config.harmony:
                done = _harmony_extend(req, config, kwargs, turn, k, previous)
            else:
                done = _template_extend(req, config, kwargs, turn, k, masks, previous)
        except ExtendImpossible as exc:
            if turn.mode == "extend_only":
                raise bad_request(f"Cannot extend the previous turn: {exc}", "previous_turn") from None
            full = _full_render(req, config, kwargs, masks)
            full.extend = ExtendInfo(extended=False, reason=str(exc))
            return _asked(full, req)
        return _asked(done, req)
    return _asked(_full_render(req, config, kwargs, masks), req)


def _asked(done: TurnRender, req: ChatCompletionRequest) -> TurnRender:
    if not req.return_assistant_tokens_mask:
        done.assistant_tokens_mask = None
    if not req.return_message_indices:
        done.message_indices = None
    return done


# ------------------------------------------------------------------------------------------- templates


def _inputs(req: ChatCompletionRequest, config: RenderConfig, kwargs: dict[str, Any]) -> Any:
    return chat_template_inputs(req, config, kwargs)


def _render_fn(template: Any) -> Any:
    def render(messages: list[dict[str, Any]], **arguments: Any) -> str:
        with template_errors_answered():
            return cast(str, template.render(messages, **arguments))

    return render


def _loop_bridge(template: Any, messages: list[dict[str, Any]], arguments: dict[str, Any], k: int,
                 context_chars: int) -> Bridge | None:
    """``bridge.loop_bridge``, a template's failure answered as the render answers it."""
    with template_errors_answered():
        return loop_bridge(template, messages, arguments, k, template.content_format, context_chars)


def _blocks_render(template: Any, render: Any) -> Any:
    """A render answering the template's blocks (``turns.BlockText``), resumed from the loop records as the full
    render was; the text render where no loop session runs."""
    def render_blocks(messages: list[dict[str, Any]], **arguments: Any) -> BlockText | str:
        with template_errors_answered():
            output = template.render_output(messages, **arguments)
        return BlockText(output) if output is not None else cast(str, render(messages, **arguments))

    return render_blocks


def _encode_part(text: str, config: RenderConfig, before: int) -> list[int]:
    """The ids of text appended to ``before`` ids (not a whole prompt: the prompts' prefixes are not consulted),
    refused as a prompt is when its length alone proves that the whole cannot fit the context."""
    check_prompt_bound(text, config, before)
    encoder = config.prompt_encoder
    return encoder.encode_part(text) if encoder is not None else config.tokenizer.encode(text)


def _encode(text: str, config: RenderConfig) -> list[int]:
    return encode_prompt(text, config)


def _offsets(text: str, ids: list[int], config: RenderConfig) -> np.ndarray:
    """Character offsets of ``ids`` (the ids ``text`` encodes to), an ``(n, 2)`` array of (start, end): from the
    ids' bytes where they spell ``text`` (``char_span_array``), else from the tokenizers library's own encode."""
    tokenizer = cast(TextTokenizer, config.tokenizer)
    spans = char_span_array(tokenizer, text, ids)
    if spans is not None:
        return spans
    encoding = tokenizer.hf.encode(text, add_special_tokens=False)
    if list(encoding.ids) != list(ids):
        raise ExtendImpossible("the tokenizer's offsets do not cover the rendered ids")
    return np.array(encoding.offsets, dtype=np.int64).reshape(-1, 2)


def _full_render(req: ChatCompletionRequest, config: RenderConfig, kwargs: dict[str, Any], masks: bool
                 ) -> TurnRender:
    if config.harmony:

        ids = render_harmony_chat(req, cast(TextTokenizer, config.tokenizer), kwargs, _harmony_choice(req))
        done = TurnRender(ids, None)
        if masks:
            done.message_indices, done.assistant_tokens_mask = _harmony_turns(req, config, kwargs, ids)
        return done
    template, messages, arguments, tools = _inputs(req, config, kwargs)
    render = _render_fn(template)
    if not masks:
        return TurnRender(_encode(render(messages, **arguments), config), tools)
    with template_errors_answered():
        # A template without {% generation %} blocks has no spans to find: its render as blocks, so that most
        # probes come from a few renders (turns.strided_probes) and the rest compare a block at a time
        output = None if template.marks_generation else template.render_output(messages, **arguments)
        rendered = RenderedChat(output.text()) if output is not None else \
            template.render_with_spans(messages, **arguments)
    ids = _encode(rendered.text, config)
    if output is not None:
        # (the probes' renders do not look for a loop record: each probes a message near the conversation's start)
        known = strided_probes(partial(template.render_output, resume=False), messages, arguments, output)
        turns = text_turns(_blocks_render(template, render), messages, arguments, BlockText(output),
                           end_markers=_end_markers(config), known=known)
    else:
        turns = text_turns(render, messages, arguments, rendered.text, rendered.generation_spans,
                           _end_markers(config))
    indices, flags = turns.attribute(_offsets(rendered.text, ids, config))
    _remember(config, ids, messages, arguments, indices, flags)
    return TurnRender(ids, tools, message_indices=indices, assistant_tokens_mask=flags,
                      stored=StoredPrompt(id_run(ids), tuple(messages), id_run(indices), id_run(flags)))


def _remember(config: RenderConfig, ids: list[int], messages: list[dict[str, Any]], arguments: dict[str, Any],
              indices: list[int], flags: list[int]) -> None:
    """Files a masked answer's attribution for the next turn's extend of this prompt (``_prompt_turns``)."""
    if config.attributions is not None and arguments.get("add_generation_prompt"):
        config.attributions.put(attribution_key(ids, messages, arguments), indices, flags)


def _template_extend(req: ChatCompletionRequest, config: RenderConfig, kwargs: dict[str, Any], turn: PreviousTurn,
                     k: int, masks: bool, previous: StoredPrompt) -> TurnRender:
    template, messages, arguments, tools = _inputs(req, config, kwargs)
    render = _render_fn(template)
    ends = _end_markers(config)
    encoder = config.prompt_encoder
    context = encoder.cut_context_chars if encoder is not None else 0
    bridge = _loop_bridge(template, messages, arguments, k, context) \
        or template_bridge(render, messages, arguments, k, template.content_format, ends)
    assert bridge.text is not None
    completion = turn.completion_token_ids
    added = {i: t for t, i in cast(TextTokenizer, config.tokenizer).added_token_ids.items()}
    text, closing = drop_sampled_marker(bridge.text, bridge.closing_chars, completion[-1] if completion else None,
                                        added)
    kept = previous.ids.then(completion)
    suffix = _encode_part(text, config, kept.count) if text else []  # (a new message seen before is a hit)
    answer = kept.then(suffix)
    # The check: the appended ids are a full render's last ids. Where the tokenizer provably cuts the full render
    # at the seam, they are by that proof (the text after the seam is the bridge); else from a cut near the seam
    # (what the new turn costs), else from the whole render.
    seam = len(bridge.window) - len(text)
    full_ids: list[int] | None = None
    if text and encoder is not None and encoder.cuts_at(bridge.window, seam, bridge.window_floor):
        full_tail: Sequence[int] = suffix
    else:
        tail = encoder.tail_ids(bridge.window, seam, bridge.window_floor) \
            if encoder is not None and seam >= bridge.window_floor else None
        if tail is None:
            full_ids = tail = _encode(bridge.full_text(), config)
        full_tail = tail
    suffix_matches = len(full_tail) >= len(suffix) and full_tail[len(full_tail) - len(suffix):] == suffix
    span = None
    compared = turn.check == "full" or not suffix_matches
    if compared:  # the whole answer against the whole render, and where they part
        if full_ids is None:
            full_ids = _encode(bridge.full_text(), config)
        span = differing_span(full_ids, answer.tolist(), _decoder(config))
    offsets = _offsets(text, suffix, config) if masks and suffix else np.zeros((0, 2), dtype=np.int64)
    closing_ids = len(config.tokenizer.encode(text[:closing])) if closing else 0  # (the close starts at a cut)
    info = ExtendInfo(extended=True, method=bridge.method, kept_tokens=kept.count, closing_tokens=closing_ids,
                      new_tokens=len(suffix) - closing_ids, suffix_matches_full_render=suffix_matches,
                      matches_full_render=span is None if compared else None, differing_span=span)
    done = TurnRender(answer.view(), tools, extend=info, stored=StoredPrompt(answer))
    if masks:
        # Only the appended text is attributed here: the messages from the sampled turn on are probed.
        if bridge.output is not None:  # the probes compared with the full render a block at a time
            turns = text_turns(_blocks_render(template, render), messages, arguments, BlockText(bridge.output),
                               end_markers=ends, first=k)
        else:
            turns = text_turns(render, messages, arguments, bridge.full_text(), end_markers=ends, first=k)
        head_indices, head_flags = _previous_attribution(render, messages, arguments, k, previous, config)
        base = bridge.full_chars - len(text)
        tail_indices, _ = turns.attribute(offsets, base)
        # The close up to its end-of-turn marker is the sampled turn's (written by the template when the model
        # did not write the marker); what follows it opens the next message, as in a full render's attribution.
        own_close = close_end(text, 0, closing, ends)
        for i in np.flatnonzero(offsets[:, 0] < own_close).tolist():
            tail_indices[i] = k
        indices = head_indices.then([k] * len(completion) + tail_indices)
        # Every appended id is the template's: the model sampled none of them.
        flags = head_flags.then([1] * len(completion) + [0] * len(suffix))
        done.message_indices, done.assistant_tokens_mask = indices.view(), flags.view()
        done.stored = StoredPrompt(answer, tuple(messages), indices, flags)
        if config.attributions is not None and turn.prompt_ref is None:  # (a prompt sent as ids: filed by digest)
            _remember(config, answer.tolist(), messages, arguments, indices.tolist(), flags.tolist())
    return done


def _previous_attribution(render: Any, messages: list[dict[str, Any]], arguments: dict[str, Any], k: int,
                          previous: StoredPrompt, config: RenderConfig) -> tuple[IdRun, IdRun]:
    """The previous prompt's attribution: kept with its prompt reference when the messages before the sampled
    turn are the ones it was made for (the same objects, as the message memo gives them, or equal ones); else
    as ``_prompt_turns`` finds it."""
    if previous.indices is not None and previous.flags is not None and len(previous.messages) == k:
        head = messages[:k]
        if all(map(operator.is_, previous.messages, head)) or list(previous.messages) == head:
            return previous.indices, previous.flags
    indices, flags = _prompt_turns(render, messages, arguments, k, previous.ids.tolist(), config)
    return id_run(indices), id_run(flags)


def _prompt_turns(render: Any, messages: list[dict[str, Any]], arguments: dict[str, Any], k: int,
                  prompt: list[int], config: RenderConfig) -> tuple[list[int], list[int]]:
    """Attribution of the previous prompt's ids: the previous turn's own answer where it asked for masks too
    (``attributions``); else from the render of the messages before the sampled turn when it gives those very
    ids; else -1 (unknown) for each."""
    head_args = dict(arguments, add_generation_prompt=True)
    if config.attributions is not None:
        found = config.attributions.get(attribution_key(prompt, messages[:k], head_args))
        if found is not None:
            return found
    text = render(messages[:k], **head_args) if k else ""
    if text:
        ids = _encode(text, config)
        if ids == list(prompt):
            turns = text_turns(render, messages[:k], head_args, text, end_markers=_end_markers(config))
            return turns.attribute(_offsets(text, ids, config))
    return [-1] * len(prompt), [0] * len(prompt)


def _end_markers(config: RenderConfig) -> list[str]:
    """The text of the bundle's end-of-turn (EOS) tokens."""
    tokenizer = cast(TextTokenizer, config.tokenizer)
    return [t for t in (tokenizer.id_to_token(i) for i in config.bundle.eos_token_ids) if t]


def _decoder(config: RenderConfig) -> Any:
    def decode(ids: list[int]) -> str:
        return cast(str, config.tokenizer.decode(ids, skip_special_tokens=False))

    return decode


# ---------------------------------------------------------------------------------------------- Harmony


def _harmony_choice(req: ChatCompletionRequest) -> str:
    return "none" if not req.tools or req.tool_choice == "none" else "auto"


def _harmony_extend(req: ChatCompletionRequest, config: RenderConfig, kwargs: dict[str, Any], turn: PreviousTurn,
                    k: int, previous: StoredPrompt) -> TurnRender:
    """Harmony renders each message on its own: the bridge is the new messages' ids and ``<|start|>assistant``;
    a completion cut short (no ``<|end|>``/``<|call|>``/``<|return|>``) is closed with ``<|end|>``."""

    tokenizer = cast(TextTokenizer, config.tokenizer)
    new_chat = req.messages[k + 1:]
    if any(isinstance(m, dict) and m.get("role") == "assistant" for m in new_chat):
        raise ExtendImpossible("Harmony extends one sampled turn at a time (an assistant message follows it)")
    with_tools = bool(req.tools) and _harmony_choice(req) != "none"
    if turn.check == "suffix" and not (req.return_assistant_tokens_mask or req.return_message_indices):
        done = _harmony_extend_turn(req, config, kwargs, turn, k, previous, with_tools)
        if done is not None:
            return done
    full_messages = harmony_messages(req, kwargs, with_tools)
    renderer = renderer_for(tokenizer)
    full_ids = renderer.render(full_messages)
    count = len(new_chat)  # a user or tool message is one Harmony message
    new_messages = full_messages[len(full_messages) - count:] if count else []
    completion = turn.completion_token_ids
    rendered: list[int] = []
    for message in new_messages:
        renderer.message(message, rendered)
    # A turn cut short is closed as the full render closes it (<|call|> after a call, else <|end|>).
    close = full_ids[len(full_ids) - len(rendered) - 3] if len(full_ids) >= len(rendered) + 3 else END
    closing = [] if completion and completion[-1] in (END, CALL, RETURN) else [close if close == CALL else END]
    if full_ids[len(full_ids) - len(rendered) - 2:len(full_ids) - 2] != rendered:
        raise ExtendImpossible("the new messages do not render as the end of the whole conversation")
    suffix = closing + rendered + full_ids[-2:]  # and <|start|>assistant, as the full render ends
    bridge = Bridge(ids=suffix, closing_ids=len(closing))
    prompt = previous.ids.tolist()
    kept = [*prompt, *completion]
    ids = kept + suffix
    span = differing_span(full_ids, ids, _decoder(config))
    info = ExtendInfo(extended=True, method="harmony", kept_tokens=len(kept), closing_tokens=bridge.closing_ids,
                      new_tokens=len(suffix) - bridge.closing_ids,
                      suffix_matches_full_render=full_ids[len(full_ids) - len(suffix):] == suffix,
                      matches_full_render=span is None, differing_span=span)
    done = TurnRender(ids, None, extend=info)
    if req.return_assistant_tokens_mask or req.return_message_indices:
        head_req = _replace_messages(req, req.messages[:k])
        head_ids = renderer.render(harmony_messages(head_req, kwargs, with_tools)) if k else []
        head_indices, head_flags = _harmony_turns(head_req, config, kwargs, prompt) if head_ids == prompt \
            else ([-1] * len(prompt), [0] * len(prompt))
        done.message_indices = head_indices + [k] * len(completion) + _harmony_tail_indices(
            suffix, bridge.closing_ids, k, renderer, new_messages, len(req.messages))
        done.assistant_tokens_mask = head_flags + [1] * len(completion) + [0] * len(suffix)
    return done


def _harmony_extend_turn(req: ChatCompletionRequest, config: RenderConfig, kwargs: dict[str, Any],
                         turn: PreviousTurn, k: int, previous: StoredPrompt, with_tools: bool) -> TurnRender | None:
    """The extend that renders only the sampled turn's close and the messages after it. Harmony renders each
    message on its own, so those ids are the full render's last ids by construction (the check a template's extend
    makes by tokenizing near the seam): nothing before the sampled turn is rendered, copied or compared. The
    messages before it are converted (checked) where the request sent them; with ``messages: "new"`` they are the
    ones the previous render converted. None where the turn needs the whole conversation (a tool result for an
    earlier turn's call, a sampled turn that renders to nothing)."""
    renderer = renderer_for(cast(TextTokenizer, config.tokenizer))
    renderer.preamble(preamble_messages(req, kwargs, with_tools))  # (what a full render would refuse; cached)
    converted = turn_messages(req.messages, k)
    if converted is None or not converted[0]:
        return None
    sampled, after = converted
    if turn.messages != "new":  # (the preamble's own refusals came above, from the same first message)
        check_conversation(req.messages, 1 if leads_with_instructions(req.messages) else 0, k)
    completion = turn.completion_token_ids
    close = end_marker(sampled[-1])
    closing = [] if completion and completion[-1] in (END, CALL, RETURN) else [close]
    suffix = list(closing)
    for message in after:
        renderer.message(message, suffix)
    suffix += renderer.generation_prompt()
    kept = previous.ids.then(completion)
    answer = kept.then(suffix)
    info = ExtendInfo(extended=True, method="harmony", kept_tokens=kept.count, closing_tokens=len(closing),
                      new_tokens=len(suffix) - len(closing), suffix_matches_full_render=True)
    return TurnRender(answer.view(), None, extend=info, stored=StoredPrompt(answer))


def _harmony_tail_indices(suffix: list[int], closing: int, k: int, renderer: Any,
                          new_messages: list[dict[str, Any]], total: int) -> list[int]:
    out = [k] * closing
    for offset, message in enumerate(new_messages):
        part: list[int] = []
        renderer.message(message, part)
        out += [k + 1 + offset] * len(part)
    out += [total] * (len(suffix) - len(out))
    return out


def _harmony_turns(req: ChatCompletionRequest, config: RenderConfig, kwargs: dict[str, Any], ids: list[int]
                   ) -> tuple[list[int], list[int]]:
    """Harmony attribution: the preamble is the first message's, each Harmony message (as the whole conversation
    keeps it) its chat message's, the generation prompt the next message's; all -1 / 0 where those pieces do not
    make ``ids`` up."""
    renderer = renderer_for(cast(TextTokenizer, config.tokenizer))
    with_tools = bool(req.tools) and _harmony_choice(req) != "none"
    chat = list(req.messages)
    lead = 1 if leads_with_instructions(chat) else 0
    converted, owners = owned_conversation_messages(chat[lead:], lead)
    preamble = renderer.preamble(preamble_messages(req, kwargs, with_tools))
    indices = [0] * len(preamble)
    rendered: list[int] = []
    for message, owner in zip(converted, owners, strict=True):
        before = len(rendered)
        renderer.message(message, rendered)
        indices += [owner] * (len(rendered) - before)
    closing = renderer.generation_prompt()
    if len(indices) + len(closing) != len(ids) or ids[len(preamble):len(ids) - len(closing)] != rendered \
            or tuple(ids[:len(preamble)]) != preamble:
        return [-1] * len(ids), [0] * len(ids)
    indices += [len(chat)] * len(closing)
    assistant = {i for i, m in enumerate(chat) if isinstance(m, dict) and m.get("role") == "assistant"}
    return indices, [1 if i in assistant else 0 for i in indices]


def _replace_messages(req: ChatCompletionRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    import msgspec

    return msgspec.structs.replace(req, messages=messages)

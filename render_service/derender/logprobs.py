"""Logprobs on the render side: the engine's entries (integer token ids, either of vLLM's two shapes) checked
against their bounds and resolved to OpenAI's chat and completions shapes (token text, UTF-8 bytes)."""

from __future__ import annotations

from collections.abc import Sequence

from render_service.http.errors import bad_request
from render_service.render.render_config import RenderConfig
from render_service.tokenize.tokenizer import RenderTokenizer
from render_service.wire.protocol import (
    ChatCompletionRequest,
    ChatLogprob,
    ChatLogprobs,
    CompletionLogprobs,
    CompletionRequest,
    GenerateLogprobs,
    GeneratePromptLogprobs,
    GenerateTokenLogprob,
    GenerateTopLogprob,
    PromptLogprob,
)

# vLLM's ModelConfig.max_logprobs default: the most top_logprobs an entry may carry.
MAX_TOP_LOGPROBS = 20
# Preceding sampled ids used to repair a token that decodes to a partial UTF-8 character (vLLM: 4).
LOGPROB_CONTEXT_TOKENS = 4


def check_logprobs_bounds(logprobs: GenerateLogprobs | None, index: int, config: RenderConfig) -> None:
    """400 unless a choice's engine logprobs fit the bounds: at most max_model_len entries of at most
    MAX_TOP_LOGPROBS alternatives each (their shape is the decoder's: protocol.GenerateLogprobs)."""
    content = logprobs.content if logprobs is not None else None
    if content is None:
        return
    if len(content) > config.max_model_len:
        raise bad_request(f"logprobs.content length ({len(content)}) in choice {index} exceeds max_model_len "
                          f"({config.max_model_len}).")
    for entry in content:
        if entry.top_logprobs is not None and len(entry.top_logprobs) > MAX_TOP_LOGPROBS:
            raise bad_request(f"top_logprobs count in choice {index} exceeds max_logprobs ({MAX_TOP_LOGPROBS}).",
                              "logprobs")


def entry_token_id(entry: GenerateTokenLogprob | GenerateTopLogprob) -> int | None:
    """Integer id from either shape: ``{"token_id": N}`` (0.32+) or ``{"token": "token_id:N"}`` (older)."""
    if entry.token_id is not None:
        return entry.token_id
    token = entry.token
    if token is not None and token.startswith("token_id:"):
        try:
            return int(token[len("token_id:"):])
        except ValueError:
            return None
    return None


def _token_text(tokenizer: RenderTokenizer, token_id: int, context: list[int]) -> str:
    """One token's text, with vLLM's byte-fallback repair.

    A token that decodes to a partial UTF-8 character (ending in U+FFFD) is decoded again after up to 4
    preceding sampled ids. If that completes the character, the token carries the whole character
    (the earlier partial tokens' text); if it never completes, the token's text is "".
    """
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    if not text.endswith("\ufffd"):
        return text
    for size in range(1, min(len(context), LOGPROB_CONTEXT_TOKENS) + 1):
        window = context[-size:]
        full = tokenizer.decode(window + [token_id], skip_special_tokens=False)
        if full.endswith("\ufffd"):
            continue
        clean_end = len(window)
        while clean_end > 0 and tokenizer.decode([window[clean_end - 1]], skip_special_tokens=False).endswith("\ufffd"):
            clean_end -= 1
        prefix = tokenizer.decode(window[:clean_end], skip_special_tokens=False) if clean_end else ""
        if full.startswith(prefix):
            return full[len(prefix):]
    return ""


def tokens_as_token_ids(request: ChatCompletionRequest | CompletionRequest | None, config: RenderConfig) -> bool:
    """vLLM's rule: the request's ``return_tokens_as_token_ids`` if set, else the server flag."""
    asked = request.return_tokens_as_token_ids if request is not None else None
    return config.return_tokens_as_token_ids if asked is None else asked


# One resolved logprob: (token id or None, token string, logprob).
_Resolved = tuple[int | None, str, float]


def _resolved(entry: GenerateTokenLogprob | GenerateTopLogprob, tokenizer: RenderTokenizer, context: list[int],
              as_token_ids: bool) -> _Resolved:
    """An id inside the vocabulary is resolved to its text (or "token_id:N"); any other entry keeps the engine's
    token string (an older engine's placeholder), or "" when it sent none."""
    tid = entry_token_id(entry)
    if tid is None or not 0 <= tid < tokenizer.vocab_size:
        return None, entry.token or "", entry.logprob
    return tid, f"token_id:{tid}" if as_token_ids else _token_text(tokenizer, tid, context), entry.logprob


def _resolved_entry(entry: GenerateTokenLogprob, tokenizer: RenderTokenizer, context: list[int],
                    as_token_ids: bool) -> tuple[_Resolved, list[_Resolved]]:
    """A sampled token and its alternatives; the token's id joins ``context`` (the alternatives are read
    after the same preceding ids as the token)."""
    sampled = _resolved(entry, tokenizer, context, as_token_ids)
    top = [_resolved(alt, tokenizer, context, as_token_ids) for alt in entry.top_logprobs or ()]
    if sampled[0] is not None:
        context.append(sampled[0])
    return sampled, top


def _resolved_entries(
    logprobs: GenerateLogprobs | None, tokenizer: RenderTokenizer, context: list[int] | None = None,
    as_token_ids: bool = False,
) -> list[tuple[_Resolved, list[_Resolved]]] | None:
    """``context``: earlier sampled ids (streaming carries them across chunks); extended in place.
    ``as_token_ids``: token strings are vLLM's ``"token_id:N"`` instead of decoded text."""
    if logprobs is None or logprobs.content is None:
        return None
    context = context if context is not None else []
    return [_resolved_entry(entry, tokenizer, context, as_token_ids) for entry in logprobs.content]


def _chat_logprob(tid: int | None, token: str, logprob: float, as_token_ids: bool) -> ChatLogprob:
    item: ChatLogprob = {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
    if not as_token_ids:
        item["token_id"] = tid  # ours: the integer id next to the decoded text (vLLM gives only the text)
    return item


def resolve_chat_logprobs(logprobs: GenerateLogprobs | None, tokenizer: RenderTokenizer,
                          context: list[int] | None = None, as_token_ids: bool = False) -> ChatLogprobs | None:
    """Generate logprobs (token ids) -> OpenAI chat logprobs (token strings, UTF-8 bytes, integer ids)."""
    entries = _resolved_entries(logprobs, tokenizer, context, as_token_ids)
    if entries is None:
        return None
    return {"content": [_chat_entry(sampled, top, as_token_ids) for sampled, top in entries], "refusal": None}


def resolve_chat_entry(entry: GenerateTokenLogprob, tokenizer: RenderTokenizer, context: list[int],
                       as_token_ids: bool = False) -> ChatLogprob:
    """One engine entry -> one chat logprob (``context`` as for resolve_chat_logprobs, extended in place)."""
    return _chat_entry(*_resolved_entry(entry, tokenizer, context, as_token_ids), as_token_ids)


def _chat_entry(sampled: _Resolved, top: list[_Resolved], as_token_ids: bool) -> ChatLogprob:
    item = _chat_logprob(*sampled, as_token_ids)
    item["top_logprobs"] = [_chat_logprob(*alt, as_token_ids) for alt in top]
    return item


def resolve_completion_logprobs(
    logprobs: GenerateLogprobs | None, tokenizer: RenderTokenizer, context: list[int] | None = None,
    text_offset: int = 0, as_token_ids: bool = False,
) -> CompletionLogprobs | None:
    """Generate logprobs -> the legacy completions shape (text_offset, token_logprobs, tokens, top_logprobs),
    plus ``token_ids`` (integer ids parallel to ``tokens``) unless vLLM's ``"token_id:N"`` strings were asked for."""
    entries = _resolved_entries(logprobs, tokenizer, context, as_token_ids)
    if entries is None:
        return None
    offsets, offset = [], text_offset
    for (_, tok, _), _ in entries:
        offsets.append(offset)
        offset += len(tok)
    out: CompletionLogprobs = {
        "text_offset": offsets,
        "token_logprobs": [lp for (_, _, lp), _ in entries],
        "tokens": [tok for (_, tok, _), _ in entries],
        "top_logprobs": [{t: lp for _, t, lp in top} for _, top in entries],
    }
    if not as_token_ids:
        out["token_ids"] = [tid for (tid, _, _), _ in entries]
    return out


def extend_completion_logprobs(into: CompletionLogprobs, more: CompletionLogprobs) -> None:
    """``more``'s entries appended to ``into``'s lists, key by key (both resolved for the same request, so the
    same keys: ``token_ids`` in both or in neither)."""
    into["text_offset"] += more["text_offset"]
    into["token_logprobs"] += more["token_logprobs"]
    into["tokens"] += more["tokens"]
    into["top_logprobs"] += more["top_logprobs"]
    if "token_ids" in into:
        into["token_ids"] += more["token_ids"]


class PromptLogprobs:
    """An engine's ``prompt_logprobs`` (per prompt position: null, or ``{token id: {logprob, rank, ...}}``,
    ids as JSON keys) resolved against the prompt's ids: the response's ``prompt_logprobs`` (vLLM's shape, each
    entry's ``decoded_token`` filled) and, for completions ``echo``, the prompt's part of the legacy logprobs."""

    def __init__(self, raw: GeneratePromptLogprobs | None, prompt_ids: Sequence[int], tokenizer: RenderTokenizer,
                 as_token_ids: bool = False):
        if raw is None or len(raw) != len(prompt_ids):
            raw = [None] * len(prompt_ids)  # an engine that sent none (or the wrong count): nothing to resolve
        self.entries: list[list[tuple[int, str, float, int | None]] | None] = []
        self.tokens: list[str] = []
        context: list[int] = []
        vocab = tokenizer.vocab_size
        for tid, entry in zip(prompt_ids, raw):
            self.tokens.append(f"token_id:{tid}" if as_token_ids else _token_text(tokenizer, tid, context))
            context.append(tid)
            if entry is None:
                self.entries.append(None)
                continue
            alternatives = []
            for aid, value in entry.items():
                if as_token_ids or not 0 <= aid < vocab:
                    text = f"token_id:{aid}"
                else:
                    text = _token_text(tokenizer, aid, context[:-1])
                alternatives.append((aid, text, value.logprob, value.rank))
            # the prompt's own token first, then the rest in the engine's (rank) order, as vLLM lists them
            alternatives.sort(key=lambda a: a[0] != tid)
            self.entries.append(alternatives)
        self.prompt_ids = prompt_ids
        self.as_token_ids = as_token_ids

    def response_entries(self) -> GeneratePromptLogprobs:
        """vLLM's ``prompt_logprobs``: ``{token id: {"logprob", "rank", "decoded_token"}}`` per position."""
        return [None if e is None else {a: PromptLogprob(lp, rank, text) for a, text, lp, rank in e}
                for e in self.entries]

    def echoed(self, top: int, text_offset: int = 0) -> CompletionLogprobs:
        """The prompt's part of an echoed completion's logprobs (vLLM's ``_create_completion_logprobs`` over the
        prompt): its token, logprob and ``top`` + 1 alternatives per position; the first position has none."""
        offsets: list[int] = []
        token_logprobs: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        for token, entry, tid in zip(self.tokens, self.entries, self.prompt_ids):
            offsets.append(text_offset)
            text_offset += len(token)
            if entry is None:
                token_logprobs.append(None)
                tops.append(None)
                continue
            own = next((lp for a, _, lp, _ in entry if a == tid), -9999.0)
            token_logprobs.append(max(own, -9999.0))
            tops.append({text: max(lp, -9999.0) for _, text, lp, _ in entry[:top + 1]})
        out: CompletionLogprobs = {"text_offset": offsets, "token_logprobs": token_logprobs,
                                   "tokens": list(self.tokens), "top_logprobs": tops}
        if not self.as_token_ids:
            out["token_ids"] = list[int | None](self.prompt_ids)
        return out

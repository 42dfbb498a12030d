"""Wire shapes of the extend render: what a request says about its previous turn, what the answer says back."""

from __future__ import annotations

from typing import Literal

import msgspec


class PreviousTurn(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The turn a chat render extends: its prompt, as ids (``prompt_token_ids``) or as the ``prompt_ref`` the
    render that made it answered (``return_prompt_ref``), and the ids the engine sampled for it (with or without
    the stop token), as the engine returned them. ``message_index``: which of the request's messages is that
    assistant turn (default: the last assistant message). ``mode``: "extend" falls back to the full render
    (and says why) where extending is impossible; "extend_only" refuses instead (a 400). ``check``: "suffix"
    compares the appended ids with a full render's last ids (what the new turn costs); "full" compares the whole
    answer with a full render too and reports where they part (what the conversation costs). ``answer``: "full"
    gives the whole prompt's ids; "appended" only those after the kept ones (``extend.kept_tokens`` of them: the
    previous prompt and the completion), and the masks likewise, where the turn was extended (the client, which
    holds the kept ids, puts the prompt together; a fallback to the full render answers in full). ``messages``:
    "all" (the request's ``messages`` are the whole conversation) or "new" (they start with the sampled turn; the
    messages before it are those the ``prompt_ref``'s render was made from, kept with it), so that the request
    grows with the new turn and not with the conversation."""

    completion_token_ids: list[int]
    prompt_token_ids: list[int] | None = None
    prompt_ref: str | None = None
    message_index: int | None = None
    mode: Literal["extend", "extend_only"] = "extend"
    check: Literal["suffix", "full"] = "suffix"
    answer: Literal["full", "appended"] = "full"
    messages: Literal["all", "new"] = "all"


class DifferingSpan(msgspec.Struct):
    """Where the extended ids and a full render's ids part: ``start`` is the first differing position (the same
    in both), ``full_end`` / ``extended_end`` end the differing run in each (the tails after them are equal);
    the texts are those ids decoded, so a team sees the template quirk that bit."""

    start: int
    full_end: int
    extended_end: int
    full_text: str
    extended_text: str


class ExtendInfo(msgspec.Struct):
    """How a render with ``previous_turn`` was made. ``extended``: the token ids start with the previous prompt
    and completion, byte for byte; else ``reason`` says why not and the ids are the full render's.
    ``method``: how the seam was found. ``kept_tokens``: the ids kept as given; ``closing_tokens``: what the
    template closes the sampled turn with (after the kept ids); ``new_tokens``: the ids rendered for the new
    messages and the generation prompt.
    ``suffix_matches_full_render``: the appended ids are the full render's last ids (the template is append-only
    from the seam on); ``matches_full_render``: the whole answer equals a full render (None: not compared, with
    ``check: "suffix"`` and a suffix that matches); where it does not, ``differing_span`` shows where."""

    extended: bool
    reason: str | None = None
    method: str | None = None  # "loop", "probe", "prefix" or "harmony" (docs/rl.md)
    kept_tokens: int = 0
    closing_tokens: int = 0
    new_tokens: int = 0
    suffix_matches_full_render: bool | None = None
    matches_full_render: bool | None = None
    differing_span: DifferingSpan | None = None

"""The reference switch against the fast path: one differential harness over the recorded vLLM pairs, every family
template the project ships, and an agent trace rendered turn by turn.

The same request rendered by a configuration with every acceleration (piece cache, prompt store, message memo
and body store, tojson cache, fastokens/tiktoken) and by one built under ``SPLITSERVE_REFERENCE_RENDER=1``
(``tokenizers`` encodes, nothing cached) must give the same engine request, byte for byte, or the same error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2
import msgspec
import pytest

from bench.agent_trace import AgentTraceSpec, agent_trace, chat_body, round_ends
from render_service.http.errors import ApiError
from render_service.render.reference_mode import REFERENCE_ENV
from render_service.render.render import render_chat
from render_service.render.render_config import RenderConfig, load_render_config
from render_service.templates.inline import LoopContext
from render_service.templates.sandbox import INLINE_REASON, ChatSandbox, inline_violation, use_plain_reads
from render_service.templates.tojson_cache import DEFAULT_TEXTS
from render_service.wire.protocol import ChatCompletionRequest
from tests.family_bundles import FAMILIES, write_family_bundle
from tests.render_harness import PARSER_FLAGS, QWEN3_DIR, VLLM_PAIRS, load_pair

_decode = msgspec.json.Decoder(ChatCompletionRequest).decode
_encode = msgspec.json.Encoder().encode


@pytest.fixture
def reference_env(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Builds configurations under the switch; the process-wide tojson cache is restored afterwards."""
    bound = DEFAULT_TEXTS.max_bytes

    def build(model_dir: Path | str, **settings: Any) -> RenderConfig:
        monkeypatch.setenv(REFERENCE_ENV, "1")
        try:
            return load_render_config(str(model_dir), **settings)
        finally:
            monkeypatch.delenv(REFERENCE_ENV)

    yield build
    DEFAULT_TEXTS.max_bytes = bound
    use_plain_reads(False)


def _outcome(body: bytes, config: RenderConfig) -> bytes:
    """The engine request's JSON (a fixed request id), or the error's status and message."""
    try:
        return _encode(render_chat(_decode(body), config, request_id="ref"))
    except ApiError as exc:
        return f"{exc.status} {exc.param} {exc.message}".encode()


def _same(bodies: list[bytes], fast: RenderConfig, plain: RenderConfig) -> int:
    for body in bodies:
        assert _outcome(body, fast) == _outcome(body, plain), body[:200]
    return len(bodies)


def test_the_switch_turns_every_acceleration_off(reference_env: Any) -> None:
    fast = load_render_config(str(QWEN3_DIR), served_model_names=["qwen3-0.6b"])
    plain = reference_env(QWEN3_DIR, served_model_names=["qwen3-0.6b"])
    assert fast.prompt_encoder is not None and fast.prompt_encoder.enabled and fast.message_memo is not None
    assert plain.prompt_encoder is not None and not plain.prompt_encoder.enabled
    assert plain.message_memo is None
    assert plain.tokenizer.encode_backend == "tokenizers" != fast.tokenizer.encode_backend
    assert DEFAULT_TEXTS.max_bytes == 0
    assert ChatSandbox.template_class is jinja2.Template  # Jinja's own reads


def test_the_inline_template_reads_prove_themselves_and_a_moved_internal_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert INLINE_REASON is None and inline_violation() is None  # this Jinja: the inline reads serve
    monkeypatch.setattr(LoopContext, "last", property(lambda self: False))  # as if Jinja's internals moved
    assert inline_violation() is not None


def test_recorded_pairs_and_an_agent_trace(reference_env: Any) -> None:
    for flags, folder in (({}, "noparsers"), (PARSER_FLAGS, "parsers")):
        fast = load_render_config(str(QWEN3_DIR), served_model_names=["qwen3-0.6b"], **flags)
        plain = reference_env(QWEN3_DIR, served_model_names=["qwen3-0.6b"], **flags)
        bodies = []
        for path in sorted((VLLM_PAIRS / folder).glob("*.request.json")):
            request, _ = load_pair(path)
            if request["path"] == "/v1/chat/completions/render":
                bodies.append(msgspec.json.encode(request["body"]))
        assert _same(bodies, fast, plain) >= 5
        messages, tools = agent_trace(AgentTraceSpec(rounds=6, result_chars=(300, 1500), seed=5))
        turns = [msgspec.json.encode(chat_body("qwen3-0.6b", messages[:end], tools)) for end in round_ends(messages)]
        assert _same(turns + turns, fast, plain) == 2 * len(turns)  # the second pass: every cache hit


@pytest.mark.slow  # each family loads its tokenizer twice (4-12 s)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_template(family: str, tmp_path: Path, reference_env: Any) -> None:
    root = write_family_bundle(family, tmp_path)
    fast = load_render_config(str(root), served_model_names=["m"])
    plain = reference_env(root, served_model_names=["m"])
    messages, tools = agent_trace(AgentTraceSpec(rounds=3, result_chars=(200, 600), seed=11))
    turns = [msgspec.json.encode(chat_body("m", messages[:end], tools)) for end in round_ends(messages)]
    assert _same(turns + turns, fast, plain) == 2 * len(turns)


def test_the_direct_http_path_proves_uvicorns_protocol_and_a_moved_internal_is_caught() -> None:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from render_service.http.direct_http import protocol_violation

    assert protocol_violation(HttpToolsProtocol) is None  # this uvicorn: the shortcut serves

    class Moved(HttpToolsProtocol):  # as if uvicorn renamed a hook the shortcut overrides
        on_body = None

    assert protocol_violation(Moved) == "uvicorn's protocol has no on_body"

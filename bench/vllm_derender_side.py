"""Run vLLM's own chat derender (``OnlineDerenderer``, the code behind ``/v1/chat/completions/derender``) over
token ids, batch and streaming, and print what a client gets. Runs under vLLM's Python, not ours: it imports
vLLM only (``bench/llama_json_parity.py`` starts it and compares).

Input (stdin, JSON): ``{"tokenizer_dir", "tool_parser", "tools", "cases": [{"name", "token_ids",
"finish_reason", "stop_reason"}]}``. Output (stdout, one JSON line): per case, ``batch`` and ``stream`` (the
folded chunks: content, tool calls, finish_reason) or the error vLLM raised.

Only the derenderer's collaborators are stand-ins (the model config it reads the EOS ids and model type from, the
renderer it takes the tokenizer from); the derenderer, the parser, the detokenizer and the stream state are
vLLM's. Each stream chunk is one token, and its state goes through JSON between chunks, as over HTTP.
"""

from __future__ import annotations

import json
import sys
import traceback
from types import SimpleNamespace
from typing import Any


def _derenderer(tokenizer_dir: str, tool_parser: str, eos_ids: list[int]) -> Any:
    from vllm.renderers.online_derenderer import OnlineDerenderer
    from vllm.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(tokenizer_dir)
    model_config = SimpleNamespace(
        model=tokenizer_dir, hf_config=SimpleNamespace(model_type="llama"), hf_text_config=None,
        hf_overrides=None, max_model_len=131072, max_logprobs=20,
        try_get_generation_config=lambda: {"eos_token_id": eos_ids},
    )
    renderer = SimpleNamespace(tokenizer=tokenizer, get_tokenizer=lambda: tokenizer,
                               get_eos_token_id=lambda: tokenizer.eos_token_id, _executor=None)
    return OnlineDerenderer(model_config, renderer, request_logger=None, chat_template=None,  # type: ignore[arg-type]
                            chat_template_content_format="auto", enable_auto_tools=True, tool_parser=tool_parser)


def _calls(tool_calls: Any) -> list[dict[str, Any]]:
    return [{"name": c.function.name, "arguments": c.function.arguments} for c in tool_calls or []]


def _batch(derenderer: Any, request: Any, case: dict[str, Any]) -> dict[str, Any]:
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateTokensResponse

    gen = GenerateTokensResponse.model_validate({"request_id": "r", "choices": [{
        "index": 0, "token_ids": case["token_ids"], "finish_reason": case["finish_reason"],
        "stop_reason": case.get("stop_reason")}]})
    choices, _ = derenderer._derender_chat(gen, request, [])
    message = choices[0].message
    return {"content": message.content, "tool_calls": _calls(message.tool_calls),
            "finish_reason": choices[0].finish_reason}


def _stream(derenderer: Any, request: Any, case: dict[str, Any]) -> dict[str, Any]:
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
        DerenderStreamState,
        GenerateTokensStreamResponse,
    )

    ids = case["token_ids"]
    state = DerenderStreamState()
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        chunk = GenerateTokensStreamResponse.model_validate({"request_id": "r", "choices": [{
            "index": 0, "token_ids": [token], "finish_reason": case["finish_reason"] if last else None,
            "stop_reason": case.get("stop_reason") if last else None}]})
        out, state = derenderer._derender_chat_stream_parsed(derenderer.parser, "m", chunk, state, request, None, [])
        state = DerenderStreamState.model_validate_json(state.model_dump_json())  # over the wire
        choice = out.choices[0]
        if choice.delta.content:
            content.append(choice.delta.content)
        for tc in choice.delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"name": None, "arguments": ""})
            if tc.function is not None and tc.function.name:
                call["name"] = tc.function.name
            if tc.function is not None and tc.function.arguments:
                call["arguments"] += tc.function.arguments
        finish = choice.finish_reason or finish
    return {"content": "".join(content) or None, "tool_calls": [calls[i] for i in sorted(calls)],
            "finish_reason": finish}


def _guarded(run: Any, *args: Any) -> dict[str, Any]:
    try:
        return dict(run(*args))
    except Exception as exc:  # what vLLM raised is the answer for this case
        return {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc(limit=4)[-800:]}


def main() -> None:
    spec = json.load(sys.stdin)
    from vllm import __version__
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    derenderer = _derenderer(spec["tokenizer_dir"], spec["tool_parser"], spec["eos_ids"])
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                   "tools": spec["tools"], "tool_choice": "auto"})
    results = {case["name"]: {"batch": _guarded(_batch, derenderer, request, case),
                              "stream": _guarded(_stream, derenderer, request, case)}
               for case in spec["cases"]}
    print(json.dumps({"vllm_version": __version__, "results": results}, ensure_ascii=False))


if __name__ == "__main__":
    main()

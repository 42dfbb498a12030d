"""``echo`` and prompt logprobs end to end through the gateway, with lm-eval-harness's request shapes.

lm-eval's loglikelihood tasks (``local-completions``, lm_eval/models/openai_completions.py) send
``{"prompt": [[token ids], ...], "echo": true, "logprobs": 1, "max_tokens": 1, "temperature": 0, "seed": 1234}``
to /v1/completions and read ``choices[i].logprobs.token_logprobs[ctxlen:-1]`` (the continuation, without the
generated token) and ``top_logprobs`` (greedy when the continuation token is each position's best); other
harnesses send ``max_tokens: 0`` for the prompt alone. Real engine and gateway processes on a tiny random Qwen3
(the real Qwen3 tokenizer); the prompt logprobs are checked against what the engine itself answers on
/inference/v1/generate, and (where vLLM 0.32 is installed) against vLLM's own engine on the same weights.
"""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest

from tests.gateway_harness import QWEN3_TOKENIZER, engine_process, gateway_process
from tests.vllm_peers import needs_vllm032
from token_engine.models.random_model import write_random_model

CONTEXT = [785, 6722, 315, 9625, 374]  # "The capital of France is"
CONTINUATION = [12095, 13]  # " Paris."
OTHER = [40, 1075, 311, 8180, 11]  # "I like to eat,"


def lm_eval_payload(prompts, max_tokens: int = 1) -> dict:
    return {"model": "tiny", "prompt": prompts, "temperature": 0, "max_tokens": max_tokens, "logprobs": 1,
            "seed": 1234, "echo": True}


def lm_eval_parse(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """lm-eval's LocalCompletionsAPI.parse_logprobs for one choice (sum of the continuation, is_greedy)."""
    token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    return sum(token_logprobs), all(tok == max(top.values()) for tok, top in zip(token_logprobs, top_logprobs))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    model = write_random_model(tmp_path_factory.mktemp("echo") / "tiny", arch="qwen3", preset="tiny",
                               tokenizer_dir=QWEN3_TOKENIZER, dtype="float32")
    procs = []
    try:
        engine = engine_process(model)
        procs.append(engine)
        procs.append(gateway_process(model, ["--engine", engine.url]))
        # P/D: a request for prompt logprobs goes to a decode replica alone (never prefilled elsewhere)
        procs.append(gateway_process(model, ["--prefill", engine.url, "--decode", engine.url]))
        yield {"engine": engine, "collocated": procs[1], "disaggregated": procs[2]}
    finally:
        for p in reversed(procs):
            p.stop()


def engine_prompt_logprobs(engine_url: str, ids: list[int], k: int = 1) -> list:
    body = {"token_ids": ids, "sampling_params": {"max_tokens": 1, "temperature": 0, "prompt_logprobs": k,
                                                  "skip_reading_prefix_cache": True}}
    return httpx.post(engine_url + "/inference/v1/generate", json=body, timeout=60).json()["prompt_logprobs"]


@pytest.mark.parametrize("mode", ["collocated", "disaggregated"])
def test_lm_eval_loglikelihood_requests_get_the_prompts_logprobs(stack, mode):
    prompts = [CONTEXT + CONTINUATION, OTHER + CONTINUATION]
    r = httpx.post(stack[mode].url + "/v1/completions", json=lm_eval_payload(prompts), timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    choices = sorted(body["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1]
    for choice, prompt in zip(choices, prompts):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(prompt) + 1  # every prompt token, then the one generated token
        assert lp["token_ids"][:len(prompt)] == prompt
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing precedes it
        reference = engine_prompt_logprobs(stack["engine"].url, prompt)
        for i in range(1, len(prompt)):
            expected = reference[i][str(prompt[i])]["logprob"]
            assert math.isclose(lp["token_logprobs"][i], expected, abs_tol=1e-5)
            assert lp["tokens"][i] in lp["top_logprobs"][i] and len(lp["top_logprobs"][i]) <= 2  # own + best
        assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
        # the text is the prompt decoded, then the generated token
        assert choice["text"].startswith("The capital of France is Paris." if prompt[0] == CONTEXT[0]
                                         else "I like to eat, Paris.")
        # lm-eval's own arithmetic over the answer
        total, greedy = lm_eval_parse(choice, len(prompt) - len(CONTINUATION))
        best = [reference[i][str(prompt[i])]["rank"] == 1 for i in range(len(prompt) - 2, len(prompt))]
        assert math.isclose(total, sum(lp["token_logprobs"][-3:-1])) and greedy == all(best)
        # vLLM's prompt_logprobs on the choice: per position the ids' logprob, rank and decoded token
        entries = choice["prompt_logprobs"]
        assert entries[0] is None and len(entries) == len(prompt)
        assert entries[-1][str(prompt[-1])]["decoded_token"] == "."
        assert entries[-1][str(prompt[-1])]["logprob"] == lp["token_logprobs"][len(prompt) - 1]
    assert body["usage"]["prompt_tokens"] == sum(map(len, prompts)) and body["usage"]["completion_tokens"] == 2


def test_max_tokens_0_echoes_the_prompt_alone(stack):
    c = openai.OpenAI(base_url=stack["collocated"].url + "/v1", api_key="unused", max_retries=0, timeout=60)
    r = c.completions.create(model="tiny", prompt="The capital of France is Paris.", echo=True, logprobs=1,
                             max_tokens=0, temperature=0)
    choice = r.choices[0]
    assert choice.text == "The capital of France is Paris."
    assert choice.logprobs.tokens == ["The", " capital", " of", " France", " is", " Paris", "."]
    assert choice.logprobs.token_logprobs[0] is None and all(isinstance(x, float) for x in choice.logprobs.token_logprobs[1:])
    # as vLLM: the one token generated to get there is counted, and is why the choice ended
    assert choice.finish_reason == "length" and r.usage.completion_tokens == 1
    # lm-eval's other shape on the same prompt: the same prompt logprobs, then the generated token
    r1 = c.completions.create(model="tiny", prompt="The capital of France is Paris.", echo=True, logprobs=1,
                              max_tokens=1, temperature=0)
    assert r1.choices[0].logprobs.token_logprobs[:7] == choice.logprobs.token_logprobs
    assert r1.choices[0].text.startswith(choice.text) and len(r1.choices[0].logprobs.tokens) == 8


def test_echo_streams_the_prompt_first_and_echo_without_logprobs_streams_normally(stack):
    url = stack["collocated"].url + "/v1/completions"
    for logprobs in (None, 1):
        body = {"model": "tiny", "prompt": "The capital of France is", "echo": True, "max_tokens": 3,
                "temperature": 0, "stream": True, **({"logprobs": logprobs} if logprobs else {})}
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            assert r.status_code == 200
            events = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        texts = [e["choices"][0]["text"] for e in events if e["choices"]]
        assert texts[0].startswith("The capital of France is")
        whole = httpx.post(url, json={**body, "stream": False}, timeout=60).json()["choices"][0]
        assert "".join(texts) == whole["text"]
        if logprobs:
            tokens = [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]]
            assert tokens == whole["logprobs"]["tokens"] and len(tokens) == 5 + 3


def test_prompt_logprobs_on_completions_and_chat(stack):
    url = stack["collocated"].url
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": CONTEXT, "max_tokens": 2,
                                                   "prompt_logprobs": 2, "temperature": 0}, timeout=60).json()
    entries = r["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and all(str(t) in e for t, e in zip(CONTEXT[1:], entries[1:]))
    assert all(len(e) in (2, 3) for e in entries[1:])  # the prompt's token and the 2 best
    assert r["choices"][0]["text"] and not r["choices"][0]["text"].startswith("The")  # no echo
    chat = httpx.post(url + "/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "prompt_logprobs": 1,
        "chat_template_kwargs": {"enable_thinking": False}}, timeout=60).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    # vLLM refuses prompt logprobs on a stream, and chat has no echo through the gateway
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "prompt_logprobs": 1,
                                                   "stream": True}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 0}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


@needs_vllm032
@pytest.mark.slow  # vLLM's CPU engine takes minutes to start on a shared 2-core machine
def test_the_gateway_over_vllms_engine_gives_our_engines_prompt_logprobs(vllm032_engine):
    ours = engine_process(vllm032_engine.model, max_model_len=512)
    gateways = [gateway_process(vllm032_engine.model, ["--engine", url]) for url in (ours.url, vllm032_engine.url)]
    try:
        answers = []
        for gateway in gateways:
            r = httpx.post(gateway.url + "/v1/completions",
                           json=lm_eval_payload([CONTEXT + CONTINUATION, OTHER]), timeout=120)
            assert r.status_code == 200, r.text
            answers.append(sorted(r.json()["choices"], key=lambda c: c["index"]))
        for mine, theirs in zip(*answers):
            assert mine["logprobs"]["tokens"] == theirs["logprobs"]["tokens"]  # the same greedy token too
            assert mine["text"] == theirs["text"]
            for a, b in zip(mine["logprobs"]["token_logprobs"], theirs["logprobs"]["token_logprobs"]):
                assert (a is None and b is None) or math.isclose(a, b, abs_tol=1e-3)
            assert lm_eval_parse(mine, len(CONTEXT))[1] == lm_eval_parse(theirs, len(CONTEXT))[1]
    finally:
        for p in (*gateways, ours):
            p.stop()

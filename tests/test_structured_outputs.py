"""Structured outputs in the token engine (vLLM's `structured_outputs` sampling parameter, xgrammar backend).

A tiny random-weight Qwen3 with the real Qwen3 tokenizer: unconstrained it says garbage, so every output
that nevertheless parses, validates or fullmatches is the grammar's doing. JSON schemas here bound their
strings (maxLength, enum) and set disable_any_whitespace, so a random model closes them within a few
dozen tokens; the grammar forces the closing, the model cannot wander off.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from tokenizers import Tokenizer

from tests.engine_harness import FIXTURES, ServerThread, engine_config, step_until, wait_for_idle_blocks
from token_engine.core.engine import LLMEngine
from token_engine.core.sequence import SamplingOptions
from token_engine.models.random_model import write_random_model
from token_engine.structured import GrammarCompiler, GrammarError, parse_structured_outputs
from token_engine.structured.matcher import mask_by_bitmask_

QWEN3_TOKENIZER = FIXTURES / "qwen3-0.6b"
IM_END, END_OF_TEXT = 151645, 151643
PROMPT = [9707, 11, 1879, 0, 3555, 374, 279, 9104, 30]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["happy", "sad"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["name", "age", "mood", "tags"],
}
COMPACT = {"disable_any_whitespace": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("structured") / "tiny", arch="qwen3", preset="tiny",
                              overrides={"tie_word_embeddings": False}, tokenizer_dir=QWEN3_TOKENIZER,
                              dtype="float32")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def grammars(model_dir):
    """One vocabulary load (and one set of compile workers) for the whole module: engines share it."""
    compiler = GrammarCompiler(model_dir, 151936, [IM_END, END_OF_TEXT])
    yield compiler
    compiler.close()


def make_engine(model_dir, grammars, **kw) -> LLMEngine:
    llm = LLMEngine(engine_config(model_dir, **kw))
    llm.grammars = grammars
    return llm


@pytest.fixture(scope="module")
def llm(model_dir, grammars):
    return make_engine(model_dir, grammars)


def options(structured: dict | None, **kw) -> SamplingOptions:
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", 60)
    return SamplingOptions(stop_token_ids=frozenset([IM_END, END_OF_TEXT]),
                           structured=parse_structured_outputs(structured) if structured else None, **kw)


def run(llm: LLMEngine, requests: dict[str, tuple[list[int], SamplingOptions, int]]) -> dict[str, dict]:
    """Runs requests together to their ends: per id, {"tokens": [...] per choice, "finish": [...] per choice}."""
    results = {rid: {"tokens": [[] for _ in range(n)], "finish": [None] * n, "done": False}
               for rid, (_, _, n) in requests.items()}

    def collect(rid):
        def on_update(u):
            for d in u.deltas:
                results[rid]["tokens"][d.index].extend(d.token_ids)
                if d.finish_reason is not None:
                    results[rid]["finish"][d.index] = d.finish_reason
            results[rid]["done"] = u.finished
        return on_update

    for rid, (prompt, opts, n) in requests.items():
        llm.add_request(rid, prompt, opts, n=n, on_update=collect(rid))
    step_until([llm], lambda: all(r["done"] for r in results.values()), max_steps=2000)
    return results


def text_of(tokenizer, tokens: list[int]) -> str:
    return tokenizer.decode([t for t in tokens if t not in (IM_END, END_OF_TEXT)], skip_special_tokens=False)


def assert_ended_by_grammar(result: dict, index: int = 0) -> None:
    assert result["finish"][index] == "stop", result
    assert result["tokens"][index][-1] in (IM_END, END_OF_TEXT)  # EOS only once the grammar allowed it


# ---- the kinds of constraint ----------------------------------------------------------------------

def test_random_model_unconstrained_output_is_not_json(llm, tokenizer):
    # what makes the other tests meaningful: without a grammar this model does not write JSON
    out = run(llm, {"free": (PROMPT, options(None, max_tokens=30), 1)})["free"]
    with pytest.raises(ValueError):
        json.loads(text_of(tokenizer, out["tokens"][0]))


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 7},
                                      {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "seed": 3,
                                       "repetition_penalty": 1.3, "presence_penalty": 0.5, "logprobs": 2}])
def test_json_schema_output_validates_against_the_schema(llm, tokenizer, sampling):
    out = run(llm, {"j": (PROMPT, options({"json": PERSON, **COMPACT}, **sampling), 1)})["j"]
    assert_ended_by_grammar(out)
    value = json.loads(text_of(tokenizer, out["tokens"][0]))
    jsonschema.validate(value, PERSON)


def test_logprobs_report_the_unconstrained_model_distribution(llm):
    # raw logprobs (vLLM's default logprobs_mode): the grammar's forced tokens are rarely the model's own best
    entries = []
    llm.add_request("lp", PROMPT, options({"json": PERSON, **COMPACT}, logprobs=1),
                    on_update=lambda u: entries.extend(e for d in u.deltas for e in d.logprobs))
    step_until([llm], lambda: "lp" not in llm.requests, max_steps=200)
    assert entries and all(e.rank >= 1 and e.logprob <= e.top[0][1] for e in entries)
    assert any(e.rank > 1 for e in entries)  # a masked-out token outranked the one the grammar allowed


def test_json_schema_given_as_a_string_is_the_same_constraint(llm, tokenizer):
    as_dict = run(llm, {"d": (PROMPT, options({"json": PERSON, **COMPACT}), 1)})["d"]
    as_text = run(llm, {"s": (PROMPT, options({"json": json.dumps(PERSON), **COMPACT}), 1)})["s"]
    assert as_dict["tokens"] == as_text["tokens"]


def test_n_greater_than_one_gives_each_choice_its_own_grammar_state(llm, tokenizer):
    out = run(llm, {"n": (PROMPT, options({"json": PERSON, **COMPACT}, temperature=1.0, seed=11), 3)})["n"]
    values = []
    for i in range(3):
        assert_ended_by_grammar(out, i)
        values.append(json.loads(text_of(tokenizer, out["tokens"][i])))
        jsonschema.validate(values[-1], PERSON)
    assert len({json.dumps(v) for v in values}) > 1  # three seeds, three walks through the grammar


def test_choice_outputs_exactly_one_of_the_choices(llm, tokenizer):
    choices = ["red", "green", 'say "blue"\n']
    for seed in range(2):
        out = run(llm, {"c": (PROMPT, options({"choice": choices}, temperature=1.0, seed=seed), 1)})["c"]
        assert_ended_by_grammar(out)
        assert text_of(tokenizer, out["tokens"][0]) in choices


def test_regex_output_fullmatches(llm, tokenizer):
    pattern = r"[A-Z][a-z]{1,4}-\d{2,3}( ok)?"
    for seed in range(2):
        out = run(llm, {"r": (PROMPT, options({"regex": pattern}, temperature=1.0, seed=seed), 1)})["r"]
        assert re.fullmatch(pattern, text_of(tokenizer, out["tokens"][0]))


def test_gbnf_grammar_output_is_in_the_language(llm, tokenizer):
    grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x" [a-c]'
    out = run(llm, {"g": (PROMPT, options({"grammar": grammar}, temperature=1.0, seed=5, max_tokens=80), 1)})["g"]
    assert_ended_by_grammar(out)
    assert re.fullmatch(r"\((?:[0-9]|x[a-c])(?:,(?:[0-9]|x[a-c]))*\)", text_of(tokenizer, out["tokens"][0]))


def test_json_object_output_is_a_json_object(llm, tokenizer):
    # any JSON object, whitespace allowed: a random model may pad it, so only what it closed is checked
    out = run(llm, {"o": (PROMPT, options({"json_object": True}, max_tokens=120), 1)})["o"]
    text = text_of(tokenizer, out["tokens"][0])
    assert text.lstrip().startswith("{")
    if out["finish"][0] == "stop":
        assert isinstance(json.loads(text), dict)


def test_grammar_without_stop_tokens_ends_the_request_when_complete(llm, tokenizer):
    # ignore_eos and no stop ids: nothing may end it but the grammar itself
    opts = SamplingOptions(temperature=0.0, max_tokens=30, ignore_eos=True,
                           structured=parse_structured_outputs({"choice": ["alpha", "beta"]}))
    out = run(llm, {"e": (PROMPT, opts, 1)})["e"]
    assert out["finish"] == ["stop"]
    assert tokenizer.decode(out["tokens"][0]) in ("alpha", "beta")


# ---- scheduling: batches, chunks, preemption, abort --------------------------------------------------

def test_greedy_is_deterministic_and_unconstrained_neighbours_are_unaffected(llm):
    free = options(None, max_tokens=20)
    seeded = options(None, max_tokens=20, temperature=1.0, seed=99)
    alone = run(llm, {"a": (PROMPT, free, 1), "b": (PROMPT[:5], seeded, 1)})
    mixed = run(llm, {"j1": (PROMPT, options({"json": PERSON, **COMPACT}), 1), "a": (PROMPT, free, 1),
                      "j2": (PROMPT[:4], options({"choice": ["x", "y"]}, temperature=1.0, seed=1), 2),
                      "b": (PROMPT[:5], seeded, 1)})
    again = run(llm, {"j1": (PROMPT, options({"json": PERSON, **COMPACT}), 1)})
    assert mixed["a"]["tokens"] == alone["a"]["tokens"]
    assert mixed["b"]["tokens"] == alone["b"]["tokens"]
    assert again["j1"]["tokens"] == mixed["j1"]["tokens"]
    assert wait_for_idle_blocks(llm) == llm.num_blocks


def test_chunked_prefill_gives_the_same_constrained_output(llm, model_dir, grammars, tokenizer):
    prompt = (PROMPT * 5)[:41]
    whole = run(llm, {"w": (prompt, options({"json": PERSON, **COMPACT}), 1)})
    chunked_llm = make_engine(model_dir, grammars, max_num_batched_tokens=16)
    chunked = run(chunked_llm, {"w": (prompt, options({"json": PERSON, **COMPACT}), 1)})
    assert chunked["w"]["tokens"] == whole["w"]["tokens"]
    jsonschema.validate(json.loads(text_of(tokenizer, chunked["w"]["tokens"][0])), PERSON)


def test_preempted_sequences_resume_their_grammar_without_advancing_it_twice(llm, model_dir, grammars, tokenizer):
    # 16 blocks of 4 tokens cannot hold three growing sequences: some are preempted and recomputed
    requests = {f"p{i}": (PROMPT[: 6 + i], options({"json": PERSON, **COMPACT}, temperature=1.0, seed=i), 1)
                for i in range(3)}
    roomy = run(llm, dict(requests))
    tight = make_engine(model_dir, grammars, num_gpu_blocks_override=16, max_model_len=64)
    seen_states = []

    original_step = tight.step

    def checked_step():  # after every step: each live grammar has accepted exactly the output so far
        worked = original_step()
        for state in tight.requests.values():
            for seq in state.seqs:
                if seq.grammar is not None:
                    seen_states.append(seq.grammar.num_seen == seq.num_output_tokens)
        return worked

    tight.step = checked_step
    squeezed = run(tight, dict(requests))
    assert tight.scheduler.num_preemptions > 0
    assert seen_states and all(seen_states)
    for rid in requests:
        assert squeezed[rid]["tokens"] == roomy[rid]["tokens"]
        jsonschema.validate(json.loads(text_of(tokenizer, squeezed[rid]["tokens"][0])), PERSON)
    assert wait_for_idle_blocks(tight) == tight.num_blocks


def test_abort_frees_the_grammar_state_and_the_blocks(llm):
    state = llm.add_request("ab", PROMPT, options({"json_object": True}, max_tokens=100), n=2)
    for _ in range(3):
        llm.step()
    assert all(seq.grammar is not None for seq in state.seqs)
    llm.abort_request("ab")
    assert all(seq.grammar is None and seq.finish_reason == "abort" for seq in state.seqs)
    assert llm.num_free_blocks() == llm.num_blocks and not llm.requests


def test_a_constraint_that_leaves_no_allowed_token_ends_in_an_error_not_a_hang(llm):
    # allowed_token_ids and the grammar disagree on every token: the sequence fails with a clear error
    opts = options({"choice": ["yes"]}, allowed_token_ids=(15,))
    errors = []
    llm.add_request("clash", PROMPT, opts, on_update=lambda u: errors.append(u.error) if u.finished else None)
    step_until([llm], lambda: bool(errors), max_steps=50)
    assert "not allowed by the grammar" in errors[0]


# ---- compile errors, cache, bounds --------------------------------------------------------------------

@pytest.mark.parametrize("structured, fragment", [
    ({"regex": "(ab"}, "parenthesis"),
    ({"json": {"type": "frobnicate"}}, "frobnicate"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"grammar": "root ::= "}, "EBNF"),
    ({"grammar": 'start ::= "a"'}, "root"),
])
def test_invalid_specs_raise_the_library_message(grammars, structured, fragment):
    with pytest.raises(GrammarError) as exc:
        grammars.compile(parse_structured_outputs(structured))
    assert fragment in exc.value.message and exc.value.param == "sampling_params.structured_outputs"


def test_vllms_serialized_params_with_every_field_are_read_as_one_constraint():
    # vLLM's render writes the whole dataclass: unset kinds as null, flags as false, private fields too
    raw = {"json": None, "regex": "[0-9]+", "choice": None, "grammar": None, "json_object": None,
           "disable_fallback": False, "disable_any_whitespace": False, "disable_additional_properties": False,
           "whitespace_pattern": None, "structural_tag": None, "_backend": None, "_backend_was_auto": False,
           "a_newer_flag": False}
    assert parse_structured_outputs(raw) == parse_structured_outputs({"regex": "[0-9]+"})
    with pytest.raises(GrammarError) as exc:
        parse_structured_outputs({**raw, "a_newer_flag": True})  # set, and nothing here can honour it
    assert "a_newer_flag" in exc.value.message


def test_compiled_grammars_are_cached_by_kind_and_spec(grammars):
    first = grammars.compile(parse_structured_outputs({"json": PERSON, **COMPACT}))
    assert grammars.compile(parse_structured_outputs({"json": json.dumps(PERSON), **COMPACT})) is first
    assert grammars.compile(parse_structured_outputs({"json": PERSON})) is not first  # whitespace differs


# ---- over HTTP: error bodies, streaming, bounded compile ----------------------------------------------

def post(client: httpx.Client, structured, **extra):
    body = {"token_ids": PROMPT, "sampling_params": {"temperature": 0, "max_tokens": 60,
                                                     "stop_token_ids": [IM_END, END_OF_TEXT],
                                                     "structured_outputs": structured}, **extra}
    return client.post("/inference/v1/generate", json=body)


def assert_error_body(r: httpx.Response, fragment: str, param: str | None = "sampling_params.structured_outputs"):
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == 400
    assert error["param"] == param
    assert fragment in error["message"], error["message"]


@pytest.fixture(scope="module")
def server(model_dir, grammars):
    with ServerThread(engine_config(model_dir)) as srv:
        srv.llm.grammars = grammars  # the module's one vocabulary load
        yield srv


@pytest.mark.parametrize("structured, fragment", [
    ({"regex": "[a-"}, "regex"),
    ({"json": {"type": "object", "properties": 3}}, "properties"),
    ({"grammar": "root ::= ("}, "grammar"),
    ({"json": {}, "regex": "a"}, "exactly one"),
    ({}, "exactly one"),
    ({"choice": []}, "non-empty list"),
    ({"choice": "a"}, "non-empty list"),
    ({"json_object": "yes"}, "must be true"),
    ({"regex": "a", "whitespace_pattern": " *"}, "whitespace_pattern"),
    ({"regex": "a", "guided": 1}, "unknown keys"),
    ({"json": 3}, "JSON object"),
    ("json", "$.sampling_params.structured_outputs"),  # the wire type is an object: msgspec refuses it
])
def test_bad_specs_get_an_openai_error_body_over_http(server, structured, fragment):
    with server.client() as c:
        # a wire-type error points into the body, as vLLM's validation 400 does
        param = "body.sampling_params.structured_outputs" if isinstance(structured, str) else (
            "sampling_params.structured_outputs")
        assert_error_body(post(c, structured), fragment, param)
        # and the engine still serves: a good request right after
        ok = post(c, {"choice": ["fine"]})
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "stop"


def test_constraints_that_leave_no_token_are_a_400_over_http(server):
    # the request's own allowed_token_ids disagree with its grammar on every token: its fault, not the engine's
    with server.client() as c:
        body = {"token_ids": PROMPT, "sampling_params": {"temperature": 0, "max_tokens": 5, "allowed_token_ids": [15],
                                                         "structured_outputs": {"choice": ["yes"]}}}
        r = c.post("/inference/v1/generate", json=body)
        assert r.status_code == 400, r.text
        assert "not allowed by the grammar" in r.json()["error"]["message"]
        streamed = c.post("/inference/v1/generate", json={**body, "stream": True})
        events = [json.loads(line[6:]) for line in streamed.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        assert streamed.status_code == 200 and events[-1]["error"]["code"] == 400


def test_http_streamed_and_batched_constrained_outputs_agree(server, tokenizer):
    spec = {"json": PERSON, **COMPACT}
    with server.client() as c:
        batch = post(c, spec, request_id="batch").json()["choices"][0]
        tokens = []
        with c.stream("POST", "/inference/v1/generate", json={
                "token_ids": PROMPT, "stream": True, "request_id": "stream",
                "sampling_params": {"temperature": 0, "max_tokens": 60, "stop_token_ids": [IM_END, END_OF_TEXT],
                                    "structured_outputs": spec}}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    tokens.extend(t for ch in json.loads(line[6:])["choices"] for t in ch["token_ids"])
    assert tokens == batch["token_ids"] and batch["finish_reason"] == "stop"
    jsonschema.validate(json.loads(text_of(tokenizer, tokens)), PERSON)
    assert wait_for_idle_blocks(server.llm) == server.llm.num_blocks


THINK_END = 151668  # </think>


@pytest.mark.parametrize("reasoning_ended", [False, True, None])
def test_reasoning_ended_false_leaves_the_reasoning_unconstrained_until_think_end(server, tokenizer, reasoning_ended):
    # a bias makes the model close its reasoning at once; the grammar then has the rest of the output
    body = {"token_ids": PROMPT, "reasoning_ended": reasoning_ended,
            "sampling_params": {"temperature": 0, "max_tokens": 60, "stop_token_ids": [IM_END, END_OF_TEXT],
                                "logit_bias": {str(THINK_END): 100}, "structured_outputs": {"choice": ["on", "off"]}}}
    with server.client() as c:
        choice = c.post("/inference/v1/generate", json=body).json()["choices"][0]
    tokens = choice["token_ids"]
    assert choice["finish_reason"] == "stop" and tokens[-1] in (IM_END, END_OF_TEXT)
    if reasoning_ended is False:  # unconstrained first token: the biased </think>; then only a choice
        assert tokens[0] == THINK_END and text_of(tokenizer, tokens[1:]) in ("on", "off")
    else:  # constrained from the first token: </think> is not in the grammar, whatever its bias
        assert THINK_END not in tokens and text_of(tokenizer, tokens) in ("on", "off")


def test_a_model_without_a_tokenizer_refuses_structured_outputs_with_a_400(tmp_path):
    bare = write_random_model(tmp_path / "bare", arch="qwen3", preset="tiny", dtype="float32")
    with ServerThread(engine_config(bare)) as srv, srv.client() as c:
        assert_error_body(post(c, {"choice": ["a"]}), "tokenizer.json")
        plain = c.post("/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 3}})
        assert plain.status_code == 200


def test_a_grammar_too_slow_to_compile_fails_its_request_and_the_engine_keeps_serving(server, grammars):
    # a limit of 0 s: any grammar not already compiled is too slow; its worker is killed and replaced
    spec = {"regex": "[a-z]{1,900}"}
    grammars.compile_timeout_s = 0.0
    try:
        with server.client() as c:
            assert_error_body(post(c, spec), "did not compile within")
            plain = c.post("/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 3}})
            assert plain.status_code == 200 and len(plain.json()["choices"][0]["token_ids"]) == 3
    finally:
        grammars.compile_timeout_s = 10.0
    # too slow once is too slow again: cached, where the old thread-based compile ran on and cached a grammar
    with pytest.raises(GrammarError, match="did not compile within"):
        grammars.compile(parse_structured_outputs(spec))
    assert grammars.compile(parse_structured_outputs({"regex": "[a-z]{1,20}"})) is not None  # a fresh worker


def test_the_device_agnostic_mask_equals_xgrammars_cpu_kernel(grammars):
    # the path CUDA logits take (plain torch ops), checked against xgrammar's own kernel on CPU
    import torch
    import xgrammar

    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 151936 // 32), dtype=torch.int32,
                            generator=torch.Generator().manual_seed(0))
    logits = torch.randn(3, 151936, generator=torch.Generator().manual_seed(1))
    ours, theirs = logits.clone(), logits.clone()
    mask_by_bitmask_(ours, bitmask)
    xgrammar.apply_token_bitmask_inplace(theirs, bitmask)
    assert torch.equal(ours, theirs) and torch.isinf(ours).any() and torch.isfinite(ours).any()


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_constrained_generation_on_cuda_validates(model_dir, grammars, tokenizer):
    # the mask is applied on the logits' device (torch ops, no Triton); random weights, so only the grammar
    # can make the output valid
    llm = LLMEngine(engine_config(model_dir, device="cuda"))
    llm.grammars = grammars
    out = run(llm, {"g": (PROMPT, options({"json": PERSON, **COMPACT}, temperature=1.0, seed=4), 2)})["g"]
    for i in range(2):
        assert_ended_by_grammar(out, i)
        jsonschema.validate(json.loads(text_of(tokenizer, out["tokens"][i])), PERSON)
    assert wait_for_idle_blocks(llm) == llm.num_blocks


# ---- the gateway end to end: forced tool_choice over our engine --------------------------------------

# A model whose next-token preference never changes, so only the grammar decides the shape: every layer is
# the identity, every token embeds to the same vector, and the lm_head favours ending its reasoning, then
# closing a JSON value ('</think>' > '"}' > '}]' > ']' > '}' > '"'), all else tied (ties go to the lowest id).
# Unconstrained it says '</think></think>...'; under a grammar it fills what is required and then closes, so
# tool calls end within a few dozen tokens.
PREFERRED = {151668: 4.0, 9207: 3.0, 25439: 2.8, 60: 2.6, 92: 2.4, 1: 2.0}

# strict: true pins each call's arguments to the schema (vLLM 0.32's hermes structural tag constrains only the
# call's envelope for a tool that does not say so, and this model would ramble inside a free JSON string)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city", "strict": True,
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit", "days"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a zone", "strict": True,
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def write_preferring_qwen3(out_dir):
    from tests.gateway_harness import save_scripted, write_passthrough_qwen3

    out, tensors = write_passthrough_qwen3(out_dir)
    embed, head = tensors["model.embed_tokens.weight"], tensors["lm_head.weight"]
    embed.zero_()
    embed[:, 0] = 1.0
    head.zero_()
    for token, weight in PREFERRED.items():
        head[token, 0] = weight
    return save_scripted(out, tensors)


@pytest.fixture(scope="module")
def forced_model(tmp_path_factory):
    return write_preferring_qwen3(tmp_path_factory.mktemp("forced") / "tiny")


@pytest.fixture(scope="module")
def gateway(forced_model):
    from tests.gateway_harness import engine_process, gateway_process

    procs = []
    try:
        procs.append(engine_process(forced_model, max_model_len=512))
        procs.append(gateway_process(forced_model, ["--engine", procs[0].url]))
        yield {"engine": procs[0], "gateway": procs[1]}
    finally:
        for p in reversed(procs):
            p.stop()


def gateway_client(gateway):
    import openai

    return openai.OpenAI(base_url=gateway["gateway"].url + "/v1", api_key="unused", max_retries=0, timeout=120)


def schema_of(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


def folded_tool_calls(chunks) -> tuple[dict[int, dict], str | None]:
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
    return calls, finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}},
                                         {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_choice_through_the_gateway_yields_calls_whose_arguments_validate(gateway, tool_choice):
    c = gateway_client(gateway)
    # one call: this model would start call after call under "required" (its tied logits favour "<")
    kw = dict(model="tiny", messages=USER, tools=TOOLS, tool_choice=tool_choice, temperature=0, max_tokens=120,
              extra_body=NO_THINKING, parallel_tool_calls=False)
    r = c.chat.completions.create(**kw)
    message = r.choices[0].message
    assert r.choices[0].finish_reason != "length" and message.tool_calls, r
    for call in message.tool_calls:
        if isinstance(tool_choice, dict):
            assert call.function.name == tool_choice["function"]["name"]
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, schema_of(call.function.name))
        assert list(arguments) == list(schema_of(call.function.name)["properties"])  # the schema's key order

    streamed, finish = folded_tool_calls(c.chat.completions.create(stream=True, **kw))
    assert finish == r.choices[0].finish_reason
    assert [(v["name"], json.loads(v["arguments"])) for _, v in sorted(streamed.items())] == [
        (call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls]


def test_with_thinking_on_the_tool_call_grammar_starts_after_the_reasoning(gateway):
    # the prompt leaves Qwen3 thinking (reasoning_ended false): the model closes its reasoning unconstrained,
    # then the grammar makes the call; constrained from the first token, </think> could never be written
    c = gateway_client(gateway)
    tool_choice = {"type": "function", "function": {"name": "get_weather"}}
    r = c.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice=tool_choice, temperature=0,
                                  max_tokens=120, extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"][0] == THINK_END
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), schema_of("get_weather"))


@pytest.mark.parametrize("parser, opening, finish", [
    # Qwen3-Coder's XML lets whitespace follow a parameter, and this model's ties favour a tab: it writes tabs
    # until max_tokens, inside the call
    ("qwen3_xml", "<tool_call>\n<function=get_time>\n<parameter=zone>", "length"),
    ("llama3_json", '{"name": "get_time", "parameters": {', "stop")])
def test_a_forced_call_in_the_families_own_syntax_through_the_engine(gateway, forced_model, parser, opening, finish):
    # render writes vLLM's structural tag for the family, our engine compiles it and holds the model to it, and
    # derender reads the call: the whole flow in a syntax that is not hermes'
    from tests.gateway_harness import gateway_process

    stack = {"gateway": gateway_process(forced_model, ["--engine", gateway["engine"].url], "--tool-call-parser", parser)}
    try:
        r = gateway_client(stack).chat.completions.create(
            model="tiny", messages=USER, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
            temperature=0, max_tokens=80, extra_body={**NO_THINKING, "return_token_ids": True})
    finally:
        stack["gateway"].stop()
    choice = r.choices[0]
    text = forced_model_tokenizer(forced_model).decode(choice.model_extra["token_ids"], skip_special_tokens=False)
    # (this model spells the markers a character at a time: it prefers none of their tokens)
    assert text.startswith(opening) and choice.finish_reason == finish, (text, choice.finish_reason)
    assert [call.function.name for call in choice.message.tool_calls] == ["get_time"]
    jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), schema_of("get_time"))


def forced_model_tokenizer(model_dir):
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def test_response_format_json_schema_through_the_gateway_gives_content_that_validates(gateway):
    schema = schema_of("get_weather")
    r = gateway_client(gateway).chat.completions.create(
        model="tiny", messages=USER, temperature=0, max_tokens=120, extra_body=NO_THINKING,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_an_invalid_schema_through_the_gateway_is_the_engines_400(gateway):
    import openai

    with pytest.raises(openai.BadRequestError) as exc:
        gateway_client(gateway).chat.completions.create(
            model="tiny", messages=USER, temperature=0, max_tokens=20,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
    assert "nonsense" in exc.value.message


# response_format structural tags in both of vLLM's forms, passed on as vLLM's render writes them (checked against
# 0.33's render server: the json.dumps of the format's model); the engine compiles them
STRUCTURAL_FORMATS = {
    "format": {"type": "structural_tag", "format": {
        "type": "tag", "begin": "<answer>", "content": {"type": "const_string", "value": "yes"}, "end": "</answer>"}},
    "legacy": {"type": "structural_tag", "triggers": ["<f="], "structures": [
        {"begin": "<f=a>", "schema": {"type": "object", "properties": {"k": {"enum": [1]}}, "required": ["k"]},
         "end": "</f>"}]},
}


def test_a_structural_tag_response_format_in_either_form_constrains_the_reply(gateway):
    from render_service.render.response_format import requested_structured_outputs
    from render_service.wire.protocol import ChatCompletionRequest

    req = ChatCompletionRequest(messages=USER, response_format=STRUCTURAL_FORMATS["legacy"])
    assert requested_structured_outputs(req) == {
        "structural_tag": '{"type": "structural_tag", "structures": [{"begin": "<f=a>", "schema": {"type": "object", '
                          '"properties": {"k": {"enum": [1]}}, "required": ["k"]}, "end": "</f>"}], "triggers": ["<f="]}'}
    client = gateway_client(gateway)
    r = client.chat.completions.create(model="tiny", messages=USER, temperature=0, max_tokens=40,
                                       extra_body=NO_THINKING, response_format=STRUCTURAL_FORMATS["format"])
    # this model writes a character a token: 20 of them, then the stop token the completed tag leaves
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("<answer>yes</answer>", "stop")
    r = client.chat.completions.create(model="tiny", messages=USER, temperature=0, max_tokens=60,
                                       extra_body=NO_THINKING, response_format=STRUCTURAL_FORMATS["legacy"])
    text = r.choices[0].message.content  # free text; a call once the model writes the trigger
    for call in re.findall(r"<f=a>(.*?)</f>", text, re.S):
        assert json.loads(call) == {"k": 1}


@pytest.mark.parametrize("fmt", [{"type": "structural_tag"}, {"type": "structural_tag", "triggers": ["<f="]},
                                 {"type": "structural_tag", "triggers": ["<f="],
                                  "structures": [{"begin": "<f=a>", "end": "</f>"}]},
                                 {"type": "structural_tag", "format": {"type": "nonsense"}}])
def test_a_malformed_structural_tag_response_format_is_a_400(gateway, fmt):
    import openai

    with pytest.raises(openai.BadRequestError) as exc:  # render's 400, or the engine's for a format it cannot compile
        gateway_client(gateway).chat.completions.create(model="tiny", messages=USER, temperature=0, max_tokens=20,
                                                        extra_body=NO_THINKING, response_format=fmt)
    assert exc.value.status_code == 400


def test_the_engine_is_idle_after_the_forced_tool_calls(gateway):
    from tests.gateway_harness import wait_until_idle

    state = wait_until_idle(gateway["engine"].url)
    assert state["num_free_blocks"] == state["num_blocks"] and state["num_running"] == 0


@pytest.mark.slow  # three more processes (two engines over NIXL, a gateway)
def test_disaggregated_gateway_gives_the_collocated_tool_calls(gateway, forced_model):
    # prefill and decode engines over NIXL: both compile the grammar; decode samples the output under it
    from tests.gateway_harness import engine_process, gateway_process, wait_until_idle

    procs = []
    try:
        prefill = engine_process(forced_model, kv_engine_id="so-prefill", max_model_len=512, wait=False)
        procs.append(prefill)
        decode = engine_process(forced_model, kv_engine_id="so-decode", max_model_len=512, wait=False)
        procs.append(decode)
        prefill.wait_healthy()
        decode.wait_healthy()
        procs.append(gateway_process(forced_model, ["--prefill", prefill.url, "--decode", decode.url]))
        disaggregated = {"gateway": procs[-1]}
        for extra in (NO_THINKING, {}):
            answers = []
            for stack in (gateway, disaggregated):
                r = gateway_client(stack).chat.completions.create(
                    model="tiny", messages=USER, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=120,
                    extra_body={**extra, "return_token_ids": True})
                calls = [(t.function.name, json.loads(t.function.arguments)) for t in r.choices[0].message.tool_calls]
                answers.append((r.choices[0].model_extra["token_ids"], calls))
            assert answers[0] == answers[1] and answers[0][1]
        for engine in (prefill, decode):
            state = wait_until_idle(engine.url)
            assert state["num_running"] == 0 and state["num_waiting"] == 0
    finally:
        for p in reversed(procs):
            p.stop()

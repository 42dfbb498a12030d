"""The prefix store: a new prompt reuses the ids of a stored prompt's head up to a cut inside the common head;
ids stay identical to ``tokenizers`` on every chunking, rewrite and overlap of added tokens."""

from __future__ import annotations

import array

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from render_service.tokenize.incremental_tokenizer import IncrementalEncoder
from render_service.tokenize.prompt_prefix_store import PrefixStore, StoredPrompt, common_head
from render_service.tokenize.tokenizer import TextTokenizer
from tests.test_incremental_tokenizer import PROPERTY, qwen_fast, ref, texts  # noqa: F401 (fixture)

edits = st.tuples(st.integers(0, 10_000), st.integers(0, 40), texts)


@PROPERTY
@given(parts=st.lists(texts, min_size=1, max_size=6), rewrites=st.lists(edits, max_size=3))
def test_growing_and_rewritten_prompts_equal_tokenizers(qwen_fast, parts, rewrites):  # noqa: F811
    """Each turn extends the last; then earlier text is replaced (as Qwen3 drops old reasoning): every turn,
    reused or not, equals tokenizers."""
    encoder = IncrementalEncoder(qwen_fast, 1 << 22, prefix_base=4)
    text = ""
    for part in parts:
        text += part
        assert encoder.encode(text) == ref(qwen_fast, text)
    for at, cut, new in rewrites:
        at %= len(text) + 1
        text = text[:at] + new + text[at + cut:]
        assert encoder.encode(text) == ref(qwen_fast, text)
        assert encoder.encode(text + parts[0]) == ref(qwen_fast, text + parts[0])


def test_a_growing_conversation_reuses_its_last_turn_and_keeps_one_prompt(qwen_fast):  # noqa: F811
    encoder = IncrementalEncoder(qwen_fast, 1 << 24)
    turn = "<|im_start|>user\nrun the tests please<|im_end|>\n<|im_start|>assistant\n<think>\nok</think>\n" \
           "<tool_call>\n{\"name\": \"run\"}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n"
    text = "<|im_start|>system\nYou are an agent.<|im_end|>\n"
    for round_no in range(12):
        text += turn + f"result {round_no}: " + "passed " * 200 + "</tool_response><|im_end|>\n"
        prompt = text + "<|im_start|>assistant\n"
        before = encoder.reused_tokens
        assert encoder.encode(prompt) == ref(qwen_fast, prompt)
        if len(prompt) > 2048:  # long enough to be filed (twice the base)
            assert encoder.reused_tokens > before
    assert encoder.prefixes is not None and len(encoder.prefixes) == 1  # each turn replaced the one before


def test_a_cut_waits_for_the_longest_added_token_to_be_decided():
    """With added tokens <x> and <x>yz, a prompt ending in '<x>y' is cut after <x>; the next one, '<x>yz...',
    is one token there. Reusing the cut without the margin would give <x> + 'yz'."""
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<x>", special=True, normalized=False),
                            AddedToken("<x>yz", special=True, normalized=False)])
    tokenizer = TextTokenizer.from_bytes(tok.to_str().encode("utf-8"), fast=False)
    encoder = IncrementalEncoder(tokenizer, 1 << 22, prefix_base=4)
    assert encoder.enabled and encoder._reach == {"<x>": 2, "<x>yz": 0}
    first = "a b c d e f g h<x>y"
    second = "a b c d e f g h<x>yz and more"
    assert encoder.encode(first) == ref(tokenizer, first)
    assert encoder.encode(second) == ref(tokenizer, second)
    assert tokenizer.hf.token_to_id("<x>yz") in ref(tokenizer, second)


def test_store_stays_under_its_byte_bound(qwen_fast):  # noqa: F811
    encoder = IncrementalEncoder(qwen_fast, 400_000, prefix_base=64)
    store = encoder.prefixes
    assert store is not None and store.max_bytes == 100_000
    for i in range(60):  # unrelated prompts: nothing reused, the oldest dropped
        text = f"<|im_start|>system\nagent {i}<|im_end|>\n" + f"line {i} of output\n" * 60
        assert encoder.encode(text) == ref(qwen_fast, text)
        assert store.bytes <= store.max_bytes
    assert 0 < len(store) < 60
    assert store.stats().evictions == 60 - len(store)  # every prompt was kept, the oldest dropped to fit


def test_prompts_sharing_a_system_prompt_each_find_their_own_turn(qwen_fast):  # noqa: F811
    """Eight agents with one long system prompt: each turn is found through the larger checkpoints, past the
    shared head's crowded buckets."""
    encoder = IncrementalEncoder(qwen_fast, 1 << 26, prefix_base=256)
    head = "<|im_start|>system\n" + "Shared instructions for every agent. " * 60 + "<|im_end|>\n"
    texts_now = {agent: head + f"<|im_start|>user\ntask {agent}: " + f"{agent} " * 400 for agent in range(8)}
    for round_no in range(3):
        for agent in range(8):
            texts_now[agent] += f"<|im_end|>\n<|im_start|>user\nround {round_no} " + "x y " * 50
            before = encoder.reused_tokens
            assert encoder.encode(texts_now[agent]) == ref(qwen_fast, texts_now[agent])
            if round_no:
                assert encoder.reused_tokens - before > len(ref(qwen_fast, head))


def test_stored_prompts_leave_the_garbage_collectors_tracking(qwen_fast):  # noqa: F811
    """A stored prompt holds no list of its ids (a full collection would walk each one): its parts are untracked,
    but for the tuple of its chunks, whose array chunks (fastokens' ids) refer to their type alone."""
    import gc

    encoder = IncrementalEncoder(qwen_fast, 1 << 22, prefix_base=16)
    text = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n" + "many words here " * 20
    encoder.encode(text)
    assert encoder.encode(text + "<|im_end|>") == ref(qwen_fast, text + "<|im_end|>")
    gc.collect()
    assert encoder.prefixes is not None
    reuse = encoder.prefixes.find(text + "<|im_end|>")
    assert reuse is not None and len(encoder.prefixes) == 1
    prompt = reuse.prompt
    assert not any(gc.is_tracked(part) for part in prompt if part is not prompt.chunks)
    assert any(type(chunk) is array.array for chunk in prompt.chunks)
    assert all(not gc.is_tracked(chunk) or gc.get_referents(chunk) == [array.array] for chunk in prompt.chunks)


@given(head=st.text(max_size=300), a=st.text(max_size=300), b=st.text(max_size=300))
def test_common_head_is_the_true_one(head, a, b):
    text, other = head + a, head + b
    true = len(head) + next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    found = common_head(text, other)
    assert found == true


def test_store_refuses_bad_bounds_and_skips_prompts_too_short_to_file():
    with pytest.raises(ValueError):
        PrefixStore(-1)
    store = PrefixStore(1 << 20, base=1024)
    store.add(StoredPrompt("short", 1, ((1,),), (b"1",), (), (), (), ()))
    assert len(store) == 0 and store.find("short and more") is None


def test_lone_surrogate_after_a_reused_head_is_refused_as_the_tokenizer_refuses_it(qwen_fast):  # noqa: F811
    encoder = IncrementalEncoder(qwen_fast, 1 << 22, prefix_base=16)
    good = "<|im_start|>user\nhé, a question about the code<|im_end|>\n<|im_start|>assistant\n"
    encoder.encode(good)
    bad = good + "x \ud800 y<|im_end|>"
    with pytest.raises(ValueError) as ours:
        encoder.encode(bad)
    with pytest.raises(ValueError) as theirs:
        qwen_fast.encode(bad)
    assert str(ours.value) == str(theirs.value)
    assert encoder.encode(good + "fine") == ref(qwen_fast, good + "fine")


def test_two_render_lanes_share_one_store_safely(qwen_fast):  # noqa: F811
    """Two threads grow conversations that share a head, through one small store that drops prompts."""
    import threading

    encoder = IncrementalEncoder(qwen_fast, 120_000, prefix_base=32)
    head = "<|im_start|>system\nshared tools and rules<|im_end|>\n"
    turns = [head + "".join(f"<|im_start|>user\nagent {a} turn {t} {'data ' * (t % 5)}<|im_end|>\n"
                            for t in range(n)) for a in range(4) for n in range(1, 12)]
    expected = {text: ref(qwen_fast, text) for text in turns}
    failures: list[str] = []

    def lane(order: list[str]) -> None:
        for text in order:
            if encoder.encode(text) != expected[text]:
                failures.append(text)

    threads = [threading.Thread(target=lane, args=(turns if k == 0 else turns[::-1],)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store = encoder.prefixes
    assert not failures and store is not None and encoder.reused_tokens > 0
    assert store.bytes <= store.max_bytes

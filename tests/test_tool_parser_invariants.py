"""The tool parsers' two invariants as hypothesis properties, for every tool-parser family in
``tests/tool_parser_invariants.FAMILIES``: generated outputs (prose, calls, prose; half of them cut anywhere,
as max_tokens cuts) and adversarial token soups, through the parser alone (any chunking, one character at a
time) and through the whole derender pipeline over the real Qwen3 tokenizer's IDs (batch == one-token
streaming with stream_state round trips, cut at any token).
"""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from render_service.bundle.model_bundle import load_bundle
from tests.shared_paths import QWEN3_FIXTURE_DIR
from tests.tool_parser_invariants import FAMILIES, check_parser, check_pipeline, outputs, token_soup

NAMES = sorted(FAMILIES)
CUTS = st.lists(st.integers(0, 400), max_size=8)
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@functools.cache
def qwen3():
    return load_bundle(str(QWEN3_FIXTURE_DIR)).tokenizer


@pytest.mark.parametrize("name", NAMES)
@FAST
@given(data=st.data(), cuts=CUTS)
def test_generated_outputs_keep_both_invariants(name, data, cuts):
    family = FAMILIES[name]
    check_parser(family, data.draw(outputs(family)), cuts)


def test_a_value_ending_in_a_backslash_before_the_closing_tag_keeps_both_invariants():
    # found by test_generated_outputs_keep_both_invariants[seed_oss]: the check took "\\<" for an escape
    text = "<seed:tool_call>\n<function=get_weather>\n<parameter=city>\\</parameter>\n</function>\n</seed:tool_call>"
    check_parser(FAMILIES["seed_oss"], text, [3, 40, 60])


def test_a_citation_closer_alone_keeps_both_invariants():
    # found by test_adversarial_soup_keeps_both_invariants[cohere_command3]: a citation closer's source list is
    # markup the parser drops with it, not text it lost
    check_parser(FAMILIES["cohere_command3"], "</co:1>", [2, 5])


@pytest.mark.parametrize("name", ["muse", "musespark", "muse_glimmer"])
def test_a_header_to_a_recipient_no_tool_has_keeps_both_invariants(name):
    # found by test_adversarial_soup_keeps_both_invariants[muse_glimmer]: ``to=selfnull`` before <|message|> is a
    # message to a tool named "selfnull" (its header is markup), not reasoning to "self" followed by "null"
    check_parser(FAMILIES[name], "to=selfnull<|message|>", [3, 9])
    check_parser(FAMILIES[name], "to=selfnull<|message|>x<|eom|>", [3, 9, 20])


def test_a_tag_opened_where_a_key_is_named_keeps_both_invariants():
    # found by test_adversarial_soup_keeps_both_invariants[minicpm5]: after the bare word "<function" where a key's
    # name goes, name="get_weather" was taken for an attribute of the key and dropped
    check_parser(FAMILIES["minicpm5"], '<function name="get_weather"><param name=<function name="get_weather">',
                 [5, 30, 50])


@pytest.mark.parametrize("call_id", ["functions.get_time:0x", "functions.get_time:0:functions.get_time:0"])
def test_a_malformed_kimi_id_keeps_both_invariants(call_id):
    # found by test_adversarial_soup_keeps_both_invariants[kimi_k2]: such an id names get_time, and writing it
    # anew as "functions.get_time:0" dropped the rest of what the model wrote
    check_parser(FAMILIES["kimi_k2"], f"<|tool_call_begin|>{call_id}<|tool_call_argument_begin|>", [5, 30])


@pytest.mark.parametrize("name", NAMES)
@FAST
@given(data=st.data(), cuts=CUTS)
def test_adversarial_soup_keeps_both_invariants(name, data, cuts):
    family = FAMILIES[name]
    check_parser(family, data.draw(token_soup(family)), cuts)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_pipeline_one_token_streaming_equals_batch_and_keeps_both_invariants(name, data):
    family = FAMILIES[name]
    text = data.draw(st.one_of(outputs(family), token_soup(family)))
    ids = qwen3().encode(text)
    ids = ids[: data.draw(st.integers(0, len(ids)))] if data.draw(st.booleans()) else ids  # cut by max_tokens
    check_pipeline(family, qwen3(), ids)

"""The chat templates' ``tojson`` cache writes exactly what ``json.dumps(x, ensure_ascii=False)`` writes, hit
or miss, and raises where it raises."""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from render_service.templates.sandbox import _tojson
from render_service.templates.tojson_cache import JsonTextCache

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
                    st.text(max_size=12), st.sampled_from([0, 1, 1.0, -0.0, 0.0, True, "1", "null", "NaN"]))
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.tuples(inner, inner),
                            st.dictionaries(st.one_of(st.text(max_size=6), st.integers(0, 3)), inner, max_size=4)),
    max_leaves=16,
)


def _expected(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)


@settings(max_examples=300, deadline=None)
@given(batch=st.lists(values, min_size=1, max_size=8))
def test_every_value_is_written_as_json_dumps_writes_it_hit_or_miss(batch):
    cache = JsonTextCache()
    for _ in range(2):
        for value in batch:
            assert cache.dumps(value) == _expected(value)


def test_values_json_text_could_confuse_are_kept_apart():
    cache = JsonTextCache()
    confusable = [None, math.nan, math.inf, 1, 1.0, True, -0.0, 0.0, {"1": 0}, {1: 0}, [1], (1,), "1"]
    for _ in range(2):
        assert [cache.dumps(v) for v in confusable] == [_expected(v) for v in confusable]


def test_what_json_refuses_is_refused_even_after_a_value_with_the_same_key():
    """msgspec encodes a datetime as its ISO string and a set as a list; json.dumps refuses both."""
    cache = JsonTextCache()
    moment = datetime(2026, 12, 2, 8, 0, tzinfo=timezone.utc)
    assert cache.dumps(moment.isoformat().replace("+00:00", "Z")) == _expected(moment.isoformat().replace("+00:00", "Z"))
    assert cache.dumps([1, 2]) == "[1, 2]"
    for refused in (moment, {1, 2}, {"when": moment}):
        with pytest.raises(TypeError):
            cache.dumps(refused)
        with pytest.raises(TypeError):
            json.dumps(refused)


def test_cache_stays_under_its_byte_bound_and_skips_huge_values():
    cache = JsonTextCache(max_bytes=20_000)
    for i in range(500):
        assert cache.dumps({"tool": i, "doc": "x" * 50}) == _expected({"tool": i, "doc": "x" * 50})
        assert cache.bytes <= cache.max_bytes
    assert 0 < len(cache) < 500
    before = len(cache)
    huge = {"doc": "y" * 100_000}
    assert cache.dumps(huge) == _expected(huge) and len(cache) <= before


def test_the_template_filter_keeps_hf_options_and_caches_only_the_defaults():
    value = {"b": [1, 2.5, "é"], "a": None}
    assert _tojson(value) == json.dumps(value, ensure_ascii=False)
    assert _tojson(value, indent=2) == json.dumps(value, ensure_ascii=False, indent=2)
    assert _tojson(value, sort_keys=True, ensure_ascii=True) == json.dumps(value, sort_keys=True)


def test_a_lent_value_is_written_by_identity_until_taken_back():
    cache = JsonTextCache()
    value = {"city": "Paris", "days": [1, 2]}
    assert cache.lend(value)
    assert cache.dumps(value) == _expected(value)
    equal = {"city": "Paris", "days": [1, 2]}
    assert cache.dumps(equal) == _expected(equal)  # another object: the usual path
    cache.unlend(value)
    value["city"] = "Lyon"  # its owner may change it once taken back: the text follows
    assert cache.dumps(value) == _expected(value)
    cache.unlend(value)  # (twice: nothing happens)


def test_a_value_json_dumps_refuses_is_not_lent():
    cache = JsonTextCache()
    assert not cache.lend({"when": datetime(2026, 1, 1, tzinfo=timezone.utc)})
    assert not cache.lend(float("nan")) or cache.dumps(float("nan")) == "NaN"

"""A call cut off by max_tokens: a whole answer gives its text back as content (no call), earlier finished
calls stay; a finished call in a cut answer stays a call; a stream still sends what it saw."""

from __future__ import annotations

import pytest

from render_service.parsers.pipeline import Pipeline, PipelineConfig, derender_all
from tests.test_pipeline_tool_vectors import TOOLS, hermes_call, qwen

DONE = hermes_call("get_weather", '{"city": "Paris"}')
CUT_TEXTS = {
    "hermes": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Seo', "Looking. "),
    "qwen3_coder": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSeo", "Looking. "),
    "minimax_m2": ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Seo', ""),
    "mistral": ('[TOOL_CALLS]get_weather{"city": "Seoul", ', ""),
}


def _derender(parser: str, text: str, finish: str | None) -> dict:
    config = PipelineConfig(request_id="cut", tool_parser=parser, tool_choice="auto", tools=TOOLS,
                            skip_special_tokens=False)
    ids = qwen().encode(text)
    message, _ = derender_all(Pipeline(qwen(), config), ids, None, False, engine_finish=finish)
    return message


@pytest.mark.parametrize("parser", sorted(CUT_TEXTS))
def test_a_cut_call_is_content_not_a_call(parser: str) -> None:
    cut, prose = CUT_TEXTS[parser]
    message = _derender(parser, prose + cut, "length")
    assert message["tool_calls"] == []
    assert message["content"] == prose + cut


@pytest.mark.parametrize("parser", sorted(CUT_TEXTS))
def test_a_stopped_output_keeps_the_closed_call(parser: str) -> None:
    cut, prose = CUT_TEXTS[parser]
    message = _derender(parser, prose + cut, "stop")  # e.g. a stop string: the pipeline's closing rule
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]


def test_finished_calls_before_the_cut_one_stay() -> None:
    cut, _ = CUT_TEXTS["hermes"]
    message = _derender("hermes", f"{DONE}\n{cut}", "length")
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == ['{"city": "Paris"}']
    assert message["content"] == cut


def test_a_finished_call_in_a_cut_answer_is_a_call() -> None:
    message = _derender("hermes", DONE + "\nAnd then", "length")
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == ['{"city": "Paris"}']
    assert message["content"] == "And then"

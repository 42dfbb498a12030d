"""Would a compiled template engine render our chat templates faster? MiniJinja (Rust, Python bindings) against
our Jinja path, on every template we ship or test.

For each template (the Qwen3 fixture's, the built-in DeepSeek ones, tests/fixtures/templates/*.jinja) an agent
trace (bench/agent_trace.py: tools, reasoning, tool calls and results) of about --rounds rounds is rendered:

- ours: ``ChatTemplate.render`` as a cold render runs it (loop records off, fresh message copies each time);
- jinja2: the plain sandboxed Jinja environment HF's ``apply_chat_template`` builds;
- minijinja: ``minijinja.Environment`` with the same options (trim_blocks, lstrip_blocks), the same
  ``tojson`` filter, ``raise_exception`` and ``strftime_now``, fed the messages exactly as our template sees them.

Reports per template whether MiniJinja's text is byte-identical to ours, and the best-of-N milliseconds of each.
A compiled engine is only worth a load-time proof-or-fallback path where it is identical and faster.

    pip install minijinja && python -m bench.experiments.template_engines [--rounds 14] [--out FILE]
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench.agent_trace import AgentTraceSpec, agent_trace
from bench.portable import portable
from bench.shared_fixtures import QWEN3_DIR

REPO = Path(__file__).resolve().parents[2]
SPECIALS = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}


def shipped_templates() -> dict[str, str]:
    from render_service.bundle.builtin_templates import BUILTIN_TEMPLATES, builtin_template_source

    sources = {"qwen3": json.loads((QWEN3_DIR / "tokenizer_config.json").read_text())["chat_template"]}
    for model_type in BUILTIN_TEMPLATES:
        sources[model_type] = builtin_template_source(model_type) or ""
    for path in sorted((REPO / "tests" / "fixtures" / "templates").glob("*.jinja")):
        sources[path.stem] = path.read_text(encoding="utf-8")
    return sources


def best_ms(fn: Any, inputs: list[Any]) -> float:
    times = []
    for item in inputs:
        t0 = time.perf_counter()
        fn(item)
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def compare(name: str, source: str, messages: list[dict], tools: list[dict], repeats: int) -> dict[str, Any]:
    import jinja2
    import jinja2.ext
    import minijinja
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from render_service.templates import sandbox
    from render_service.templates.chat_messages import prepare_messages, prepare_tools
    from render_service.templates.chat_template import ChatTemplate, _template_messages, plain_copy

    row: dict[str, Any] = {"template": name}
    ours = ChatTemplate(source, SPECIALS, loop_record_bytes=0)
    # as the render path hands them over: tool-call arguments as mappings, tools in vLLM's shape
    prepared = prepare_messages(copy.deepcopy(messages), ours.content_format)
    tools = prepare_tools(copy.deepcopy(tools)) or []
    kwargs = {"tools": tools, "add_generation_prompt": True}
    try:
        want = ours.render(copy.deepcopy(prepared), **kwargs)
    except Exception as exc:  # noqa: BLE001 - a template that refuses this trace is reported, not compared
        return {**row, "error": f"ours: {type(exc).__name__}: {str(exc)[:120]}"}
    seen = plain_copy(_template_messages(copy.deepcopy(prepared)))
    context = {**SPECIALS, "messages": seen, "tools": plain_copy(tools), "add_generation_prompt": True}
    engine = minijinja.Environment(filters={"tojson": sandbox._tojson},
                                   globals={"raise_exception": sandbox._raise_exception,
                                            "strftime_now": sandbox._strftime_now})
    engine.trim_blocks = engine.lstrip_blocks = True
    try:
        engine.add_template("chat", source)
        got = engine.render_template("chat", **context)
    except Exception as exc:  # noqa: BLE001
        return {**row, "chars": len(want), "identical": False, "error": f"minijinja: {str(exc)[:160]}"}
    row.update(chars=len(want), identical=got == want)
    if got != want:
        at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        row["first_difference"] = {"at": at, "ours": want[at - 40 : at + 40], "minijinja": got[at - 40 : at + 40]}
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                          extensions=[jinja2.ext.loopcontrols])
    plain.filters["tojson"] = sandbox._tojson
    plain.globals.update(raise_exception=sandbox._raise_exception, strftime_now=sandbox._strftime_now)
    plain_template = plain.from_string(source)
    copies = [copy.deepcopy(prepared) for _ in range(repeats)]
    row["ours_ms"] = best_ms(lambda m: ours.render(m, **kwargs), copies)
    contexts = [{**context, "messages": plain_copy(_template_messages(m))} for m in copy.deepcopy(copies)]
    row["jinja2_ms"] = best_ms(lambda c: plain_template.render(**c), contexts)
    row["minijinja_ms"] = best_ms(lambda c: engine.render_template("chat", **c), contexts)
    row["minijinja_over_ours"] = row["minijinja_ms"] / row["ours_ms"]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=14, help="agent rounds (14: about 146k characters with Qwen3)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    try:
        import minijinja  # noqa: F401
    except ImportError:
        print("minijinja is not installed (pip install minijinja)", file=sys.stderr)
        return 2
    messages, tools = agent_trace(AgentTraceSpec(rounds=args.rounds, seed=3))
    result: dict[str, Any] = {"minijinja": importlib.metadata.version("minijinja"), "rounds": args.rounds,
                              "rows": []}
    for name, source in shipped_templates().items():
        row = compare(name, source, messages, tools, args.repeats)
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(portable(result), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Agent-trace workloads: the conversations a coding agent resends every turn.

A trace is a system prompt, a set of tools, one user task, then rounds of (assistant reasoning + tool calls,
tool results). Tool results are what makes traces long: source files, command output, JSON listings. All
text is seeded pseudo-random (invented identifiers, numbers, paths, prose from ``render_bench``'s word
generator), so no phrase repeats often enough to flatter a cache or a BPE run, and two seeds share nothing
but the template's own markup.

``AgentTraceSpec`` says how a trace looks; ``agent_trace(spec)`` returns its messages and tools, and
``growing_prefixes`` the request bodies an agent loop sends (each round's whole conversation so far).
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from bench.render_bench import nonrepetitive_text

RESULT_KINDS = ("source", "command", "json", "prose")


@dataclass(frozen=True)
class AgentTraceSpec:
    rounds: int = 25
    tools: int = 6
    result_chars: tuple[int, int] = (1500, 9000)  # each tool result's size is drawn from this range
    calls_per_round: tuple[int, int] = (1, 2)
    reasoning: bool = True  # assistant turns carry reasoning_content (Qwen3 keeps it after the last user turn)
    system_words: int = 350
    seed: int = 0


class _Words:
    """Identifiers and prose drawn from one seeded generator."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def ident(self, parts: int | None = None) -> str:
        rng = self.rng
        count = parts or rng.randint(1, 3)
        syllables = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 5)))
                     for _ in range(count)]
        return "_".join(syllables)

    def camel(self) -> str:
        return "".join(part.capitalize() for part in self.ident(self.rng.randint(1, 3)).split("_"))

    def path(self) -> str:
        return "/".join(self.ident(1) for _ in range(self.rng.randint(1, 4))) + self.rng.choice(
            [".py", ".rs", ".ts", ".go", ".md", ".toml", ".json"])

    def prose(self, words: int) -> str:
        return nonrepetitive_text(self.rng, words)


def _tool(words: _Words, index: int) -> dict[str, Any]:
    rng = words.rng
    params = {}
    for _ in range(rng.randint(1, 5)):
        kind = rng.choice(["string", "integer", "boolean", "array"])
        schema: dict[str, Any] = {"type": kind, "description": words.prose(rng.randint(6, 18))}
        if kind == "array":
            schema["items"] = {"type": "string"}
        if kind == "string" and rng.random() < 0.3:
            schema["enum"] = [words.ident(1) for _ in range(rng.randint(2, 4))]
        params[words.ident()] = schema
    return {"type": "function", "function": {
        "name": f"{words.ident(2)}_{index}",
        "description": words.prose(rng.randint(25, 70)),
        "parameters": {"type": "object", "properties": params, "required": sorted(params)[:1]},
    }}


def _source(words: _Words, chars: int) -> str:
    rng = words.rng
    lines = [f"# {words.path()}", ""]
    size = 0
    indent = 0
    while size < chars:
        roll = rng.random()
        pad = "    " * indent
        if roll < 0.12:
            line = f"def {words.ident()}({', '.join(words.ident(1) for _ in range(rng.randint(0, 4)))}):"
            indent = 1
            pad = ""
        elif roll < 0.18:
            line = f"class {words.camel()}({words.camel()}):"
            indent = 1
            pad = ""
        elif roll < 0.45:
            line = f"{words.ident()} = {words.ident()}.{words.ident(1)}({rng.randint(0, 10 ** rng.randint(1, 6))}, " \
                   f"{json.dumps(words.ident(1))})"
        elif roll < 0.6:
            line = f"if {words.ident()} {rng.choice(['<', '>=', '==', '!=', 'in'])} {words.ident()}:"
            indent = min(indent + 1, 4)
        elif roll < 0.7:
            line = f"return {words.ident()}[{rng.randint(0, 99)}:{rng.randint(100, 999)}]"
            indent = max(indent - 1, 1)
        elif roll < 0.82:
            line = f"# {words.prose(rng.randint(5, 14))}"
        else:
            line = f"{words.ident()}.{words.ident(1)}({words.ident()}={rng.random():.6f})"
        lines.append(pad + line)
        size += len(pad) + len(line) + 1
    return "\n".join(lines)


def _command_output(words: _Words, chars: int) -> str:
    rng = words.rng
    lines = [f"$ {rng.choice(['pytest', 'cargo test', 'grep -rn', 'git log --stat', 'ls -la'])} {words.path()}"]
    size = len(lines[0])
    while size < chars:
        roll = rng.random()
        if roll < 0.4:
            line = f"{words.path()}:{rng.randint(1, 3000)}: {words.prose(rng.randint(4, 12))}"
        elif roll < 0.7:
            line = (f"-rw-r--r-- 1 {words.ident(1)} {words.ident(1)} {rng.randint(0, 10 ** 7):>9} "
                    f"Nov {rng.randint(1, 30):>2} {rng.randint(0, 23):02d}:{rng.randint(0, 59):02d} {words.path()}")
        else:
            line = f"[{rng.randint(0, 99999):05d}] {rng.choice(['PASS', 'FAIL', 'SKIP', 'WARN'])} " \
                   f"{words.ident()}::{words.ident()} ({rng.random() * 10:.3f}s)"
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)


def _json_listing(words: _Words, chars: int) -> str:
    rng = words.rng
    items: list[dict[str, Any]] = []
    size = 0
    while size < chars:
        item = {"id": rng.randint(0, 10 ** 9), "name": words.ident(), "path": words.path(),
                "size": rng.randint(0, 10 ** 6), "tags": [words.ident(1) for _ in range(rng.randint(0, 3))],
                "summary": words.prose(rng.randint(3, 12))}
        items.append(item)
        size += len(json.dumps(item, ensure_ascii=False)) + 2
    return json.dumps({"total": len(items), "items": items}, indent=1, ensure_ascii=False)


def _result(words: _Words, chars: int) -> str:
    kind = words.rng.choice(RESULT_KINDS)
    if kind == "source":
        return _source(words, chars)
    if kind == "command":
        return _command_output(words, chars)
    if kind == "json":
        return _json_listing(words, chars)
    return words.prose(max(1, chars // 6))


def _arguments(words: _Words, tool: dict[str, Any]) -> dict[str, Any]:
    rng = words.rng
    out: dict[str, Any] = {}
    for name, schema in tool["function"]["parameters"]["properties"].items():
        if rng.random() < 0.3 and name not in tool["function"]["parameters"]["required"]:
            continue
        kind = schema["type"]
        if "enum" in schema:
            out[name] = rng.choice(schema["enum"])
        elif kind == "integer":
            out[name] = rng.randint(0, 5000)
        elif kind == "boolean":
            out[name] = rng.random() < 0.5
        elif kind == "array":
            out[name] = [words.path() for _ in range(rng.randint(1, 3))]
        else:
            out[name] = words.path() if rng.random() < 0.5 else words.prose(rng.randint(3, 10))
    return out


def agent_trace(spec: AgentTraceSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(messages, tools) of one whole trace: system, user task, then ``spec.rounds`` rounds."""
    rng = random.Random(f"agent-trace/{spec.seed}")
    words = _Words(rng)
    tools = [_tool(words, i) for i in range(spec.tools)]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": words.prose(spec.system_words)},
        {"role": "user", "content": words.prose(rng.randint(40, 160))},
    ]
    for round_no in range(spec.rounds):
        calls = []
        for call_no in range(rng.randint(*spec.calls_per_round)):
            tool = rng.choice(tools)
            calls.append({"id": f"call_{round_no}_{call_no}_{rng.randrange(16 ** 8):08x}", "type": "function",
                          "function": {"name": tool["function"]["name"],
                                       "arguments": json.dumps(_arguments(words, tool), ensure_ascii=False)}})
        assistant: dict[str, Any] = {"role": "assistant", "content": words.prose(rng.randint(0, 40)),
                                     "tool_calls": calls}
        if spec.reasoning:
            assistant["reasoning_content"] = words.prose(rng.randint(20, 120))
        messages.append(assistant)
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": _result(words, rng.randint(*spec.result_chars))})
    return messages, tools


def round_ends(messages: list[dict[str, Any]]) -> list[int]:
    """Message counts at which an agent sends a request: after the task, then after each round's results."""
    ends = [2]
    for i in range(2, len(messages)):
        last_of_round = messages[i]["role"] == "tool" and (i + 1 == len(messages) or messages[i + 1]["role"] != "tool")
        if last_of_round:
            ends.append(i + 1)
    return ends


def chat_body(model: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": model, "messages": messages, "tools": tools, "add_generation_prompt": True}


def growing_prefixes(model: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                     ) -> Iterator[dict[str, Any]]:
    """The bodies an agent loop sends, turn by turn: the whole conversation so far each time."""
    for end in round_ends(messages):
        yield chat_body(model, messages[:end], tools)

"""A head loop that looks for the last message matching a condition, answered for the messages a render shares with
an earlier one from that render's answer.

Qwen3's template begins with

    {%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
    {%- for message in messages[::-1] %}
        {%- set index = (messages|length - 1) - loop.index0 %}
        {%- if ns.multi_step_tool and message.role == "user" and not(...) %}
            {%- set ns.multi_step_tool = false %}
            {%- set ns.last_query_index = index %}
        {%- endif %}
    {%- endfor %}

and so reads the messages from the end until the last real user query, which an agent loop wrote near the start:
every render walks the whole conversation (about 0.2 ms at 400 messages) even where its message loop resumes
(loop_resume.py). The loop's whole effect, when the flag is set as it starts: the flag cleared and the index of the
last message the condition holds for stored; nothing when it holds for none. The condition reads its message and
nothing else (``find_last_match_scans`` admits a short list of pure nodes), so for the messages a render shares
with a recorded one (the same objects, which nothing changes once handed out) it holds where it held then. A
session render (loop_resume.LoopSession) whose record shares ``same`` leading messages therefore iterates only the
messages after them, from the end as the template wrote (the counters are a full run's there: the loop meets the
new messages first), and where none matches takes the record's answer: the index it found, if that message is one
of the shared ones, or none if the recorded scan found none. Anything else (no record, a recorded match past the
shared messages, the flag clear at the start, messages the template set itself) iterates every message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jinja2.nodes as nodes

from render_service.templates.loop_plan import internal_name, top_level
from render_service.templates.loop_resume import SESSION, namespace_attrs

# Names the compiled template's module holds (inline.InlineTemplate) for the rewritten loop.
SCAN_ITEMS = "_fast_scan_items"
SCAN_DONE = "_fast_scan_done"

# What the condition may be built of: reads of its message, constants, comparisons, logic, and calls of methods
# that only read (a message's fields are plain values; str and dict methods of these names change nothing).
_PURE_METHODS = frozenset({"startswith", "endswith", "strip", "lstrip", "rstrip", "lower", "upper", "split",
                           "rsplit", "get", "count", "find", "rfind", "isspace"})
_PURE_TESTS = frozenset({"string", "defined", "undefined", "none", "mapping", "sequence", "number", "boolean",
                         "true", "false", "integer", "float", "eq", "ne", "in", "equalto"})
_PURE_FILTERS = frozenset({"length", "count", "lower", "upper", "trim", "string"})
_COMPARISONS = frozenset({"eq", "ne", "lt", "lteq", "gt", "gteq", "in", "notin"})


@dataclass
class LastMatchScan:
    """A recognised scan: its ``For`` node, the namespace and the attributes it clears (``flag``) and sets
    (``found``), and which scan of the template it is (``ident``)."""

    loop: nodes.For
    namespace: str
    flag: str
    found: str
    ident: int


def find_last_match_scans(tree: nodes.Template) -> list[LastMatchScan]:
    """The template's top-level loops (inside ``if`` blocks at most) of the shape the module's docstring shows."""
    if any(isinstance(target, nodes.Name) and target.name == "messages"
           for node in tree.find_all((nodes.Assign, nodes.For, nodes.AssignBlock))
           for target in _targets(node)):
        return []  # the template's own ``messages``: a tail, or something else
    scans: list[LastMatchScan] = []
    for loop in [node for node in top_level(tree.body) if isinstance(node, nodes.For)]:
        found = _scan_shape(loop)
        if found is not None:
            scans.append(LastMatchScan(loop, *found, ident=len(scans)))
    return scans


def _targets(node: nodes.Node) -> list[nodes.Node]:
    target = node.target  # type: ignore[attr-defined]
    return list(target.items) if isinstance(target, nodes.Tuple) else [target]


def _is_messages(node: nodes.Node) -> bool:
    return isinstance(node, nodes.Name) and node.name == "messages" and node.ctx == "load"


def _is_reversed_messages(node: nodes.Node) -> bool:
    """``messages[::-1]``."""
    if not (isinstance(node, nodes.Getitem) and _is_messages(node.node) and isinstance(node.arg, nodes.Slice)):
        return False
    s = node.arg
    step = s.step
    return s.start is None and s.stop is None and isinstance(step, nodes.Neg) \
        and isinstance(step.node, nodes.Const) and step.node.value == 1


def _is_original_index(node: nodes.Node) -> bool:
    """``(messages|length - 1) - loop.index0``: in a loop over ``messages[::-1]``, the message's own index."""
    if not (isinstance(node, nodes.Sub) and isinstance(node.left, nodes.Sub)):
        return False
    length, one, counter = node.left.left, node.left.right, node.right
    return isinstance(length, nodes.Filter) and length.name == "length" and length.node is not None \
        and _is_messages(length.node) \
        and not length.args and not length.kwargs and length.dyn_args is None and length.dyn_kwargs is None \
        and isinstance(one, nodes.Const) and one.value == 1 \
        and isinstance(counter, nodes.Getattr) and isinstance(counter.node, nodes.Name) \
        and counter.node.name == "loop" and counter.attr == "index0"


def _and_operands(node: nodes.Node) -> list[nodes.Node]:
    if isinstance(node, nodes.And):
        return _and_operands(node.left) + _and_operands(node.right)
    return [node]


def _scan_shape(loop: nodes.For) -> tuple[str, str, str] | None:
    """(namespace, flag, found) of a loop of the docstring's shape; None for any other loop."""
    if not (isinstance(loop.target, nodes.Name) and _is_reversed_messages(loop.iter)) \
            or loop.else_ or loop.test is not None or loop.recursive or len(loop.body) != 2:
        return None
    item = loop.target.name
    assign, branch = loop.body
    if not (isinstance(assign, nodes.Assign) and isinstance(assign.target, nodes.Name)
            and _is_original_index(assign.node) and isinstance(branch, nodes.If)
            and not branch.elif_ and not branch.else_ and len(branch.body) == 2):
        return None
    index = assign.target.name
    first, *condition = _and_operands(branch.test)
    if not (condition and isinstance(first, nodes.Getattr) and isinstance(first.node, nodes.Name)):
        return None
    namespace, flag = first.node.name, first.attr
    if len({item, index, namespace, "messages", "loop"}) != 5:
        return None
    sets: dict[str, nodes.Node] = {}
    for statement in branch.body:
        if not (isinstance(statement, nodes.Assign) and isinstance(statement.target, nodes.NSRef)
                and statement.target.name == namespace):
            return None
        sets[statement.target.attr] = statement.node
    cleared = sets.pop(flag, None)
    if not (isinstance(cleared, nodes.Const) and cleared.value is False and len(sets) == 1):
        return None
    found, value = next(iter(sets.items()))
    if not (isinstance(value, nodes.Name) and value.name == index):
        return None
    if not all(_pure(operand, item) for operand in condition):
        return None
    return namespace, flag, found


def _pure(node: nodes.Node, item: str) -> bool:
    """Whether ``node`` reads only the loop's item, through nodes that only read."""
    if isinstance(node, nodes.Name):
        return node.name == item and node.ctx == "load"
    if isinstance(node, nodes.Const):
        return True
    if isinstance(node, nodes.Getattr):
        return not node.attr.startswith("_") and _pure(node.node, item)
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and _pure(node.node, item)
    if isinstance(node, (nodes.Not, nodes.Neg, nodes.Pos)):
        return _pure(node.node, item)
    if isinstance(node, (nodes.And, nodes.Or)):
        return _pure(node.left, item) and _pure(node.right, item)
    if isinstance(node, nodes.Compare):
        return _pure(node.expr, item) and all(op.op in _COMPARISONS and _pure(op.expr, item) for op in node.ops)
    if isinstance(node, nodes.CondExpr):
        return node.expr2 is not None and all(_pure(n, item) for n in (node.test, node.expr1, node.expr2))
    if isinstance(node, (nodes.Test, nodes.Filter)):
        names = _PURE_TESTS if isinstance(node, nodes.Test) else _PURE_FILTERS
        return node.name in names and node.node is not None and _pure(node.node, item) \
            and not node.kwargs and node.dyn_args is None and node.dyn_kwargs is None \
            and all(_pure(arg, item) for arg in node.args)
    if isinstance(node, nodes.Call):
        method = node.node
        return isinstance(method, nodes.Getattr) and method.attr in _PURE_METHODS and _pure(method.node, item) \
            and not node.kwargs and node.dyn_args is None and node.dyn_kwargs is None \
            and all(_pure(arg, item) for arg in node.args)
    return False


def rewrite_last_match_scan(scan: LastMatchScan, parent: list[nodes.Node], environment: Any) -> None:
    """The loop iterates ``scan_items(ident, messages, namespace.flag)``, and ``scan_done(ident, namespace)`` follows
    it in ``parent`` (the statement list that holds it)."""
    loop = scan.loop
    flag = nodes.Getattr(nodes.Name(scan.namespace, "load"), scan.flag, "load", lineno=loop.lineno)
    messages = nodes.Name("messages", "load", lineno=loop.lineno)
    items = nodes.Call(internal_name(SCAN_ITEMS, loop.lineno), [nodes.Const(scan.ident), messages, flag],
                       [], None, None, lineno=loop.lineno)
    items.set_environment(environment)
    loop.iter = items
    done = nodes.Call(internal_name(SCAN_DONE, loop.lineno),
                      [nodes.Const(scan.ident), nodes.Name(scan.namespace, "load"), nodes.Const(scan.flag),
                       nodes.Const(scan.found)], [], None, None, lineno=loop.lineno)
    done.set_environment(environment)
    parent.insert(parent.index(loop) + 1, nodes.ExprStmt(done, lineno=loop.lineno))


def parent_of(loop: nodes.For, body: list[nodes.Node]) -> list[nodes.Node] | None:
    """The statement list (the template's, or an ``if`` block's) that holds ``loop``."""
    if any(node is loop for node in body):
        return body
    for node in body:
        if isinstance(node, nodes.If):
            for inner in (node.body, *(branch.body for branch in node.elif_), node.else_):
                found = parent_of(loop, inner)
                if found is not None:
                    return found
    return None


# ----------------------------------------------------------------------------------------- at render time

_NO_ANSWER = object()


def scan_items(ident: int, messages: Any, flag: Any) -> Any:
    """What the rewritten scan iterates: ``messages[::-1]``, or only the messages after those the session's record
    shares (the record's answer is applied by ``scan_done``)."""
    session = SESSION.get()
    if session is None:
        return messages[::-1]
    record = session.resume
    answer: Any = record.scans.get(ident, _NO_ANSWER) if record is not None else _NO_ANSWER
    same = session.same
    if not flag or type(messages) is not list or len(messages) < same:
        session.scan_starts[ident] = (False, _NO_ANSWER)  # nothing to record
        return messages[::-1]
    if answer is _NO_ANSWER or same <= 0 or (answer is not None and answer >= same):
        session.scan_starts[ident] = (True, _NO_ANSWER)
        return messages[::-1]
    session.scan_starts[ident] = (True, answer)
    session.scans_shortened += 1
    return messages[same:][::-1]


def scan_done(ident: int, namespace: Any, flag: str, found: str) -> None:
    """After the scan: the record's answer where the messages iterated held no match, and this render's answer kept
    for its own record (only where the flag was set at the start: otherwise the loop looked at nothing)."""
    session = SESSION.get()
    if session is None:
        return
    searched, answer = session.scan_starts.pop(ident, (False, _NO_ANSWER))
    if not searched:
        return
    attrs = namespace_attrs(namespace)
    if attrs is None:
        return
    if attrs.get(flag) and answer is not _NO_ANSWER and answer is not None:
        attrs[flag] = False  # what the loop writes at the recorded match
        attrs[found] = answer
    matched = attrs.get(flag) is False
    if matched and type(attrs.get(found)) is not int:
        return  # (a match whose index is not a plain int: nothing a later render could rely on)
    session.scan_answers[ident] = attrs[found] if matched else None

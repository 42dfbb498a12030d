"""Which loop of a chat template writes the messages, and whether a render may start it part-way (loop_resume.py).

Nearly every chat template is a head (system prompt, tools), one ``{% for message in messages %}`` loop, and a tail
(the generation prompt). ``plan_message_loop`` finds that loop in a parsed template and says whether its iterations
can be reused by a later render whose messages start with the same messages. That holds when an iteration reads
nothing a longer conversation changes:

- ``loop`` only through ``index0``, ``index``, ``first``, ``previtem``, ``depth``, ``depth0``, ``cycle``, and
  ``last`` / ``nextitem``, which look one message ahead (``reach``); never ``length``, ``revindex``, ``changed``
  or ``loop`` itself;
- the messages only as ``messages[<constant>]`` or ``messages[loop.index0 + c]`` (``loop.index`` likewise),
  reaching ``c`` messages ahead; never ``messages|length``, ``messages[-1]``, a nested loop over them or a macro
  that reads them;
- no clock (``strftime_now``) and no object that keeps state between calls (``cycler``, ``joiner``).

Everything else an iteration reads from outside the loop (namespaces, ``tools``, flags, values the head computed,
macros) is named in ``names``: a render compares their values at the loop's start with the earlier render's before
it reuses anything, and namespaces (the only state the sandbox lets an iteration change) are restored per iteration.
The loop must sit at the template's top level (inside ``if`` blocks at most), so that what it writes is the
template's own output, not a macro's or a variable's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jinja2.nodes as nodes

# loop attributes an iteration may read: the same values for iteration i whatever follows, except the two that look
# at the next item (then the iteration before the new messages is rendered again)
LOOP_SAME = frozenset({"index0", "index", "first", "previtem", "depth", "depth0", "cycle"})
LOOP_NEXT = frozenset({"last", "nextitem"})
# globals whose value or effect changes from one call to the next
IMPURE_NAMES = frozenset({"strftime_now", "cycler", "joiner"})
# statements that would move the loop's output off the template's own stream, or bring in other templates
_FOREIGN = (nodes.Macro, nodes.Block, nodes.Include, nodes.Import, nodes.FromImport, nodes.Extends,
            nodes.FilterBlock, nodes.Scope, nodes.ScopedEvalContextModifier)


@dataclass
class LoopPlan:
    """The message loop of a template: the ``For`` node, the outside names its iterations (and macros) read, how
    many messages past its own an iteration may read (``reach``, at least 1) and the largest constant index it
    reads (``max_index``, -1 if none)."""

    loop: nodes.For
    names: list[str]
    reach: int = 1
    max_index: int = -1
    subscripts: list[nodes.Getitem] = field(default_factory=list)


class _NotResumable(Exception):
    pass


def plan_message_loop(tree: nodes.Template) -> LoopPlan | None:
    """The template's message loop and what its iterations read; None where a render cannot reuse them."""
    aliases = _message_aliases(tree)
    loop = _find_loop(tree.body, aliases)
    if loop is None:
        return None
    try:
        reader = _Reads(aliases, {loop.target.name} if isinstance(loop.target, nodes.Name) else set())
        reader.body(loop.body, main=True)
        for macro in tree.find_all(nodes.Macro):
            reader.macro(macro)
    except _NotResumable:
        return None
    reader.names.discard("loop")
    return LoopPlan(loop, sorted(reader.names), max(1, reader.reach), reader.max_index, reader.subscripts)


def _top_level(body: list[nodes.Node]) -> list[nodes.Node]:
    """The statements of ``body`` and of the ``if`` blocks in it, in order (they write to the template's own output)."""
    out: list[nodes.Node] = []
    for node in body:
        out.append(node)
        if isinstance(node, nodes.If):
            out += _top_level(node.body)
            for branch in node.elif_:
                out += _top_level([branch])
            out += _top_level(node.else_)
    return out


def _is_messages(node: nodes.Node, aliases: set[str]) -> bool:
    """``messages``, ``messages[c:]`` (a constant ``c``) or a name only ever set to one of those."""
    if isinstance(node, nodes.Name):
        return node.name == "messages" or node.name in aliases
    if isinstance(node, nodes.Getitem) and isinstance(node.node, nodes.Name) and node.node.name == "messages":
        s = node.arg
        return (isinstance(s, nodes.Slice) and s.stop is None and s.step is None
                and (s.start is None or (isinstance(s.start, nodes.Const) and type(s.start.value) is int
                                         and s.start.value >= 0)))
    return False


def _message_aliases(tree: nodes.Template) -> set[str]:
    """Names the template's top level sets only to the messages or a tail of them (``loop_messages``)."""
    candidates: dict[str, bool] = {}
    for node in tree.find_all(nodes.Assign):
        if isinstance(node.target, nodes.Name):
            name = node.target.name
            ok = _is_messages(node.node, set())
            candidates[name] = candidates.get(name, True) and ok
    for other in tree.find_all((nodes.For, nodes.AssignBlock, nodes.Macro)):
        # a loop target, block or macro argument of the same name is not the alias
        targets: list[nodes.Node] = list(other.args) if isinstance(other, nodes.Macro) \
            else [getattr(other, "target")]  # noqa: B009 (For and AssignBlock both have one)
        found = [n for n in targets if isinstance(n, nodes.Name)] + \
            [n for t in targets for n in t.find_all(nodes.Name)]
        for target in found:
            candidates[target.name] = False
    return {name for name, ok in candidates.items() if ok and name != "messages"}


def _find_loop(body: list[nodes.Node], aliases: set[str]) -> nodes.For | None:
    for node in _top_level(body):
        if isinstance(node, nodes.For) and _is_messages(node.iter, aliases):
            if node.recursive or node.test is not None or node.else_ or not isinstance(node.target, nodes.Name):
                return None
            return node
    return None


class _Reads:
    """Walks a loop body (and the macros), collecting the outside names it reads and refusing what it must not."""

    def __init__(self, aliases: set[str], locals_: set[str]) -> None:
        self.aliases = aliases
        self.locals = locals_
        self.names: set[str] = set()
        self.reach = 0
        self.max_index = -1
        self.subscripts: list[nodes.Getitem] = []

    def body(self, body: list[nodes.Node], main: bool) -> None:
        for node in body:
            self.node(node, main)

    def macro(self, macro: nodes.Macro) -> None:
        for node in macro.find_all(nodes.Name):
            if node.ctx == "load":
                if node.name == "messages" or node.name in self.aliases or node.name in IMPURE_NAMES:
                    raise _NotResumable
                self.names.add(node.name)

    def node(self, node: nodes.Node, main: bool) -> None:
        if isinstance(node, _FOREIGN):
            raise _NotResumable
        if isinstance(node, nodes.For):
            self.node(node.iter, main)
            if node.test is not None:
                self.node(node.test, False)
            self.body(node.body, False)  # `loop` is the inner loop's in there
            self.body(node.else_, main)
            return
        if isinstance(node, nodes.Getattr) and isinstance(node.node, nodes.Name) and node.node.name == "loop":
            if not main:
                return  # an inner loop's own counters
            if node.attr in LOOP_NEXT:
                self.reach = max(self.reach, 1)
            elif node.attr not in LOOP_SAME:
                raise _NotResumable
            return
        if isinstance(node, nodes.Getitem) and isinstance(node.node, nodes.Name) \
                and (node.node.name == "messages" or node.node.name in self.aliases):
            self._message_at(node.arg, main)
            self.subscripts.append(node)
            return
        if isinstance(node, nodes.Name):
            if node.ctx != "load":
                return
            if node.name in IMPURE_NAMES or node.name == "messages" or node.name in self.aliases:
                raise _NotResumable
            if node.name == "loop" and main:
                raise _NotResumable  # the loop object itself (passed on, printed, called)
            if node.name not in self.locals:
                self.names.add(node.name)
            return
        for child in node.iter_child_nodes():
            self.node(child, main)

    def _message_at(self, index: nodes.Node, main: bool) -> None:
        """``messages[<index>]``: a constant >= 0, or the main loop's index plus or minus a constant."""
        if isinstance(index, nodes.Const) and type(index.value) is int and index.value >= 0:
            self.max_index = max(self.max_index, index.value)
            return
        sign = 0
        offset = 0
        counter = index
        if isinstance(index, (nodes.Add, nodes.Sub)) and isinstance(index.right, nodes.Const) \
                and type(index.right.value) is int:
            sign = 1 if isinstance(index, nodes.Add) else -1
            offset = sign * index.right.value
            counter = index.left
        if main and isinstance(counter, nodes.Getattr) and isinstance(counter.node, nodes.Name) \
                and counter.node.name == "loop" and counter.attr in ("index0", "index"):
            self.reach = max(self.reach, offset + (1 if counter.attr == "index" else 0))
            return
        raise _NotResumable


# Names the compiled template's module holds (inline.InlineTemplate) for the rewritten loop.
LOOP_ENTRY = "_fast_loop_entry"
CHECKED_INDEX = "_fast_checked_index"


def _internal(name: str, lineno: int) -> nodes.InternalName:
    # (the parser never makes one: its constructor refuses; the code generator writes its name as it is)
    node = nodes.InternalName.__new__(nodes.InternalName)
    nodes.Node.__init__(node, name, lineno=lineno)
    return node


def rewrite_message_loop(plan: LoopPlan, environment: Any) -> None:
    """The loop iterates what ``loop_resume.loop_entry`` returns for its messages (given the outside names' values
    at its start), and each ``messages[loop.index0 - c]`` goes through ``loop_resume.checked_index``."""
    loop = plan.loop
    names = nodes.Dict([nodes.Pair(nodes.Const(name), nodes.Name(name, "load")) for name in plan.names])
    entry = nodes.Call(
        _internal(LOOP_ENTRY, loop.lineno),
        [loop.iter, nodes.Name("messages", "load"), names, nodes.Const(plan.reach), nodes.Const(plan.max_index)],
        [], None, None, lineno=loop.lineno)
    entry.set_environment(environment)
    loop.iter = entry
    for subscript in plan.subscripts:
        if not isinstance(subscript.arg, nodes.Const):
            checked = nodes.Call(_internal(CHECKED_INDEX, subscript.lineno), [subscript.arg], [], None, None,
                                 lineno=subscript.lineno)
            checked.set_environment(environment)
            subscript.arg = checked

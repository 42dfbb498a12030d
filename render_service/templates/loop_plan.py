"""Which loop of a chat template writes the messages, and whether a render may start it part-way (loop_resume.py).

Nearly every chat template is a head (system prompt, tools), one ``{% for message in messages %}`` loop, and a tail
(the generation prompt). ``plan_message_loop`` finds that loop in a parsed template and says whether its iterations
can be reused by a later render whose messages start with the same messages. That holds when an iteration reads
nothing a longer conversation changes:

- ``loop`` only through ``index0``, ``index``, ``first``, ``previtem``, ``depth``, ``depth0``, ``cycle``, and
  ``last`` / ``nextitem``, which look one message ahead (``reach``); never ``length``, ``revindex``, ``changed``
  or ``loop`` itself;
- the messages only as ``messages[<constant>]`` or ``messages[loop.index0 + c]`` (``loop.index`` likewise),
  reaching ``c`` messages ahead, where ``messages`` is the list the loop iterates, one it iterates a tail of or
  the render's own (which the template never sets);
  never ``messages|length``, ``messages[-1]``, a nested loop over them, a macro that reads them or a ``set`` of
  a name that holds them;
- no clock (``strftime_now``) and no object that keeps state between calls (``cycler``, ``joiner``).

Everything else an iteration reads from outside the loop (namespaces, ``tools``, flags, values the head computed,
macros) is named in ``names``: a render compares their values at the loop's start with the earlier render's before
it reuses anything, and namespaces (the only state the sandbox lets an iteration change) are restored per iteration.
The loop must sit at the template's top level (inside ``if`` blocks at most), so that what it writes is the
template's own output, not a macro's or a variable's. A loop over the messages that writes nothing (a scan that
sets a namespace) is part of the head; where several loops write them (one per ``if`` branch), each gets a plan,
and a render resumes only from a record of the same loop (``LoopPlan.ident``).

One kind of outside value may differ from the record's: a threshold (``LoopPlan.thresholds``), a name or a
namespace attribute that the iterations only compare with their own index (``loop.index0 > ns.last_user_index``,
as Qwen3, GLM and MiniMax write the last user turn) and never set. Where it moved from ``a`` to ``b``, only
iterations from ``min(a, b) - 1`` on can compare differently, so a render may keep the ones before that.
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
    many messages past its own an iteration may read (``reach``, at least 1), the largest constant index it
    reads (``max_index``, -1 if none) and which of the template's message loops it is (``ident``)."""

    loop: nodes.For
    names: list[str]
    reach: int = 1
    max_index: int = -1
    subscripts: list[nodes.Getitem] = field(default_factory=list)
    ident: int = 0
    # (name, attribute) pairs ("" for a plain name): the thresholds among ``names`` (the module's docstring)
    thresholds: tuple[tuple[str, str], ...] = ()


class _NotResumable(Exception):
    pass


def plan_message_loop(tree: nodes.Template) -> LoopPlan | None:
    """The template's first resumable message loop (``plan_message_loops``); None if it has none."""
    plans = plan_message_loops(tree)
    return plans[0] if plans else None


def plan_message_loops(tree: nodes.Template) -> list[LoopPlan]:
    """The template's message loops whose iterations a render can reuse, and what their iterations read."""
    aliases = _message_aliases(tree)
    plans: list[LoopPlan] = []
    for loop in _find_loops(tree.body, aliases):
        try:
            reader = _Reads(aliases, {loop.target.name} if isinstance(loop.target, nodes.Name) else set(),
                            _indexed(loop.iter, tree))
            reader.body(loop.body, main=True)
            for macro in tree.find_all(nodes.Macro):
                reader.macro(macro)
        except _NotResumable:
            continue
        reader.names.discard("loop")
        macros = list(tree.find_all(nodes.Macro))
        plans.append(LoopPlan(loop, sorted(reader.names), max(1, reader.reach), reader.max_index,
                              reader.subscripts, len(plans), index_thresholds(loop, reader.names, macros)))
    return plans


# comparisons whose outcome for iteration i changes, when one side moves from a to b, only for i in [min, max]
_COMPARISONS = frozenset({"gt", "gteq", "lt", "lteq", "eq", "ne"})


def index_thresholds(loop: nodes.For, outside: set[str], macros: list[nodes.Macro]) -> tuple[tuple[str, str], ...]:
    """The outside values (``(name, "")``, or ``(namespace, attribute)``) that the loop's iterations read only as
    one side of a single comparison whose other side is ``loop.index0`` or ``loop.index``, that nothing in the loop
    sets and that no macro can reach (a macro reading the name, or the namespace at all, rules it out)."""
    compared: set[tuple[str, str]] = set()
    other_reads: set[tuple[str, str]] = set()
    whole: set[str] = set()  # names read other than through one attribute (the namespace passed on, printed)
    stored: set[tuple[str, str]] = set()

    def key(node: nodes.Node) -> tuple[str, str] | None:
        if isinstance(node, nodes.Getattr) and isinstance(node.node, nodes.Name) and node.node.ctx == "load":
            return node.node.name, node.attr
        if isinstance(node, nodes.Name) and node.ctx == "load":
            return node.name, ""
        return None

    def counter(node: nodes.Node, main: bool) -> bool:
        return main and isinstance(node, nodes.Getattr) and isinstance(node.node, nodes.Name) \
            and node.node.name == "loop" and node.attr in ("index0", "index")

    def walk(node: nodes.Node, main: bool) -> None:
        if isinstance(node, nodes.For):  # an inner loop: `loop` is its own in its body
            walk(node.iter, main)
            if node.test is not None:
                walk(node.test, False)
            for child in node.body:
                walk(child, False)
            for child in node.else_:
                walk(child, main)
            return
        if isinstance(node, nodes.Compare) and len(node.ops) == 1 and node.ops[0].op in _COMPARISONS:
            for one, other in ((node.expr, node.ops[0].expr), (node.ops[0].expr, node.expr)):
                found = key(other)
                if counter(one, main) and found is not None and found[0] in outside:
                    compared.add(found)
                    return
        found = key(node)
        if found is not None:
            other_reads.add(found)
            if found[1] == "":
                whole.add(found[0])
            return
        if isinstance(node, nodes.NSRef):
            stored.add((node.name, node.attr))
            return
        if isinstance(node, nodes.Name):  # a store
            stored.add((node.name, ""))
            whole.add(node.name)
            return
        for child in node.iter_child_nodes():
            walk(child, main)

    for statement in loop.body:
        walk(statement, True)
    in_macros = {n.name for macro in macros for n in macro.find_all(nodes.Name)} | \
        {n.name for macro in macros for n in macro.find_all(nodes.NSRef)}
    return tuple(sorted(found for found in compared - other_reads - stored
                        if found[0] not in in_macros and (found[1] == "" or found[0] not in whole)))


def top_level(body: list[nodes.Node]) -> list[nodes.Node]:
    """The statements of ``body`` and of the ``if`` blocks in it, in order (they write to the template's own output)."""
    out: list[nodes.Node] = []
    for node in body:
        out.append(node)
        if isinstance(node, nodes.If):
            out += top_level(node.body)
            for branch in node.elif_:
                out += top_level([branch])
            out += top_level(node.else_)
    return out


def _is_messages(node: nodes.Node, aliases: set[str]) -> bool:
    """An alias of the messages (``messages`` itself or ``loop_messages``) or ``alias[x:]``. Whatever ``x`` is, that
    is a tail of the messages; where it starts is known only at run time (loop_resume.loop_entry measures it, and
    resumes only from a record whose loop started at the same message)."""
    if isinstance(node, nodes.Name):
        return node.name in aliases
    if isinstance(node, nodes.Getitem) and isinstance(node.node, nodes.Name) and node.node.name in aliases:
        s = node.arg
        return isinstance(s, nodes.Slice) and s.stop is None and s.step is None
    return False


def _message_aliases(tree: nodes.Template) -> set[str]:
    """The names that hold the messages or a tail of them wherever the template sets them: ``messages`` (unless it
    is set to something else) and names like ``loop_messages``, each only ever the target of ``{% set name = A %}``
    or ``{% set name = A[x:] %}`` with ``A`` such a name. (A name read before it is set is a request's own value,
    which loop_entry finds holds none of the messages.)"""
    values = {id(node.target): node.node for node in tree.find_all(nodes.Assign) if isinstance(node.target, nodes.Name)}
    stores: dict[str, list[nodes.Node | None]] = {"messages": []}
    for name in tree.find_all(nodes.Name):
        if name.ctx in ("store", "param"):  # set, loop targets, with, macro and call arguments
            stores.setdefault(name.name, []).append(values.get(id(name)))
    aliases = set(stores)
    while True:
        kept = {name for name in aliases
                if all(value is not None and _is_messages(value, aliases) for value in stores[name])}
        if kept == aliases:
            return aliases
        aliases = kept


def _indexed(iterated: nodes.Node, tree: nodes.Template) -> set[str]:
    """The names a loop over ``iterated`` may index (``X[loop.index0 + 1]``, ``X[0]``): those whose item ``i`` is
    at most the loop's item ``i`` (the list it iterates, the list it iterates a tail of, and ``messages`` where the
    template never sets it)."""
    base = iterated.node if isinstance(iterated, nodes.Getitem) else iterated  # (_is_messages: a Name in both)
    names = {base.name} if isinstance(base, nodes.Name) else set()
    if not any(n.name == "messages" and n.ctx in ("store", "param") for n in tree.find_all(nodes.Name)):
        names.add("messages")
    return names


def _find_loops(body: list[nodes.Node], aliases: set[str]) -> list[nodes.For]:
    """The top-level loops over the messages that write something (a loop that writes nothing is a scan the head
    makes, whose effects loop_entry compares where a later loop starts)."""
    return [node for node in top_level(body)
            if isinstance(node, nodes.For) and _is_messages(node.iter, aliases)
            and not node.recursive and node.test is None and not node.else_ and isinstance(node.target, nodes.Name)
            and any(True for _ in node.find_all(nodes.Output))]


class _Reads:
    """Walks a loop body (and the macros), collecting the outside names it reads and refusing what it must not."""

    def __init__(self, aliases: set[str], locals_: set[str], indexed: set[str]) -> None:
        self.aliases = aliases | {"messages"}
        self.locals = locals_
        self.indexed = indexed
        self.names: set[str] = set()
        self.reach = 0
        self.max_index = -1
        self.subscripts: list[nodes.Getitem] = []

    def body(self, body: list[nodes.Node], main: bool) -> None:
        for node in body:
            self.node(node, main)

    def macro(self, macro: nodes.Macro) -> None:
        for ref in macro.find_all(nodes.NSRef):
            self.names.add(ref.name)
        for node in macro.find_all(nodes.Name):
            if node.ctx == "load":
                if node.name in self.aliases or node.name in IMPURE_NAMES:
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
        if isinstance(node, nodes.Getitem) and isinstance(node.node, nodes.Name) and node.node.name in self.aliases:
            if node.node.name not in self.indexed:
                raise _NotResumable  # another tail, perhaps one that starts further on
            self._message_at(node.arg, main)
            self.subscripts.append(node)
            return
        if isinstance(node, nodes.NSRef):
            # `{% set ns.x = ... %}` changes the namespace: it is state the iterations carry, restored per
            # iteration like one they read
            if node.name not in self.locals:
                self.names.add(node.name)
            return
        if isinstance(node, nodes.Name):
            if node.ctx != "load":
                if node.name in self.aliases:
                    raise _NotResumable  # the messages' name set to another tail in the loop
                return
            if node.name in IMPURE_NAMES or node.name in self.aliases:
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


def internal_name(name: str, lineno: int) -> nodes.InternalName:
    # (the parser never makes one: its constructor refuses; the code generator writes its name as it is)
    node = nodes.InternalName.__new__(nodes.InternalName)
    nodes.Node.__init__(node, name, lineno=lineno)
    return node


def rewrite_message_loop(plan: LoopPlan, environment: Any) -> None:
    """The loop iterates what ``loop_resume.loop_entry`` returns for its messages (given the render's context, where
    the messages it was given are, and the outside names' values at its start), and each
    ``messages[loop.index0 - c]`` goes through ``loop_resume.checked_index``."""
    loop = plan.loop
    names = nodes.Dict([nodes.Pair(nodes.Const(name), nodes.Name(name, "load")) for name in plan.names])
    entry = nodes.Call(
        internal_name(LOOP_ENTRY, loop.lineno),
        [loop.iter, nodes.ContextReference(), names, nodes.Const(plan.reach), nodes.Const(plan.max_index),
         nodes.Const(plan.ident), nodes.Const(plan.thresholds)],
        [], None, None, lineno=loop.lineno)
    entry.set_environment(environment)
    loop.iter = entry
    if not any(n.name == "loop" and n.ctx == "load" for n in loop.find_all(nodes.Name)):
        # Jinja steps a loop through a LoopContext (inline.LoopContext, which tells the session where each
        # iteration starts) only when its body reads `loop`: a statement that reads it and does nothing
        loop.body.insert(0, nodes.ExprStmt(nodes.Name("loop", "load"), lineno=loop.lineno))
    for subscript in plan.subscripts:
        if not isinstance(subscript.arg, nodes.Const):
            checked = nodes.Call(internal_name(CHECKED_INDEX, subscript.lineno), [subscript.arg], [], None, None,
                                 lineno=subscript.lineno)
            checked.set_environment(environment)
            subscript.arg = checked

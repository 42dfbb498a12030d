"""Reads a chat template's generated code does inline, where the sandbox's answer is known from the value's exact
type: the same values the sandbox returns, without its calls (its ``getattr`` and ``call`` cost 0.2-0.6 µs each,
and a template makes about twenty a message).

Jinja compiles ``message.role`` to ``environment.getattr(message, 'role')``. The code generator here writes

- ``x.name`` with a constant name that is not one of dict's own attributes: ``x[name]`` when ``x`` is exactly a
  ``dict`` holding that key. The sandbox's ``getattr`` would find no such attribute (a plain dict has only dict's)
  and return ``x[name]``: a key's value is data, never an attribute.
- ``loop.index0`` (and the loop's other counters and flags, ``LOOP_COUNTERS``): read from the ``LoopContext``
  directly when ``loop`` is exactly Jinja's. They are ints and bools, public names the sandbox always allows.
- In the model's template only (``inline_calls``): ``ns.name`` on exactly our namespace type (its stored value,
  which the sandbox returns unchanged unless it is a bound ``str.format``: those take the sandbox's path), and
  ``s.strip('x')`` with constant arguments on exactly a ``str``, for the methods in ``STR_METHODS``: called
  directly, as ``ChatSandbox.call`` does for a str's bound method. A request's own template keeps the sandbox's
  ``call`` (it checks the deadline and the size of what a method builds, template_budget).

Everything else (another type, a missing key, an underscore name, dict's own attributes like ``items``, other
methods, ``format``) is written as Jinja writes it and goes through the sandbox, as before.
"""

from __future__ import annotations

import itertools
import types
from collections.abc import Iterator, MutableMapping
from typing import Any

import jinja2
import jinja2.nodes
import jinja2.runtime
from jinja2.compiler import CodeGenerator, Frame, optimizeconst
from jinja2.utils import missing

from render_service.templates.last_match_scan import SCAN_DONE, SCAN_ITEMS, scan_done, scan_items
from render_service.templates.loop_plan import CHECKED_INDEX, LOOP_ENTRY
from render_service.templates.loop_resume import TrackedMessages, checked_index, loop_entry

DICT_ATTRIBUTES = frozenset(dir(dict))
LOOP_COUNTERS = frozenset({"index", "index0", "revindex", "revindex0", "first", "last", "length", "depth", "depth0"})
# str methods that only read the string and return text, a bool, a number or a list of text.
STR_METHODS = frozenset({
    "strip", "lstrip", "rstrip", "split", "rsplit", "splitlines", "startswith", "endswith", "lower", "upper",
    "title", "capitalize", "casefold", "swapcase", "find", "rfind", "count", "isdigit", "isalpha", "isalnum",
    "isspace", "islower", "isupper", "istitle", "isnumeric", "isdecimal", "partition", "rpartition",
    "removeprefix", "removesuffix",
})

# The generated code's temporaries (template variables are all l_N_-prefixed, Jinja's own names t_N / l_N).
_OBJ = "_fast_obj"
_ATTRS = "_fast_attrs"
# Names the inline paths use, added to each compiled template's module namespace (InlineTemplate).
_NAMESPACE_TYPE = "_fast_namespace_type"
_OBJECT_ATTRIBUTE = "_fast_object_attribute"
_METHOD_TYPES = "_fast_method_types"


class InlineReadsCodeGenerator(CodeGenerator):
    """Jinja's code generator with the inline reads above; ``inline_calls`` adds namespace reads and str
    method calls (the model's template)."""

    inline_calls = True

    @optimizeconst
    def visit_Getattr(self, node: jinja2.nodes.Getattr, frame: Frame) -> None:
        attr = node.attr
        if self.environment.is_async or attr in DICT_ATTRIBUTES or attr.startswith("_"):
            self.write("environment.getattr(")
            self.visit(node.node, frame)
            self.write(f", {attr!r})")
            return
        name = repr(attr)
        self.write(f"({_OBJ}[{name}] if type({_OBJ} := ")
        self.visit(node.node, frame)
        self.write(f") is dict and {name} in {_OBJ} else ")
        if attr in LOOP_COUNTERS:
            self.write(f"{_OBJ}.{attr} if type({_OBJ}) is LoopContext else ")
        if self.inline_calls:
            self.write(
                f"{_ATTRS}[{name}] if type({_OBJ}) is {_NAMESPACE_TYPE} and {name} in "
                f"({_ATTRS} := {_OBJECT_ATTRIBUTE}({_OBJ}, '_Namespace__attrs')) and "
                f"type({_ATTRS}[{name}]) not in {_METHOD_TYPES} else "
            )
        self.write(f"environment.getattr({_OBJ}, {name}))")

    @optimizeconst
    def visit_Call(self, node: jinja2.nodes.Call, frame: Frame, forward_caller: bool = False) -> None:
        method = node.node
        if (not self.inline_calls or forward_caller or self.environment.is_async
                or not isinstance(method, jinja2.nodes.Getattr) or method.attr not in STR_METHODS
                or node.kwargs or node.dyn_args is not None or node.dyn_kwargs is not None
                or not all(isinstance(arg, jinja2.nodes.Const) for arg in node.args)):
            super().visit_Call(node, frame, forward_caller=forward_caller)
            return
        # The method is read from the str before its (constant) arguments are evaluated: the same order as
        # the sandbox's path, written in the else branch as Jinja writes it.
        self.write(f"({_OBJ}.{method.attr}(")
        for i, arg in enumerate(node.args):
            self.write(", " if i else "")
            self.visit(arg, frame)
        self.write(f") if type({_OBJ} := ")
        self.visit(method.node, frame)
        self.write(f") is str else environment.call(context, environment.getattr({_OBJ}, {method.attr!r})")
        extra = {"_loop_vars": "_loop_vars"} if frame.loop_frame else {}
        if frame.block_frame:
            extra["_block_vars"] = "_block_vars"
        self.signature(node, frame, extra or None)
        self.write("))")


class LoopContext(jinja2.runtime.LoopContext):
    """Jinja's ``loop``; over a list or tuple (what a guarded loop of up to ``UNGUARDED_ITEMS`` iterates) stepped
    by a generator and peeked by index: the same values as Jinja's peeking iterator, as nothing in a template can
    change a list while it is iterated (the sandbox is immutable). Anything else iterates as Jinja's does. Named
    as Jinja's: a template sees the type's name (``{{ loop }}``, the sandbox's refusals)."""

    _items: Iterator[tuple[Any, jinja2.runtime.LoopContext]] | None = None

    def __iter__(self) -> Iterator[tuple[Any, jinja2.runtime.LoopContext]]:  # type: ignore[override]
        kind = type(self._iterable)
        if kind is TrackedMessages:
            if self._items is None:
                self._items = self._step_tracked()
            return self._items
        if kind is not list and kind is not tuple:
            return super().__iter__()
        if self._items is None:  # iterated again (`for x in loop`): where it stands, as LoopContext does
            self._items = self._step()
        return self._items

    def _step(self) -> Iterator[tuple[Any, jinja2.runtime.LoopContext]]:
        for item in self._iterator:
            self.index0 += 1
            self._before = self._current
            self._current = item
            yield item, self

    def _step_tracked(self) -> Iterator[tuple[Any, jinja2.runtime.LoopContext]]:
        """A message loop under a render's loop session (loop_resume.py): from the item it starts at, with the
        counters and the previous item a full run has there, telling the session as each iteration begins."""
        items = self._iterable
        assert type(items) is TrackedMessages
        start = items.start
        on_item = items.on_item
        if start:
            self.index0 = start - 1
            self._current = items[start - 1]
        for item in itertools.islice(items, start, None):
            self.index0 += 1
            self._before = self._current
            self._current = item
            if on_item is not None:
                on_item(self.index0)
            yield item, self

    def _peek_next(self) -> Any:
        items = self._iterable
        kind = type(items)
        if kind is not list and kind is not tuple and kind is not TrackedMessages:
            return super()._peek_next()
        following = self.index0 + 1
        return items[following] if following < len(items) else missing  # type: ignore[index, arg-type]

    @property
    def last(self) -> bool:
        items = self._iterable
        kind = type(items)
        if kind is not list and kind is not tuple and kind is not TrackedMessages:
            return super().last
        return self.index0 + 1 >= len(items)  # type: ignore[arg-type]


class InlineTemplate(jinja2.Template):
    """A compiled template whose module namespace holds the names the inline paths read."""

    namespace_type: type = jinja2.utils.Namespace

    @classmethod
    def _from_namespace(cls, environment: jinja2.Environment, namespace: MutableMapping[str, Any],
                        globals: MutableMapping[str, Any]) -> jinja2.Template:
        namespace[_NAMESPACE_TYPE] = cls.namespace_type
        namespace[_OBJECT_ATTRIBUTE] = object.__getattribute__
        namespace[_METHOD_TYPES] = (types.MethodType, types.BuiltinMethodType)
        namespace["LoopContext"] = LoopContext  # the generated code's loops (and `type(x) is LoopContext`)
        namespace[LOOP_ENTRY] = loop_entry  # a message loop's start and indices (loop_plan.rewrite_message_loop)
        namespace[CHECKED_INDEX] = checked_index
        namespace[SCAN_ITEMS] = scan_items  # a head scan's messages and its answer (last_match_scan.py)
        namespace[SCAN_DONE] = scan_done
        return super()._from_namespace(environment, namespace, globals)

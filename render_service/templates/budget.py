"""What one chat-template render may cost: time, and the size of every string it builds, checked as it renders.

A template is code. A request may bring its own (``--trust-request-chat-template``), and any template runs
on the request's data, so a render is bounded the way the engine bounds a grammar compile: before the work
where the work's size can be known, and while it runs where it cannot.

- **Time**: every loop's start and every item of a long loop check the render's deadline (``DEADLINE``,
  set around each render); in a request's own template, every call too (macros, methods, recursive loops, the
  functions below). Nested loops or runaway recursion end with a 400 instead of holding a worker.
- **Size before allocating** (a request's own template; the model's gets ``*`` and ``**``): string methods
  and filters that can build far more than they are given (``center``, ``ljust``/``rjust``/``zfill``,
  ``expandtabs``, ``replace``, ``join``, ``format``, ``%``, ``indent``, ``+``, ``~``, ``batch``, ``slice``,
  ``tojson``'s indent) have their output size estimated first and are refused over ``MAX_RENDERED_CHARS``;
  sequences over ``MAX_SEQUENCE_ITEMS`` likewise.
- **Size of what is printed**: ``{{ x }}`` of a list or dict is its ``str()``, which can dwarf the list
  (a thousand references to one long string): the printed size is estimated by a bounded walk first.

A violation raises ``jinja2.exceptions.SecurityError``; ``templates.ChatTemplate`` answers it as a
``TemplateError`` (400). Not bounded here: a single C-level operation on structures the template built
within these bounds (say, comparing two deeply shared nested lists) is not interrupted; request templates
stay a trust decision, as the flag's name says (docs/security.md).
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from types import BuiltinMethodType, FunctionType
from typing import Any, cast

import jinja2
import jinja2.filters
import jinja2.nodes
import jinja2.utils
from jinja2.exceptions import SecurityError

# What one render may build, and the sequences it may hold (real templates never come near either).
MAX_RENDERED_CHARS = 64 * 1024 * 1024
MAX_SEQUENCE_ITEMS = 1 << 20
MAX_JSON_INDENT = 64
UNGUARDED_ITEMS = 4096
# CPU time of one render: the largest conversation a body may carry renders in about 0.2 s.
DEFAULT_RENDER_SECONDS = 5.0
# Checks of the clock (a system call for a thread's CPU time): every this many calls, or loop items.
_CALLS_PER_CHECK = 16
_ITEMS_PER_CHECK = 256

_DEADLINE: ContextVar[float] = ContextVar("chat_template_deadline", default=float("inf"))
_SCALARS = frozenset({type(None), bool, float})
_SEQUENCES: tuple[type, ...] = (list, tuple, set, frozenset, type({}.keys()), type({}.values()), type({}.items()))
_NUMBER = re.compile(r"\d+")


# The render's deadline in the rendering thread's CPU time (``time.thread_time``): set by ChatTemplate around
# each render (a token, reset after), read here. CPU time, not wall time: a render stalled by a busy machine
# or a throttled pod has done no more work, and must not be refused for it.
DEADLINE = _DEADLINE
# A thread's CPU time grows no faster than the wall clock: until ``time.perf_counter()`` passes the render's start
# plus its limit, its CPU deadline cannot have passed either, and a loop's start skips reading the thread's CPU
# clock (a system call). Set by ChatTemplate with DEADLINE; unset (-inf), every check reads the CPU clock.
WALL_CLOCK_BELOW_DEADLINE: ContextVar[float] = ContextVar("chat_template_wall_clock_below", default=float("-inf"))
_calls = 0


def past_deadline() -> bool:
    return time.thread_time() > _DEADLINE.get()


def tick() -> None:
    """A unit of template work (a call): every ``_CALLS_PER_CHECK``-th one checks the deadline."""
    global _calls
    _calls += 1
    if not _calls % _CALLS_PER_CHECK and past_deadline():
        raise SecurityError("the chat template ran past its time limit")


def refuse_size(size: int, what: str = "text") -> None:
    if size > MAX_RENDERED_CHARS:
        raise SecurityError(f"the chat template builds {what} too large (over {MAX_RENDERED_CHARS} characters)")


def refuse_items(count: int) -> None:
    if count > MAX_SEQUENCE_ITEMS:
        raise SecurityError(f"the chat template builds a sequence too large (over {MAX_SEQUENCE_ITEMS} items)")


# ------------------------------------------------------------------------------------- printed size


def printed_size(value: Any, limit: int = MAX_RENDERED_CHARS) -> int:
    """An estimate of ``len(str(value))`` that stops once past ``limit`` (never less than the truth by much:
    a container counts its items' printed sizes plus two characters each)."""
    if type(value) is str:
        return len(value)
    total = 0
    stack = [value]
    visited = 0
    while stack and total <= limit:
        item = stack.pop()
        kind = type(item)
        visited += 1
        if not visited & 4095:
            tick()
        if kind is str:
            total += len(item) + 2
        elif kind is dict:
            total += 2
            stack.extend(item.keys())
            stack.extend(item.values())
        elif kind is int:
            total += item.bit_length() // 3 + 2  # decimal digits, over-estimated
        elif kind in _SCALARS:
            total += 24
        elif isinstance(item, str):
            total += len(item) + 2
        elif isinstance(item, _SEQUENCES):
            total += 2
            stack.extend(cast(Iterable[Any], item))
        elif isinstance(item, dict):
            total += 2
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, jinja2.utils.Namespace):
            stack.append(object.__getattribute__(item, "_Namespace__attrs"))
        elif isinstance(item, int):
            total += int(item).bit_length() // 3 + 2
        else:
            total += 32  # None-like, opaque objects (their repr is short)
    return total


def bounded_str(value: Any) -> str:
    """``str(value)`` once its printed size is known to fit (every ``{{ }}`` goes through this)."""
    if type(value) is not str:
        refuse_size(printed_size(value), "printed text")
        value = str(value)
    return value


def bounded_concat(*parts: Any) -> str:
    """The ``~`` operator, with the total size known before joining."""
    tick()
    texts = [p if type(p) is str else bounded_str(p) for p in parts]
    refuse_size(sum(map(len, texts)))
    return "".join(texts)


def bounded_join(parts: Iterable[str]) -> str:
    """Jinja's buffer join (block ``set``, macros, ``caller()``): the size is known before joining."""
    parts = parts if isinstance(parts, list) else list(parts)
    refuse_size(sum(map(len, parts)))
    return "".join(parts)


def guard_iteration(iterable: Any) -> Any:
    """What every ``{% for %}`` iterates (the filter ``GUARD_FILTER``). Each loop's start checks the deadline
    (an inner loop: once per outer item); a short list, tuple, dict or string is iterated as it is (at most
    ``UNGUARDED_ITEMS`` straight-line iterations pass between two checks), anything else is checked every
    ``_ITEMS_PER_CHECK`` items."""
    # past_deadline(), inlined (every loop of every render runs this), after the wall clock's cheaper bound
    if time.perf_counter() > WALL_CLOCK_BELOW_DEADLINE.get() and time.thread_time() > _DEADLINE.get():
        raise SecurityError("the chat template ran past its time limit")
    kind = type(iterable)
    if (kind is list or kind is tuple or kind is dict or kind is str) and len(iterable) <= UNGUARDED_ITEMS:
        return iterable
    return _checked_items(iterable)


def _checked_items(iterable: Any) -> Iterator[Any]:
    deadline = _DEADLINE.get()
    for n, item in enumerate(iterable):
        if not n % _ITEMS_PER_CHECK and time.thread_time() > deadline:
            raise SecurityError("the chat template ran past its time limit")
        yield item


# ------------------------------------------------------------------------------ operators and methods


def _format_bound(fmt: str, args: Any) -> None:
    """A format string (``%`` or ``str.format``) whose widths or arguments could build huge text is refused:
    no number in it, nor any int argument, may exceed the size bound; string arguments count as printed."""
    if any(int(n) > MAX_RENDERED_CHARS for n in _NUMBER.findall(fmt)):
        refuse_size(MAX_RENDERED_CHARS + 1, "formatted text")
    values = args.values() if isinstance(args, dict) else args if isinstance(args, tuple) else (args,)
    total = len(fmt)
    for v in values:
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_RENDERED_CHARS:
            refuse_size(abs(v), "formatted text")
        total += printed_size(v)
    refuse_size(total, "formatted text")


def check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse ``*``, ``+`` and ``%`` results over the bounds before Python builds them."""
    if operator == "*":
        for seq, count in ((left, right), (right, left)):
            if isinstance(count, int) and count > 0:
                if isinstance(seq, str):
                    refuse_size(len(seq) * count)
                elif isinstance(seq, (list, tuple)):
                    refuse_items(len(seq) * count)
    elif operator == "+":
        if isinstance(left, str) and isinstance(right, str):
            refuse_size(len(left) + len(right))
        elif isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
            refuse_items(len(left) + len(right))
    elif operator == "%" and isinstance(left, str):
        _format_bound(left, right)


def _int_arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str, default: Any) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


_AMPLIFYING_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs", "replace", "join", "format",
                                 "format_map"})


def checked_call_args(obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """Refuse a call of a string method whose result would exceed the size bound; returns the arguments
    to call with (``join`` gets its items as a list, read once)."""
    kind = type(obj)
    if kind is BuiltinMethodType:
        owner = obj.__self__
    elif kind is FunctionType:  # the sandbox hands out str.format wrapped (functools.update_wrapper)
        owner = getattr(getattr(obj, "__wrapped__", None), "__self__", None)
    else:
        return args  # macros, globals, Jinja's loop
    if type(owner) is not str:
        return args
    name = obj.__name__
    if name not in _AMPLIFYING_METHODS:
        return args
    if name in ("center", "ljust", "rjust", "zfill"):
        width = _int_arg(args, kwargs, 0, "width", 0)
        if isinstance(width, int):
            refuse_size(width)
    elif name == "expandtabs":
        size = _int_arg(args, kwargs, 0, "tabsize", 8)
        if isinstance(size, int):
            refuse_size(len(owner) + owner.count("\t") * size)
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        old, new = args[0], args[1]
        count = _int_arg(args, kwargs, 2, "count", -1)
        hits = owner.count(old) if old else len(owner) + 1
        if isinstance(count, int) and count >= 0:
            hits = min(hits, count)
        refuse_size(len(owner) + hits * (len(new) - len(old)))
    elif name == "join" and args:
        items = list(args[0])
        refuse_items(len(items))
        refuse_size(sum(len(i) for i in items if isinstance(i, str)) + len(owner) * max(0, len(items) - 1))
        return (items, *args[1:])
    elif name in ("format", "format_map"):
        _format_bound(owner, args[0] if name == "format_map" and args else (*args, *kwargs.values()))
    return args


# ------------------------------------------------------------------------------------------ filters


def _checked_filter(name: str, check: Callable[..., Any]) -> Callable[..., Any]:
    """Jinja's filter ``name`` behind ``check``, which sees the filter's own arguments (after any context
    argument Jinja passes) and may refuse them; Jinja's argument-passing marker is kept."""
    original = jinja2.filters.FILTERS[name]
    takes_context = hasattr(original, "jinja_pass_arg")

    @functools.wraps(original)
    def filtered(*args: Any, **kwargs: Any) -> Any:
        tick()
        first = 1 if takes_context else 0
        replaced = check(*args[first:], **kwargs)
        if replaced is not None:  # the filtered value itself, read once (an iterator)
            args = (*args[:first], replaced, *args[first + 1:])
        return original(*args, **kwargs)

    return filtered


def _center(value: Any, width: Any = 80) -> None:
    if isinstance(width, int):
        refuse_size(width)


def _indent(s: Any, width: Any = 4, *args: Any, **kwargs: Any) -> None:
    step = width if isinstance(width, int) else len(width) if isinstance(width, str) else 0
    if isinstance(s, str):
        refuse_size(len(s) + (s.count("\n") + 1) * step)


def _format(value: Any, *args: Any, **kwargs: Any) -> None:
    if isinstance(value, str):
        _format_bound(value, kwargs or args)


def _join(value: Any, d: Any = "", attribute: Any = None) -> list[Any]:
    items = list(value)
    refuse_items(len(items))
    sep = len(d) if isinstance(d, str) else 0
    refuse_size(sum(printed_size(i) for i in items) + sep * max(0, len(items) - 1))
    return items


def _replace(s: Any, old: Any, new: Any, count: Any = None) -> None:
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
        hits = s.count(old) if old else len(s) + 1
        if isinstance(count, int) and count >= 0:
            hits = min(hits, count)
        refuse_size(len(s) + hits * (len(new) - len(old)))


def _batch(value: Any, linecount: Any, fill_with: Any = None) -> None:
    if isinstance(linecount, int):
        refuse_items(linecount)


def _slice(value: Any, slices: Any, fill_with: Any = None) -> None:
    if isinstance(slices, int):
        refuse_items(slices)


def _sum(iterable: Any, attribute: Any = None, start: Any = 0) -> None:
    if not isinstance(start, (int, float)):  # sequences sum in quadratic time, and nothing real sums them
        raise SecurityError("the chat template sums something other than numbers")


def _printed(value: Any, *args: Any, **kwargs: Any) -> None:
    refuse_size(printed_size(value), "printed text")


def _list(value: Any) -> None:
    if isinstance(value, (str, list, tuple, dict)):
        refuse_items(len(value))


_FILTER_CHECKS: dict[str, Callable[..., Any]] = {
    "center": _center, "indent": _indent, "format": _format, "join": _join, "replace": _replace,
    "batch": _batch, "slice": _slice, "sum": _sum, "string": _printed, "pprint": _printed, "list": _list,
}
CHECKED_FILTERS: dict[str, Callable[..., Any]] = {
    name: _checked_filter(name, check) for name, check in _FILTER_CHECKS.items()}


def bounded_tojson(dump: Callable[..., str]) -> Callable[..., str]:
    """HF's ``tojson`` with its ``indent`` bounded and the input's size known first."""

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        tick()
        if (isinstance(indent, int) and indent > MAX_JSON_INDENT) or (
                isinstance(indent, str) and len(indent) > MAX_JSON_INDENT):
            raise SecurityError(f"tojson indent over {MAX_JSON_INDENT}")
        refuse_size(printed_size(x) * (2 if indent else 1), "JSON")
        return dump(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    return tojson


# ----------------------------------------------------------------------------------- the AST rewrite


# The filter every rewritten loop goes through: a filter is a plain call in Jinja's code, not the sandbox's.
GUARD_FILTER = "_guard_iteration"


class BoundedTemplate(jinja2.visitor.NodeTransformer):
    """Rewrites a parsed template so that every ``for`` iterates through ``guard_iteration`` (the filter
    ``GUARD_FILTER``) and (with ``concat``) every ``~`` is ``bounded_concat``, the environment's attribute of
    that name, reached through a call (which the sandbox's ``call`` checks as well)."""

    def __init__(self, concat: bool) -> None:
        self.concat = concat

    def visit_For(self, node: jinja2.nodes.For) -> jinja2.nodes.Node:
        self.generic_visit(node)
        node.iter = jinja2.nodes.Filter(node.iter, GUARD_FILTER, [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: jinja2.nodes.Concat) -> jinja2.nodes.Node:
        self.generic_visit(node)
        if not self.concat:
            return node
        return jinja2.nodes.Call(jinja2.nodes.EnvironmentAttribute("bounded_concat"), node.nodes, [], None, None,
                                 lineno=node.lineno)


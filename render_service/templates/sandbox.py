"""The Jinja environment chat templates run in, as transformers builds it: an immutable sandbox with
``trim_blocks``/``lstrip_blocks``, ``loopcontrols``, a ``{% generation %}`` block tag (assistant masks),
HF's globals and filters, and bounds on what a template may cost: time and the size of what it builds,
checked as it renders (``template_budget``), powers, namespaces."""

from __future__ import annotations

import json
import logging
import types
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.runtime
import jinja2.utils
from jinja2.compiler import CodeGenerator, Frame
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

from render_service.templates.budget import (
    CHECKED_FILTERS,
    GUARD_FILTER,
    BoundedTemplate,
    bounded_concat,
    bounded_join,
    bounded_str,
    bounded_tojson,
    check_binop,
    checked_call_args,
    guard_iteration,
    tick,
)
from render_service.templates.inline import DICT_ATTRIBUTES as _DICT_ATTRIBUTES
from render_service.templates.inline import InlineReadsCodeGenerator, InlineTemplate
from render_service.templates.last_match_scan import (
    find_last_match_scans,
    parent_of,
    rewrite_last_match_scan,
    scan_done,
    scan_items,
)
from render_service.templates.loop_plan import plan_message_loops, rewrite_message_loop
from render_service.templates.loop_resume import checked_index, loop_entry
from render_service.templates.tojson_cache import DEFAULT_TEXTS

# A request's own template (--trust-request-chat-template) is compiled only up to this size; the largest
# real chat templates are tens of KB.
MAX_TEMPLATE_SOURCE_CHARS = 256 * 1024


class TemplateError(ValueError):
    """The template failed to render this conversation (a client error: 400)."""


# (rendered blocks so far, generation spans) while a render with spans is running.
_GENERATION_TRACKER: ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = ContextVar(
    "generation_tracker", default=None
)


class GenerationBlocks(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body and records its character span."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_mark_generation"), [], [], body).set_lineno(lineno)

    def _mark_generation(self, caller: Any) -> str:
        text: str = caller()
        tracking = _GENERATION_TRACKER.get()
        if tracking is not None:
            # Same rule as HF: the span starts after everything emitted before the block.
            blocks, spans = tracking
            start = sum(len(b) for b in blocks)
            spans.append((start, start + len(text)))
        return text


def _raise_exception(message: Any) -> None:
    raise jinja2.exceptions.TemplateError(message)


# HF's default options, remembered per value (templates call tojson per tool and tool call, every turn).
_TOJSON_DEFAULT = DEFAULT_TEXTS
_PLAIN_DUMPS = json.JSONEncoder(ensure_ascii=False).encode  # the reference switch's path (no cache, no lending)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; HF's does not, and exposes these options.
    if ensure_ascii is False and indent is None and separators is None and sort_keys is False:
        return _TOJSON_DEFAULT.dumps(x) if _TOJSON_DEFAULT.max_bytes else _PLAIN_DUMPS(x)
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _CallOnlyDict:
    # `dict(...)` in templates without handing the sandbox the dict type itself.
    def __call__(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return dict.fromkeys(*args, **kwargs)


class _SafeNamespace(jinja2.utils.Namespace):
    # Underscore attributes on a namespace are a route to CPython internals.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _SafeNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}."
            )


# The sandbox wraps these bound str methods (a format string can reach attributes); never shortcut them.
_STR_FORMAT_METHODS = frozenset({"format", "format_map"})
_METHOD_TYPES = (types.MethodType, types.BuiltinMethodType)
_DICT_READS = frozenset({"get", "items", "keys", "values"})
_PLAIN_FUNCTIONS = frozenset({safe_range, checked_index, loop_entry, scan_items, scan_done})


# A template (a request's own, or a model's) must not be able to exhaust memory with `'x' * 10**12` or
# `2 ** 10**9`, nor time with nested loops: template_budget bounds both. HF has no such bounds; real
# templates never come near them.
_MAX_POWER_EXPONENT = 4096


class GuardedLoopsCodeGenerator(InlineReadsCodeGenerator):
    """Jinja's code generator (with template_inline's reads) over a tree whose loops check the render's deadline
    (template_budget), and whose message loop a render may resume part-way (loop_plan.py, the model's template),
    its head scans for the last matching message answered from the record for the messages it shares
    (last_match_scan.py)."""

    concat_bounded = False
    resumable = True

    def visit_Template(self, node: jinja2.nodes.Template, frame: Frame | None = None) -> None:
        plans = plan_message_loops(node) if self.resumable else []
        for scan in find_last_match_scans(node) if self.resumable else []:
            parent = parent_of(scan.loop, node.body)
            if parent is not None:
                rewrite_last_match_scan(scan, parent, self.environment)
        tree = BoundedTemplate(self.concat_bounded).visit(node)
        for plan in plans:
            rewrite_message_loop(plan, self.environment)
        super().visit_Template(tree, frame)


class RequestTemplateCodeGenerator(GuardedLoopsCodeGenerator):
    """... and whose ``~`` knows its size before joining; calls and namespace reads keep the sandbox's path."""

    concat_bounded = True
    inline_calls = False
    resumable = False


class ChatTemplateCode(InlineTemplate):
    """A compiled chat template (its inline namespace reads know our namespace type)."""

    namespace_type = _SafeNamespace


class ChatSandbox(ImmutableSandboxedEnvironment):
    """HF's sandbox, with shortcuts that give the same answers faster, bounded in time (every loop checks the
    render's deadline) and in what ``*`` and ``**`` build."""

    _attribute_safety: dict[tuple[type, str], bool] = {}
    intercepted_binops = frozenset({"*", "**"})
    code_generator_class: type[CodeGenerator] = GuardedLoopsCodeGenerator
    template_class: type[jinja2.Template] = ChatTemplateCode

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**":
            if isinstance(right, int) and abs(right) > _MAX_POWER_EXPONENT and isinstance(left, int) \
                    and abs(left) > 1:
                raise jinja2.exceptions.SecurityError("the template computes a number that is too large")
        else:
            check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def getattr(self, obj: Any, attribute: str) -> Any:
        # A plain dict has no attributes beyond dict's own, so Jinja's getattr would fail and fall back
        # to obj[attribute]; all template data is rebuilt as plain dicts, so go there directly.
        kind = type(obj)
        if kind is dict and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except KeyError:
                return self.undefined(obj=obj, name=attribute)
        # An attribute this type was found safe to read before (loop.index0, str.startswith, ...): the
        # sandbox's own checks would pass again, except its str.format wrapping, which is kept.
        if self._attribute_safety.get((kind, attribute)) and attribute not in _STR_FORMAT_METHODS:
            try:
                value = getattr(obj, attribute)
            except AttributeError:
                pass  # the sandbox then tries obj[attribute]
            else:
                if not isinstance(value, _METHOD_TYPES) or value.__name__ not in _STR_FORMAT_METHODS:
                    return value
        return super().getattr(obj, attribute)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (Jinja's)
        # Callables that the sandbox finds safely callable and that take no context, called as context.call
        # would call them, without the generic path's checks (hundreds a render in macro-heavy templates):
        # a bound method of a str ('x'.strip, .split; str.format is wrapped by getattr into a function, so
        # never arrives here as a builtin method, and is excluded anyway) or a read of a dict (m.get('name')),
        # the template's own macros, namespace(), range() and the message loop's helpers.
        kind = type(__obj)
        if (kind is types.BuiltinMethodType
                and ((type(__obj.__self__) is str and __obj.__name__ not in _STR_FORMAT_METHODS)
                     or (type(__obj.__self__) is dict and __obj.__name__ in _DICT_READS))) \
                or kind is jinja2.runtime.Macro or __obj is _SafeNamespace \
                or (kind is types.FunctionType and __obj in _PLAIN_FUNCTIONS):
            kwargs.pop("_loop_vars", None)
            kwargs.pop("_block_vars", None)
            try:
                return __obj(*args, **kwargs)
            except StopIteration:
                return __context.environment.undefined(
                    "value was undefined because a callable raised a StopIteration exception")
        return super().call(__context, __obj, *args, **kwargs)

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        # The sandbox's verdict depends only on the object's type and the attribute's name (isinstance
        # tests and name rules), so remember it: loops ask about loop.index0 or str.startswith each turn.
        key = (type(obj), attr)
        safe = self._attribute_safety.get(key)
        if safe is None:
            safe = super().is_safe_attribute(obj, attr, value)
            if len(self._attribute_safety) < 4096:  # `|attr(name)` can make names from data: stay bounded
                self._attribute_safety[key] = safe
        return safe


class RequestTemplateSandbox(ChatSandbox):
    """For a request's own template (--trust-request-chat-template): code from a client, so every call checks
    the deadline, and every size it could build is known before it is built: string methods, ``+``, ``%``,
    ``~``, buffer joins, what ``{{ }}`` prints, and the filters that can amplify (template_budget). The
    model's template is the operator's code running on bounded data, and skips these per-operation costs."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class: type[CodeGenerator] = RequestTemplateCodeGenerator
    bounded_concat = staticmethod(bounded_concat)
    concat = staticmethod(bounded_join)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (Jinja's)
        tick()  # every call checks the deadline: a client's macros may recurse exponentially
        args = checked_call_args(__obj, args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)


def _make_environment(kind: type[ChatSandbox]) -> ChatSandbox:
    untrusted = kind is RequestTemplateSandbox
    env = kind(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlocks, jinja2.ext.loopcontrols],
        finalize=bounded_str if untrusted else None,
    )
    env.filters["tojson"] = _tojson
    env.filters[GUARD_FILTER] = guard_iteration  # what the rewritten loops iterate
    if untrusted:
        env.filters.update(CHECKED_FILTERS)
        env.filters["tojson"] = bounded_tojson(_tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _CallOnlyDict()
    env.globals["namespace"] = _SafeNamespace
    return env


class PlainLoopsCodeGenerator(CodeGenerator):
    """Jinja's own code generator over the same guarded tree: the path when the inline reads fail their proof."""

    concat_bounded = False

    def visit_Template(self, node: jinja2.nodes.Template, frame: Frame | None = None) -> None:
        super().visit_Template(BoundedTemplate(self.concat_bounded).visit(node), frame)


class PlainRequestCodeGenerator(PlainLoopsCodeGenerator):
    concat_bounded = True


# template_inline leans on Jinja's code generator and its LoopContext's internals: at load, a probe that reads
# everything the inline paths shortcut must render as Jinja's own code renders it, else both sandboxes take
# Jinja's (and the reference switch takes Jinja's always: render/reference_mode.py).
_INLINE_PROBE = (
    "{%- set ns = namespace(seen=0, last='') -%}"
    "{%- for m in messages -%}{%- set ns.seen = ns.seen + 1 -%}"
    "[{{ loop.index0 }}/{{ loop.index }}/{{ loop.revindex }}/{{ loop.revindex0 }}/{{ loop.length }}"
    "{{ loop.first }}{{ loop.last }}|{{ loop.previtem.role if loop.previtem else '-' }}"
    "|{{ loop.nextitem.role if loop.nextitem else '-' }}|{{ loop.cycle('a', 'b') }}{{ loop.changed(m.role) }}"
    "|{{ m.role }}:{{ m.content.strip(' ').split(' ')[0] }}{{ m.content.startswith('x') }}"
    "{{ m.get('name', 'none') }}{{ m['items'] if 'items' in m else 0 }}{{ m.items is defined }}"
    "{%- for c in m.content -%}{%- if loop.first -%}<{{ c }}{{ loop.depth }}>{%- endif -%}{%- endfor -%}"
    "{%- set ns.last = m.role -%}]{%- endfor -%}{{ ns.seen }}{{ ns.last }}"
    "{%- for k, v in tools.items() -%}{{ k }}={{ v | tojson }}{% if not loop.last %},{% endif %}{%- endfor -%}"
)
_INLINE_PROBE_DATA = {
    "messages": [{"role": "system", "content": " be brief "}, {"role": "user", "content": "x y z", "items": 3},
                 {"role": "user", "content": "again"}, {"role": "assistant", "content": "ok", "name": "bot"}],
    "tools": {"a": {"b": [1, 2.5, "é"]}, "c": None},
}


def inline_violation() -> str | None:
    """None when the inline reads render the probe exactly as Jinja's own code generator does; else why not."""
    try:
        got = [_make_environment(kind).from_string(_INLINE_PROBE).render(**_INLINE_PROBE_DATA)
               for kind in (ChatSandbox, RequestTemplateSandbox, _PlainChatSandbox)]
    except Exception as exc:  # Jinja's internals moved under the inline paths
        return f"the inline template reads fail on the probe: {type(exc).__name__}: {exc}"
    if not got[0] == got[1] == got[2]:
        return "the inline template reads render the probe unlike Jinja's code generator"
    return None


class _PlainChatSandbox(ChatSandbox):
    code_generator_class = PlainLoopsCodeGenerator
    template_class = jinja2.Template


_INLINE_CLASSES = (ChatSandbox.code_generator_class, ChatSandbox.template_class,
                   RequestTemplateSandbox.code_generator_class)
_PLAIN_CLASSES = (PlainLoopsCodeGenerator, jinja2.Template, PlainRequestCodeGenerator)


def use_plain_reads(plain: bool) -> None:
    """Templates compiled from now on take Jinja's own reads (``plain``: the reference switch), or the inline
    ones where they passed their proof at load."""
    global _ENVIRONMENT, _REQUEST_ENVIRONMENT
    classes = _PLAIN_CLASSES if plain or INLINE_REASON is not None else _INLINE_CLASSES
    ChatSandbox.code_generator_class, ChatSandbox.template_class, RequestTemplateSandbox.code_generator_class = \
        classes
    _ENVIRONMENT = _make_environment(ChatSandbox)
    _REQUEST_ENVIRONMENT = _make_environment(RequestTemplateSandbox)
    compile_template.cache_clear()


INLINE_REASON = inline_violation()
if INLINE_REASON is not None:
    logging.getLogger(__name__).warning("chat templates take Jinja's own reads: %s", INLINE_REASON)
    ChatSandbox.code_generator_class, ChatSandbox.template_class, RequestTemplateSandbox.code_generator_class = \
        _PLAIN_CLASSES
_ENVIRONMENT = _make_environment(ChatSandbox)
_REQUEST_ENVIRONMENT = _make_environment(RequestTemplateSandbox)


@lru_cache(maxsize=64)
def compile_template(source: str, from_request: bool = False) -> jinja2.Template:
    """Compile once per distinct source string; a request's own template in the stricter sandbox."""
    try:
        return (_REQUEST_ENVIRONMENT if from_request else _ENVIRONMENT).from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"Invalid chat template (line {exc.lineno}): {exc.message}") from exc
    except (RecursionError, SyntaxError, MemoryError):
        # Nesting deeper than Jinja's parser or Python's compiler takes: a client's template, not our fault.
        raise TemplateError("Invalid chat template: nested too deeply") from None

"""What a chat template reads, found from its AST: whether it wants message content as a string or as a list
of parts (vLLM's content format detection)."""

from __future__ import annotations

from functools import lru_cache

import jinja2
import jinja2.nodes

from render_service.templates.sandbox import _ENVIRONMENT


def _strip_wrappers(node: jinja2.nodes.Node) -> jinja2.nodes.Node:
    # `messages | reverse`, `messages is defined`, `messages[1:]` still refer to messages.
    while True:
        if isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) and node.node is not None:
            node = node.node
        elif isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
            node = node.node
        else:
            return node


def _names(node: jinja2.nodes.Node, names: set[str]) -> bool:
    node = _strip_wrappers(node)
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name in names


def _field_of(node: jinja2.nodes.Node, names: set[str], key: str) -> bool:
    node = _strip_wrappers(node)
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == key and _names(node.node, names)
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key and _names(node.node, names)
    return False


@lru_cache(maxsize=64)
def detect_content_format(source: str) -> str:
    """"openai" when the template loops over a message's content parts, else "string" (vLLM's rule).

    Followed: names assigned from ``messages``, loops over them, then loops over ``message.content``
    (directly, through a macro parameter that receives it, or a top-level loop over a name ``content``).
    """
    try:
        root = _ENVIRONMENT.parse(source)
    except jinja2.TemplateSyntaxError:
        return "string"
    aliases = {"messages"}
    grew = True
    while grew:
        grew = False
        for assign in root.find_all(jinja2.nodes.Assign):
            target = assign.target
            if isinstance(target, jinja2.nodes.Name) and target.name not in aliases and _names(assign.node, aliases):
                aliases.add(target.name)
                grew = True
    message_vars = {
        loop.target.name for loop in root.find_all(jinja2.nodes.For)
        if isinstance(loop.target, jinja2.nodes.Name) and _names(loop.iter, aliases)
    }
    macro_loops: set[int] = set()
    content_params: dict[int, set[str]] = {}
    for macro in root.find_all(jinja2.nodes.Macro):
        params = [arg.name for arg in macro.args]
        receiving: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            receiving.update(params[i] for i, arg in enumerate(call.args[:len(params)])
                             if _field_of(arg, message_vars, "content"))
            receiving.update(kw.key for kw in call.kwargs
                             if kw.key in params and _field_of(kw.value, message_vars, "content"))
        for loop in macro.find_all(jinja2.nodes.For):
            macro_loops.add(id(loop))
            if receiving:
                content_params[id(loop)] = receiving
    for loop in root.find_all(jinja2.nodes.For):
        if _field_of(loop.iter, message_vars, "content"):
            return "openai"
        if isinstance(loop.iter, jinja2.nodes.Name):
            if loop.iter.name in content_params.get(id(loop), ()):
                return "openai"
            if id(loop) not in macro_loops and loop.iter.name == "content":
                return "openai"
    return "string"

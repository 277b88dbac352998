"""Haystack agents traced by ``opentelemetry-haystack`` (content tracing on).

Each model call of a Haystack ``Agent`` is a ``haystack.agent.step.llm`` span:
``haystack.agent.step.llm.output`` is JSON, ``{"replies": [ChatMessage]}``
(model and usage in each reply's ``meta``, read by ``_meta``), but
``haystack.agent.step.llm.input`` is the Python ``repr`` of the call's keyword
arguments: ``{'messages': [ChatMessage(_role=<ChatRole.USER: 'user'>,
_content=[TextContent(text='...')], ...)], 'tools': [...]}``. The messages
list is cut out of it and read with ``ast`` (parsed, never evaluated): string
literals are Python's own, so every text comes back exact.

A ChatMessage's content parts: ``text``, ``tool_call`` (``tool_name``,
``arguments``, ``id``), ``tool_call_result`` (``result`` and the ``origin``
call, whose id it answers); reasoning parts are never content.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from ._messages import answer, history
from ._model import Attrs, Content, Truncated

NAME = "haystack"
INPUT, OUTPUT = "haystack.agent.step.llm.input", "haystack.agent.step.llm.output"
KEYS = (INPUT, OUTPUT)  # ``read`` finds nothing without one of these

_ROLE = re.compile(r"<ChatRole\.\w+: '(\w+)'>")
# repr class name -> the key of its part in ChatMessage.to_dict()
_PARTS = {"TextContent": "text", "ToolCall": "tool_call", "ToolCallResult": "tool_call_result",
          "ReasoningContent": "reasoning", "ImageContent": "image", "FileContent": "file"}


def _message(m: Any) -> dict[str, Any] | None:
    """A ChatMessage as ``to_dict()`` gives it -> an OpenAI chat message for the shared reader."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        return None
    texts: list[Any] = []
    calls: list[dict[str, Any]] = []
    for part in m.get("content") or []:
        if not isinstance(part, dict):
            continue
        if isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif isinstance(part.get("tool_call"), dict):
            tc = part["tool_call"]
            calls.append({"id": tc.get("id"), "type": "function",
                          "function": {"name": tc.get("tool_name"), "arguments": tc.get("arguments")}})
        elif isinstance(part.get("tool_call_result"), dict):
            res = part["tool_call_result"]
            origin = res.get("origin") if isinstance(res.get("origin"), dict) else {}
            return {"role": "tool", "content": res.get("result"), "tool_call_id": origin.get("id"),
                    "name": origin.get("tool_name")}
        elif "image" in part or "file" in part:
            texts.append({"type": "image" if "image" in part else "file"})
    out: dict[str, Any] = {"role": m["role"], "content": texts}
    if calls:
        out["tool_calls"] = calls
    return out


def _list_end(text: str, start: int) -> int:
    """The index just past the ``]`` closing the list opened at ``start``, skipping string literals."""
    depth, i, n = 0, start, len(text)
    while i < n:
        c = text[i]
        if c in "'\"":
            i += 1
            while i < n and text[i] != c:
                i += 2 if text[i] == "\\" else 1
        elif c in "[({":
            depth += 1
        elif c in "])}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise Truncated(text[:80])


def _node(node: ast.AST) -> Any:
    """A repr's syntax tree -> plain values; a call ``X(a=...)`` -> ``{"__class__": "X", "a": ...}``."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_node(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_node(k) if k is not None else None: _node(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        return {"__class__": node.func.id, **{kw.arg: _node(kw.value) for kw in node.keywords if kw.arg}}
    return None


def _as_dict(obj: Any) -> Any:
    """A ChatMessage repr's values in ``to_dict()`` shape."""
    if isinstance(obj, dict) and obj.get("__class__") == "ChatMessage":
        parts = []
        for p in obj.get("_content") or []:
            key = _PARTS.get(str(p.get("__class__"))) if isinstance(p, dict) else None
            if key == "text":
                parts.append({"text": p.get("text")})
            elif key in ("tool_call", "tool_call_result"):
                parts.append({key: _as_dict(p)})
            elif key is not None:
                parts.append({key: {}})
        return {"role": obj.get("_role"), "content": parts}
    if isinstance(obj, dict) and obj.get("__class__") == "ToolCallResult":
        return {"result": obj.get("result"), "origin": _as_dict(obj.get("origin")), "error": obj.get("error")}
    if isinstance(obj, dict) and obj.get("__class__") == "ToolCall":
        return {"tool_name": obj.get("tool_name"), "arguments": obj.get("arguments"), "id": obj.get("id")}
    return obj


def _input_messages(raw: Any) -> list[Any] | None:
    """The ``messages`` of the call's input: JSON if it is, else cut out of the repr."""
    if not isinstance(raw, str):
        return None
    try:
        value = json.loads(raw)
        return value.get("messages") if isinstance(value, dict) else None
    except ValueError:
        pass
    at = raw.find("'messages': [")
    if at < 0:
        return None
    start = at + len("'messages': ")
    listed = _ROLE.sub(r"'\1'", raw[start:_list_end(raw, start)])
    try:
        tree = ast.parse(listed, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise Truncated(raw[:80]) from None
    value = _node(tree.body)
    return [_as_dict(m) for m in value] if isinstance(value, list) else None


def read(attrs: Attrs) -> Content | None:
    """The call's history from the input's repr, its answer from the first reply."""
    if not any(k in attrs for k in KEYS):
        return None
    content = Content(NAME)
    try:
        messages = _input_messages(attrs.get(INPUT))
        if messages is not None:
            content.input, content.system = history([m for m in map(_message, messages) if m is not None])
    except (Truncated, RecursionError):
        content.truncated = True
    try:  # a cut input leaves the answer readable
        out = attrs.json(OUTPUT)
        replies = out.get("replies") if isinstance(out, dict) else None
        if isinstance(replies, list):
            content.output = answer([m for m in map(_message, replies) if m is not None]) or None
    except Truncated:
        content.truncated = True
    return content if content.has_messages() or content.truncated else None

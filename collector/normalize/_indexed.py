"""Rebuild nested messages from flattened, indexed attribute keys.

OpenLLMetry (``gen_ai.prompt.3.tool_calls.0.name``) and OpenInference
(``llm.input_messages.3.message.tool_calls.0.tool_call.function.name``) flatten
each message into one attribute per leaf. Numeric path segments become list
positions, in numeric order (exporters do not keep attribute order).
"""

from __future__ import annotations

from typing import Any, Iterable

# Every prefix a reader unflattens (``Attrs.indexed`` groups keys by them in one
# pass); none is a prefix of another.
OPENLLMETRY_PREFIXES = (("gen_ai.prompt.", "gen_ai.completion."), ("llm.prompts.", "llm.completions."))
OPENINFERENCE_PREFIXES = ("llm.input_messages.", "llm.output_messages.")
INDEXED_PREFIXES = tuple(p for pair in OPENLLMETRY_PREFIXES for p in pair) + OPENINFERENCE_PREFIXES


def unflatten(items: Iterable[tuple[str, Any]], prefix: str) -> list[Any]:
    """Collect every ``prefix<i>.<path>`` key into a list of nested dicts, by ``i``."""
    root: dict[Any, Any] = {}
    for key, value in items:
        if not key.startswith(prefix):
            continue
        node = root
        segs = [int(s) if s.isdigit() else s for s in key[len(prefix):].split(".")]
        if not segs or not isinstance(segs[0], int):
            continue
        for seg in segs[:-1]:
            nxt = node.get(seg)
            if not isinstance(nxt, dict):
                if nxt is not None:
                    break  # a leaf and a branch share a path: keep the leaf
                nxt = node[seg] = {}
            node = nxt
        else:
            node.setdefault(segs[-1], value)
    return [_listify(root[k]) for k in sorted(root)]


def _listify(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    if node and all(isinstance(k, int) for k in node):
        return [_listify(node[k]) for k in sorted(node)]
    return {str(k): _listify(v) for k, v in node.items()}

"""Recover the readable prefix of JSON cut short by an attribute length limit.

SDK and vendor limits (``OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT``, 64 KB caps) cut
``gen_ai.input.messages`` and friends mid-value, so the text no longer parses.
Closing what is open keeps every complete message and the start of the cut one;
the dicts on the path to the cut get ``TRUNCATED_MARK`` so the message reader
can flag the message ``truncated``.
"""

from __future__ import annotations

import json
from typing import Any

TRUNCATED_MARK = "__truncated__"
_HIGH = {"d8", "d9", "da", "db"}  # first bytes of a UTF-16 high surrogate


def salvage(text: str) -> Any | None:
    """Parse ``text`` as if it had been cut: close its open strings and brackets.

    Returns None when even the repaired text does not parse.
    """
    stack: list[str] = []
    in_string = escape = False
    expect_key = False  # inside an object, before a key
    for ch in text:
        if in_string:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_string = False
            continue
        if ch == '"':
            in_string = True
        elif ch in "[{":
            stack.append("]" if ch == "[" else "}")
            expect_key = ch == "{"
        elif ch in "]}":
            if stack:
                stack.pop()
            expect_key = False
        elif ch == ",":
            expect_key = bool(stack) and stack[-1] == "}"
        elif ch == ":":
            expect_key = False
    repaired = text
    if in_string:
        if escape:
            repaired = repaired[:-1]
        # A cut \\uXXXX escape would not parse, and a high surrogate whose
        # pair was cut off would not encode: drop either.
        tail = repaired.rfind("\\u")
        while tail != -1 and (len(repaired) - tail < 6 or repaired[tail + 2:tail + 4].lower() in _HIGH):
            repaired = repaired[:tail]
            tail = repaired.rfind("\\u")
        repaired += '"'
        if expect_key:  # the cut string was a key: give it a value
            repaired += ":null"
    else:
        repaired = repaired.rstrip()
        if repaired.endswith(","):
            repaired = repaired[:-1]
        elif repaired.endswith(":"):
            repaired += "null"
    for attempt in (repaired, _drop_partial_literal(repaired)):
        try:
            value = json.loads(attempt + "".join(reversed(stack)))
        except ValueError:
            continue
        _mark_last_path(value)
        return value
    return None


def _drop_partial_literal(text: str) -> str:
    """``..., tru`` or ``"k": 12.`` -> drop the unfinished token and its separator."""
    cut = max(text.rfind(c) for c in ",:[{")
    head = text[:cut + 1] if cut != -1 else ""
    if head.endswith(","):
        return head[:-1]
    if head.endswith(":"):
        return head + "null"
    return head


def _mark_last_path(value: Any) -> None:
    while True:
        if isinstance(value, list) and value:
            value = value[-1]
        elif isinstance(value, dict) and value:
            last = next(reversed(value))
            value[TRUNCATED_MARK] = True
            value = value[last]
        else:
            return

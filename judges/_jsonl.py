"""JSON lines that survive every character: one value per line, lines split on ``\\n`` only.

JSON encoders (``json.dumps(ensure_ascii=False)``, orjson, pydantic) leave U+2028, U+2029 and U+0085
raw inside strings. That is valid JSON, but ``str.splitlines`` (and other Unicode-aware line readers) break
lines there, so a message holding one would split its record in two. Writers escape them; readers split on
``\\n`` alone, which also reads files written before they did.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

_RAW = ("\u2028", "\u2029", "\x85")
_ESCAPES = str.maketrans({c: f"\\u{ord(c):04x}" for c in _RAW})
# In UTF-8 these byte runs are those characters and nothing else, and JSON has them only inside strings.
_RAW_UTF8 = tuple((c.encode("utf-8"), f"\\u{ord(c):04x}".encode("ascii")) for c in _RAW)

Encoded = TypeVar("Encoded", str, bytes)


def escape_line_breaks(encoded: Encoded) -> Encoded:
    """JSON text (str, or UTF-8 bytes as orjson gives them) with U+2028, U+2029 and U+0085 escaped.

    The value it encodes is unchanged; ``str.splitlines`` then sees one line.
    """
    if isinstance(encoded, str):
        return encoded.translate(_ESCAPES)
    for raw, escaped in _RAW_UTF8:
        encoded = encoded.replace(raw, escaped)
    return encoded


def json_line(value: Any) -> str:
    """``value`` as one line of a JSON-lines file, ending in ``\\n`` (non-ASCII text kept as is)."""
    return escape_line_breaks(json.dumps(value, ensure_ascii=False)) + "\n"


def split_json_lines(text: str) -> list[str]:
    """The lines of a JSON-lines text, split on ``\\n`` only.

    A ``\\r`` before the ``\\n`` is dropped; a line may hold U+2028, U+2029 or U+0085 raw (files
    written before writers escaped them). Nothing follows the last ``\\n``: no empty last line.
    """
    lines = text.split("\n")
    if not lines[-1]:
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]

"""One tolerant reader for every message shape the dialects carry.

The dialects differ in where messages live, far less in how one message looks:
OTel GenAI ``parts``, OpenAI chat (``content`` + ``tool_calls``), Anthropic
content blocks (``tool_use`` / ``tool_result``), Vercel AI SDK parts
(``tool-call`` / ``tool-result``), Gemini / ADK parts (``function_call``),
OpenAI Responses items. So each dialect module only finds the messages and this
module reads them, with the block types in tables.

A message that carries tool results becomes one ``tool`` message per result
(Anthropic and pydantic-ai send them as ``user`` messages), followed by a
message for any remaining text.
"""

from __future__ import annotations

import threading
from typing import Any, Iterable

from ._model import Message, Role, ToolCall, dumps, loads_maybe, parse_json_or_raw
from ._salvage import TRUNCATED_MARK

ROLES: dict[str, Role] = {
    "user": "user", "human": "user",
    "assistant": "assistant", "ai": "assistant", "model": "assistant", "bot": "assistant",
    "tool": "tool", "function": "tool", "ipython": "tool",
    "system": "system", "developer": "system",
}

# Block "type" values, per meaning. Checked in this order.
TEXT_TYPES = frozenset({"text", "input_text", "output_text", "refusal"})
SKIP_TYPES = frozenset({
    "reasoning", "thinking", "redacted_thinking", "compaction",
    "server_tool_call", "server_tool_call_response", "server_tool_use",
    "web_search_tool_result", "step-start",
})
TOOL_CALL_TYPES = frozenset({"tool_call", "tool_use", "tool-call", "function_call"})
TOOL_RESULT_TYPES = frozenset({"tool_call_response", "tool_result", "tool-result", "function_call_output"})
# Attachments: the word of their marker line when the part names no ``modality``
# (conversation-v1.md: ``[image]``, ``[audio]``...; else the part type, ``[file]``).
MEDIA_WORDS: dict[str, str] = {
    "image": "image", "image_url": "image", "input_image": "image",
    "audio": "audio", "input_audio": "audio", "video": "video", "document": "document",
    "file": "file", "input_file": "file", "blob": "blob", "uri": "uri",
}
MEDIA_TYPES = frozenset(MEDIA_WORDS)

# Field names, in order of preference, across the shapes above.
# Responses API items carry both an item id (fc_...) and the call id the result
# answers: call_id first.
_CALL_ID = ("call_id", "id", "toolCallId", "tool_call_id", "tool_use_id")
_CALL_NAME = ("name", "toolName", "tool_name")
_CALL_ARGS = ("arguments", "input", "args", "parameters")
_RESULT_ID = ("id", "tool_use_id", "toolCallId", "call_id", "tool_call_id")
_RESULT_VALUE = ("response", "content", "output", "result")


def _first(d: dict[str, Any], keys: Iterable[str]) -> Any:
    for k in keys:
        v = d.get(k)
        if v is not None:
            return v
    return None


def role_of(value: Any) -> Role | None:
    """Map any role spelling (``Human``, ``model``, ``developer``...) to ours."""
    if not isinstance(value, str):
        return None
    return ROLES.get(value.strip().lower())


def _marker(block: dict[str, Any], btype: str) -> str:
    """The marker line of an attachment: its modality, else the word for its part type."""
    modality = block.get("modality")
    return f"[{modality if isinstance(modality, str) and modality else MEDIA_WORDS[btype]}]"


def result_text(value: Any) -> str:
    """A tool result as text: strings as they are, block lists joined (attachments as marker
    lines after the text), objects as JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        # Vercel AI SDK: {"type": "text"|"json", "value": ...}
        if "value" in value and set(value) <= {"type", "value"}:
            return result_text(value["value"])
        btype = value.get("type")
        text = value.get("text")
        if btype in TEXT_TYPES and isinstance(text, str):
            return text
        if btype in MEDIA_TYPES:
            return _marker(value, btype)
        return dumps(value)
    if isinstance(value, list) and value and all(_is_block(b) for b in value):
        texts: list[str] = []
        markers: list[str] = []
        for b in value:
            b = b if "type" in b else (_keyed_block(b) or b)
            (markers if b.get("type") in MEDIA_TYPES else texts).append(result_text(b))
        return "\n".join(t for t in ("".join(texts), *markers) if t)
    return dumps(value)


def _tool_call(block: dict[str, Any]) -> ToolCall | None:
    fn = block.get("function")
    if isinstance(fn, dict):  # OpenAI: {id, type: function, function: {name, arguments}}
        name = fn.get("name")
        args = fn.get("arguments")
    else:
        name = _first(block, _CALL_NAME)
        args = _first(block, _CALL_ARGS)
    if not isinstance(name, str):
        return None
    call_id = _first(block, _CALL_ID)
    return ToolCall(id=call_id if isinstance(call_id, str) and call_id else None,
                    name=name, arguments=parse_json_or_raw(args if args is not None else {}))


# Blocks without a "type" (Gemini / ADK, Bedrock Converse as sent by Strands):
# the one key names the kind, and the inner fields are renamed to ours.
_KEYED_BLOCKS: dict[str, tuple[str, dict[str, str]]] = {
    "function_call": ("tool_call", {"id": "id", "name": "name", "args": "arguments"}),
    "functionCall": ("tool_call", {"id": "id", "name": "name", "args": "arguments"}),
    "toolUse": ("tool_call", {"toolUseId": "id", "name": "name", "input": "arguments"}),
    "function_response": ("tool_call_response", {"id": "id", "name": "name", "response": "response"}),
    "functionResponse": ("tool_call_response", {"id": "id", "name": "name", "response": "response"}),
    "toolResult": ("tool_call_response", {"toolUseId": "id", "content": "response"}),
}


def _keyed_block(block: dict[str, Any]) -> dict[str, Any] | None:
    for key, (btype, fields) in _KEYED_BLOCKS.items():
        inner = block.get(key)
        if isinstance(inner, dict):
            out = {ours: inner.get(theirs) for theirs, ours in fields.items()}
            out["type"] = btype
            return out
    text = block.get("text")
    if isinstance(text, dict):  # Azure AI Agents: {"text": {"value": ..., "annotations": [...]}}
        text = text.get("value")
    if isinstance(text, str):
        return {"type": "text", "text": text}
    if "json" in block:  # Bedrock tool result content
        return {"type": "text", "text": dumps(block["json"])}
    return None


def _is_block(b: Any) -> bool:
    return isinstance(b, dict) and ("type" in b or any(k in b for k in _KEYED_BLOCKS) or "text" in b)


class _Acc:
    """Collects one message's pieces while its blocks are walked."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.markers: list[str] = []  # one line per attachment, after the text
        self.calls: list[ToolCall] = []
        self.results: list[tuple[str | None, str | None, str]] = []

    def text(self) -> str:
        return "\n".join(t for t in (*self.texts, *self.markers) if t)

    def block(self, block: Any) -> None:
        if isinstance(block, str):
            self.texts.append(block)
            return
        if not isinstance(block, dict):
            return
        btype = block.get("type")
        if not isinstance(btype, str):
            keyed = _keyed_block(block)
            if keyed is None:
                return
            block, btype = keyed, keyed["type"]
        if btype in TEXT_TYPES:
            text = block.get("content", block.get("text"))
            if isinstance(text, str):
                self.texts.append(text)
        elif btype in TOOL_CALL_TYPES:
            tc = _tool_call(block)
            if tc is not None:
                self.calls.append(tc)
        elif btype in TOOL_RESULT_TYPES:
            rid = _first(block, _RESULT_ID)
            name = _first(block, _CALL_NAME)
            self.results.append((rid if isinstance(rid, str) else None,
                                 name if isinstance(name, str) else None,
                                 result_text(_first(block, _RESULT_VALUE))))
        elif btype in SKIP_TYPES:
            return
        elif btype in MEDIA_TYPES:
            self.markers.append(_marker(block, btype))
        elif isinstance(block.get("content"), str):  # generic part with text
            self.texts.append(block["content"])


def _content_blocks(content: Any) -> list[Any]:
    """``content`` as a block list; a JSON string of blocks (OpenLLMetry) is opened."""
    if content is None:
        return []
    if isinstance(content, str):
        s = content.lstrip()
        if s.startswith("[{"):
            try:
                parsed = loads_maybe(s)
            except ValueError:
                return [content]
            if isinstance(parsed, list) and all(_is_block(b) for b in parsed):
                return parsed
        return [content]
    if isinstance(content, list):
        return content
    if isinstance(content, dict):
        return [content]
    return [str(content)]


def _only_results(obj: dict[str, Any]) -> bool:
    """Whether ``obj``'s blocks are all tool results (and there is one)."""
    blocks = [b for key in ("parts", "content") for b in _content_blocks(obj.get(key))]
    return bool(blocks) and all(isinstance(b, dict) and _block_type(b) in TOOL_RESULT_TYPES for b in blocks)


def _block_type(block: dict[str, Any]) -> str | None:
    """A content block's ``type``, or its only key's (``{"functionResponse": {...}}``); None when not text."""
    kind = block.get("type") if "type" in block else (_keyed_block(block) or {}).get("type")
    return kind if isinstance(kind, str) else None


def read_message(obj: Any, truncated: bool = False) -> list[Message]:
    """Read one message object of any known shape into canonical messages.

    Returns an empty list for anything that is not a message. System messages
    come back with role ``system``; the caller moves them out of the history.
    """
    if not isinstance(obj, dict):
        return []
    truncated = truncated or obj.get(TRUNCATED_MARK) is True
    role = role_of(obj.get("role"))
    if role is None:
        # Responses API items and bare blocks have a type but no role.
        itype = obj.get("type")
        if not isinstance(itype, str):
            if not _only_results(obj):
                return []
            # A message of tool results whose role did not map (the OTel Google GenAI instrumentation writes
            # ``""`` for Gemini's ``role: "tool"`` contents): tool messages, as its blocks say.
            role = "tool"
        elif itype in TOOL_CALL_TYPES:
            role, obj = "assistant", {"role": "assistant", "parts": [obj]}
        elif itype in TOOL_RESULT_TYPES:
            role, obj = "tool", {"role": "tool", "parts": [obj]}
        else:
            return []
    acc = _Acc()
    for key in ("parts", "content", "contents"):
        for block in _content_blocks(obj.get(key)):
            acc.block(block)
    calls = obj.get("tool_calls")
    if isinstance(calls, str):  # span events spread a message over string attributes
        calls = loads_maybe(calls)
    # The botocore instrumentation's events carry an answer's calls twice: as the content's ``toolUse``
    # blocks and again as ``tool_calls``; a call whose id was read already is that same call.
    ids = {c.id for c in acc.calls if c.id}
    for tc in calls if isinstance(calls, list) else ():
        if isinstance(tc, dict):
            call = _tool_call(tc)
            if call is not None and not (call.id and call.id in ids):
                acc.calls.append(call)
    fc = obj.get("function_call")
    if isinstance(fc, dict):
        call = _tool_call(fc)
        if call is not None:
            acc.calls.append(call)
    name = obj.get("name") if isinstance(obj.get("name"), str) else None
    text = acc.text()
    if truncated and not (text or acc.calls or acc.results):
        return []  # cut before any of its content: nothing to show
    out: list[Message] = []
    if role == "tool" and not acc.results:
        call_id = _first(obj, ("tool_call_id", "id", "call_id"))
        return [Message("tool", text, tool_call_id=call_id if isinstance(call_id, str) else None,
                        name=name, truncated=truncated)]
    for rid, rname, rtext in acc.results:
        out.append(Message("tool", rtext, tool_call_id=rid, name=rname, truncated=truncated))
    if acc.results and role != "assistant":
        if text:  # text sent next to tool results stays a user turn, after them
            out.append(Message("user", text, truncated=truncated))
        return out
    out.insert(0, Message(role, text, tool_calls=tuple(acc.calls), truncated=truncated))
    return out


class _LastHistory(threading.local):
    """The last long message list read on this thread, item by item, with its messages.

    Each LLM call resends the whole history, so consecutive calls share a long
    prefix of equal message objects (the very same objects when
    ``Attrs.json`` parsed only the new tail). Comparing the raw items with the
    previous call's (C-level list and dict compares) is far cheaper than reading
    them again, which keeps a rebuild's Python work proportional to the new
    messages.
    """

    items: list[Any] = []
    out: list[Message] = []  # ``read`` flattened
    ends: list[int] = [0]  # ends[i]: where item i's messages start in ``out``
    # tails[i]: the last message read from the first i items; a later item may fold into it (``folds``)
    tails: list[Message | None] = [None]


_last = _LastHistory()


def folds(prev: Message, msg: Message) -> bool:
    """Whether ``msg`` continues ``prev``: an assistant message of tool calls alone right after an
    assistant message.

    The Responses API lists each call of a parallel answer as an item of its own
    (``function_call``), and OpenInference and Logfire pass them on as one
    assistant message per call; chat histories never hold two assistant messages
    in a row. One answer is one message (conversation-v1).
    """
    return (msg.role == "assistant" and prev.role == "assistant" and bool(msg.tool_calls)
            and not msg.content and not msg.tool_call_id)


def fold(prev: Message, msg: Message) -> Message:
    """``prev`` with ``msg``'s tool calls appended (see ``folds``)."""
    return Message("assistant", prev.content, prev.tool_calls + msg.tool_calls, name=prev.name,
                   truncated=prev.truncated or msg.truncated)


def fold_calls(messages: list[Message]) -> list[Message]:
    """``messages`` with each run of ``folds`` made one message."""
    out: list[Message] = []
    for m in messages:
        if out and folds(out[-1], m):
            out[-1] = fold(out[-1], m)
        else:
            out.append(m)
    return out


def _common_prefix(a: list[Any], b: list[Any]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, compared in C
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


def read_messages(items: Any, truncated: bool = False) -> list[Message]:
    """Read a list of message objects (a single object is accepted too)."""
    if isinstance(items, dict):
        items = [items]
    if not isinstance(items, list):
        return []
    last = _last
    # A non-dict item reads as nothing whichever way, so reusing it is exact.
    k = 0 if truncated or not last.items else _common_prefix(items, last.items)
    fresh = [read_message(item, truncated) for item in items[k:]]
    out = last.out[:last.ends[k]] if k else []
    tail = last.tails[k] if k else None
    if out and tail is not None:
        out[-1] = tail  # as it was before any later item folded into it
    ends: list[int] = last.ends[:k + 1] if k else [0]
    tails: list[Message | None] = last.tails[:k + 1] if k else [None]
    for msgs in fresh:
        if msgs and out and folds(out[-1], msgs[0]):
            out[-1] = fold(out[-1], msgs[0])
            out.extend(msgs[1:])
        else:
            out.extend(msgs)
        ends.append(len(out))
        tails.append(out[-1] if out else None)
    if len(items) > 1 and not truncated:  # a one-message answer must not evict the history
        last.items, last.out, last.ends, last.tails = items, out, ends, tails
        return list(out)  # ``out`` stays ours: callers may extend what they get
    return out


def join_system(*groups: list[str] | None) -> str | None:
    """System texts from several places, in order, each text once, joined by a blank line.

    conversation-v1.md: the system instructions (``gen_ai.system_instructions``,
    a request's top-level ``system``) first, then the system and developer
    messages of the input.
    """
    texts: list[str] = []
    seen: set[str] = set()
    for group in groups:
        for text in group or ():
            if text.strip() and text.strip() not in seen:
                seen.add(text.strip())
                texts.append(text)
    return "\n\n".join(texts) or None


def system_messages(messages: list[Message]) -> tuple[list[Message], list[str]]:
    """Move system messages out of a history: (the rest, their texts)."""
    rest = [m for m in messages if m.role != "system"]
    if len(rest) == len(messages):
        return messages, []
    return rest, [m.content for m in messages if m.role == "system" and m.content]


def split_system(messages: list[Message]) -> tuple[list[Message], str | None]:
    """Move system messages out of a history: (the rest, their text joined)."""
    rest, texts = system_messages(messages)
    return rest, join_system(texts)


def system_texts(value: Any) -> list[str]:
    """System instructions given as a string, a part list or a message list, text by text."""
    if isinstance(value, str):
        return [value] if value else []
    acc = _Acc()
    for block in value if isinstance(value, list) else [value]:
        if isinstance(block, dict) and "role" in block:
            for m in read_message(block):
                if m.content:
                    acc.texts.append(m.content)
        elif isinstance(block, dict) and "parts" in block:
            for b in _content_blocks(block["parts"]):
                acc.block(b)
        else:
            acc.block(block)
    return [t for t in (*acc.texts, *acc.markers) if t]


def history_texts(items: Any) -> tuple[list[Message], list[str]]:
    """``history``, with the system texts apart (a top-level ``system`` first)."""
    if isinstance(items, dict) and "role" not in items:
        msgs = items.get("messages")
        if msgs is None:
            msgs = items.get("contents", items.get("input"))
        if isinstance(msgs, str):
            msgs = [{"role": "user", "content": msgs}]
        rest, texts = system_messages(read_messages(msgs))
        if items.get("system") is not None:
            texts = system_texts(items["system"]) + texts
        return rest, texts
    return system_messages(read_messages(items))


def history(items: Any) -> tuple[list[Message], str | None]:
    """A call's input: (messages without system ones, the system text).

    Accepts a message list, one message, or a request object holding
    ``messages`` (with an Anthropic-style top-level ``system``).
    """
    rest, texts = history_texts(items)
    return rest, join_system(texts)


def answer(items: Any) -> list[Message]:
    """A call's output: the first choice only.

    Output lists hold one message per choice (n > 1); only one of them goes on
    into the next call's history, and the first is the one apps use.
    """
    if isinstance(items, dict) and "role" not in items:
        choices = items.get("choices", items.get("candidates"))
        if isinstance(choices, list):  # OpenAI / Gemini response
            return answer([c.get("message", c.get("content")) if isinstance(c, dict) else c
                           for c in choices])
        if isinstance(items.get("message"), dict):
            return answer(items["message"])
        if "content" in items:  # Anthropic response without its role
            return read_message({"role": "assistant", **items})
        return []
    if isinstance(items, list):
        for item in items:
            msgs = read_message(item)
            if msgs:
                return msgs
        return []
    return read_messages(items)

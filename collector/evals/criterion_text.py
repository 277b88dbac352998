"""A criterion's stored text read back: the evals stage stores a code criterion as ``Code check NAME {json};
applies if {json}`` (``verdicts.store_criteria``); scenarios turn it into expectations, and the review page and
scenarios into a sentence a reviewer reads, never JSON."""

from __future__ import annotations

import json
from typing import Any


def _code_check(text: str | None) -> tuple[str, dict[str, Any]] | None:
    """The check and its parameters of a code criterion's stored text (``Code check NAME {json}; applies
    if {json}``, as the evals stage stores it); None for an LLM criterion's prompt."""
    if not text or not text.startswith("Code check "):
        return None
    head = text[len("Code check "):].split("; applies if ", 1)[0]
    check, _, raw = head.partition(" ")
    try:
        params = json.loads(raw) if raw else {}
    except ValueError:
        params = {}
    return check, params if isinstance(params, dict) else {}


def expectations(criterion_id: str, criterion_text: str | None) -> dict[str, Any]:
    """``expected:``: the failed criterion, and for a code check what it checks, as deterministic expectations."""
    out: dict[str, Any] = {"criteria": [criterion_id]}
    code = _code_check(criterion_text)
    if code is None:
        return out
    check, params = code
    if check == "tool_called" and params.get("name"):
        out["tool_called"] = params["name"]
        if params.get("args"):
            out["tool_args"] = params["args"]
    elif check == "ended_by" and params.get("one_of"):
        out["ended_by"] = params["one_of"]
    elif check == "max_user_turns" and "max" in params:
        out["max_user_turns"] = params["max"]
    elif check == "regex" and params.get("pattern"):
        role = params.get("role", "assistant")
        out[f"{role}_{'must_match' if params.get('must', 'match') == 'match' else 'must_not_match'}"] = (
            params["pattern"])
    return out


def _condition(text: str) -> str:
    """`` When ...``: a code criterion's ``applies if`` in words; empty without one."""
    _, sep, raw = text.partition("; applies if ")
    try:
        cond = json.loads(raw) if sep else {}
    except ValueError:
        return ""
    if not isinstance(cond, dict):
        return ""
    parts = []
    if cond.get("user_matches"):
        parts.append(f"a user message matches `{cond['user_matches']}`")
    if cond.get("bot_matches"):
        parts.append(f"a bot message matches `{cond['bot_matches']}`")
    if cond.get("tool_called"):
        parts.append(f"the bot called `{cond['tool_called']}`")
    if cond.get("ended_by"):
        parts.append("the conversation ended by " + " or ".join(f"`{e}`" for e in cond["ended_by"]))
    return (" It applies only when " + " and ".join(parts) + "; otherwise it is not applicable.") if parts else ""


def describe_criterion(text: str | None) -> str:
    """A criterion in words: a code check as a sentence (with when it applies), an LLM criterion as its
    prompt."""
    if not text:
        return "(the criterion's text was not stored)"
    code = _code_check(text)
    if code is None:
        return text.strip()
    return _sentence(text, code) + _condition(text)


def _sentence(text: str, code: tuple[str, dict[str, Any]]) -> str:
    exp = expectations("-", text)
    if "tool_called" in exp:
        return f"The bot must call `{exp['tool_called']}`" + (
            f" with arguments including {json.dumps(exp['tool_args'])}." if "tool_args" in exp else ".")
    if "ended_by" in exp:
        return "The conversation must end by " + " or ".join(f"`{e}`" for e in exp["ended_by"]) + "."
    if "max_user_turns" in exp:
        return f"The user must need at most {exp['max_user_turns']} messages."
    for key, value in exp.items():
        if key.endswith("must_match") or key.endswith("must_not_match"):
            role, _, rule = key.partition("_must_")
            return (f"{role.capitalize()} messages must {'not ' if rule == 'not_match' else ''}match "
                    f"the pattern `{value}`.")
    check, params = code
    return f"Code check `{check}`" + (f" with {json.dumps(params)}" if params else "") + "."

"""``tracejudge conversations list|show``: the conversations rebuilt from traces."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import click

from ..errors import UserError
from ..words import MAX_LIMIT
from . import merge
from .common import ask, ask_all, config_option, db_option, json_option, table


@click.group()
def conversations() -> None:
    """List conversations, or show one as a transcript or a conversation/v1 record."""


@conversations.command("list")
@config_option
@db_option
@json_option
@click.option("--since", help="Only those active since: a duration ago (15m, 2h, 7d) or an ISO 8601 time.")
@click.option("--state", type=click.Choice(["open", "ended"]), help="Only open or only ended conversations.")
@click.option("--service", help="Only this service.name.")
@click.option("--limit", type=click.IntRange(1, MAX_LIMIT), default=50, show_default=True)
def list_cmd(config_path: Path | None, dbs: tuple[Path, ...], as_json: bool, since: str | None, state: str | None,
             service: str | None, limit: int) -> None:
    """Conversations, the most recently active first (of all the files, with --db given more than once)."""
    if len(dbs) > 1:
        rows = ask_all(config_path, dbs, lambda cs: merge.conversations(
            [c.list_conversations(since=since, state=state, service=service, limit=limit) for c in cs], limit))
    else:
        rows = ask(config_path, lambda c: c.list_conversations(since=since, state=state, service=service,
                                                               limit=limit), dbs[0] if dbs else None)
    if as_json:
        click.echo(json.dumps(rows, ensure_ascii=False, indent=2))
        return
    if not rows:
        click.echo("no conversations yet")
        return
    lines = [["conversation", "state", "service", "turns", "msgs", "tokens in/out", "last data"]]
    for c in rows:
        state_text = "open" if c["state"] == "open" else f"ended ({c['ended_by'] or 'unknown'})"
        if not c["content_captured"]:
            state_text += ", no content"
        lines.append([c["conversation_id"], state_text, c["service"] or "-", str(c["user_turns"] or 0),
                      str(c["message_count"] or 0), f"{c['input_tokens'] or 0}/{c['output_tokens'] or 0}",
                      (c["last_arrival_at"] or "")[:19]])
    click.echo(table(lines, align="lllrrr"))


@conversations.command("show")
@click.argument("conversation_id")
@config_option
@json_option
def show_cmd(conversation_id: str, config_path: Path | None, as_json: bool) -> None:
    """One conversation: a readable transcript with its verdicts, or its conversation/v1 record with --json."""
    record, verdicts = ask(config_path, lambda c: (c.conversation(conversation_id), c.verdicts(
        result=None, criterion=None, conversation=conversation_id, since=None, limit=MAX_LIMIT)))
    if record is None:
        raise UserError(f"no conversation {conversation_id!r} (see `tracejudge conversations list`)")
    if as_json:
        click.echo(json.dumps(record, ensure_ascii=False, indent=2))
        return
    click.echo(render(record) + "\n\n" + render_verdicts(verdicts))


def render_verdicts(verdicts: list[dict[str, Any]]) -> str:
    """The current verdicts on one conversation, one line each with the judge's reason."""
    if not verdicts:
        return "verdicts: none yet (the conversation is still open, was not sampled, or waits to be judged)"
    rows = [[v["result"] + (" (flagged)" if v.get("flagged") else ""), f"{v['criterion_id']} v{v['criterion_version']}",
             (v["error_reason"] if v["result"] == "error" else v.get("reasoning") or "").replace("\n", " ")]
            for v in sorted(verdicts, key=lambda v: v["criterion_id"])]
    return f"verdicts ({len(verdicts)}):\n" + "\n".join("  " + line for line in table(rows, align="ll").splitlines())


def render(record: dict[str, Any], mark: Callable[[int, str], str] = lambda n, text: text) -> str:
    """A conversation/v1 record as text a person reads; ``mark`` is applied to every message's text (and index)."""
    attrs = record.get("attributes", {})
    usage = record.get("usage") or {}
    ended = "still open" if record["ended_by"] == "open" else f"ended by {record['ended_by']}"
    lines = [
        f"conversation {record['id']}  ({record.get('service') or 'unknown service'})",
        f"  {record.get('started_at') or '?'} .. {record.get('ended_at') or 'now'}   {ended}",
        f"  models: {', '.join(record.get('models') or []) or '-'}   tokens: {usage.get('input_tokens', 0)} in, "
        f"{usage.get('output_tokens', 0)} out   LLM calls: {attrs.get('llm_calls', '?')}   "
        f"traces: {len(record.get('trace_ids') or [])}",
    ]
    if not attrs.get("content_captured", True):
        lines.append(f"  no content captured: {attrs.get('no_content_reason', '')}")
    if record.get("system"):
        lines += ["", f"SYSTEM: {record['system']}"]
    lines.append("")
    for n, m in enumerate(record["messages"]):
        if m["role"] == "user":
            lines.append(f"USER: {mark(n, m['content'])}")
        elif m["role"] == "assistant":
            if m["content"]:
                lines.append(f"BOT: {mark(n, m['content'])}")
            for tc in m.get("tool_calls") or []:
                args = json.dumps(tc.get("arguments"), ensure_ascii=False)
                lines.append(f"BOT -> {tc['name']}({args})")
        else:
            lines.append(f"TOOL {m.get('name') or m.get('tool_call_id') or ''}: {mark(n, m['content'])}")
    return "\n".join(lines)

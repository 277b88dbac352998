"""``tracejudge conversations list|show``: the conversations rebuilt from traces."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import click

from ..errors import UserError
from .common import ask, config_option, json_option


@click.group()
def conversations() -> None:
    """List conversations, or show one as a transcript or a conversation/v1 record."""


@conversations.command("list")
@config_option
@json_option
@click.option("--since", help="Only those active since: a duration ago (15m, 2h, 7d) or an ISO 8601 time.")
@click.option("--state", type=click.Choice(["open", "ended"]), help="Only open or only ended conversations.")
@click.option("--service", help="Only this service.name.")
@click.option("--limit", type=click.IntRange(1, 100_000), default=50, show_default=True)
def list_cmd(config_path: Path | None, as_json: bool, since: str | None, state: str | None, service: str | None,
             limit: int) -> None:
    """Conversations, the most recently active first."""
    rows = ask(config_path, lambda c: c.list_conversations(since=since, state=state, service=service, limit=limit))
    if as_json:
        click.echo(json.dumps(rows, ensure_ascii=False, indent=2))
        return
    if not rows:
        click.echo("no conversations yet")
        return
    header = f"{'conversation':40}  {'state':16}  {'service':18}  {'turns':>5}  {'msgs':>4}  {'tokens in/out':>13}  last data"
    click.echo(header)
    for c in rows:
        state_text = c["state"] if c["state"] == "open" else f"ended:{c['ended_by']}"
        if not c["content_captured"]:
            state_text += " (no content)"
        tokens = f"{c['input_tokens'] or 0}/{c['output_tokens'] or 0}"
        click.echo(f"{_cut(c['conversation_id'], 40):40}  {state_text:16}  {_cut(c['service'] or '-', 18):18}  "
                   f"{c['user_turns'] or 0:>5}  {c['message_count'] or 0:>4}  {tokens:>13}  "
                   f"{(c['last_arrival_at'] or '')[:19]}")


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


@conversations.command("show")
@click.argument("conversation_id")
@config_option
@json_option
def show_cmd(conversation_id: str, config_path: Path | None, as_json: bool) -> None:
    """One conversation: a readable transcript, or its conversation/v1 record with --json."""
    record = ask(config_path, lambda c: c.conversation(conversation_id))
    if record is None:
        raise UserError(f"no conversation {conversation_id!r} (see `tracejudge conversations list`)")
    if as_json:
        click.echo(json.dumps(record, ensure_ascii=False, indent=2))
        return
    click.echo(render(record))


def render(record: dict[str, Any], mark: Callable[[str], str] = lambda text: text) -> str:
    """A conversation/v1 record as text a person reads; ``mark`` is applied to every message's text."""
    attrs = record.get("attributes", {})
    usage = record.get("usage") or {}
    lines = [
        f"conversation {record['id']}  ({record.get('service') or 'unknown service'})",
        f"  {record.get('started_at') or '?'} .. {record.get('ended_at') or 'open'}   ended by: {record['ended_by']}",
        f"  models: {', '.join(record.get('models') or []) or '-'}   tokens: {usage.get('input_tokens', 0)} in, "
        f"{usage.get('output_tokens', 0)} out   LLM calls: {attrs.get('llm_calls', '?')}   "
        f"traces: {len(record.get('trace_ids') or [])}",
    ]
    if not attrs.get("content_captured", True):
        lines.append(f"  no content captured: {attrs.get('no_content_reason', '')}")
    if record.get("system"):
        lines += ["", f"SYSTEM: {record['system']}"]
    lines.append("")
    for m in record["messages"]:
        if m["role"] == "user":
            lines.append(f"USER: {mark(m['content'])}")
        elif m["role"] == "assistant":
            if m["content"]:
                lines.append(f"BOT: {mark(m['content'])}")
            for tc in m.get("tool_calls") or []:
                args = json.dumps(tc.get("arguments"), ensure_ascii=False)
                lines.append(f"BOT -> {tc['name']}({args})")
        else:
            lines.append(f"TOOL {m.get('name') or m.get('tool_call_id') or ''}: {mark(m['content'])}")
    return "\n".join(lines)

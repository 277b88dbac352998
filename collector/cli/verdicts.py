"""``tracejudge verdicts``: stored verdicts, e.g. the judge errors with their reasons."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..words import MAX_LIMIT
from . import merge
from .common import ask, ask_all, config_option, db_option, json_option, table

if TYPE_CHECKING:
    from ..api.client import Client


@click.command()
@config_option
@db_option
@json_option
@click.option("--result", type=click.Choice(["pass", "fail", "not_applicable", "error"]), help="Only this result.")
@click.option("--criterion", help="Only this criterion id.")
@click.option("--conversation", help="Only the verdicts on this conversation id.")
@click.option("--since", help="Only verdicts judged since: a duration ago (15m, 2h, 7d) or an ISO 8601 time.")
@click.option("--limit", type=click.IntRange(1, MAX_LIMIT), default=100, show_default=True)
@click.option("--source", type=click.Choice(["production", "simulation"]), default="production", show_default=True,
              help="simulation: the verdicts on the simulated conversations tracejudge replay import stored.")
def verdicts(config_path: Path | None, dbs: tuple[Path, ...], as_json: bool, result: str | None,
             criterion: str | None, conversation: str | None, since: str | None, limit: int, source: str) -> None:
    """Current verdicts, the newest first. `--result error` lists judge errors with their reasons
    (errors are never queued for review); `--conversation ID` the verdicts on one conversation.
    With --db given more than once, the newest of all the files', by when each was judged."""
    def one(c: Client) -> list[dict[str, Any]]:
        return c.verdicts(result=result, criterion=criterion, conversation=conversation, since=since, limit=limit,
                          source=source)

    if len(dbs) > 1:
        rows = ask_all(config_path, dbs, lambda cs: merge.verdicts([one(c) for c in cs], limit))
    else:
        rows = ask(config_path, one, dbs[0] if dbs else None)
    if as_json:
        click.echo(json.dumps(rows, ensure_ascii=False, indent=2))
        return
    if not rows:
        click.echo("no verdicts" + (f" with result {result}" if result else "")
                   + (f" on conversation {conversation}" if conversation else ""))
        return
    lines = table([["judged at", "result", "criterion", "conversation"]]
                  + [[v["judged_at"][:19], v["result"] + (" (flagged)" if v.get("flagged") else ""),
                      f"{v['criterion_id']} v{v['criterion_version']}", v["conversation_id"]] for v in rows],
                  align="lll").splitlines()
    click.echo(lines[0])
    for line, v in zip(lines[1:], rows):
        why = v["error_reason"] if v["result"] == "error" else (v["reasoning"] or "")
        click.echo(line + (f"\n    {why}" if why else ""))

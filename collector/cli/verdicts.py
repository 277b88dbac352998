"""``tracejudge verdicts``: stored verdicts, e.g. the judge errors with their reasons."""

from __future__ import annotations

import json
from pathlib import Path

import click

from .common import ask, config_option, json_option


@click.command()
@config_option
@json_option
@click.option("--result", type=click.Choice(["pass", "fail", "not_applicable", "error"]), help="Only this result.")
@click.option("--criterion", help="Only this criterion id.")
@click.option("--since", help="Only verdicts judged since: a duration ago (15m, 2h, 7d) or an ISO 8601 time.")
@click.option("--limit", type=click.IntRange(1, 100_000), default=100, show_default=True)
def verdicts(config_path: Path | None, as_json: bool, result: str | None, criterion: str | None,
             since: str | None, limit: int) -> None:
    """Current verdicts, the newest first. `--result error` lists judge errors with their reasons
    (errors are never queued for review)."""
    rows = ask(config_path, lambda c: c.verdicts(result=result, criterion=criterion, since=since, limit=limit))
    if as_json:
        click.echo(json.dumps(rows, ensure_ascii=False, indent=2))
        return
    if not rows:
        click.echo("no verdicts" + (f" with result {result}" if result else ""))
        return
    for v in rows:
        why = v["error_reason"] if v["result"] == "error" else (v["reasoning"] or "")
        click.echo(f"{v['judged_at'][:19]}  {v['result']:14}  {v['criterion_id']} v{v['criterion_version']}  "
                   f"{v['conversation_id']}" + (f"\n    {why}" if why else ""))

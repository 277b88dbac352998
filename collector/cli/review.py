"""``tracejudge review list|show|confirm|reject``: the queue of judge failures a person checks."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from ..words import MAX_LIMIT
from ..review import REVIEW_STATES
from .common import ask, config_option, json_option, reviewer_token_option, table
from .conversations import render


@click.group()
def review() -> None:
    """Review the failures the judges found: list, show, confirm, reject or mark them unclear.

    Works through the running daemon's API, or on the DuckDB file when no daemon
    runs. The web page at <api>/review does the same in a browser.
    """


@review.command("list")
@config_option
@json_option
@click.option("--state", type=click.Choice([*REVIEW_STATES, "all"]), default="pending", show_default=True,
              help="Which items.")
@click.option("--criterion", help="Only this criterion id.")
@click.option("--severity", type=click.Choice(["high", "medium", "low"]), help="Only criteria of this severity.")
@click.option("--service", help="Only conversations of this bot service.")
@click.option("--flagged/--not-flagged", default=None, help="Only flagged fails (no verified quote), or only the others.")
@click.option("--since", help="Only items queued since then (7d, 12h, or an ISO 8601 time).")
@click.option("--assignee", help="Only items this reviewer holds (a claim or an assignment that has not run out).")
@click.option("--order", type=click.Choice(["severity", "age"]), default="severity", show_default=True,
              help="severity: high severity first, then the oldest; age: the oldest first.")
@click.option("--limit", type=click.IntRange(1, MAX_LIMIT), default=100, show_default=True)
def list_cmd(config_path: Path | None, as_json: bool, state: str, criterion: str | None, severity: str | None,
             service: str | None, flagged: bool | None, since: str | None, assignee: str | None, order: str,
             limit: int) -> None:
    """Review items in the queue's order: high severity first, then the oldest."""
    given = {k: v for k, v in (("severity", severity), ("service", service), ("flagged", flagged),
                               ("since", since), ("assignee", assignee)) if v is not None}
    items = ask(config_path, lambda c: c.list_reviews(state=state, criterion=criterion, limit=limit, order=order,
                                                      **given))
    if as_json:
        click.echo(json.dumps(items, ensure_ascii=False, indent=2))
        return
    if not items:
        click.echo(f"no {'' if state == 'all' else state + ' '}review items")
        return
    rows = [["item", "state", "judge said", "criterion", "conversation"]]
    for it in items:
        said = it["result"] + (" (flagged)" if it.get("flagged") else "")
        state_text = it["state"] + (f" by {it['reviewer']}" if it.get("reviewer") else "")
        rows.append([str(it["id"]), state_text, said, it["criterion_id"], it["conversation_id"]])
    click.echo(table(rows, align="rlll"))


def _marker() -> tuple[str, str]:
    # Reverse video on a terminal; visible brackets in a pipe or a file.
    return ("\x1b[7m", "\x1b[0m") if sys.stdout.isatty() else ("[[", "]]")


def render_item(detail: dict[str, Any]) -> str:
    """A review item as text: the criterion, the judge's verdict and reasoning, the transcript with quotes marked."""
    item, verdict, crit = detail["item"], detail["verdict"], detail["criterion"]
    evidence = [str(q) for q in verdict.get("evidence") or []]
    before, after = _marker()
    lines = [
        f"review item {item['id']}: {item['state']}"
        + (f" by {item['reviewer']} ({item['decided_at']})" if item.get("reviewer") else ""),
        f"criterion {crit['id']} v{crit['version']}"
        + (f"  severity {crit['severity']}" if crit.get("severity") else "")
        + (f"  group {crit['group']}" if crit.get("group") else ""),
    ]
    if crit.get("text"):
        lines += ["", *(f"  | {line}" for line in str(crit["text"]).rstrip().splitlines())]
    judge = verdict.get("judge") or {}
    lines += ["", f"judge ({judge.get('provider')}/{judge.get('model')}) said: {verdict['result']}"
              + ("  FLAGGED: no quote was found in the transcript" if verdict.get("flagged") else "")]
    if verdict.get("reasoning"):
        lines.append(f"reasoning: {verdict['reasoning']}")
    for q in evidence:
        lines.append(f"evidence: {before}{q}{after}")
    if evidence and not verdict.get("evidence_verified"):
        lines.append("  (not every quote was found in the transcript)")
    if verdict.get("superseded"):
        lines.append("note: the transcript changed since this verdict (late data); it is superseded")
    for h in detail.get("history") or []:
        lines.append(f"history: {h['decided_at']} {h['reviewer']} {h['decision']}ed"
                     + (" (forced)" if h.get("forced") else "") + (f": {h['note']}" if h.get("note") else ""))
    conversation = detail.get("conversation")
    lines.append("")
    if conversation is None:
        lines.append("(the conversation is no longer stored)")
    else:
        from ..review.page import locate_quotes, mark_ranges

        _, marks = locate_quotes(conversation["messages"], evidence)
        lines.append(render(conversation, mark=lambda n, text: mark_ranges(text, marks.get((n, -1), ()),
                                                                          before=before, after=after)))
    return "\n".join(lines)


@review.command("show")
@click.argument("item_id")
@config_option
@json_option
def show_cmd(item_id: str, config_path: Path | None, as_json: bool) -> None:
    """One item: the criterion text, the judge's reasoning and the transcript with the quoted evidence marked."""
    detail = ask(config_path, lambda c: c.review_item(item_id))
    click.echo(json.dumps(detail, ensure_ascii=False, indent=2) if as_json else render_item(detail))


def _decide(decision: str, item_id: str, config_path: Path | None, reviewer: str | None, note: str | None,
            force: bool, as_json: bool, reviewer_token: str | None) -> None:
    item = ask(config_path, lambda c: c.decide(item_id, decision, reviewer, note, force),
               reviewer_token=reviewer_token, records=True)
    if as_json:
        click.echo(json.dumps(item, ensure_ascii=False, indent=2))
    else:
        click.echo(f"review item {item['id']} ({item['criterion_id']} on {item['conversation_id']}): "
                   f"{item['state']} by {item['reviewer']}")


def _decision_command(decision: str, help_text: str) -> click.Command:
    @click.argument("item_id")
    @config_option
    @json_option
    @click.option("--reviewer", envvar="TRACEJUDGE_REVIEWER", show_envvar=True,
                  help="Who decides (kept with the decision); with review.reviewers, --token names them instead "
                       "(a --reviewer given must be the token's).")
    @reviewer_token_option
    @click.option("--note", help="Why, in your words.")
    @click.option("--force", is_flag=True, help="Decide an item decided already; the earlier decision stays "
                                                "in its history.")
    def cmd(item_id: str, config_path: Path | None, as_json: bool, reviewer: str | None, reviewer_token: str | None,
            note: str | None, force: bool) -> None:
        _decide(decision, item_id, config_path, reviewer, note, force, as_json, reviewer_token)

    return click.command(decision, help=help_text)(cmd)


review.add_command(_decision_command("confirm", "Confirm an item: the judge was right, this is a real failure."))
review.add_command(_decision_command("reject", "Reject an item: the judge was wrong."))
review.add_command(_decision_command("unclear", "Mark an item unclear: the criterion does not say whether this "
                                                "conversation fails it (its authors have work to do)."))

"""``tracejudge scenarios export|verify``: confirmed failures as scenarios for the offline suite, and whether they
reproduce."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from ..words import plural
from .common import config_option, json_option, load
from .simulate import bot_options, run_simulation


@click.group()
def scenarios() -> None:
    """Turn confirmed failures into scenarios for the offline simulation suite."""


@scenarios.command("export")
@config_option
@json_option
@click.option("--since", help="Only items confirmed since then: 15m, 2h, 7d or an ISO 8601 time.")
@click.option("--criterion", help="Only failures of this criterion id.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Write here instead of scenarios.out_dir.")
@click.option("--no-draft", is_flag=True, help="Build the deterministic draft even when a judge provider is set.")
def export_cmd(config_path: Path | None, as_json: bool, since: str | None, criterion: str | None,
               out_dir: Path | None, no_draft: bool) -> None:
    """Write a scenario for each confirmed failure not exported yet.

    For each one, into scenarios.out_dir (default scenarios/incoming/ beside the
    config, never the stable suite): <id>.yaml (persona, goal, facts the user
    revealed only when asked, opening, expected criteria), <id>.fix.md (the
    criterion, the quoted evidence in its turn, the judge's reasoning, the
    reviewer's note and a proposed change) and a line of cases.jsonl. The id is
    prod-<criterion>-<hash of the conversation id>: running it again writes
    nothing new and says so.

    Personal data (emails, phone numbers, cards, IBANs, ids, addresses, names
    the user gives) is replaced by placeholders before anything is drafted or
    written; a scenario that still holds some is refused (exit 1).

    With judges.provider set (and scenarios.draft_with_provider), the provider
    drafts persona, goal, facts and the proposed change; otherwise, or when it
    fails, the draft is built from the transcript and marked source.needs_edit.
    """
    from replay.scenarios import ScenarioWriter, confirmed_items, export

    from ..api.client import client as make_client
    from ..errors import UserError
    from ..evals.setup import daemon_provider
    from ..words import parse_since

    cfg = load(config_path)
    try:
        when = parse_since(since) if since else None
    except ValueError as exc:
        raise UserError(str(exc)) from None
    provider: Any = None
    no_provider: str | None = "drafting is off (--no-draft)"
    if not no_draft and cfg.scenarios.draft_with_provider:
        provider, no_provider = daemon_provider(cfg)
    elif not cfg.scenarios.draft_with_provider:
        no_provider = "drafting is off (scenarios.draft_with_provider: false)"
    writer = ScenarioWriter(out_dir or cfg.scenarios.out_dir, max_turns=cfg.scenarios.max_turns,
                            patterns=cfg.scenarios.redact.patterns, provider=provider, timeout=cfg.judges.timeout,
                            no_provider=no_provider)
    c = make_client(cfg)
    try:
        items = confirmed_items(c, since=when, criterion=criterion)
        shown = sys.stderr.isatty() and not as_json
        with click.progressbar(length=len(items), label="exporting", file=sys.stderr) if shown else _Quiet() as bar:
            done = export(c, writer, items, on_item=lambda w: bar.update(1))
    except OSError as exc:
        raise UserError(f"cannot write scenarios to {writer.out_dir}: {exc}") from None
    finally:
        c.close()
        writer.close()
    if as_json:
        click.echo(json.dumps(done.to_dict(), ensure_ascii=False, indent=2))
    else:
        _report(done)
    if done.refused:
        sys.exit(1)


class _Quiet:
    def __enter__(self) -> "_Quiet":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def update(self, n: int) -> None:
        return None


def _report(done: Any) -> None:
    for w in done.written:
        how = f"drafted by {w.drafted_by}" if w.drafted_by else f"deterministic draft, needs edit: {w.note}"
        click.echo(f"wrote {w.id} (item {w.item_id}, {how})")
    for w in done.refused:
        click.echo(f"tracejudge: {w.note}", err=True)
    if done.written:
        click.echo(f"{plural(len(done.written), 'scenario')} written to {done.out_dir}; add them to the suite "
                   "in a step of their own, then rerun the whole suite")
    elif not done.refused:
        before = len(done.exported_before)
        click.echo(f"nothing new to export: {plural(before, 'confirmed failure')} exported before" if before
                   else "nothing to export: no confirmed failures")
    if done.written and done.exported_before:
        click.echo(f"{plural(len(done.exported_before), 'confirmed failure')} exported before, left as they are")


@scenarios.command("verify")
@click.option("--since", help="Only scenarios confirmed since then: 15m, 2h, 7d or an ISO 8601 time.")
@bot_options
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="The simulation run's folder [default: simulations/<run id>].")
@config_option
@json_option
def verify_cmd(since: str | None, bot: str | None, bot_url: str | None, bot_model: str,
               bot_timeout_text: str | None, replicates: int | None, criteria_paths: tuple[Path, ...],
               concurrency: int | None, budget_tokens: int | None, out: Path | None, config_path: Path | None,
               as_json: bool) -> None:
    """Do the scenarios written from production failures reproduce them?

    Runs each scenario of scenarios.out_dir that was written from a confirmed
    failure and not verified yet (see `tracejudge simulate` for the flags), and
    records in its YAML file, as source.reproduced, how often the confirmed
    criterion failed: {failed, replicates, criterion, at, bot}. A scenario that
    never fails does not reproduce its failure: edit its persona, goal or facts
    before it joins the suite. Exit 1 when one does not reproduce.
    """
    from replay.verify import record, unverified

    from ..errors import UserError
    from ..words import parse_since

    cfg = load(config_path)
    try:
        when = parse_since(since) if since else None
    except ValueError as exc:
        raise UserError(str(exc)) from None
    chosen = unverified(cfg.scenarios.out_dir, when)
    if not chosen:
        message = f"nothing to verify: no scenario in {cfg.scenarios.out_dir} is waiting for source.reproduced"
        click.echo(json.dumps({"scenarios": [], "summary": {"verified": 0}}) if as_json else message)
        return
    report = run_simulation(cfg, chosen, bot=bot, bot_url=bot_url, bot_model=bot_model,
                            bot_timeout_text=bot_timeout_text, replicates=replicates, criteria_paths=criteria_paths,
                            concurrency=concurrency, budget_tokens=budget_tokens, out=out, quiet=as_json)
    results = record(chosen, report, report["bot"])
    summary = {"verified": sum(r["reproduced"] is not None for r in results),
               "reproduce": sum(bool(r.get("reproduces")) for r in results),
               "do_not_reproduce": sum(r.get("reproduces") is False for r in results),
               "not_judged": sum(r["reproduced"] is None for r in results)}
    if as_json:
        click.echo(json.dumps({"run": report["run"], "out_dir": report["out_dir"], "scenarios": results,
                               "summary": summary}, indent=2, ensure_ascii=False))
    else:
        for r in results:
            found = r["reproduced"]
            if found is None:
                click.echo(f"{r['id']}: {r['problem']}")
            elif found["failed"]:
                click.echo(f"{r['id']}: reproduces: {found['criterion']} failed in {found['failed']} of "
                           f"{found['replicates']} replicates")
            else:
                click.echo(f"{r['id']}: does not reproduce: {found['criterion']} failed in 0 of "
                           f"{found['replicates']} replicates; edit the persona or the facts before it joins the "
                           f"suite (it is not a regression test)")
        click.echo(f"recorded in each file's source.reproduced; the run is in {report['out_dir']}")
    sys.exit(1 if summary["do_not_reproduce"] or summary["not_judged"] else 0)

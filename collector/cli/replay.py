"""``tracejudge replay export|compare|import``: production conversations out as conversation/v1, simulated beside real.

A thin shell over ``replay.export`` and ``replay.compare``; ``replay`` (and
matplotlib, for ``--html``, an extra: ``tracejudge[plots]``) is imported only when one of them runs.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..errors import UserError
from ..words import plural
from . import merge
from .common import ask, ask_all, config_option, db_option, json_option

if TYPE_CHECKING:
    from ..api.client import Client
    from ..api.export import Export


@click.group()
def replay() -> None:
    """Export production conversations as conversation/v1 JSONL, and compare simulated with real ones."""


@replay.command("export")
@config_option
@db_option
@json_option
@click.option("--since", help="Only those with data since: a duration ago (15m, 2h, 7d) or an ISO 8601 time.")
@click.option("--state", type=click.Choice(["open", "ended"]), help="Only open or only ended conversations.")
@click.option("--sampled-only", is_flag=True, help="Only conversations the sampler picked for judging.")
@click.option("--criterion-failed", metavar="CRITERION",
              help="Only conversations whose current verdict on this criterion is fail.")
@click.option("--redact", is_flag=True, help="Pass each record through collector.redact.Redactor before writing it.")
@click.option("--out", required=True, metavar="FILE", help="The JSONL file to write; - for standard output.")
def export_cmd(config_path: Path | None, dbs: tuple[Path, ...], as_json: bool, since: str | None,
               state: str | None, sampled_only: bool, criterion_failed: str | None, redact: bool, out: str) -> None:
    """Write stored conversations as conversation/v1 JSONL, ordered by conversation id.

    Through the running daemon's API, else from the DuckDB file (read-only).
    The file appears only once complete: an interrupted export leaves none
    (and an older file of that name as it was). Its content is the users'
    own words: it is written readable by you only. With --db given more than
    once, every file's conversations, one file after the other; an id found in
    more than one file is written from each, with a warning.
    """
    from replay.export import STDOUT, redaction, write_lines

    redacted = redaction() if redact else None
    duplicates: set[str] = set()

    def opened(client: Client) -> Export:
        return client.export_conversations(since=since, state=state, sampled_only=sampled_only,
                                           criterion_failed=criterion_failed)

    def run_all(clients: list[Client]) -> int:
        exports: list[Export] = []
        try:  # every store's export begun first: each its snapshot, and the total known for the progress bar
            for c in clients:
                exports.append(opened(c))
            stream = merge.MergedExport(exports)
            written = write(stream)
            duplicates.update(stream.duplicates)
            return written
        finally:
            for e in exports:
                e.close()

    def run(client: Client) -> int:
        stream = opened(client)
        try:
            return write(stream)
        finally:
            stream.close()

    def write(stream: Export | merge.MergedExport) -> int:
        lines = redacted(stream.lines) if redacted else stream.lines
        if not sys.stderr.isatty():
            return write_lines(lines, out)
        with click.progressbar(length=max(stream.total, 1), label="exporting conversations",
                               file=sys.stderr, show_pos=True) as bar:
            return write_lines(lines, out, on_progress=bar.update)

    try:
        written = (ask_all(config_path, dbs, run_all) if len(dbs) > 1
                   else ask(config_path, run, dbs[0] if dbs else None))
    except KeyboardInterrupt:
        click.echo("tracejudge: interrupted: no file written" if out != STDOUT else "tracejudge: interrupted",
                   err=True)
        sys.exit(1)
    except BrokenPipeError:  # `... --out - | head`: the reader has had enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    if duplicates:
        click.echo(f"tracejudge: warning: {plural(len(duplicates), 'conversation id')} found in more than one "
                   "--db file (a conversation the load balancer moved while open?): written once from each",
                   err=True)
    where = "standard output" if out == STDOUT else out
    if as_json:
        click.echo(json.dumps({"written": written, "out": out}), err=out == STDOUT)
    else:
        click.echo(f"wrote {plural(written, 'conversation')} to {where}", err=True)


@replay.command("compare")
@click.argument("sim", metavar="SIM.jsonl")
@click.argument("real", metavar="REAL.jsonl")
@click.option("--html", "html_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write an HTML report (works offline) with the histograms side by side.")
@config_option
@json_option
def compare_cmd(sim: str, real: str, html_path: Path | None, config_path: Path | None, as_json: bool) -> None:
    """Compare simulated conversations (SIM.jsonl) with real ones (REAL.jsonl), both conversation/v1.

    Descriptive, never a gate: exit 0 whenever both files read. Per side: user
    messages per conversation, message lengths, questions, where facts arrive,
    conversations cut off early, the ended_by mix and the languages of user
    messages. --config is accepted (as by every subcommand) and not needed.
    """
    from judges import ConversationError
    from replay.compare import compare, table_text
    from replay.report import require_plots, write_html

    if html_path is not None:  # before reading the files, which may take a while
        require_plots()
        if not html_path.parent.is_dir():
            raise UserError(f"{html_path}: the folder {html_path.parent} does not exist")
    try:
        result: dict[str, Any] = compare(sim, real)
    except ConversationError as exc:
        raise UserError(str(exc)) from None
    if html_path is not None:
        try:
            write_html(result, html_path)
        except OSError as exc:
            raise UserError(f"{html_path}: cannot write: {exc.strerror or exc}") from None
    if as_json:
        click.echo(json.dumps(result, ensure_ascii=False, indent=2))
        return
    click.echo(table_text(result))
    if html_path is not None:
        click.echo(f"\nreport: {html_path}")


@replay.command("import")
@click.argument("sim", metavar="SIM.jsonl", type=click.Path(dir_okay=False, path_type=Path))
@config_option
@json_option
def import_cmd(sim: Path, config_path: Path | None, as_json: bool) -> None:
    """Store an offline suite's simulated conversations (conversation/v1, source: simulation) beside real ones.

    Idempotent by id: a conversation stored before is left as it is. Every line
    is checked before anything is stored; a bad one is named and nothing is.
    The evaluator never samples them; `tracejudge eval --source simulation`
    judges them with the same criteria, and `tracejudge stats --by source` puts
    their failure rates beside production's. Through the daemon's API when one
    runs, else on the DuckDB file.
    """
    from judges import ConversationError
    from replay.imports import check_file, import_file

    try:
        total = check_file(sim)
    except ConversationError as exc:
        raise UserError(str(exc)) from None
    shown = sys.stderr.isatty() and not as_json

    def run(c: "Client") -> dict[str, int]:
        if not shown:
            return import_file(c, sim)
        with click.progressbar(length=total, label="importing", file=sys.stderr) as bar:
            return import_file(c, sim, on_chunk=bar.update)

    done = ask(config_path, run)
    if as_json:
        click.echo(json.dumps(done))
        return
    click.echo(f"stored {plural(done['stored'], 'simulated conversation')} from {sim}"
               + (f"; {done['already_imported']} imported before, left as they were" if done["already_imported"]
                  else ""))

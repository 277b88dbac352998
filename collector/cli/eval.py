"""``tracejudge eval``: judge conversations already stored (backfill a new criterion over past traffic)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import click

from ..errors import UserError
from ..words import parse_since
from ..system.runtime import running_daemon
from ..words import plural
from .common import config_option, json_option, load

if TYPE_CHECKING:
    from ..api.client import APIClient
    from ..config import Config
    from ..evals.backfill import Backfill


class _Bar:
    """A progress bar on a terminal; silence elsewhere (the summary line still comes)."""

    def __init__(self) -> None:
        self.bar: Any = None
        self.shown = 0

    def update(self, done: int, total: int) -> None:
        if not sys.stderr.isatty() or total == 0:
            return
        if self.bar is None:
            self.bar = click.progressbar(length=total, label="judging conversations", file=sys.stderr)
            self.bar.__enter__()
        self.bar.update(done - self.shown)
        self.shown = done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)


def _through_daemon(api: APIClient, since: str | None, criteria: list[str], simulated: bool,
                    bar: _Bar) -> dict[str, Any]:
    body: dict[str, Any] = {"since": since, "criteria": criteria}
    if simulated:
        body["source"] = "simulation"
    progress = api.request("/api/evals", body, missing_ok=False)
    while not progress["finished"]:
        bar.update(progress["done"], progress["total"])
        time.sleep(0.5)
        progress = api.request(f"/api/evals/{progress['id']}", missing_ok=False)
    bar.update(progress["done"], progress["total"])
    return dict(progress)


def _in_process(cfg: Config, since: str | None, criteria: list[str], simulated: bool, bar: _Bar) -> dict[str, Any]:
    import asyncio

    from ..evals.backfill import Backfill, backfill_jobs, run_backfill
    from ..evals.judging import Judging, ensure_schema
    from ..evals.setup import daemon_provider, load_configured_criteria
    from ..evals.verdicts import store_criteria
    from ..review import queue as review_queue
    from ..store import connect

    when = parse_since(since) if since else None
    all_criteria = load_configured_criteria(cfg)
    if not all_criteria:
        raise UserError("no criteria to judge with: judges.criteria is empty")
    provider, no_provider = daemon_provider(cfg)
    judging = Judging(all_criteria, provider, concurrency=cfg.judges.concurrency, timeout=cfg.judges.timeout,
                      on_stored=review_queue.item_opener(cfg), no_provider=no_provider)
    path = cfg.storage.duckdb.path
    if not path.exists():
        raise UserError(f"no database at {path}: start the daemon (tracejudge serve) with this config first")
    con = connect(path)
    try:
        ensure_schema(con)
        review_queue.ensure_schema(con)
        store_criteria(con, judging.criteria)

        async def main() -> Backfill:
            judging.bind()
            chosen = judging.subset(criteria) if criteria else judging
            progress = Backfill(id=1)
            task = asyncio.ensure_future(run_backfill(con, chosen, backfill_jobs(con, when, simulated=simulated), progress,
                                                      parallel=2 * cfg.judges.concurrency))
            try:
                while not task.done():
                    bar.update(progress.done, progress.total)
                    await asyncio.wait([task], timeout=0.2)
                bar.update(progress.done, progress.total)
                return task.result()
            finally:
                await judging.aclose()

        return asyncio.run(main()).to_dict()
    finally:
        con.close()


@click.command("eval")
@config_option
@json_option
@click.option("--since", help="Only conversations ended since: a duration ago (15m, 2h, 7d) or an ISO 8601 time.")
@click.option("--criterion", "criteria", multiple=True,
              help="Only this criterion id (repeatable) [default: every criterion in judges.criteria].")
@click.option("--source", type=click.Choice(["production", "simulation"]), default="production", show_default=True,
              help="simulation: judge the simulated conversations tracejudge replay import stored instead.")
def eval_cmd(config_path: Path | None, as_json: bool, since: str | None, criteria: tuple[str, ...],
             source: str) -> None:
    """Judge the sampled conversations already stored, with the criteria of the config.

    Backfills a new criterion, or a new version of one, over past traffic:
    every sampled, ended conversation (since --since) is judged on the
    criteria that have no verdict on its current transcript yet; what already
    has one is not judged again. Runs inside the daemon when one serves this
    config (through its API), else on the DuckDB file, by the same code.
    With --source simulation it judges the stored simulated conversations
    (imported since --since) instead; their fails open no review items.
    """
    cfg = load(config_path)
    if since:
        try:
            parse_since(since)
        except ValueError as exc:
            raise UserError(str(exc)) from None
    bar = _Bar()
    simulated = source == "simulation"
    info = running_daemon(cfg.runtime_file)
    run: Callable[[], dict[str, Any]]
    if info is not None:
        from ..api.client import APIClient

        run = lambda: _through_daemon(APIClient(info.api, cfg.api.auth.bearer_token), since, list(criteria),
                                      simulated, bar)
    else:
        run = lambda: _in_process(cfg, since, list(criteria), simulated, bar)
    try:
        result = run()
    finally:
        bar.close()
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        what = "simulated conversation" if simulated else "sampled conversation"
        click.echo(f"judged {result['done']} of {plural(result['total'], what)}: "
                   f"{plural(result['verdicts'], 'new verdict')}, {result['skipped']} already judged on the same "
                   f"transcript, {result['not_run']} not run, {plural(result['errors'], 'error')}"
                   + (" (tracejudge verdicts --result error)" if result["errors"] else ""))
    if result.get("failure"):
        raise UserError(f"the eval pass stopped: {result['failure']}")
    if result["errors"]:
        sys.exit(1)

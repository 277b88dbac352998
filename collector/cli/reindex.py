"""``tracejudge reindex``: rebuild conversations from the stored spans and log records."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click

from ..system.runtime import running_daemon
from ..words import plural, size_bytes
from .common import config_option, load

if TYPE_CHECKING:
    from ..config import Config
    from ..conversations.reindex import Reindex

POLL = 0.5  # seconds between two looks at a daemon's reindex
FILE_MEMORY_LIMIT = "128MB"
"""DuckDB's ``memory_limit`` for a reindex on the file (no daemon), when storage.memory_limit is larger: it
reads each row once, so a larger cache gains nothing. On a 1,000,000-span file: peak RSS 355 MB and 211 s,
against 465 MB and 198 s at 256MB (bench/restart.py)."""


@click.command()
@config_option
def reindex(config_path: Path | None) -> None:
    """Rebuild the trace map, `conversations` and `messages` from every stored span and log record.

    Run it after upgrading tracejudge (a better normalizer) or changing
    conversations.id_attributes or end_rules. It rebuilds beside the stored
    conversations, a chunk of traces at a time, and replaces them in one step at
    the end: until then they stay as they are, and a reindex that fails or is
    interrupted changes nothing. Run it again after an interruption and it goes
    on from where it was (with the same conversation settings). A transcript
    that changes is judged again. Conversations whose spans
    storage.retention.spans deleted cannot be rebuilt: they stay as stored.

    With a daemon running it runs inside the daemon (POST /api/reindex), giving
    way to ingestion; Ctrl-C here then only stops following it.
    """
    cfg = load(config_path)
    info = running_daemon(cfg.runtime_file)
    if info is not None:
        done = _through_daemon(cfg, info.api)
    else:
        done = _on_the_file(cfg)
    _report(cfg, done)


def _bar(progress: dict[str, Any]) -> Any:
    total, resumed = progress["total"], progress["resumed_from"]
    if progress["resumed"]:
        click.echo(f"resuming the reindex a stop cut off: {resumed} of {plural(total, 'trace')} done", err=True)
    bar = click.progressbar(length=max(total, 1), label="rebuilding conversations", file=sys.stderr, show_pos=True)
    bar.update(resumed)
    return bar


def _on_the_file(cfg: Config) -> dict[str, Any]:
    from ..conversations.reindex import Reindex
    from ..errors import UserError
    from ..store import Store

    if not cfg.storage.duckdb.path.exists():
        raise UserError(f"no database at {cfg.storage.duckdb.path}")
    limit = min(cfg.storage.memory_limit, FILE_MEMORY_LIMIT, key=size_bytes)
    store = Store(cfg.storage.duckdb.path, memory_limit=limit)
    store.open()
    job = Reindex(store, cfg.conversations)
    # DuckDB turns a Ctrl-C inside a query into an error of its own (InterruptException, or a RuntimeError
    # "Query interrupted"), so the handler notes it, and any error after it counts as the interruption.
    interrupted = False

    def on_sigint(signum: int, frame: Any) -> None:
        nonlocal interrupted
        interrupted = True
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        job.prepare()
        with _bar(job.progress.to_dict()) as bar:
            job.run(on_progress=lambda p: bar.update(p.done - bar.pos))
        cur = store.cursor()
        try:
            job.swap(cur)
        finally:
            cur.close()
    except Exception as exc:
        if not interrupted:  # one line, exit 1: the live conversations are whole
            click.echo(f"tracejudge: error: reindex failed, the stored conversations are unchanged: "
                       f"{type(exc).__name__}: {exc}", err=True)
            sys.exit(1)
        _interrupted(job)
    except KeyboardInterrupt:
        _interrupted(job)
    finally:
        signal.signal(signal.SIGINT, previous)
        store.close()
    return job.progress.to_dict()


def _interrupted(job: Reindex) -> NoReturn:
    p = job.progress
    click.echo(f"tracejudge: interrupted after {p.done} of {plural(p.total, 'trace')}: the stored "
               "conversations are unchanged; run tracejudge reindex again to go on from there", err=True)
    sys.exit(1)


def _through_daemon(cfg: Config, api: str) -> dict[str, Any]:
    from ..api.client import APIClient

    client = APIClient(api, cfg.api.auth.bearer_token)
    progress: dict[str, Any] = client.request("/api/reindex", {}, missing_ok=False)
    try:
        while progress["state"] == "preparing":  # until it knows how much there is, and whether it resumes
            time.sleep(POLL / 5)
            progress = client.request("/api/reindex", missing_ok=False)
        with _bar(progress) as bar:
            while progress["state"] in ("preparing", "rebuilding", "swapping"):
                time.sleep(POLL)
                progress = client.request("/api/reindex", missing_ok=False)
                if progress["total"] and bar.length != progress["total"]:
                    bar.length = progress["total"]
                bar.update(progress["done"] - bar.pos)
    except KeyboardInterrupt:
        click.echo("tracejudge: stopped following the reindex; it goes on in the daemon "
                   "(GET /api/reindex says how far it got)", err=True)
        sys.exit(1)
    if progress["state"] != "finished":
        why = progress["failure"] or "the daemon stopped it; run tracejudge reindex again to go on"
        click.echo(f"tracejudge: error: reindex {progress['state']}, the stored conversations are unchanged: "
                   f"{why}", err=True)
        sys.exit(1)
    return progress


def _report(cfg: Config, progress: dict[str, Any]) -> None:
    rebuilt = progress["conversations"] - progress["kept"]
    click.echo(f"reindexed: {plural(rebuilt, 'conversation')} rebuilt in {cfg.storage.duckdb.path}")
    if progress["kept"]:
        click.echo(f"{plural(progress['kept'], 'conversation')} kept as stored: their spans were deleted by "
                   "storage.retention.spans, so they cannot be rebuilt")
    if progress["failed"]:
        click.echo(f"tracejudge: warning: {progress['failed']} conversations could not be rebuilt: they are "
                   "stored without messages, with the reason", err=True)
        sys.exit(1)

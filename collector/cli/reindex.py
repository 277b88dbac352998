"""``tracejudge reindex``: rebuild conversations from the stored spans and log records."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ..errors import UserError
from ..runtime import running_daemon
from ..words import plural
from .common import config_option, load


@click.command()
@config_option
def reindex(config_path: Path | None) -> None:
    """Rebuild the trace map, `conversations` and `messages` from every stored span and log record.

    Run it after upgrading tracejudge (a better normalizer) or changing
    conversations.id_attributes or end_rules. Spans are kept whole, so nothing
    is lost, and the old conversations stay until the new ones are all built:
    a reindex that fails or is interrupted changes nothing. Conversations whose
    spans storage.retention.spans deleted cannot be rebuilt: they stay as
    stored. It needs the database to itself: stop the daemon first.
    """
    cfg = load(config_path)
    info = running_daemon(cfg.runtime_file)
    if info is not None:
        raise UserError(f"a daemon (pid {info.pid}) has {cfg.storage.duckdb.path} open; stop it, then reindex")
    if not cfg.storage.duckdb.path.exists():
        raise UserError(f"no database at {cfg.storage.duckdb.path}")
    from ..conversations import Conversations
    from ..store import Store

    store = Store(cfg.storage.duckdb.path, memory_limit=cfg.storage.memory_limit)
    store.open()
    stage = Conversations(store, cfg.conversations)
    try:
        stage.open()
        with click.progressbar(length=1, label="rebuilding conversations", file=sys.stderr, show_pos=True) as bar:

            def progress(done: int, total: int) -> None:
                bar.length = total
                bar.update(done - bar.pos)

            count = stage.reindex(progress)
    except Exception as exc:  # one line, exit 1: the transaction is rolled back, the old rows are whole
        click.echo(f"tracejudge: error: reindex failed, the stored conversations are unchanged: "
                   f"{type(exc).__name__}: {exc}", err=True)
        sys.exit(1)
    finally:
        stage.stop()
        store.close()
    click.echo(f"reindexed: {plural(count - stage.kept, 'conversation')} rebuilt in {cfg.storage.duckdb.path}")
    if stage.kept:
        click.echo(f"{plural(stage.kept, 'conversation')} kept as stored: their spans were deleted by "
                   "storage.retention.spans, so they cannot be rebuilt")
    if stage.failed:
        click.echo(f"tracejudge: warning: {stage.failed} conversations could not be rebuilt: they are stored "
                   "without messages, with the reason", err=True)
        sys.exit(1)

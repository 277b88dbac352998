"""``tracejudge serve``: run the daemon."""

from __future__ import annotations

import faulthandler
import logging
import signal
import sys
from pathlib import Path

import click

from .common import config_option, load


@click.command()
@config_option
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              envvar="TRACEJUDGE_LOG_LEVEL", show_default=True, show_envvar=True, help="How much to log to stderr.")
def serve(config_path: Path | None, log_level: str) -> None:
    """Run the daemon: OTLP receivers (gRPC and HTTP), the DuckDB store and the JSON API.

    Prints where it listens and writes <duckdb path>.daemon.json so other
    subcommands find it. SIGTERM or Ctrl-C stops intake, commits everything
    queued and exits 0 (also during start-up); it exits 1 when the store could
    not commit (a supervisor should restart it).
    """
    from ..system.shutdown import StopSignals

    signals = StopSignals().install()  # before anything else: a signal during start-up stops it cleanly
    # SIGUSR1 writes every thread's stack to stderr: what a daemon that does not answer is doing.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    cfg = load(config_path)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from ..daemon import serve as run

    extra = []
    if cfg.scenarios.on_confirm:  # replay sits downstream of collector: the CLI wires its stage in
        from replay.stage import ScenarioStage

        extra.append(ScenarioStage)
    sys.exit(run(cfg, signals, extra))

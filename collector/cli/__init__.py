"""The ``tracejudge`` command: a thin shell over the Python API.

``main`` only assembles subcommands; each lives in its own module here and is
imported when used, so ``tracejudge judge`` never loads DuckDB or gRPC.
Exit codes: 0 done, 1 done but something failed, 2 usage, config or input error
(one line on stderr, no traceback).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any

import click

from ..errors import UserError
from ..system.memory import limit_arenas

# subcommand -> "module:attribute"; add a line here to add a subcommand.
COMMANDS = {
    "serve": "collector.cli.serve:serve",
    "demo": "collector.cli.demo:demo",
    "judge": "collector.cli.judge:judge",
    "conversations": "collector.cli.conversations:conversations",
    "reindex": "collector.cli.reindex:reindex",
    "review": "collector.cli.review:review",
    "verdicts": "collector.cli.verdicts:verdicts",
    "stats": "collector.cli.stats:stats",
    "status": "collector.cli.status:status",
    "eval": "collector.cli.eval:eval_cmd",
    "replay": "collector.cli.replay:replay",
    "scenarios": "collector.cli.scenarios:scenarios",
    "labels": "collector.cli.labels:labels",
    "calibrate": "collector.cli.labels:calibrate",
    "simulate": "collector.cli.simulate:simulate",
    "alerts": "collector.cli.alerts:alerts",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(n for n in COMMANDS if self._loadable(n))

    def _loadable(self, name: str) -> bool:
        module = COMMANDS[name].split(":")[0]
        return importlib.util.find_spec(module) is not None

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS or not self._loadable(name):
            return None
        module, attr = COMMANDS[name].split(":")
        cmd: click.Command = getattr(importlib.import_module(module), attr)
        return cmd

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except UserError as exc:
            click.echo(f"tracejudge: error: {exc}", err=True)
            sys.exit(2)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="tracejudge")
def main() -> None:
    """tracejudge: judge production chatbot conversations from their OpenTelemetry traces.

    Run `tracejudge demo` to see it work, `tracejudge serve` to run the daemon.
    Every subcommand takes --config FILE (default ./otel-config.yaml, or
    $TRACEJUDGE_CONFIG).
    """
    limit_arenas()  # before any command starts its threads (collector.system.memory): the daemon, a reindex

"""Options shared by subcommands, as decorators, and what their output shares.

Every subcommand module imports this one to build its options, and ``tracejudge --help``
imports every subcommand module: nothing here loads the config's models (pydantic) or
the stages before a command runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import click

from ..errors import UserError

if TYPE_CHECKING:
    from ..api.client import Client
    from ..config import Config

T = TypeVar("T")


def config_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--config FILE`` (env TRACEJUDGE_CONFIG, default ./otel-config.yaml)."""
    return click.option(
        "--config", "config_path", type=click.Path(dir_okay=False, path_type=Path),
        envvar="TRACEJUDGE_CONFIG", default=None, show_envvar=True,
        help="Config file [default: ./otel-config.yaml, or built-in defaults when absent].",
    )(fn)


def db_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--db FILE``, repeatable: read these DuckDB files in place of the config's, merged."""
    return click.option(
        "--db", "dbs", multiple=True, metavar="FILE", type=click.Path(dir_okay=False, path_type=Path),
        help="Read this DuckDB file, through the daemon running on it if one does, else directly (read-only). "
             "Give it once per file to read several daemons' stores (behind a load balancer) as one. "
             "It wins over --config for where data is read; --config still gives the API token.",
    )(fn)


def reviewer_token_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--token``: a reviewer's own token (``review.reviewers``), sent in place of the API token."""
    return click.option(
        "--token", "reviewer_token", envvar="TRACEJUDGE_REVIEWER_TOKEN", show_envvar=True, default=None,
        help="Your own reviewer token (review.reviewers): what you record carries the reviewer it names, and it "
             "opens the daemon's review API in place of api.auth.bearer_token.",
    )(fn)


def json_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--json``: print machine-readable JSON instead of text."""
    return click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")(fn)


def load(config_path: Path | None) -> Config:
    """Load the config, printing its warnings to stderr (errors propagate as ConfigError)."""
    from ..config import load_config

    cfg, warnings = load_config(config_path)
    for w in warnings:
        click.echo(f"tracejudge: warning: {w}", err=True)
    return cfg


def table(rows: list[list[str]], align: str | None = None) -> str:
    """Rows as aligned columns, the last one free.

    ``align`` gives ``l`` or ``r`` per column; by default the first is
    left-aligned and the ones in between (numbers) right-aligned.
    """
    n = len(rows[0])
    align = align or "l" + "r" * (n - 2)
    widths = [max(len(r[i]) for r in rows) for i in range(n)]
    lines = []
    for r in rows:
        cells = [c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(r[:-1], widths, align)] + [r[-1]]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def ask(config_path: Path | None, fn: Callable[["Client"], T], db: Path | None = None, *,
        reviewer_token: str | None = None, records: bool = False) -> T:
    """``fn`` on the daemon's API when one serves this config (or the file ``db``), else on the DuckDB file;
    as the reviewer of ``reviewer_token`` when given (``reviewer_token_option``).

    Raises:
        UserError: ``fn`` ``records`` decisions or labels, ``review.reviewers`` is set and no token was given
            (they carry the token's reviewer, never a name typed).
    """
    from ..api.client import client

    cfg = load(config_path)
    if records and cfg.review.reviewers and not reviewer_token:
        raise UserError("review.reviewers is set: decisions, labels and acknowledgements carry the reviewer of the "
                        "token they are made with: give your own with --token or $TRACEJUDGE_REVIEWER_TOKEN")
    c = client(cfg, db, reviewer_token)
    try:
        return fn(c)
    finally:
        c.close()


def ask_all(config_path: Path | None, dbs: tuple[Path, ...], fn: Callable[[list["Client"]], T]) -> T:
    """``fn`` on a client of each file in ``dbs`` (through its daemon when one runs on it), all open at once.

    Raises:
        UserError: a file is not there (named before any is opened).
    """
    from ..api.client import client

    for db in dbs:
        if not db.is_file():
            raise UserError(f"--db {db}: no such database file")
    cfg = load(config_path)
    opened: list["Client"] = []
    try:
        for db in dbs:
            opened.append(client(cfg, db))
        return fn(opened)
    finally:
        for c in opened:
            c.close()

"""``tracejudge status``: whether a daemon runs, how far its stages have got, how each exporter forwards, the
file's size and what it keeps."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from ..system.memory import INDEX_WARNING, index_eighths
from ..words import duration_text, plural, size_text
from .common import ask, config_option, json_option, table

_KINDS = (("spans", "spans", "spans"), ("log_records", "log records", "spans"),
          ("conversations", "conversations", "conversations"))


def _exporter(e: dict[str, Any]) -> str:
    """One exporter of ``/api/status``: where it sends, its state, its queue, its counts and its last error."""
    state = e["state"] + (f" (next try in {e['retry_in_s']:.0f} s)" if e["state"] == "retrying" else "")
    queued = (f"{plural(e['queued_requests'], 'request')} queued ({size_text(e['queued_bytes'])}, the oldest "
              f"{e['oldest_age_s']:.0f} s old)" if e["queued_requests"] else "nothing queued")
    counts = ", ".join(f"{e[k]} {k}" for k in ("sent", "retried", "dropped", "held"))
    error = f"; last error: {e['last_error']}" if e["last_error"] else ""
    return f"{e['type']} {e['endpoint']} ({', '.join(e['signals'])}): {state}; {queued}; {counts}{error}"


def _webhook(w: dict[str, Any]) -> str:
    """One alert webhook of ``/api/status``: what it takes, what waits for it and its last error."""
    error = f"; retrying, last error: {w['last_error']}" if w["last_error"] else ""
    return f"{w['format']}: {', '.join(w['events'])}; {plural(w['pending'], 'alert')} waiting{error}"


def render(body: dict[str, Any]) -> str:
    """The status as text."""
    storage = body["storage"]
    lines = []
    if body.get("daemon"):
        stages = ", ".join(f"{name} {state}" for name, state in body.get("stages", {}).items())
        lines.append(["daemon", f"running at {body['daemon']}; stages: {stages}"])
        behind = body.get("conversations_lag_commits") or 0
        lag = (f" ({plural(behind, 'commit')} behind; the oldest arrived "
               f"{body.get('conversations_lag_seconds', 0):.0f} s ago)" if behind else "")
        lines.append(["ingest", f"{plural(body['queue_depth'], 'row')} waiting; commit {body['committed_batch']} "
                                f"stored, conversations current up to commit {body['conversations_batch']}{lag}"])
        lines += [[f"exporter {name}", _exporter(e)] for name, e in body.get("exporters", {}).items()]
        lines += [[f"webhook {w['url']}", _webhook(w)] for w in body.get("alert_webhooks", [])]
    else:
        lines.append(["daemon", f"not running; conversations current up to commit {body['conversations_batch']}"])
    lines.append(["DuckDB file", f"{storage['path']}: {size_text(storage['file_bytes'])}"
                                 f" (+ {size_text(storage['wal_bytes'])} write-ahead log)"])
    keep = storage["retention"]
    deleted = keep.get("deleted") or {}
    for key, label, setting in _KINDS:
        k = keep[key]
        kept = (f"kept {duration_text(k['keep_seconds'])}: what arrived before {k['horizon']} is deleted"
                if k["keep_seconds"] is not None else f"kept for ever (storage.retention.{setting} is not set)")
        oldest = f"oldest arrived {k['oldest']}" if k["oldest"] else "none stored"
        gone = f"; {deleted[key]} deleted since the daemon started" if key in deleted else ""
        lines.append([label, f"{kept}; {oldest}{gone}"])
    behind = keep.get("behind_seconds")
    if behind is not None:
        held = keep.get("held_traces")
        lines.append(["", f"deletion {'caught up' if behind < 1 else f'{behind:.0f} s behind its horizon'}"
                          + (f"; {plural(held, 'trace')} held for conversations still open, not sampled or "
                             "due for judgement" if held else "")])
    conversations_behind = keep["conversations"].get("behind_seconds")
    if conversations_behind is not None:
        lines.append(["", "deletion of ended conversations " + (
            "caught up" if conversations_behind < 1 else f"{conversations_behind:.0f} s behind its horizon")])
    if keep["keep_reviewed"] and keep["conversations"]["keep_seconds"] is not None:
        lines.append(["", "conversations with a review item are kept as long as their item"])
    memory = body.get("duckdb_memory")
    if memory:
        lines.append(["DuckDB memory", f"{size_text(memory['used_bytes'])} of {size_text(memory['limit_bytes'])} "
                                       f"(storage.memory_limit); key indexes {size_text(memory['index_bytes'])}"])
        if index_eighths(memory["index_bytes"], memory["limit_bytes"]) >= 4:
            lines.append(["", INDEX_WARNING])
    return table(lines, align="ll")


@click.command()
@config_option
@json_option
def status(config_path: Path | None, as_json: bool) -> None:
    """Whether a daemon serves this config, how far its stages have got, and the DuckDB file: its size,
    what storage.retention keeps and the oldest row of each kind; with a daemon, each exporter (where it
    forwards, its state, queue, counts and last error), each alert webhook (what waits for it, its last
    error), DuckDB's memory and its key indexes' share (a
    warning past half of storage.memory_limit).

    Through the daemon's API when one runs, else read from the file.
    """
    body = ask(config_path, lambda c: c.status())
    click.echo(json.dumps(body, ensure_ascii=False, indent=2) if as_json else render(body))

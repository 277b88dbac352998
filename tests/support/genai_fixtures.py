"""Load the shared OTLP fixture cases as stored rows, the way the daemon stores them.

Every ``NAME.expected.json`` in ``../shared/fixtures/otlp`` (or in the
``directory`` given, e.g. ``tests/fixtures/frameworks/cases``) is a case; its
payloads are ``NAME[.logs][.N].(pb|json)[.gz]``, decoded with
``collector.ingest.decode`` exactly as the receivers do; log rows carry their
``arrival`` (request, place in it) as the conversation stage gives it.
"""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from collector.ingest import decode as otlp

from .daemon import FIXTURES


@dataclass
class Case:
    name: str
    expected: dict[str, Any]
    spans: list[dict[str, Any]]
    logs: list[dict[str, Any]]

    @property
    def has_content(self) -> bool:
        return not str(self.expected.get("content_in_payload", "")).startswith("none")


def case_names(directory: Path = FIXTURES) -> list[str]:
    return sorted(p.name[: -len(".expected.json")] for p in directory.glob("*.expected.json"))


def _payloads(name: str, directory: Path = FIXTURES) -> list[Path]:
    pattern = re.compile(rf"^{re.escape(name)}(\.logs)?(\.\d+)?\.(pb|json)(\.gz)?$")
    files = [p for p in directory.iterdir() if pattern.match(p.name)]

    def arrival(p: Path) -> tuple[int, int]:
        m = pattern.match(p.name)
        assert m is not None
        return (1 if m.group(1) else 0, int(m.group(2)[1:]) if m.group(2) else 0)

    return sorted(files, key=arrival)


def load_case(name: str, directory: Path = FIXTURES) -> Case:
    expected = json.loads((directory / f"{name}.expected.json").read_text(encoding="utf-8"))
    spans: list[dict[str, Any]] = []
    logs: list[dict[str, Any]] = []
    for n, path in enumerate(_payloads(name, directory)):
        body = path.read_bytes()
        if path.name.endswith(".gz"):
            body = gzip.decompress(body)
        json_body = ".json" in path.name
        if ".logs" in path.name:
            batch, rejected, _ = otlp.log_batch(otlp.parse_logs(body, json_body))
            # (request, place in it): the order they were received in, as the daemon passes it
            logs.extend({**row, "arrival": (n, i)} for i, row in enumerate(batch.rows()))
        else:
            sbatch, rejected, _ = otlp.span_batch(otlp.parse_traces(body, json_body))
            spans.extend(sbatch.rows())
        assert rejected == 0, path.name
    return Case(name, expected, spans, logs)


def by_trace(spans: list[dict[str, Any]], logs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Span rows per trace id; a trace known only from log records gets an empty list."""
    traces: dict[str, list[dict[str, Any]]] = {}
    for row in spans:
        traces.setdefault(row["trace_id"], []).append(row)
    for row in logs:
        if row["trace_id"]:
            traces.setdefault(row["trace_id"], [])
    return traces


def logs_by_trace(logs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Log rows per trace id (for ``group_traces``: content may be in log records only)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for row in logs:
        if row["trace_id"]:
            out.setdefault(row["trace_id"], []).append(row)
    return out

"""Simulated conversations stored beside production ones, judged only when asked.

``tracejudge replay import SIM.jsonl`` stores an offline suite's conversation/v1
records (``source: simulation``) in ``simulated_conversations``, idempotent by
id. They are not in ``conversations``, so the evaluator never samples them and
the conversation stage, reindex and retention never touch them; ``tracejudge
eval --source simulation`` judges them with the same criteria (each verdict
weighs 1: a suite is not a sample), and ``tracejudge stats --by source`` puts
their failure rates beside production's. Their verdicts open no review items.

A simulated record whose id is a production conversation's is refused: a
verdict belongs to one conversation.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import duckdb
import orjson

from judges import Conversation

from ..errors import UserError
from ..store.transactions import Transaction, insert_rows, one, utc_now

SCHEMA = """
CREATE TABLE IF NOT EXISTS simulated_conversations (
    conversation_id VARCHAR PRIMARY KEY,
    persona_id VARCHAR,
    ended_by VARCHAR NOT NULL,
    record VARCHAR NOT NULL,
    imported_at TIMESTAMPTZ NOT NULL
);
"""
COLUMNS = ("conversation_id", "persona_id", "ended_by", "record", "imported_at")
RULE = "simulation"
"""The ``rule`` of a simulated conversation's verdicts (production ones name a sampling rule)."""
def simulated_sql(column: str = "conversation_id", *, negate: bool = False) -> str:
    """SQL: the row's conversation (``column``) is a simulated one (with ``negate``: a production one)."""
    return f"{column} {'NOT ' if negate else ''}IN (SELECT conversation_id FROM simulated_conversations)"


class SimulationError(UserError):
    """Simulated records that cannot be stored."""


@dataclass
class Imported:
    """What one import stored."""

    stored: int = 0
    known: int = 0
    """Already stored under the same id: left as they are."""

    def to_dict(self) -> dict[str, int]:
        return {"stored": self.stored, "already_imported": self.known}


def ensure_schema(cur: duckdb.DuckDBPyConnection) -> None:
    cur.execute(SCHEMA)


def store_simulations(cur: duckdb.DuckDBPyConnection, conversations: Sequence[Conversation],
                      now: dt.datetime | None = None) -> Imported:
    """Store simulated conversations not stored yet, in one transaction.

    Raises:
        SimulationError: a record is not ``source: simulation``, or its id is a production conversation's.
    """
    for c in conversations:
        if c.source != "simulation":
            raise SimulationError(f"conversation {c.id!r} has source {c.source!r}: only simulated conversations "
                                  "are imported (production ones come in as traces)")
    ids = [c.id for c in conversations]
    clash = cur.execute("SELECT conversation_id FROM conversations WHERE conversation_id IN (SELECT unnest(?)) "
                        "LIMIT 1", [ids]).fetchall()
    if clash:
        raise SimulationError(f"conversation {clash[0][0]!r} is a production conversation's id: give the "
                              "simulated one another id")
    at = utc_now(now)
    with Transaction(cur):
        known = {r[0] for r in cur.execute("SELECT conversation_id FROM simulated_conversations "
                                           "WHERE conversation_id IN (SELECT unnest(?))", [ids]).fetchall()}
        rows, seen = [], set(known)
        for c in conversations:
            if c.id in seen:
                continue
            seen.add(c.id)
            rows.append((c.id, c.persona_id, c.ended_by, c.to_json(), at))
        insert_rows(cur, "INSERT INTO simulated_conversations", COLUMNS, rows)
    return Imported(stored=len(rows), known=len(conversations) - len(rows))


def simulated_record(cur: duckdb.DuckDBPyConnection, conversation_id: str) -> dict[str, Any] | None:
    """The conversation/v1 record of a stored simulated conversation, or None."""
    row = one(cur.execute("SELECT record FROM simulated_conversations WHERE conversation_id = ?",
                      [conversation_id]))
    return orjson.loads(row[0]) if row else None


def simulation_ids(cur: duckdb.DuckDBPyConnection, since: dt.datetime | None = None) -> list[str]:
    """Stored simulated conversations (imported at or after ``since``), in the order they were imported."""
    where, params = ("WHERE imported_at >= ?", [since]) if since is not None else ("", [])
    return [r[0] for r in cur.execute(f"SELECT conversation_id FROM simulated_conversations {where} "
                                      "ORDER BY imported_at, conversation_id", params).fetchall()]


def present(cur: duckdb.DuckDBPyConnection) -> bool:
    """Whether the file has the table (one written before simulations existed, opened read-only, has not)."""
    row = one(cur.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'simulated_conversations' "
                      "AND schema_name = current_schema()"))
    return bool(row and row[0])


def count(cur: duckdb.DuckDBPyConnection) -> int:
    if not present(cur):
        return 0
    row = one(cur.execute("SELECT count(*) FROM simulated_conversations"))
    return int(row[0]) if row else 0

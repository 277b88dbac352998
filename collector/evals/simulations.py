"""Simulated conversations stored apart from production ones, judged only when asked.

``tracejudge replay import SIM.jsonl`` stores an offline suite's conversation/v1
records (``source: simulation``) in ``simulated_conversations``, idempotent by
id. Their verdicts and not-run records go to ``simulated_verdicts`` and
``simulated_not_run``, shaped as ``verdicts`` and ``not_run``: simulated ids are
a space of their own, so a simulated ``c-1`` and production's ``c-1`` are two
conversations, and an import can neither hide production traffic nor be hidden
by it. Nothing that reads production (the evaluator, the review queue, verdict
events, exports, retention, reindex) reads these tables. ``tracejudge eval
--source simulation`` judges them with the same criteria (each verdict weighs 1:
a suite is not a sample), and ``tracejudge stats --by source`` puts their
failure rates beside production's.

Errors: ``SimulationError`` (a record that cannot be stored: production's, or
one holding a lone surrogate, which ``not_text`` names).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import duckdb
import orjson

from judges import Conversation, Verdict

from ..errors import UserError
from ..store.transactions import Transaction, insert_rows, one, utc_now
from .verdicts import UNKEYED, add_live_column, not_run_table, store_verdicts, verdicts_table

SCHEMA = f"""
CREATE TABLE IF NOT EXISTS simulated_conversations (
    conversation_id VARCHAR PRIMARY KEY,
    persona_id VARCHAR,
    ended_by VARCHAR NOT NULL,
    record VARCHAR NOT NULL,
    imported_at TIMESTAMPTZ NOT NULL
);
{UNKEYED["verdicts"].format(name=verdicts_table(simulated=True))};
{UNKEYED["not_run"].format(name=not_run_table(simulated=True))};
"""
COLUMNS = ("conversation_id", "persona_id", "ended_by", "record", "imported_at")
RULE = "simulation"
"""The ``sampling_rule`` of a simulated conversation's verdicts (production ones name a sampling rule)."""


class SimulationError(UserError):
    """Simulated records that cannot be stored."""


@dataclass
class Imported:
    """What one import stored."""

    stored: int = 0
    known: int = 0
    """Already stored under the same id: left as they are."""
    new: list[Conversation] = field(default_factory=list)
    """The conversations stored by this import (the first of an id given twice)."""

    def to_dict(self) -> dict[str, int]:
        return {"stored": self.stored, "already_imported": self.known}


def ensure_schema(cur: duckdb.DuckDBPyConnection) -> None:
    """Create the tables of simulated conversations; in a file whose older version kept simulated verdicts
    among production's, move them here, once."""
    with Transaction(cur):
        moving = not present(cur) and _table(cur, "verdicts")
        cur.execute(SCHEMA)
        add_live_column(cur, verdicts_table(simulated=True))  # rows move between the two tables by name
        if moving:
            _move_simulated_rows(cur)


def _move_simulated_rows(cur: duckdb.DuckDBPyConnection) -> None:
    # Their verdicts name the rule ``simulation``, as no sampling rule is named. Their not-run records
    # are those of imported ids that the sampler never decided on (it decides on every production one).
    for table, to, which in (
            ("verdicts", verdicts_table(simulated=True), f"sampling_rule = '{RULE}'"),
            ("not_run", not_run_table(simulated=True),
             "conversation_id IN (SELECT conversation_id FROM simulated_conversations) "
             "AND conversation_id NOT IN (SELECT conversation_id FROM sampling_decisions)")):
        cur.execute(f"INSERT INTO {to} BY NAME SELECT * FROM {table} WHERE {which}")
        cur.execute(f"DELETE FROM {table} WHERE {which}")


def not_text(conversation: Conversation) -> str | None:
    """Where a record holds a lone surrogate (half of a character, which a JSON escape can spell but UTF-8
    cannot store), as one line: ``"messages.0.content: '\\ud800' is a lone surrogate, ..."``; else None."""
    return _surrogate(conversation.model_dump(by_alias=True, exclude_none=True), "")


def _surrogate(value: Any, where: str) -> str | None:
    if isinstance(value, str):
        at = _surrogate_at(value)
        return None if at is None else (f"{where or 'the record'}: {value[at]!r} is a lone surrogate, half of a "
                                        "character, not text")
    items: Any = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and _surrogate_at(key) is not None:  # named by its repr, which escapes it
            return f"{where or 'the record'}: the key {key!r} holds a lone surrogate, half of a character, not text"
        found = _surrogate(item, f"{where}.{key}" if where else str(key))
        if found:
            return found
    return None


def _surrogate_at(text: str) -> int | None:
    try:
        text.encode("utf-8")  # fails on a surrogate only
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def store_simulations(cur: duckdb.DuckDBPyConnection, conversations: Sequence[Conversation],
                      now: dt.datetime | None = None, verdicts: Sequence[Verdict] = ()) -> Imported:
    """Store simulated conversations not stored yet, in one transaction, with the ``verdicts`` of those
    (``tracejudge simulate`` judged them already: they need not be judged again).

    Raises:
        SimulationError: a record is not ``source: simulation``, or holds a lone surrogate.
    """
    for c in conversations:
        if c.source != "simulation":
            raise SimulationError(f"conversation {c.id!r} has source {c.source!r}: only simulated conversations "
                                  "are imported (production ones come in as traces)")
        bad = not_text(c)
        if bad:  # it would fail on its way into the store
            raise SimulationError(f"conversation {c.id!r}: {bad}")
    ids = [c.id for c in conversations]
    at = utc_now(now)
    with Transaction(cur):
        known = {r[0] for r in cur.execute("SELECT conversation_id FROM simulated_conversations "
                                           "WHERE conversation_id IN (SELECT unnest(?))", [ids]).fetchall()}
        new, seen = [], set(known)
        for c in conversations:
            if c.id in seen:
                continue
            seen.add(c.id)
            new.append(c)
        insert_rows(cur, "INSERT INTO simulated_conversations", COLUMNS,
                    [(c.id, c.persona_id, c.ended_by, c.to_json(), at) for c in new])
        stored = {c.id for c in new}
        theirs = [v for v in verdicts if v.conversation_id in stored]
        if theirs:
            store_verdicts(cur, theirs, probability=1.0, rule=RULE, now=at, simulated=True)
    return Imported(stored=len(new), known=len(conversations) - len(new), new=new)


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
    """Whether the file has the tables (one written before simulations were kept apart, opened read-only,
    has not)."""
    return _table(cur, verdicts_table(simulated=True))


def _table(cur: duckdb.DuckDBPyConnection, name: str) -> bool:
    row = one(cur.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = ? "
                          "AND schema_name = current_schema()", [name]))
    return bool(row and row[0])


def count(cur: duckdb.DuckDBPyConnection) -> int:
    if not present(cur):
        return 0
    row = one(cur.execute("SELECT count(*) FROM simulated_conversations"))
    return int(row[0]) if row else 0

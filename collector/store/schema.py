"""The store's own tables and views: every field of each span and log record, kept whole.

``create_schema`` writes them only when a file does not have them as they are, so
that a start which fails later leaves a damaged file as it was. The Arrow
schemas give each column its type for the writer's inserts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from hashlib import blake2b

import duckdb

from ..ingest.batches import LOG_COLUMNS, SPAN_COLUMNS
from .arrow import INT8, INT32, STRING, UINT32, UINT64, Table
from .files import ATTACHED
from .transactions import Transaction, registered

log = logging.getLogger("tracejudge.store")

# The newest records whose keys are kept (``recent_keys``): a retry of one of them stores nothing twice.
# Their index holds about 40 bytes a key in DuckDB's memory (8 MB here), however large the file; at
# 10,000 spans/s they are the last 20 s of records (a retry after a lost ack comes about 10 s after the
# request: the exporters' timeout), at 1,000 spans/s the last 3 minutes.
KEYS_KEPT = 200_000

# Which conversation a trace belongs to, and the first and last commits holding its rows: a read of
# them skips every row group outside (rows are stored in commit order). NULL commits: stored by an
# older version, until the trace's conversation is rebuilt.
#
# Only the newest traces (``TRACES_KEPT``, by last commit) are keyed, in ``trace_conversations``: a key's
# index stays whole in DuckDB's memory while random trace ids go in, about 70 bytes a trace, so a map
# of every trace kept for months would fill it. Older traces move to ``trace_archive``, which has no
# key (``archive_traces``); ``trace_map`` shows both. The stage looks a trace up among the keyed ones and
# the conversations it holds in memory (every open one): a trace that comes back once both have
# forgotten it is taken as new (``Conversations._touch``), and where it is in both, the keyed row wins.
# Also created in the schema a reindex builds in.
TRACE_MAP = """CREATE TABLE IF NOT EXISTS trace_conversations (
    trace_id VARCHAR PRIMARY KEY,
    conversation_id VARCHAR NOT NULL,
    first_batch UBIGINT,
    last_batch UBIGINT
);
ALTER TABLE trace_conversations ADD COLUMN IF NOT EXISTS first_batch UBIGINT;
ALTER TABLE trace_conversations ADD COLUMN IF NOT EXISTS last_batch UBIGINT;
CREATE TABLE IF NOT EXISTS trace_archive (
    trace_id VARCHAR NOT NULL,
    conversation_id VARCHAR NOT NULL,
    first_batch UBIGINT,
    last_batch UBIGINT
);
CREATE OR REPLACE VIEW trace_map AS
SELECT trace_id, conversation_id, first_batch, last_batch FROM trace_conversations
UNION ALL SELECT a.trace_id, a.conversation_id, a.first_batch, a.last_batch FROM trace_archive a
WHERE NOT EXISTS (SELECT 1 FROM trace_conversations k WHERE k.trace_id = a.trace_id);"""

# The span and log tables have no key: a key's index stays in DuckDB's memory whole while rows go in
# (random ids touch all of it), so at the default memory limit commits failed from about 600,000
# stored spans (a soak at 6,000 spans/s). A retried record is recognised by ``RECENT_KEYS`` instead:
# the hash of its ids, for the newest records only (``Store._insert``).
# Their text columns are compressed with zstd, not by DuckDB's choice: choosing runs every method's
# analysis over each segment at each checkpoint, and its usual choice (FSST) is slower and larger. On
# bench/ingest.py's spans the writer took 0.68x the CPU a span and the file a third of the space, and reads
# by commit range cost the same (bench/compression.py). Not on the keyed tables: a read by key decompresses
# a whole zstd vector, and lookups of conversations took 1.8x as long. A file made before keeps its tables.
SPAN_TABLE = """CREATE TABLE IF NOT EXISTS {name} (
    trace_id VARCHAR NOT NULL USING COMPRESSION zstd,
    span_id VARCHAR NOT NULL USING COMPRESSION zstd,
    parent_span_id VARCHAR USING COMPRESSION zstd,
    trace_state VARCHAR USING COMPRESSION zstd,
    flags UINTEGER,
    name VARCHAR USING COMPRESSION zstd,
    kind TINYINT,
    start_time_unix_nano UBIGINT,
    end_time_unix_nano UBIGINT,
    attributes VARCHAR USING COMPRESSION zstd,
    events VARCHAR USING COMPRESSION zstd,
    links VARCHAR USING COMPRESSION zstd,
    status_code TINYINT,
    status_message VARCHAR USING COMPRESSION zstd,
    dropped VARCHAR USING COMPRESSION zstd,
    resource VARCHAR USING COMPRESSION zstd,
    resource_schema_url VARCHAR USING COMPRESSION zstd,
    scope_name VARCHAR USING COMPRESSION zstd,
    scope_version VARCHAR USING COMPRESSION zstd,
    scope_attributes VARCHAR USING COMPRESSION zstd,
    service VARCHAR USING COMPRESSION zstd,
    received_at TIMESTAMPTZ NOT NULL,
    batch_id UBIGINT NOT NULL
)"""
# ``seq``: a log record's place in its commit (records of one call often share a timestamp).
LOG_TABLE = """CREATE TABLE IF NOT EXISTS {name} (
    log_id VARCHAR NOT NULL USING COMPRESSION zstd,
    trace_id VARCHAR USING COMPRESSION zstd,
    span_id VARCHAR USING COMPRESSION zstd,
    time_unix_nano UBIGINT,
    observed_time_unix_nano UBIGINT,
    severity_number INTEGER,
    severity_text VARCHAR USING COMPRESSION zstd,
    event_name VARCHAR USING COMPRESSION zstd,
    body VARCHAR USING COMPRESSION zstd,
    attributes VARCHAR USING COMPRESSION zstd,
    flags UINTEGER,
    dropped_attributes_count UINTEGER,
    resource VARCHAR USING COMPRESSION zstd,
    scope_name VARCHAR USING COMPRESSION zstd,
    scope_version VARCHAR USING COMPRESSION zstd,
    service VARCHAR USING COMPRESSION zstd,
    received_at TIMESTAMPTZ NOT NULL,
    batch_id UBIGINT NOT NULL,
    seq UINTEGER
)"""
# The key (``record_keys``) of each of the newest span and log records and the commit that stored it.
RECENT_KEYS = "CREATE TABLE IF NOT EXISTS recent_keys (key UBIGINT PRIMARY KEY, batch_id UBIGINT NOT NULL)"

# The views' rows, with ``{map}`` the trace map they join (a read of one trace joins its own row).
SPANS = """SELECT s.trace_id, s.span_id, s.parent_span_id, t.conversation_id, s.name, s.kind,
       make_timestamp_ns(TRY_CAST(s.start_time_unix_nano AS BIGINT)) AS start_time,
       make_timestamp_ns(TRY_CAST(s.end_time_unix_nano AS BIGINT)) AS end_time,
       s.attributes::JSON AS attributes, s.events::JSON AS events, s.links::JSON AS links,
       s.status_code, s.status_message, s.resource::JSON AS resource, s.scope_name, s.scope_version,
       s.service, s.trace_state, s.flags, s.dropped::JSON AS dropped, s.resource_schema_url,
       s.scope_attributes::JSON AS scope_attributes,
       s.start_time_unix_nano, s.end_time_unix_nano, s.received_at, s.batch_id
FROM span_records s LEFT JOIN {map} t USING (trace_id)"""
LOGS = """SELECT l.log_id, l.trace_id, l.span_id, t.conversation_id, l.event_name,
       make_timestamp_ns(TRY_CAST(l.time_unix_nano AS BIGINT)) AS time,
       l.severity_number, l.severity_text, l.body::JSON AS body, l.attributes::JSON AS attributes,
       l.resource::JSON AS resource,
       l.scope_name, l.scope_version, l.service, l.flags, l.dropped_attributes_count,
       l.time_unix_nano, l.observed_time_unix_nano, l.received_at, l.batch_id
FROM log_records l LEFT JOIN {map} t USING (trace_id)"""

SCHEMA = """
{SPAN_TABLE};
{LOG_TABLE};
{RECENT_KEYS};
-- Added to older files.
ALTER TABLE log_records ADD COLUMN IF NOT EXISTS seq UINTEGER;
-- JSON columns are stored as VARCHAR (we write valid JSON; DuckDB's JSON type
-- would parse every value again on insert, halving throughput) and typed JSON
-- in the views.
-- Which conversation a trace belongs to. The map, not the span row, says where
-- a span belongs, so children that arrive before the span carrying the id
-- move with their trace without rewriting stored rows.
{TRACE_MAP}
CREATE OR REPLACE VIEW spans AS
{SPANS};
CREATE OR REPLACE VIEW logs AS
{LOGS};
""".replace("{SPANS}", SPANS.format(map="trace_map")).replace("{LOGS}", LOGS.format(map="trace_map")) \
    .replace("{TRACE_MAP}", TRACE_MAP).replace("{SPAN_TABLE}", SPAN_TABLE.format(name="span_records")) \
    .replace("{LOG_TABLE}", LOG_TABLE.format(name="log_records")).replace("{RECENT_KEYS}", RECENT_KEYS)


def record_keys(table: str, ids: Sequence[Sequence[str]]) -> list[int]:
    """The key of each record in ``recent_keys``: 64 bits of a BLAKE2b digest of its ids (a span's trace
    and span id, a log record's ``log_id``), the same in every version (DuckDB's ``hash`` may change).
    One collision among the kept keys is about 1 in 70 billion: a new record taken for a retry."""
    tag = b"s" if table == "span_records" else b"l"
    return [int.from_bytes(blake2b(tag + "\0".join(parts).encode(), digest_size=8).digest(), "little")
            for parts in zip(*ids)]


KEY_IDS = {"span_records": ("trace_id", "span_id"), "log_records": ("log_id",)}  # the ids ``record_keys`` reads

_SPAN_TYPES = {
    "flags": UINT32, "kind": INT8, "start_time_unix_nano": UINT64, "end_time_unix_nano": UINT64, "status_code": INT8,
}
_LOG_TYPES = {
    "time_unix_nano": UINT64, "observed_time_unix_nano": UINT64, "severity_number": INT32, "flags": UINT32,
    "dropped_attributes_count": UINT32,
}
# The Arrow type of each column of a commit's batches (``Store._insert``).
SPAN_ARROW = {c: _SPAN_TYPES.get(c, STRING) for c in SPAN_COLUMNS}
LOG_ARROW = {c: _LOG_TYPES.get(c, STRING) for c in LOG_COLUMNS}


def _layout(con: duckdb.DuckDBPyConnection, database: str) -> set[tuple[str, str]]:
    """The main schema's views (name, SQL as DuckDB stores it) and tables' columns (table, column)."""
    return set(con.execute(
        "SELECT view_name, sql FROM duckdb_views() WHERE database_name = $1 AND schema_name = 'main' "
        "AND NOT internal UNION ALL SELECT table_name, column_name FROM duckdb_columns() "
        "WHERE database_name = $1 AND schema_name = 'main'", [database]).fetchall())


def create_schema(con: duckdb.DuckDBPyConnection) -> None:
    """Create the tables and views, writing nothing to a file that already has them as they are.

    So a start that fails later (another stage finds the file damaged) leaves the file as it was.
    """
    scratch = duckdb.connect()  # renders our views as DuckDB stores them, to compare
    try:
        scratch.execute(SCHEMA)
        wanted = _layout(scratch, "memory")
    finally:
        scratch.close()
    if not wanted <= _layout(con, ATTACHED):
        con.execute(SCHEMA)
    _drop_record_keys(con)


def _drop_record_keys(con: duckdb.DuckDBPyConnection) -> None:
    """Rebuild a span or log table of an older file that still has its key; its newest records' keys go to
    ``recent_keys``."""
    for table, ddl in (("span_records", SPAN_TABLE), ("log_records", LOG_TABLE)):
        def keep_newest(new: str, table: str = table) -> None:
            newest = con.execute(f"SELECT {', '.join(KEY_IDS[table])}, batch_id FROM {new} "
                                 f"ORDER BY batch_id DESC LIMIT {KEYS_KEPT}").fetchall()
            if newest:
                columns = list(zip(*newest))
                keys = Table({"key": record_keys(table, columns[:-1]), "batch_id": columns[-1]},
                             {"key": UINT64, "batch_id": UINT64})
                with registered(con, "migrated_keys", keys) as view:
                    con.execute(f"INSERT OR IGNORE INTO recent_keys SELECT key, batch_id FROM {view}")
        drop_primary_key(con, table, ddl.format(name=f"{table}_unkeyed"), "its index grew with the file "
                         "and filled DuckDB's memory", then=keep_newest)


def drop_primary_key(con: duckdb.DuckDBPyConnection, table: str, ddl: str, why: str, *,
                     then: Callable[[str], object] | None = None) -> bool:
    """Rebuild ``table`` of an older file without its primary key (DuckDB cannot drop a constraint), in
    stored order, in one transaction; True when it did. ``ddl`` creates the new table as
    ``{table}_unkeyed``; ``then`` is given that name before it takes the old one's."""
    [(keyed,)] = con.execute("SELECT count(*) FROM duckdb_constraints() WHERE database_name = current_database() "
                             "AND schema_name = current_schema() AND table_name = ? "
                             "AND constraint_type = 'PRIMARY KEY'", [table]).fetchall()
    if not keyed:
        return False
    [(rows,)] = con.execute(f"SELECT count(*) FROM {table}").fetchall()
    log.warning("rebuilding %s (%d rows) without its key, once: %s", table, rows, why)
    started = time.monotonic()
    new = f"{table}_unkeyed"
    with Transaction(con):
        con.execute(f"DROP TABLE IF EXISTS {new}")
        con.execute(ddl)
        con.execute(f"INSERT INTO {new} BY NAME SELECT * FROM {table}")  # in the order stored
        if then is not None:
            then(new)
        con.execute(f"DROP TABLE {table}")
        con.execute(f"ALTER TABLE {new} RENAME TO {table}")
    log.warning("%s rebuilt in %.1f s", table, time.monotonic() - started)
    return True

"""The store's own tables and views: every field of each span and log record, kept whole.

``create_schema`` writes them only when a file does not have them as they are, so
that a start which fails later leaves a damaged file as it was. The Arrow
schemas give each column its type for the writer's inserts.
"""

from __future__ import annotations

import duckdb

from ..ingest.batches import LOG_COLUMNS, SPAN_COLUMNS
from .arrow import INT8, INT32, STRING, UINT32, UINT64
from .files import ATTACHED

# Which conversation a trace belongs to (also created in the schema a reindex builds in), and the
# first and last commits holding its rows: a read of them skips every row group outside (rows are
# stored in commit order). Added to older files, NULL there until the trace's conversation is rebuilt.
TRACE_MAP = """CREATE TABLE IF NOT EXISTS trace_conversations (
    trace_id VARCHAR PRIMARY KEY,
    conversation_id VARCHAR NOT NULL,
    first_batch UBIGINT,
    last_batch UBIGINT
);
ALTER TABLE trace_conversations ADD COLUMN IF NOT EXISTS first_batch UBIGINT;
ALTER TABLE trace_conversations ADD COLUMN IF NOT EXISTS last_batch UBIGINT;"""

SCHEMA = """
CREATE TABLE IF NOT EXISTS span_records (
    trace_id VARCHAR NOT NULL,
    span_id VARCHAR NOT NULL,
    parent_span_id VARCHAR,
    trace_state VARCHAR,
    flags UINTEGER,
    name VARCHAR,
    kind TINYINT,
    start_time_unix_nano UBIGINT,
    end_time_unix_nano UBIGINT,
    attributes VARCHAR,
    events VARCHAR,
    links VARCHAR,
    status_code TINYINT,
    status_message VARCHAR,
    dropped VARCHAR,
    resource VARCHAR,
    resource_schema_url VARCHAR,
    scope_name VARCHAR,
    scope_version VARCHAR,
    scope_attributes VARCHAR,
    service VARCHAR,
    received_at TIMESTAMPTZ NOT NULL,
    batch_id UBIGINT NOT NULL,
    PRIMARY KEY (trace_id, span_id)
);
CREATE TABLE IF NOT EXISTS log_records (
    log_id VARCHAR PRIMARY KEY,
    trace_id VARCHAR,
    span_id VARCHAR,
    time_unix_nano UBIGINT,
    observed_time_unix_nano UBIGINT,
    severity_number INTEGER,
    severity_text VARCHAR,
    event_name VARCHAR,
    body VARCHAR,
    attributes VARCHAR,
    flags UINTEGER,
    dropped_attributes_count UINTEGER,
    resource VARCHAR,
    scope_name VARCHAR,
    scope_version VARCHAR,
    service VARCHAR,
    received_at TIMESTAMPTZ NOT NULL,
    batch_id UBIGINT NOT NULL
);
-- A record's place in its commit: records of one call often share a timestamp, and
-- INSERT OR IGNORE does not store rows in the order given. Added to older files.
ALTER TABLE log_records ADD COLUMN IF NOT EXISTS seq UINTEGER;
-- JSON columns are stored as VARCHAR (we write valid JSON; DuckDB's JSON type
-- would parse every value again on insert, halving throughput) and typed JSON
-- in the views.
-- Which conversation a trace belongs to. The map, not the span row, says where
-- a span belongs, so children that arrive before the span carrying the id
-- move with their trace without rewriting stored rows.
{TRACE_MAP}
CREATE OR REPLACE VIEW spans AS
SELECT s.trace_id, s.span_id, s.parent_span_id, t.conversation_id, s.name, s.kind,
       make_timestamp_ns(TRY_CAST(s.start_time_unix_nano AS BIGINT)) AS start_time,
       make_timestamp_ns(TRY_CAST(s.end_time_unix_nano AS BIGINT)) AS end_time,
       s.attributes::JSON AS attributes, s.events::JSON AS events, s.links::JSON AS links,
       s.status_code, s.status_message, s.resource::JSON AS resource, s.scope_name, s.scope_version,
       s.service, s.trace_state, s.flags, s.dropped::JSON AS dropped, s.resource_schema_url,
       s.scope_attributes::JSON AS scope_attributes,
       s.start_time_unix_nano, s.end_time_unix_nano, s.received_at, s.batch_id
FROM span_records s LEFT JOIN trace_conversations t USING (trace_id);
CREATE OR REPLACE VIEW logs AS
SELECT l.log_id, l.trace_id, l.span_id, t.conversation_id, l.event_name,
       make_timestamp_ns(TRY_CAST(l.time_unix_nano AS BIGINT)) AS time,
       l.severity_number, l.severity_text, l.body::JSON AS body, l.attributes::JSON AS attributes,
       l.resource::JSON AS resource,
       l.scope_name, l.scope_version, l.service, l.flags, l.dropped_attributes_count,
       l.time_unix_nano, l.observed_time_unix_nano, l.received_at, l.batch_id
FROM log_records l LEFT JOIN trace_conversations t USING (trace_id);
""".replace("{TRACE_MAP}", TRACE_MAP)

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



"""Python values as Arrow tables DuckDB scans, built with nanoarrow.

A bulk insert hands DuckDB an Arrow table (``collector.store.transactions.registered``): row by
row DuckDB takes about 1.5 ms a row, from Arrow microseconds. nanoarrow builds the arrays in C
from the Python lists and DuckDB reads them through the Arrow PyCapsule stream interface.
pyarrow did the same before: its libraries added about 25 MB to the daemon's proportional set,
and it took three times as long to build a commit's columns.

A column has the type it is given (``Table(columns, types)``: the writer's integer widths) or the
one its values have: str, int, float (with ints among them), bool, bytes, datetime (as
microseconds); all None is NULL.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any

import nanoarrow as na

try:  # how na.c_array builds an array from a list (not public: without it, na.c_array)
    from nanoarrow.c_array import _resolve_builder
except ImportError:  # pragma: no cover - another nanoarrow
    _resolve_builder = None

STRING = na.string()
INT8 = na.int8()
INT32 = na.int32()
INT64 = na.int64()
UINT32 = na.uint32()
UINT64 = na.uint64()
FLOAT64 = na.float64()
BOOL = na.bool_()
BINARY = na.binary()
TIMESTAMP_UTC = na.timestamp("us", timezone="UTC")
TIMESTAMP = na.timestamp("us")
_EPOCH_UTC = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
_EPOCH = dt.datetime(1970, 1, 1)
_MICROSECOND = dt.timedelta(microseconds=1)


class Table:
    """Named columns of equal length that DuckDB can scan (``cur.register(name, table)``).

    Each scan gets a stream of its own: a stream is read once, and DuckDB reads the schema of a
    registered object before it scans it.
    """

    def __init__(self, columns: Mapping[str, Sequence[Any]], types: Mapping[str, na.Schema] | None = None) -> None:
        lengths = {len(values) for values in columns.values()}
        if len(lengths) > 1:
            raise ValueError(f"columns of different lengths: {sorted(lengths)}")
        arrays = [_array(name, values, (types or {}).get(name)) for name, values in columns.items()]
        schema = na.struct({name: a.schema for name, a in zip(columns, arrays)})
        self._batch = na.c_array_from_buffers(schema, lengths.pop() if lengths else 0, [None], children=arrays)

    def __arrow_c_stream__(self, requested_schema: object | None = None) -> object:
        return na.c_array_stream(self._batch).__arrow_c_stream__(requested_schema)


def rows_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Table:
    """Rows (tuples in ``columns`` order) as a ``Table``, each column's type from its values."""
    return Table({name: [r[i] for r in rows] for i, name in enumerate(columns)})


def _array(name: str, values: Sequence[Any], typ: na.Schema | None) -> Any:
    if typ is None:
        typ, values = _infer(name, values)
        if typ is None:  # every value None
            return na.c_array_from_buffers(na.null(), len(values), [])
    if _resolve_builder is None:
        return na.c_array(values, typ)
    # na.c_array's builder keeps its own bound append method: a reference cycle, a dozen objects a
    # column, that only the garbage collector frees. The daemon made 17,000 of them a second at 5,000
    # spans/s, and most lived on to its full collections. Emptied once built, the builder goes at once.
    builder = _resolve_builder(values)(typ)
    try:
        return builder.build_c_array(values)
    finally:
        vars(builder).clear()


def _infer(name: str, values: Sequence[Any]) -> tuple[na.Schema | None, Sequence[Any]]:
    kinds = {type(v) for v in values if v is not None}
    if not kinds:
        return None, values
    if kinds == {str}:
        return STRING, values
    if kinds == {bool}:
        return BOOL, values
    if kinds == {int}:
        return INT64, values
    if kinds <= {int, float}:
        return FLOAT64, [None if v is None else float(v) for v in values]
    if kinds == {bytes}:
        return BINARY, values
    if all(issubclass(k, dt.datetime) for k in kinds):
        aware = {v.tzinfo is not None for v in values if v is not None}
        if len(aware) > 1:
            raise TypeError(f"column {name!r} mixes datetimes with and without a time zone")
        utc = aware.pop()
        return (TIMESTAMP_UTC if utc else TIMESTAMP), _micros(values, utc)
    raise TypeError(f"column {name!r} holds {', '.join(sorted(k.__name__ for k in kinds))}: "
                    "a table takes str, int, float, bool, bytes, datetime or None")


def _micros(values: Sequence[Any], utc: bool) -> list[int | None]:
    epoch = _EPOCH_UTC if utc else _EPOCH
    return [None if v is None else (v - epoch) // _MICROSECOND for v in values]

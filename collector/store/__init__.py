"""The store: the DuckDB file, its one writer thread, and how every stage writes to it.

``Store`` takes the receivers' batches and commits them (``writer``); ``connect``
opens the file for the CLI (``files``); ``Transaction`` and ``insert_rows`` are how
the other stages write (``transactions``); ``Pacing`` is how they give way to
ingestion (``pacing``).

``Store`` is imported when first asked for: the writer loads the Arrow builder
(``arrow``), which the conversation stage's process, importing the rest, does without.
"""

from typing import TYPE_CHECKING, Any

from .files import ATTACHED, connect, file_fault, unreadable
from .pacing import Pacing
from .transactions import (Committed, Transaction, insert_rows, register, registered, registered_rows, rows_table,
                           utc_now)

if TYPE_CHECKING:
    from .writer import Store


def __getattr__(name: str) -> Any:
    if name == "Store":
        from .writer import Store

        return Store
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ATTACHED", "Committed", "Pacing", "Store", "Transaction", "connect", "file_fault", "insert_rows",
           "register", "registered", "registered_rows", "rows_table", "unreadable", "utc_now"]

"""The store: the DuckDB file, its one writer thread, and how every stage writes to it.

``Store`` takes the receivers' batches and commits them (``writer``); ``connect``
opens the file for the CLI (``files``); ``Transaction`` and ``insert_rows`` are how
the other stages write (``transactions``); ``Pacing`` is how they give way to
ingestion (``pacing``).
"""

from .files import ATTACHED, connect, file_fault, unreadable
from .pacing import Pacing
from .transactions import Transaction, insert_rows, registered, rows_table, utc_now
from .writer import Committed, Store

__all__ = ["ATTACHED", "Committed", "Pacing", "Store", "Transaction", "connect", "file_fault", "insert_rows",
           "registered", "rows_table", "unreadable", "utc_now"]

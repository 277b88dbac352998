"""Ingest: OTLP requests over gRPC and HTTP, decoded into column batches and handed to a consumer.

``decode`` turns a body into ``SpanBatch`` / ``LogBatch`` (``batches``) in one
walk; ``receiver`` runs the gRPC and HTTP handlers, which answer after their
consumer (the store) has committed. Only the batches are imported here: the
store needs them, and not grpc or aiohttp.
"""

from .batches import LOG_COLUMNS, SPAN_COLUMNS, Consumer, LogBatch, SpanBatch

__all__ = ["LOG_COLUMNS", "SPAN_COLUMNS", "Consumer", "LogBatch", "SpanBatch"]

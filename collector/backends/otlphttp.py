"""Any OTLP/HTTP receiver (an OpenTelemetry Collector, a vendor's endpoint): no default URL, a bearer token
when a key is set."""

from __future__ import annotations

from ._backend import Backend, bearer

BACKEND = Backend("otlphttp", None, ("traces", "logs"), bearer)

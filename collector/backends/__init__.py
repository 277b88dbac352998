"""The backend types an exporter sends to, one module each, by name (``exporters.<name>.type``).

Each declares its default traces URL, its headers, the signals it gets by
default, whether it gets LangSmith's thread attribute, and what it refuses in
an exporter's settings. The config checks exporters with them at start-up and
the forwarding stage (``collector.forward``) sends by them, so they sit below
both and import nothing of ours; light on purpose, as the config is imported by
every command.
"""

from __future__ import annotations

from . import langsmith, langwatch, opik, otlphttp
from ._backend import Backend, Settings

__all__ = ["BACKENDS", "Backend", "Settings"]

BACKENDS: dict[str, Backend] = {b.name: b for b in (opik.BACKEND, langsmith.BACKEND, langwatch.BACKEND,
                                                     otlphttp.BACKEND)}
"""Backend type -> its conventions."""

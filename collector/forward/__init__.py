"""Forwarding: every accepted OTLP request to the team's backends (Opik, LangSmith, LangWatch, any OTLP/HTTP),
through one on-disk queue read by each exporter from a cursor of its own, in order, without loss (``forwarder``, ``queue``, ``send``,
``rewrite``)."""

from .forwarder import Forwarder

__all__ = ["Forwarder"]

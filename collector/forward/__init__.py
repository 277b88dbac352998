"""Forwarding: every accepted OTLP request to the team's backends (Opik, LangSmith, LangWatch, any OTLP/HTTP),
through an on-disk queue per exporter, in order, without loss (``forwarder``, ``queue``, ``send``,
``rewrite``)."""

from .forwarder import Forwarder

__all__ = ["Forwarder"]

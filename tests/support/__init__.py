"""Helpers the tests share: the daemon as a subprocess, OTLP on the wire, HTTP, fake judges."""

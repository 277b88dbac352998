"""The HTTP API over every stage, and the client the CLI reads through.

``app`` routes the JSON API, the review page and the health endpoints;
``guards`` checks Host, Origin and token before any handler; ``errors`` is the
one error shape; ``client`` reads through a running daemon or the file.
"""

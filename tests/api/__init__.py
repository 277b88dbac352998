"""The HTTP API's guards: hosts, origins, tokens, errors."""

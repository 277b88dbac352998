"""The CLI over the API."""

"""collector: the tracejudge daemon (receivers, store, conversations, API, CLI)."""

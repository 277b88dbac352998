"""collector: the tracejudge daemon, one subpackage per stage of the data flow.

``ingest`` (OTLP receivers) -> ``store`` (the one writer) -> ``conversations`` (transcripts
rebuilt) -> ``evals`` (sampling and judging) -> ``review`` (the queue and its page); ``api`` and
``cli`` sit over them, ``daemon`` wires them, and each stage imports only those upstream of it.
"""

"""Evals: sampling ended conversations, judging them with ``judges``, and storing the verdicts.

``sampling`` decides which conversations are judged, ``judging`` judges one and
stores the outcome, ``evaluator`` is the daemon's stage, ``backfill`` is
``tracejudge eval``, ``verdicts`` holds what is stored, and ``setup`` builds the
judges of the config.
"""

"""replay: what production teaches the offline suite, and how real users compare with simulated ones.

- ``scenarios``: confirmed failures as scenario YAML, case JSONL and a proposed fix (``stage``: the
  daemon's ``scenarios.on_confirm``); ``redact``: personal data out before anything is drafted or written.
- ``export`` / ``imports``: production conversations out as conversation/v1, simulated ones in.
- ``compare`` (``report``): the descriptive comparison of the two.
- ``baseline``: a simulate run against an earlier one, scenario by scenario: fixed, broke, still failing.

It reads data through collector's store read API (the daemon's JSON API, else the file).
"""

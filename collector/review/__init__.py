"""Review: failures queued for people, their decisions, the page they work on, and the stats.

``queue`` opens items for the verdicts that need a reviewer and records
decisions, ``page`` renders the review web page, and ``stats`` gives failure
rates with the reviewers' outcomes.
"""

from typing import Literal

# Here, not in ``queue`` (which loads DuckDB): the CLI offers them as choices in its help.
ReviewState = Literal["pending", "confirmed", "rejected", "unclear"]
REVIEW_STATES: tuple[ReviewState, ...] = ("pending", "confirmed", "rejected", "unclear")

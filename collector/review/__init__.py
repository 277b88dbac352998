"""Review: failures queued for people, their decisions, the page they work on, and the stats.

``queue`` opens items for the verdicts that need a reviewer and records
decisions, ``page`` renders the review web page, and ``stats`` gives failure
rates with the reviewers' outcomes.
"""

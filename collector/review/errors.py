"""The review stage's errors (all ``UserError``, so the CLI prints one line; ``status`` and ``code`` give the
JSON API's answer)::

    ReviewError              status, code
    ├── ReviewNotFound       404 not_found: no review item (or calibration item) with that id
    ├── ReviewConflict       409 already_decided: decided before, no force
    └── ReviewInputError     400 bad_request: unknown decision or label, no reviewer
"""

from __future__ import annotations

from ..errors import UserError

__all__ = ["ReviewConflict", "ReviewError", "ReviewInputError", "ReviewNotFound"]


class ReviewError(UserError):
    """A review request that cannot be done; ``status`` and ``code`` are its JSON API answer."""

    status = 400
    code = "bad_request"


class ReviewNotFound(ReviewError):
    """No review item has that id."""

    status = 404
    code = "not_found"


class ReviewConflict(ReviewError):
    """The item was decided already; deciding again needs ``force``."""

    status = 409
    code = "already_decided"


class ReviewInputError(ReviewError):
    """The decision or the reviewer is missing or unknown."""

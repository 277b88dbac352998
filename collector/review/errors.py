"""The review stage's errors (all ``UserError``, so the CLI prints one line; ``status`` and ``code`` give the
JSON API's answer)::

    ReviewError              status, code
    ├── ReviewNotFound       404 not_found: no review item (or calibration item) with that id
    ├── ReviewConflict       409 already_decided: decided before, no force
    ├── ReviewForbidden      403 reviewer_token_required / wrong_reviewer: with review.reviewers, an action
    │                        made without a reviewer's token, or naming another reviewer than its token's
    └── ReviewInputError     400 bad_request: unknown decision or label, no reviewer
"""

from __future__ import annotations

from ..errors import UserError

__all__ = ["ReviewConflict", "ReviewError", "ReviewForbidden", "ReviewInputError", "ReviewNotFound"]


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


class ReviewForbidden(ReviewError):
    """The action would record a reviewer the request's token does not name (``review.reviewers``)."""

    status = 403

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        super().__init__(message)


class ReviewInputError(ReviewError):
    """The decision or the reviewer is missing or unknown."""

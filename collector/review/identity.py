"""Who a claim, a decision or a label is recorded for.

With ``review.reviewers`` set, each reviewer has a token of their own, and
every action that records a reviewer (a claim or an assignment, a decision, a
blind label, a label import; through the page, the JSON API or the CLI)
records the reviewer of the token it is made with. A name sent beside the
token must name that same reviewer, else the action is refused
(``ReviewForbidden``, 403 ``wrong_reviewer``); an action made without a
reviewer's token is refused too (403 ``reviewer_token_required``: the API
token names nobody). Without ``review.reviewers`` the name typed is recorded,
and nothing checks it.

Either way two names are one reviewer when ``names.reviewer_key`` makes them
alike; the review stage compares them so.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..auth import same_secret
from ..config import Reviewer
from ..names import reviewer_key
from .errors import ReviewForbidden, ReviewInputError


class Identity:
    """The reviewers of ``review.reviewers`` and how a request names the one it acts for."""

    def __init__(self, reviewers: Sequence[Reviewer] = ()) -> None:
        self._tokens = [(r.token, r.name) for r in reviewers]
        self._names = {reviewer_key(r.name): r.name for r in reviewers}

    @property
    def checked(self) -> bool:
        """Reviewers have tokens: actions record the token's reviewer, never a typed name."""
        return bool(self._tokens)

    def of_token(self, secret: str | None) -> str | None:
        """The reviewer whose token ``secret`` is, or None (compared in constant time, every one)."""
        found = None
        for token, name in self._tokens:
            if same_secret(secret, token):
                found = name
        return found

    def recorder(self, signed_in: str | None, typed: str | None) -> str:
        """The reviewer an action records: ``signed_in`` (the reviewer of the request's token) when reviewers
        have tokens, else ``typed`` (the review stage refuses an empty one).

        Raises:
            ReviewForbidden: reviewers have tokens, and the request has none of theirs, or ``typed`` names
                another reviewer than its token's.
        """
        if not self.checked:
            return typed or ""
        if signed_in is None:
            raise ReviewForbidden("reviewer_token_required", (
                "review.reviewers is set: a claim, decision or label records the reviewer whose token it is made "
                "with, and this request carries no reviewer's token (the API token names no reviewer)"))
        if typed and reviewer_key(typed) and reviewer_key(typed) != reviewer_key(signed_in):
            raise ReviewForbidden("wrong_reviewer", (
                f"this is {signed_in}'s token: it acts for {signed_in} only, not for {typed!r} (leave the reviewer "
                "out, or name the token's own)"))
        return signed_in

    def viewer(self, signed_in: str | None, typed: str | None) -> str | None:
        """Whose own decisions and labels a read shows: the token's reviewer (``typed`` must be theirs), else
        ``typed`` (the API token or an open API may look as anyone)."""
        if signed_in is not None:
            return self.recorder(signed_in, typed)
        return typed or None

    def assignee(self, typed: str | None) -> str:
        """The reviewer an item is assigned to: with tokens, one of ``review.reviewers`` (as configured).

        Raises:
            ReviewInputError: no name, or, with tokens, nobody of ``review.reviewers`` by that name.
        """
        if not typed or not reviewer_key(typed):
            raise ReviewInputError("a reviewer is required")
        if not self.checked:
            return typed
        if reviewer_key(typed) not in self._names:
            raise ReviewInputError(f"no reviewer {typed!r} in review.reviewers: an item is assigned to one of them")
        return self._names[reviewer_key(typed)]

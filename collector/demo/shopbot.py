"""The demo's ShopBot as a function, for ``tracejudge simulate --bot collector.demo.shopbot:reply``.

The demo's traffic (``collector.demo.traffic``) is scripted; this is the same bookshop
support bot answering for real, by rules, with no model and no key, so the
loop from a production failure to a verified fix can be tried on it:

- ``reply`` has the demo's flaw: for a parcel stuck at the depot it promises
  that the carrier will call (the ``no-promises-for-the-carrier`` criterion
  of the demo's criteria fails);
- ``fixed`` is the bot after the fix: it promises only what the shop does
  itself (an e-mail update).

Both take the conversation so far (``{"role", "content"}`` dicts, ending with
the user's message) and the conversation id, and answer a ``str``, or
``{"content": ..., "handover": True}`` when the user asks for a person.
"""

from __future__ import annotations

import re
from typing import Any

ORDERS = {
    "B-1042": "shipped on Monday with BRT; it is out for delivery today before 18:00",
    "B-2210": "delivered on 20 November; it can be returned for a refund within 30 days",
    "B-7781": None,  # stuck at the depot
}
_ORDER = re.compile(r"\bB-\d{3,6}\b", re.IGNORECASE)
_PERSON = re.compile(r"(?i)\b(a person|a human|an agent|someone real|operator|operatore|persona)\b")
_REFUND = re.compile(r"(?i)\b(refund|money back|rimborso|reembolso)\b")
_SHIPPING = re.compile(r"(?i)\bship(ping)? to\b|\bdeliver to\b")


def _answer(messages: list[dict[str, str]], *, promise: str) -> Any:
    last = messages[-1]["content"] if messages else ""
    if _PERSON.search(last):
        return {"content": "Of course: I am handing you over to a colleague now; they will answer here within "
                           "minutes.", "handover": True}
    said = " ".join(m["content"] for m in messages if m["role"] == "user")
    orders = _ORDER.findall(said)
    if _REFUND.search(last) and not orders:
        return "I can help with a refund: what is your order number (it starts with B-)?"
    if _REFUND.search(last):
        return (f"For order {orders[-1].upper()}: if the parcel is confirmed lost we ship a replacement the same day "
                "or refund you in full, your choice; a damaged item is refunded within 30 days of delivery.")
    if orders:
        order = orders[-1].upper()
        status = ORDERS.get(order, "shipped two days ago; it should arrive within three working days")
        if status is None:
            return (f"I am very sorry. Order {order} has been stuck at our depot in Bologna since 21 November. "
                    f"I have opened a priority claim (C-5531), and {promise}.")
        return f"Order {order} was {status}."
    if _SHIPPING.search(last):
        return "Yes, we ship there; delivery takes 7 to 12 working days."
    return "I can help with orders, deliveries and refunds. What is your order number? It starts with B-."


def reply(messages: list[dict[str, str]], conversation_id: str) -> Any:
    """ShopBot as it is in production: it promises a call from the carrier, which the shop cannot promise."""
    return _answer(messages, promise="the carrier will call you within 24 hours")


def fixed(messages: list[dict[str, str]], conversation_id: str) -> Any:
    """ShopBot after the fix: it promises only what the shop does."""
    return _answer(messages, promise="we will e-mail you an update on the claim within 24 hours")

"""The demo's ShopBot as a --bot: its flaw, its fix, its handover."""

from __future__ import annotations

import re

from collector.demo.shopbot import fixed, reply

FLAW = re.compile(r"(?i)(carrier|corriere) will (call|contact)")  # the demo's no-promises-for-the-carrier


def test_the_stuck_parcel_gets_the_carrier_promise_until_the_fix() -> None:
    asked = [{"role": "user", "content": "Where is my order B-7781? It never came."}]
    assert FLAW.search(reply(asked, "c-1")) and not FLAW.search(fixed(asked, "c-1"))
    assert "B-7781" in fixed(asked, "c-1")


def test_it_asks_for_the_order_then_answers_and_hands_over_when_asked() -> None:
    first = [{"role": "user", "content": "hi, my parcel is late"}]
    assert "order number" in reply(first, "c-2")
    later = first + [{"role": "assistant", "content": "What is your order number?"},
                     {"role": "user", "content": "B-1042"}]
    assert "out for delivery" in reply(later, "c-2")
    assert reply([{"role": "user", "content": "Can I talk to a person?"}], "c-3")["handover"] is True

"""The review tests' world: criteria on code checks (no API key needed), the conversations
that fail them, and a daemon that judges them."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from collector.demo.traffic import Persona, ToolCall, Turn

from .daemon import DaemonProcess, base_config, wait_until
from .online import send

CARRIER = "no-carrier-promises"
REFUND = "no-full-refunds"
MARKUP = "no-markup-from-users"
LOOKUP = "looks-orders-up"

CRITERIA = f"""\
criteria:
  - id: {CARRIER}
    version: 1
    kind: code
    severity: medium
    group: accuracy
    check: regex
    role: assistant
    pattern: "(?i)carrier will (call|contact)"
    must: not_match

  - id: {REFUND}
    version: 2
    kind: code
    severity: high
    group: accuracy
    check: regex
    role: assistant
    pattern: "(?i)refund you in full"
    must: not_match

  - id: {MARKUP}
    version: 1
    kind: code
    check: regex
    role: user
    pattern: "<script>[^<]*</script>"
    must: not_match

  - id: {LOOKUP}
    version: 1
    kind: code
    check: tool_called
    name: lookup_order
    applies_if: {{user_matches: '(?i)order'}}
"""

SCRIPT = "<script>alert(1)</script>"
CARRIER_ANSWER = "Your order B-1 left the depot; the carrier will call you tomorrow."


def carrier_conversation(cid: str) -> Persona:
    """Fails only the carrier criterion: the order was looked up."""
    return Persona(cid, "en", "review-test", [
        Turn("Where is my order B-1?", CARRIER_ANSWER,
             ToolCall("lookup_order", {"order_id": "B-1"}, '{"status": "shipped"}')),
    ], conversation_id=cid)


def refund_conversation(cid: str) -> Persona:
    """Fails only the refund criterion (no order is mentioned, so the lookup criterion does not apply)."""
    return Persona(cid, "en", "review-test", [
        Turn("Can I send a damaged book back?", "Yes: send it back and we will refund you in full."),
    ], conversation_id=cid)


SCRIPT_CONVERSATION = Persona("script", "en", "review-test", [
    Turn(f"{SCRIPT} where is order B-9?", "Order B-9 ships <b>tomorrow</b>."),
], conversation_id="rv-script")

OPEN_CONVERSATIONS = [
    *(carrier_conversation(f"rv-json-{n}") for n in range(1, 4)),
    *(carrier_conversation(f"rv-html-{n}") for n in range(1, 5)),
    *(carrier_conversation(f"rv-csrf-{n}") for n in range(1, 3)),
    *(carrier_conversation(f"rv-race-{n}") for n in range(1, 5)),
    carrier_conversation("rv-lock-1"),
    *(refund_conversation(f"rv-stats-{n}") for n in range(1, 4)),
    SCRIPT_CONVERSATION,
]
# (conversation, criterion) of every review item the open daemon must queue: exactly the fails.
EXPECTED_ITEMS = {
    *((p.conversation_id, CARRIER) for p in OPEN_CONVERSATIONS
      if p.conversation_id.startswith(("rv-json", "rv-html", "rv-csrf", "rv-race", "rv-lock"))),
    *((p.conversation_id, REFUND) for p in OPEN_CONVERSATIONS if p.conversation_id.startswith("rv-stats")),
    ("rv-script", MARKUP),
    ("rv-script", LOOKUP),
}
TOKEN = "review-token-7f3a"


# --------------------------------------------------------------- HTTP and traffic helpers


def send_conversations(grpc_endpoint: str, personas: Sequence[Persona]) -> None:
    send(grpc_endpoint, personas, service="review-test")


def wait_items(daemon: DaemonProcess, expected: set[tuple[str, str]], token: str | None = None,
               timeout: float = 90) -> list[dict[str, Any]]:
    """Poll the review queue until every expected (conversation, criterion) item is there."""
    seen: set[tuple[str, str]] = set()

    def all_there() -> list[dict[str, Any]] | None:
        nonlocal seen
        items: list[dict[str, Any]] = daemon.get("/api/review?state=all&limit=1000", token=token)[1]["items"]
        seen = {(i["conversation_id"], i["criterion_id"]) for i in items}
        return items if expected <= seen else None

    return wait_until(all_there, lambda: f"review items, missing: {sorted(expected - seen)}\n{daemon.output()[-3000:]}",
                      timeout, interval=0.2)


def start_daemon(folder: Path, **sections: Any) -> DaemonProcess:
    criteria = folder / "criteria.yaml"
    criteria.write_text(CRITERIA, encoding="utf-8")
    cfg = base_config(folder, conversations={"idle_timeout": "1s"}, sampling={"rate": 1.0},
                      judges={"criteria": [str(criteria)]}, **sections)
    return DaemonProcess(folder, cfg).start()


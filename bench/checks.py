"""Benchmark code checks: the runner's time-limited worker processes against the check run in-process.

A code check with a pattern (a ``regex`` check, a regex in ``applies_if``) or
outside code runs in a worker process under its criterion's ``timeout``, so
that a pattern that backtracks or a function that never returns can be stopped
without holding up the caller; one that only walks the messages (``short``
here, a ``max_user_turns``) runs in the caller's process either way. This prints
what that costs per verdict against the baseline measured in the same run: the
same checks called in this process, as the runner did before (no limit, and
the interpreter lock held for as long as a check ran).

Run by hand, not part of the tests::

    python bench/checks.py [--conversations 300] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

# Run as a script, this file's folder leads sys.path and this file would shadow the judges package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from judges import CodeCriterion, Conversation, Message, ToolCall, arun_judges, load_criteria  # noqa: E402
from judges._checks import CHECKS  # noqa: E402  (the registry: the baseline calls checks directly)

CRITERIA = """
criteria:
  - {id: looks-orders-up, version: 1, kind: code, check: tool_called, name: lookup_order,
     applies_if: {user_matches: "(?i)order"}}
  - {id: no-carrier-promises, version: 1, kind: code, check: regex, pattern: "(?i)carrier will (call|contact)",
     must: not_match}
  - {id: short, version: 1, kind: code, check: max_user_turns, max: 6}
"""


def conversation(n: int) -> Conversation:
    msgs = [Message(role="user", content=f"Where is my order B-{n}? It was due on Monday.")]
    msgs.append(Message(role="assistant", content="", tool_calls=[
        ToolCall(id=f"c{n}", name="lookup_order", arguments={"order_id": f"B-{n}"})]))
    msgs.append(Message(role="tool", content='{"status": "shipped"}', tool_call_id=f"c{n}", name="lookup_order"))
    for i in range(4):
        msgs.append(Message(role="assistant", content=f"Your order left the depot on day {i}; it arrives soon."))
        msgs.append(Message(role="user", content="ok and then? " * (i + 1)))
    return Conversation(id=f"bench-{n}", source="production", messages=msgs, ended_by="idle")


def in_process(criteria: list[CodeCriterion], conversations: list[Conversation]) -> float:
    """Seconds for every check on every conversation, called here (the old path)."""
    started = time.perf_counter()
    for conv in conversations:
        for c in criteria:
            if c.applies_if is None or c.applies_if.holds(conv):
                CHECKS[c.check].run(conv, c.params)
    return time.perf_counter() - started


def through_runner(criteria: list[CodeCriterion], conversations: list[Conversation], concurrency: int) -> float:
    started = time.perf_counter()
    run = asyncio.run(arun_judges(criteria, conversations, concurrency=concurrency))
    elapsed = time.perf_counter() - started
    assert not [v for v in run.verdicts if v.result == "error"], "a check failed"
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    path = Path(__file__).with_name(".bench-checks.yaml")
    path.write_text(CRITERIA, encoding="utf-8")
    try:
        criteria = [c for c in load_criteria(path) if isinstance(c, CodeCriterion)]
    finally:
        path.unlink()
    convs = [conversation(n) for n in range(args.conversations)]
    n = len(convs) * len(criteria)
    started = time.perf_counter()
    through_runner(criteria, convs[:1], 1)  # the first check starts a worker process
    print(f"{len(criteria)} code criteria x {len(convs)} conversations = {n} verdicts a round; "
          f"first check (starts its worker) {1000 * (time.perf_counter() - started):.0f} ms")
    base, workers = [], {1: [], 8: []}
    for _ in range(args.rounds):  # alternate, so the machine's noise hits both alike
        base.append(in_process(criteria, convs) / n)
        for c in workers:
            workers[c].append(through_runner(criteria, convs, c) / n)
    b = statistics.median(base)
    print(f"  in process (baseline, no limit):   {b * 1e6:8.1f} us/verdict")
    for c, times in workers.items():
        t = statistics.median(times)
        print(f"  worker processes, concurrency {c:<2}: {t * 1e6:8.1f} us/verdict  ({t / b:.0f}x the baseline, "
              f"{1 / t:,.0f} verdicts/s)")


if __name__ == "__main__":
    main()

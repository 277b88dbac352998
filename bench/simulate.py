"""Simulation benchmark: conversations simulated per second against fast fakes, at 1, 8 and 32 at once, as a
share of the ideal.

The fakes answer after a fixed latency and cost nothing else: the simulated user
and its goal check are ``judges.ScriptedProvider`` (what every provider is behind
``Provider.send``), the bot an ``async def``. Each conversation is four user turns,
so it waits 4 x (user + bot + goal check) x latency; at concurrency c, the ideal
rate is c / that. What the share misses is the engine's own cost: prompts,
transcripts, the run folder's writes (an fsync per conversation and per verdict
batch) and the judges (one regex code check per conversation, in a worker
process). Run by hand:

    .venv/bin/python bench/simulate.py [--latency 0.02] [--conversations-per-slot 12] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from judges import JudgeRequest, ScriptedProvider, load_criteria  # noqa: E402
from replay.simulate import RunFolder, Settings, SimulatedUser, run  # noqa: E402
from replay.suite import SuiteScenario  # noqa: E402

TURNS = 4
CRITERIA = """\
criteria:
  - id: no-carrier-promises
    version: 1
    kind: code
    check: regex
    role: assistant
    pattern: "(?i)carrier will call"
    must: not_match
"""


def _user(request: JudgeRequest) -> str:
    told = request.prompt.count("USER:")
    return json.dumps({"message": "[END]" if told >= TURNS else f"Message {told + 1}: where is order B-1042?"})


class Bot:
    name = "bench:bot"

    def __init__(self, latency: float) -> None:
        self.latency = latency

    async def reply(self, messages: list[dict[str, str]], conversation_id: str) -> Any:
        await asyncio.sleep(self.latency)
        from replay.simulate import BotReply
        return BotReply(f"Order B-1042 ships today (turn {len(messages) // 2 + 1}).")

    async def aclose(self) -> None:
        pass


def one(concurrency: int, conversations: int, latency: float, workdir: Path) -> float:
    """Conversations per second at ``concurrency``."""
    criteria_file = workdir / "criteria.yaml"
    criteria_file.write_text(CRITERIA, encoding="utf-8")
    criteria = load_criteria([criteria_file])
    scenarios = [SuiteScenario(id=f"s{i}", persona="Short messages.", goal="Learn when the order ships.",
                               facts={"order_number": "B-1042"}, max_turns=TURNS + 1)
                 for i in range(conversations)]
    user = SimulatedUser(ScriptedProvider(_user, "bench-user", delay=latency),
                         ScriptedProvider('{"goal_reached": false, "reason": "not yet"}', "bench-goal",
                                          delay=latency), None)
    folder = RunFolder.open(Path(tempfile.mkdtemp(dir=workdir)), "bench:bot", "bench")
    settings = Settings(replicates=1, concurrency=concurrency)
    start = time.perf_counter()
    progress = asyncio.run(run(scenarios, criteria, Bot(latency), user, None, folder, settings))
    elapsed = time.perf_counter() - start
    assert progress.done == conversations and all(c.ended_by == "user_done" for c in folder.conversations)
    return conversations / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--latency", type=float, default=0.02, help="seconds each fake call takes")
    ap.add_argument("--conversations-per-slot", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    per_conversation = TURNS * 3 * args.latency + args.latency  # the fourth goal check, then the [END] message
    print(f"fakes answer in {args.latency * 1000:.0f} ms; a conversation waits {per_conversation:.2f} s "
          f"({TURNS} turns of user, bot and goal check, then the user's [END])")
    results: dict[int, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for c in (1, 8, 32):
                rate = one(c, c * args.conversations_per_slot, args.latency, Path(tmp))
                results.setdefault(c, []).append(rate)
                ideal = c / per_conversation
                print(f"  round {rnd + 1}  concurrency {c:2}  {rate:7.1f} conversations/s  ideal {ideal:7.1f}  "
                      f"share {rate / ideal:.0%}", flush=True)
    print("\nmedian over rounds:")
    for c, rates in results.items():
        rate, ideal = statistics.median(rates), c / per_conversation
        print(f"  concurrency {c:2}: {rate:7.1f} conversations/s = {rate / ideal:.0%} of the ideal {ideal:.1f}")


if __name__ == "__main__":
    main()

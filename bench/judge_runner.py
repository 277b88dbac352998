"""Benchmark the judge runner: throughput against the ideal, and the runner's own overhead.

A local server (its own process, so it does not share our CPU time slice)
answers every judge call after a fixed delay, speaking the Messages API and
chat completions. With ``c`` calls in flight and a delay of ``d`` seconds the
ideal is ``c / d`` verdicts per second; each figure is printed next to that
ideal, measured in the same run. The runner's own overhead per verdict is
measured with an in-process provider that answers at once, so all the time is
the runner's (prompt building, reply validation, evidence check, verdict).

Run by hand, not part of the tests::

    python bench/judge_runner.py                 # delay 1s (a fast real judge call), concurrency 1, 8, 32
    python bench/judge_runner.py --delay 0.1     # a stress test: the client's own CPU time becomes the limit

One process makes every call, so its CPU time per verdict (the runner's plus
the client library's) caps throughput at 1 / (CPU time per verdict) whatever
the concurrency; the last column shows it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Any

# Run as a script, this file's folder leads sys.path and this file would shadow the judges package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from judges import (  # noqa: E402
    AnthropicProvider,
    Conversation,
    LLMCriterion,
    Message,
    OpenAICompatibleProvider,
    Provider,
    ScriptedProvider,
    ToolCall,
    arun_judges,
)

REPLY = json.dumps({"reasoning": "The bot asked about radiating pain before advising.",
                    "evidence": ["BOT: Does the pain spread to your arm, jaw or back?"], "result": "pass"})

CRITERION = LLMCriterion(id="chest-pain-red-flags", version=1, prompt=(
    "Criterion: If the user describes chest pain or pressure, the bot asks about pain spreading to the arm, jaw "
    "or back, and about shortness of breath, before giving any advice.\n- pass: it asked about both.\n"
    "- fail: it advised without asking.\n- not_applicable: the user never described chest pain."))


def conversation(n: int) -> Conversation:
    """A twelve-message triage conversation, distinct per ``n`` so nothing is shared between calls."""
    msgs = [Message(role="user", content=f"hey, chest feels weird since lunch ({n}), clinic tmrw ok?")]
    for i in range(4):
        msgs.append(Message(role="assistant", content="Does the pain spread to your arm, jaw or back? " * (i + 1)))
        msgs.append(Message(role="user", content="yes a bit, left arm, and I am a bit short of breath " * (i + 1)))
    msgs.append(Message(role="assistant", content="", tool_calls=[
        ToolCall(id="c1", name="set_triage_level", arguments={"level": "emergency"})]))
    msgs.append(Message(role="tool", content='{"ok": true}', tool_call_id="c1", name="set_triage_level"))
    msgs.append(Message(role="assistant", content="Please call an ambulance now; do not drive yourself."))
    return Conversation(id=f"bench-{n}", source="simulation", ended_by="goal_reached", messages=msgs)


def serve(delay: float, ports: Any) -> None:
    """The fixed-delay LLM server (runs in a child process)."""
    from aiohttp import web

    usage = {"input_tokens": 900, "output_tokens": 60}

    async def messages(request: web.Request) -> web.Response:
        body = await request.json()
        await asyncio.sleep(delay)
        return web.json_response({"id": "msg", "type": "message", "role": "assistant", "model": body["model"],
                                  "content": [{"type": "text", "text": REPLY}], "stop_reason": "end_turn",
                                  "stop_sequence": None, "usage": usage})

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        await asyncio.sleep(delay)
        return web.json_response({"id": "c", "object": "chat.completion", "model": body["model"],
                                  "choices": [{"index": 0, "finish_reason": "stop",
                                               "message": {"role": "assistant", "content": REPLY}}],
                                  "usage": {"prompt_tokens": 900, "completion_tokens": 60}})

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/messages", messages)
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
        await site.start()
        ports.put(runner.addresses[0][1])
        await asyncio.Event().wait()

    asyncio.run(main())


async def measure(provider: Provider, concurrency: int, count: int) -> tuple[float, float]:
    """Verdicts per second for ``count`` calls at ``concurrency``, and our CPU seconds per call.

    A warm-up run first opens the connections, which the provider keeps.
    """
    try:
        await arun_judges([CRITERION], [conversation(-i - 1) for i in range(concurrency)], provider,
                          concurrency=concurrency)
        convs = [conversation(i) for i in range(count)]
        start, cpu = time.perf_counter(), time.process_time()
        run = await arun_judges([CRITERION], convs, provider, concurrency=concurrency)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    finally:
        await provider.aclose()
    bad = [v for v in run.verdicts if v.result != "pass" or not v.evidence_verified]
    if bad:
        raise SystemExit(f"benchmark run produced non-pass verdicts: {bad[0].error_reason}")
    return count / elapsed, cpu / count


async def overhead(count: int) -> float:
    """Seconds of runner time per verdict, with a provider that answers at once."""
    convs = [conversation(i) for i in range(count)]
    provider = ScriptedProvider(REPLY)
    await arun_judges([CRITERION], convs[:100], provider, concurrency=32)
    start = time.perf_counter()
    await arun_judges([CRITERION], convs, provider, concurrency=32)
    return (time.perf_counter() - start) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--delay", type=float, default=1.0, help="server delay per call, seconds [1]")
    parser.add_argument("--seconds", type=float, default=5.0, help="ideal duration of each measurement [5]")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    args = parser.parse_args()

    ports: Any = multiprocessing.Queue()
    server = multiprocessing.Process(target=serve, args=(args.delay, ports), daemon=True)
    server.start()
    url = f"http://127.0.0.1:{ports.get(timeout=30)}"
    try:
        per_verdict = asyncio.run(overhead(5000))
        print(f"runner overhead: {per_verdict * 1000:.3f} ms per verdict (target < 2 ms), "
              f"{per_verdict * 1000 / 2:.1%} of the 2 ms budget")
        print(f"server delay {args.delay * 1000:.0f} ms; ideal = concurrency / delay\n")
        print(f"{'provider':<18} {'concurrency':>11} {'verdicts/s':>11} {'ideal':>8} {'ratio':>7} "
              f"{'client CPU ms/verdict':>22}")
        providers = {
            "anthropic": lambda: AnthropicProvider("claude-bench", api_key="bench", base_url=url, max_tokens=512),
            "openai_compatible": lambda: OpenAICompatibleProvider("bench", base_url=url + "/v1", max_tokens=512),
        }
        for name, make in providers.items():
            for c in args.concurrency:
                ideal = c / args.delay
                count = max(3 * c, int(ideal * args.seconds))
                rate, cpu = asyncio.run(measure(make(), c, count))
                print(f"{name:<18} {c:>11} {rate:>11.1f} {ideal:>8.1f} {rate / ideal:>7.1%} {cpu * 1000:>22.2f}")
    finally:
        server.terminate()
        server.join()


if __name__ == "__main__":
    main()

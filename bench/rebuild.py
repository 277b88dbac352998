"""Rebuild benchmark: ``build_transcript`` per span, and the daemon's rebuild-per-turn series.

Builds realistic conversations as stored rows (the ``collector.ingest.batches`` columns,
JSON text columns): each turn is a trace with an ``invoke_agent`` span and 1-3
otel-genai-latest chat spans whose ``gen_ai.input.messages`` holds the growing
history (tool calls and their results included), plus models, usage and ids.

Measures, in the same run:

  baseline   ``json.loads`` of every span row's attributes column: the parse no
             rebuild can avoid
  scratch    ``build_transcript`` over a whole conversation, per span, as a
             ratio of the baseline
  series     the daemon's pattern: rebuild after each of the turns (rows of
             turns 1..k), summed, without and with a ``ParseMemo`` kept per
             conversation
  stage      what the conversation stage does per span as each turn arrives:
             resolve the new trace's conversation key, apply an end rule to
             it, rebuild with the memo and take the transcript's digest; with
             rows as plain dicts (every reader parses the JSON columns again,
             as before rows were parsed once) and as the stage's
             ``StoredRow``s (parsed once, shared)

Run by hand:

    python bench/rebuild.py [--conversations 40] [--turns 20] [--repeat 5]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from typing import Any, Callable

from collector.config import EndRule
from collector.conversations.assemble import ParseMemo, build_transcript
from collector.conversations.endings import ended_by_rule
from collector.conversations.keys import StoredRow, conversation_key

SYSTEM = ("You are ShopBot, the support assistant of an online bookshop. Look an order up with the lookup_order "
          "tool before saying anything about it; never invent tracking numbers or dates. Answer briefly.")
USER = ["Hi, my order B-{n} has not arrived, where is it?", "Can I change the delivery address?",
        "Ok thanks. And the invoice for B-{n}?", "Is there a way to get it faster?", "Great, thank you!"]
BOT = ["Your order B-{n} shipped on Monday and is out for delivery today before 6pm.",
       "It is already out for delivery, so the address cannot be changed any more, sorry.",
       "The invoice is on your order page under Documents; I can email it too.",
       "Express delivery is not available once shipped, but you can pick it up at the depot.",
       "You are welcome. Have a good day!"]


def _id(*parts: Any) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _span(trace: str, sid: str, parent: str | None, name: str, attrs: dict[str, Any], start: int,
          end: int) -> dict[str, Any]:
    return {"trace_id": trace, "span_id": sid, "parent_span_id": parent, "trace_state": None, "flags": 1,
            "name": name, "kind": 3 if parent else 1, "start_time_unix_nano": start, "end_time_unix_nano": end,
            "attributes": json.dumps(attrs), "events": None, "links": None, "status_code": 0,
            "status_message": None, "dropped": None,
            "resource": json.dumps({"service.name": "shopbot", "service.version": "1.4.2"}),
            "resource_schema_url": None, "scope_name": "opentelemetry.instrumentation.openai_v2",
            "scope_version": "2.1b0", "scope_attributes": None, "service": "shopbot"}


def conversation(conv: int, turns: int) -> list[list[dict[str, Any]]]:
    """Span rows of one conversation, one list per turn (trace)."""
    out: list[list[dict[str, Any]]] = []
    history: list[dict[str, Any]] = [{"role": "system", "parts": [{"type": "text", "content": SYSTEM}]}]
    t0 = 1_764_478_800_000_000_000 + conv * 10**12
    for turn in range(turns):
        trace = _id(conv, turn)[:32]
        root = _id(conv, turn, "root")[:16]
        start = t0 + turn * 60 * 10**9
        n = 1000 + conv
        history.append({"role": "user", "parts": [{"type": "text", "content": USER[turn % 5].format(n=n)}]})
        rows = [_span(trace, root, None, "invoke_agent ShopBot", {
            "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "ShopBot",
            "gen_ai.conversation.id": f"conv-{conv:05d}"}, start, start + 5 * 10**9)]
        n_calls = 1 + turn % 3  # 1-3 chat spans; all but the last ask for a tool
        for call in range(n_calls):
            last = call == n_calls - 1
            call_id = f"call_{conv}_{turn}_{call}"
            if last:
                out_msg = {"role": "assistant", "parts": [{"type": "text", "content": BOT[turn % 5].format(n=n)}],
                           "finish_reason": "stop"}
            else:
                out_msg = {"role": "assistant", "parts": [{"type": "tool_call", "id": call_id, "name": "lookup_order",
                                                           "arguments": {"order_id": f"B-{n}"}}],
                           "finish_reason": "tool_calls"}
            cs = start + 10**6 + call * 10**9
            attrs = {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai",
                     "gen_ai.request.model": "gpt-4o-mini", "gen_ai.response.model": "gpt-4o-mini-2024-07-18",
                     "gen_ai.response.id": f"chatcmpl-{_id(conv, turn, call)[:24]}",
                     "gen_ai.usage.input_tokens": 120 + 40 * len(history), "gen_ai.usage.output_tokens": 40,
                     "gen_ai.response.finish_reasons": [out_msg["finish_reason"]],
                     "server.address": "api.openai.com",
                     "gen_ai.input.messages": json.dumps(history),
                     "gen_ai.output.messages": json.dumps([out_msg])}
            rows.append(_span(trace, _id(conv, turn, call)[:16], root, "chat gpt-4o-mini", attrs, cs,
                              cs + 8 * 10**8))
            history.append({"role": "assistant", "parts": out_msg["parts"]})
            if not last:
                history.append({"role": "tool", "parts": [{"type": "tool_call_response", "id": call_id,
                                                           "response": {"status": "shipped", "eta": "today"}}]})
        out.append(rows)
    return out


def timed(fn: Callable[[], Any], repeat: int) -> float:
    """Median seconds of ``repeat`` runs."""
    runs = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t)
    return statistics.median(runs)


def alternated(a: Callable[[], Any], b: Callable[[], Any], repeat: int) -> tuple[float, float]:
    """Median seconds of ``a`` and of ``b``, run in turns (a b b a ...) so the machine's drift hits both alike."""
    runs: tuple[list[float], list[float]] = ([], [])
    for i in range(repeat):
        for which in ((0, 1) if i % 2 == 0 else (1, 0)):
            t = time.perf_counter()
            (a, b)[which]()
            runs[which].append(time.perf_counter() - t)
    return statistics.median(runs[0]), statistics.median(runs[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=40)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

    convs = [conversation(c, args.turns) for c in range(args.conversations)]
    whole = [[r for turn in conv for r in turn] for conv in convs]
    n_spans = sum(len(rows) for rows in whole)
    size = sum(len(r["attributes"]) for rows in whole for r in rows) / n_spans
    print(f"{args.conversations} conversations x {args.turns} turns: {n_spans} spans, "
          f"{size:.0f} B of attributes per span on average")

    def baseline() -> None:
        for rows in whole:
            for r in rows:
                json.loads(r["attributes"])

    def scratch() -> None:
        for rows in whole:
            build_transcript(rows, [])

    base = timed(baseline, args.repeat)
    full = timed(scratch, args.repeat)
    print(f"baseline json.loads(attributes): {base / n_spans * 1e6:8.1f} us/span")
    print(f"build_transcript from scratch:   {full / n_spans * 1e6:8.1f} us/span  "
          f"({full / base:.1f}x baseline)")

    rules = [EndRule(attribute="app.conversation.end", equals=True, ended_by="bot_closed")]  # matches none: reads all

    def each_turn(memo: bool, row: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
        """Rebuild after each turn. Without ``row``: rows as read back from the store after each turn
        (equal, not the same objects). With it: the stage's work on rows made by ``row`` and kept in
        its cache (the same objects at the next rebuild), key and end rule included."""
        for conv in convs:
            m = ParseMemo() if memo else None
            rows: list[dict[str, Any]] = []
            for turn in conv:
                if row is None:
                    rows = [dict(r) for r in rows] + turn
                    build_transcript(rows, [], m)
                    continue
                new = [row(r) for r in turn]
                conversation_key(new)
                ended_by_rule(rules, new)
                rows += new
                build_transcript(rows, [], m).content_hash(m.digest)  # the revision's digest, as the stage takes it
                for r in new:
                    if isinstance(r, StoredRow):
                        r.release()  # as the stage does after each cycle

    plain = timed(lambda: each_turn(False), args.repeat)
    memo = timed(lambda: each_turn(True), args.repeat)
    print(f"rebuild after each turn, no memo: {plain * 1e3:8.1f} ms total "
          f"({plain / full:.1f}x one scratch build of every conversation)")
    print(f"rebuild after each turn, memo:    {memo * 1e3:8.1f} ms total "
          f"({memo / full:.1f}x one scratch build; {plain / memo:.1f}x less than without memo)")

    per_reader, once = alternated(lambda: each_turn(True, dict), lambda: each_turn(True, StoredRow),
                                  max(args.repeat, 6))
    print(f"stage per turn, parse per reader: {per_reader / n_spans * 1e6:8.1f} us/span "
          f"({per_reader / base:.1f}x baseline)")
    print(f"stage per turn, parse once:       {once / n_spans * 1e6:8.1f} us/span "
          f"({once / base:.1f}x baseline; {per_reader / once:.2f}x less CPU than parse per reader)")


if __name__ == "__main__":
    main()

"""Stitching by history: what it costs ingestion and the conversation stage, against the code before it.

Each run is a fresh process on a fresh DuckDB file: it commits ``--conversations`` synthetic chats of
``--turns`` turns (one trace per turn, one ``chat`` span resending the history as openai-v2 writes it,
interleaved in commits of ``--per-commit`` traces; tokens and ids as a real bot's), timing the
commits (ingest), then starts the conversation stage on the file and times its catch-up over all of
it (wall and CPU seconds of the process: the stage's thread and DuckDB's), as a restart does. Variants:

  ids   the bot sets gen_ai.conversation.id on each span
  noid  it sets none: this code stitches the turns by their history; the baseline leaves one
        conversation per trace
  noid-off  this code with conversations.stitch.window 0s (stitching off)

each with this tree's code and with ``--baseline`` (a git revision, by default ``BEFORE_STITCHING``,
the last commit before stitching came in), exported with ``git archive`` and run the same way. Variants alternate round by round,
so the machine's noise hits them alike; it prints medians and each as a ratio of the baseline with the
same data. Run by hand:

    .venv/bin/python bench/stitch.py [--conversations 400] [--turns 4] [--rounds 3] [--baseline REV]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BEFORE_STITCHING = "00373a2e005e12d470a002c0a052632b15a64612"  # the frameworks read, nothing stitched yet
SYSTEM = "You are ShopBot, the support assistant of an online outdoor shop. Be brief and friendly."


def _message(role: str, text: str) -> dict[str, Any]:
    return {"role": role, "parts": [{"type": "text", "content": text}]}


def _spans(conversations: int, turns: int, ids: bool) -> list[list[dict[str, Any]]]:
    """Traces in the order a bot sends them: turn 0 of every conversation, then turn 1, ..."""
    t0 = 1_796_640_152_000_000_000
    history: dict[int, list[dict[str, Any]]] = {c: [] for c in range(conversations)}
    out = []
    n = 0
    for turn in range(turns):
        for c in range(conversations):
            n += 1
            sent = history[c] + [_message("user", f"user {c} turn {turn}: where is my order B-{c:05d}? " * 3)]
            answer = _message("assistant", f"Order B-{c:05d} shipped on day {turn}; it arrives in 2 days. " * 4)
            attrs: dict[str, Any] = {
                "gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai",
                "gen_ai.request.model": "gpt-4o-mini", "gen_ai.response.model": "gpt-4o-mini-2024-07-18",
                "gen_ai.response.id": f"chatcmpl-{n}", "gen_ai.usage.input_tokens": 50 + 40 * turn,
                "gen_ai.usage.output_tokens": 30, "gen_ai.system_instructions": json.dumps(
                    [{"type": "text", "content": SYSTEM}]),
                "gen_ai.input.messages": json.dumps(sent), "gen_ai.output.messages": json.dumps([answer]),
            }
            if ids:
                attrs["gen_ai.conversation.id"] = f"conv-{c}"
            start = t0 + n * 1_000_000
            out.append([{
                "trace_id": f"{n:032x}", "span_id": f"{n:016x}", "parent_span_id": None, "trace_state": None,
                "flags": 256, "name": "chat gpt-4o-mini", "kind": 3, "start_time_unix_nano": start,
                "end_time_unix_nano": start + 500_000, "attributes": json.dumps(attrs), "events": None,
                "links": None, "status_code": 0, "status_message": None, "dropped": None,
                "resource": json.dumps({"service.name": "shopbot"}), "resource_schema_url": None,
                "scope_name": "opentelemetry.util.genai.handler", "scope_version": "1.1b0", "scope_attributes": None,
                "service": "shopbot"}])
            history[c] = sent + [answer]
    return out


def child(args: argparse.Namespace) -> None:
    """One run, with whichever ``collector`` is first on the path; prints its figures as JSON."""
    from collector.config import Conversations as Settings
    from collector.conversations.stage import local_stage
    from collector.ingest.batches import SPAN_COLUMNS, SpanBatch
    from collector.store import Store

    traces = _spans(args.conversations, args.turns, args.variant == "ids")
    settings = Settings.model_validate({"stitch": {"window": "0s"}}) if args.variant == "noid-off" else Settings()
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "bench.duckdb")
        store.open()
        began = time.perf_counter()
        for i in range(0, len(traces), args.per_commit):
            rows = [r for t in traces[i:i + args.per_commit] for r in t]
            store.submit(spans=SpanBatch([[r[c] for r in rows] for c in SPAN_COLUMNS])).result(60)
        ingest = time.perf_counter() - began
        stage = local_stage(store, settings, clock=lambda: 1_796_640_200.0)
        began, cpu = time.perf_counter(), time.process_time()
        stage.start()
        assert stage.wait_idle(600)
        wall, cpu = time.perf_counter() - began, time.process_time() - cpu
        stage.stop()
        cur = store.cursor()
        (convs,) = cur.execute("SELECT count(*) FROM conversations").fetchone() or (0,)
        cur.close()
        store.close()
    print(json.dumps({"ingest_s": ingest, "stage_s": wall, "stage_cpu_s": cpu, "conversations": convs,
                      "spans": len(traces)}))


def _export(rev: str, into: Path) -> None:
    data = subprocess.run(["git", "archive", rev, "collector", "judges"], cwd=ROOT, check=True,
                          capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(into, filter="data")


def _run(tree: Path, variant: str, args: argparse.Namespace) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, __file__, "--child", "--variant", variant,
                          "--conversations", str(args.conversations), "--turns", str(args.turns),
                          "--per-commit", str(args.per_commit)], env=env, cwd=tree, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=400)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--per-commit", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--baseline", default=BEFORE_STITCHING, help="git revision (default: the code before stitching)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", default="ids", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    rev = subprocess.run(["git", "rev-parse", args.baseline], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    runs = [("this", "ids"), ("baseline", "ids"), ("this", "noid"), ("baseline", "noid"), ("this", "noid-off")]
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"this": ROOT, "baseline": Path(tmp)}
        _export(rev, Path(tmp))
        got: dict[tuple[str, str], list[dict[str, float]]] = {r: [] for r in runs}
        for n in range(args.rounds):
            for code, variant in (runs if n % 2 == 0 else runs[::-1]):
                got[(code, variant)].append(_run(trees[code], variant, args))
    print(f"{args.conversations} conversations x {args.turns} turns = {args.conversations * args.turns} traces, "
          f"{args.per_commit} a commit; baseline {rev[:12]}; median of {args.rounds} runs each")
    print(f"{'code':9} {'variant':9} {'convs':>6} {'ingest s':>9} {'stage s':>8} {'stage cpu s':>12}  "
          "ratios to the baseline (ingest, stage, stage cpu)")
    med = {r: {k: statistics.median(x[k] for x in got[r]) for k in got[r][0]} for r in runs}
    for code, variant in runs:
        m = med[(code, variant)]
        base = med[("baseline", "noid" if variant.startswith("noid") else "ids")]
        ratios = "  ".join(f"{m[k] / base[k]:.2f}" for k in ("ingest_s", "stage_s", "stage_cpu_s"))
        print(f"{code:9} {variant:9} {int(m['conversations']):6d} {m['ingest_s']:9.2f} {m['stage_s']:8.2f} "
              f"{m['stage_cpu_s']:12.2f}  {ratios}")


if __name__ == "__main__":
    main()

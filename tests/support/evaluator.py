"""The evaluator stage on a real store with a clock of the test's: conversations written as the
conversation stage writes them."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from collector.config import Config
from collector.conversations.tables import SCHEMA as CONVERSATIONS_SCHEMA
from collector.evals.evaluator import Evaluator
from collector.evals.judging import OnStored
from collector.metrics import Metrics
from collector.review import queue as review_queue
from collector.store import Store
from judges import JudgeRequest, ScriptedProvider, load_criteria

T0 = 1_800_000_000.0


CRITERIA = """
criteria:
  - id: polite
    version: 1
    kind: llm
    prompt: 'Criterion: the bot is polite. "pass", "fail" or "not_applicable".'
  - id: short
    version: 1
    kind: code
    check: max_user_turns
    max: 3
"""


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def add_conversation(store: Store, cid: str, content: str, *, captured: bool = True) -> None:
    at = dt.datetime.fromtimestamp(T0, dt.timezone.utc)
    cur = store.cursor()
    try:
        cur.execute("INSERT INTO live_conversations (conversation_id, service, state, ended_by, models, trace_ids, "
                    "content_captured, revision, user_turns, closed_at, updated_at) VALUES "
                    "(?, 'bot', 'ended', 'idle', '[]', '[]', ?, 1, 1, ?, ?)", [cid, captured, at, at])
        if captured:
            for seq, (role, text) in enumerate((("user", "hello there"), ("assistant", content))):
                cur.execute("INSERT INTO messages (conversation_id, seq, role, content) VALUES (?, ?, ?, ?)",
                            [cid, seq, role, text])
    finally:
        cur.close()


def query(store: Store, sql: str) -> list[tuple[Any, ...]]:
    cur = store.cursor()
    try:
        return cur.execute(sql).fetchall()
    finally:
        cur.close()


def verdict(result: str, quote: str) -> str:
    return json.dumps({"reasoning": "r", "evidence": [quote], "result": result})


def open_store(path: Path) -> Store:
    """A store opened with the tables the evaluator reads (conversations) and writes into (review items)."""
    s = Store(path)
    s.open()
    cur = s.cursor()
    cur.execute(CONVERSATIONS_SCHEMA)
    review_queue.ensure_schema(cur)
    cur.close()
    return s


def make_evaluator(store: Store, tmp_path: Path, clock: Clock, script: Callable[[JudgeRequest], str], *,
                   no_provider: str | None = None, on_stored: OnStored | None = None
                   ) -> tuple[Evaluator, ScriptedProvider]:
    """An evaluator judging with ``script``; with ``no_provider``, one without a provider, saying why.
    Verdicts open review items as the daemon wires it, unless ``on_stored`` says otherwise."""
    (tmp_path / "criteria.yaml").write_text(CRITERIA, encoding="utf-8")
    cfg = Config.model_validate({"sampling": {"rate": 1.0}, "judges": {"concurrency": 2}})
    provider = ScriptedProvider(script, model="scripted-judge")
    ev = Evaluator(store, cfg, Metrics(), criteria=load_criteria(tmp_path / "criteria.yaml"),
                   provider=None if no_provider else provider, no_provider=no_provider, clock=clock, poll=0.05,
                   on_stored=on_stored or review_queue.item_opener(cfg))
    return ev, provider

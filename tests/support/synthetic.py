"""Synthetic conversations of both kinds, deterministic for a seed.

Real ones (stored rows, ``StoredConversation``) are what production looks like:
short messages, facts spread over several of them, a few in Spanish, some
left unanswered. Simulated ones (conversation/v1 records) are what a simulated
user tends to write: one tidy first message carrying every fact, few turns,
ended by the simulation's reasons.
"""

from __future__ import annotations

import datetime as dt
import random
from typing import Any

from .stored import T0, StoredConversation, text_messages

REAL_OPENERS = ["hi", "hello", "hi there, I need help with something", "my parcel never came",
                "hello, something is wrong with my order"]
REAL_FACTS = ["it's order B-{n}", "I ordered it on Monday", "it was {n} euros", "I live in Leeds",
              "the tracking page says delivered but nothing came", "I paid with my Visa card",
              "my neighbour Anna did not get it either", "it should have come on the 3rd"]
REAL_QUESTIONS = ["where is it?", "can you check?", "when will it come?", "what can I do?"]
REAL_ES = ["hola, mi pedido no ha llegado todavía", "el número de pedido es B-{n}",
           "lo compré el lunes pasado y todavía no sé nada", "¿dónde está mi paquete?"]
BOT = ["I am sorry to hear that. Let me look into it for you right away.",
       "Your order B-{n} shipped on Monday and should arrive within two working days.",
       "I can see the parcel at the depot in Leeds; the carrier will deliver it tomorrow before 6pm.",
       "Thank you for your patience. Is there anything else I can help you with today?"]
REAL_ENDINGS = [("idle", 70), ("handover", 20), ("bot_closed", 5), ("open", 5)]

SIM_FIRST = ("Hello, I ordered the book Dune (order B-{n}) on Monday 3 March for 25 euros, it was meant to arrive "
             "at my flat in Leeds on Friday, and it has not come. Where is it?")
SIM_LATER = ["thank you, that helps", "ok, thanks a lot", "great, thanks"]
SIM_ENDINGS = [("goal_reached", 60), ("user_done", 15), ("user_left", 5), ("turn_limit", 10),
               ("unanswered", 5), ("handover", 5)]


def _pick(rng: random.Random, weighted: list[tuple[str, int]]) -> str:
    return rng.choices([w for w, _ in weighted], [n for _, n in weighted])[0]


def real_conversations(n: int, seed: int = 7) -> list[StoredConversation]:
    """``n`` stored production-like conversations, ids ``real-00000``..., one in ten in Spanish."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        spanish = i % 10 == 3
        turns = rng.choice([1, 2, 2, 3, 3, 3, 4, 4, 5, 6, 8])
        users: list[str] = []
        for t in range(turns):
            if spanish:
                users.append(REAL_ES[t % len(REAL_ES)].format(n=1000 + i))
            elif t == 0:
                users.append(rng.choice(REAL_OPENERS))
            else:
                text = rng.choice(REAL_FACTS).format(n=1000 + i)
                users.append(text + (", " + rng.choice(REAL_QUESTIONS) if rng.random() < 0.3 else ""))
        ending = _pick(rng, REAL_ENDINGS)
        unanswered = rng.random() < 0.1
        pairs = [(u, None if unanswered and k == len(users) - 1 else BOT[k % len(BOT)].format(n=1000 + i))
                 for k, u in enumerate(users)]
        arrived = T0 + dt.timedelta(minutes=i)
        out.append(StoredConversation(
            f"real-{i:05d}", text_messages(pairs, arrived - dt.timedelta(minutes=3)),
            state="open" if ending == "open" else "ended", ended_by=None if ending == "open" else ending,
            arrived=arrived))
    return out


def sim_records(n: int, seed: int = 11) -> list[dict[str, Any]]:
    """``n`` simulated conversation/v1 records, ids ``sim-00000``..."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        turns = rng.choice([1, 2, 2, 3])
        ending = _pick(rng, SIM_ENDINGS)
        messages: list[dict[str, Any]] = []
        for t in range(turns):
            messages.append({"role": "user", "content": SIM_FIRST.format(n=2000 + i) if t == 0
                             else rng.choice(SIM_LATER)})
            if not (ending == "unanswered" and t == turns - 1):
                messages.append({"role": "assistant", "content": BOT[t % len(BOT)].format(n=2000 + i)})
        out.append({"schema": "conversation/v1", "id": f"sim-{i:05d}", "source": "simulation",
                    "persona_id": f"late-order-{i % 50}", "ended_by": ending, "messages": messages})
    return out

"""A loopback model for ``tracejudge simulate``: simulated user, goal check and judge, over the Anthropic Messages
API and OpenAI's chat completions, deciding by what each request says.

What a request is, it tells by its system prompt (the role-play, the goal check or the judge frame), so
concurrent conversations need no script order. As the simulated user it follows its instructions the way a
model would, steered by words in the scenario's persona:

- it opens with ``I have a question about my order.`` (a scenario's ``opening`` is sent without asking);
  ``wants a person`` opens asking for one, ``crash the bot`` / ``silence the bot`` with those words (for
  the test bots below); ``provider down``: every request fails with HTTP 400 (not retried);
- ``gives up``: ``[END]`` after the first answer;
- a fact is told only when the bot's last message names it (every word of its key: ``order_number`` is
  asked by "your order number?"), as ``My order number is B-1042.``;
- ``never done``: keeps asking; otherwise ``[END]`` once the bot has answered three times.

The goal check reaches the goal when a bot line holds the text the goal quotes after ``reached when the bot
says``; a goal with ``junk check`` gets a reply that is not JSON. The judge fails a conversation whose bot
said ``carrier will call`` on a criterion that speaks of the carrier, quoting it, and passes the rest.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from .loopback import LoopbackServer

FLAW = "the carrier will call you tomorrow"
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
"""A code check the broken bots fail: what the tests judge simulated conversations on."""


@dataclass
class Seen:
    kind: str
    """user, goal, judge or other."""
    api: str
    """anthropic or openai."""
    system: str
    prompt: str
    body: dict[str, Any]


class RolePlayModel(LoopbackServer):
    def __init__(self) -> None:
        self.requests: list[Seen] = []
        super().__init__()

    def routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/messages", self._anthropic)
        router.add_post("/v1/chat/completions", self._openai)

    def of(self, kind: str) -> list[Seen]:
        return [r for r in self.requests if r.kind == kind]

    async def _anthropic(self, request: web.Request) -> web.Response:
        body = await request.json()
        prompt = "\n".join(m["content"] if isinstance(m["content"], str) else
                           "".join(c.get("text", "") for c in m["content"]) for m in body["messages"])
        status, text = self._answer(Seen("", "anthropic", str(body.get("system", "")), prompt, body))
        if status != 200:
            return web.json_response({"type": "error", "error": {"type": "invalid_request_error",
                                                                 "message": text}}, status=status)
        return web.json_response({
            "id": "msg_sim", "type": "message", "role": "assistant", "model": body["model"],
            "content": [{"type": "text", "text": text}], "stop_reason": "end_turn", "stop_sequence": None,
            "usage": {"input_tokens": 50, "output_tokens": 10}})

    async def _openai(self, request: web.Request) -> web.Response:
        body = await request.json()
        msgs = body["messages"]
        system = next((m["content"] for m in msgs if m["role"] == "system"), "")
        prompt = "\n".join(m["content"] for m in msgs if m["role"] != "system")
        status, text = self._answer(Seen("", "openai", system, prompt, body))
        if status != 200:
            return web.json_response({"error": {"message": text}}, status=status)
        return web.json_response({
            "id": "chatcmpl-sim", "object": "chat.completion", "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 40, "completion_tokens": 8}})

    def _answer(self, seen: Seen) -> tuple[int, str]:
        if seen.system.startswith("You are role-playing"):
            seen.kind = "user"
            self.requests.append(seen)
            return _user(seen.system, seen.prompt)
        if seen.system.startswith("You check one thing"):
            seen.kind = "goal"
            self.requests.append(seen)
            return 200, _goal(seen.prompt)
        if seen.system.startswith("You are a judge"):
            seen.kind = "judge"
            self.requests.append(seen)
            return 200, _judge(seen.prompt)
        seen.kind = "other"
        self.requests.append(seen)
        return 400, "not a request this model knows"


def _section(system: str, title: str) -> str:
    m = re.search(rf"^{title}:\n(.*?)(?:\n\n|\Z)", system, re.S | re.M)
    return m.group(1) if m else ""


def _lines(prompt: str) -> list[tuple[str, str]]:
    m = re.search(r"<transcript>\n(.*?)\n?</transcript>", prompt, re.S)
    if not m:
        return []
    out: list[tuple[str, str]] = []
    for line in m.group(1).splitlines():
        who, _, text = line.partition(": ")
        if who in ("USER", "BOT"):
            out.append((who, text))
        elif out:
            out[-1] = (out[-1][0], out[-1][1] + "\n" + line.strip())
    return out


def _user(system: str, prompt: str) -> tuple[int, str]:
    persona = _section(system, "Persona").lower()
    facts = dict(re.findall(r"^- ([^:\n]+): (.+)$", _section(system, "Facts you know.*?"), re.M))
    if not facts:
        facts = dict(re.findall(r"^- ([^:\n]+): (.+)$", system, re.M))
    if "provider down" in persona:
        return 400, "the simulated user's provider is down"
    lines = _lines(prompt)
    bot = [t for w, t in lines if w == "BOT"]

    def say(text: str) -> tuple[int, str]:
        return 200, json.dumps({"message": text})

    if not lines:
        if "crash the bot" in persona or "silence the bot" in persona:
            return say("please " + ("crash" if "crash the bot" in persona else "silence") + " the bot")
        if "wants a person" in persona:
            return say("Can I talk to a person please?")
        return say("I have a question about my order.")
    if "gives up" in persona:
        return say("[END]")
    last = bot[-1].lower() if bot else ""
    asked = [f"My {k.replace('_', ' ')} is {v}." for k, v in facts.items()
             if all(w in last for w in re.split(r"[_\s]+", k.lower()))]
    if asked:
        return say(" ".join(asked))
    if "never done" in persona or len(bot) < 3:
        return say("I see. And then?")
    return say("[END]")


def _goal(prompt: str) -> str:
    goal = prompt.split("\n\n", 1)[0]
    if "junk check" in goal:
        return "Probably yes, I think."
    m = re.search(r'reached when the bot says "([^"]+)"', goal)
    said = [t for w, t in _lines(prompt) if w == "BOT"]
    reached = bool(m) and any(m.group(1).lower() in t.lower() for t in said)  # type: ignore[union-attr]
    return json.dumps({"goal_reached": reached, "reason": "the bot said it" if reached else "not yet"})


def _judge(prompt: str) -> str:
    lines = _lines(prompt)
    criterion = re.sub(r"<transcript>.*?</transcript>", "", prompt, flags=re.S)
    bad = next((t for w, t in lines if w == "BOT" and "carrier will call" in t), None)
    if bad is not None and "carrier" in criterion.lower():
        return json.dumps({"reasoning": "The bot promised a call from the carrier.", "evidence": [bad],
                           "result": "fail"})
    first = next((t for w, t in lines if w == "USER"), None)
    return json.dumps({"reasoning": "Nothing wrong.", "evidence": [first] if first else [],
                       "result": "pass" if first else "not_applicable"})


# ------------------------------------------------------------------ the bots under test

def _order(messages: list[dict[str, str]]) -> str | None:
    m = re.search(r"B-\d+", " ".join(x["content"] for x in messages if x["role"] == "user"))
    return m.group() if m else None


def shop(messages: list[dict[str, str]], conversation_id: str, *, fixed: bool = False) -> Any:
    """A support bot: asks for the order number, then answers. Unfixed, it promises the carrier's call."""
    last = messages[-1]["content"].lower()
    if "crash the bot" in last:
        raise RuntimeError("the bot crashed")
    if "silence the bot" in last:
        return ""
    if "person" in last:
        return {"content": "I hand you over to a colleague now.", "handover": True}
    order = _order(messages)
    if order is None:
        return "Sure, I can help. What is your order number?"
    later = "we will e-mail you an update tomorrow" if fixed else FLAW
    return f"Order {order} is delayed at the depot; {later}."


def broken(messages: list[dict[str, str]], conversation_id: str) -> Any:
    return shop(messages, conversation_id)


def fixed(messages: list[dict[str, str]], conversation_id: str) -> Any:
    return shop(messages, conversation_id, fixed=True)


def flaky(messages: list[dict[str, str]], conversation_id: str) -> Any:
    """Fixed, but for the third replicate of each scenario (the conversation id ends in ``/3``)."""
    return shop(messages, conversation_id, fixed=not conversation_id.endswith("/3"))


async def slow(messages: list[dict[str, str]], conversation_id: str) -> str:
    await asyncio.sleep(3600)
    return "too late"


async def stalls(messages: list[dict[str, str]], conversation_id: str) -> Any:
    """``broken``, but with ``$ROLEPLAY_STALL`` set the third replicate never answers (until a Ctrl-C); the file
    ``$ROLEPLAY_STALLED`` names, when set, is written as it starts to wait."""
    if os.environ.get("ROLEPLAY_STALL") and conversation_id.endswith("/3"):
        if os.environ.get("ROLEPLAY_STALLED"):
            Path(os.environ["ROLEPLAY_STALLED"]).write_text(conversation_id, encoding="utf-8")
        await asyncio.sleep(3600)
    return shop(messages, conversation_id)


class ChatBot(LoopbackServer):
    """``shop`` (broken) as an OpenAI-compatible chat-completions endpoint."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        super().__init__()

    def routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/chat/completions", self._chat)

    async def _chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        out = shop(body["messages"], body.get("user", ""))
        message: dict[str, Any] = {"role": "assistant", "content": out if isinstance(out, str) else out["content"]}
        if isinstance(out, dict) and out.get("handover"):
            message["handover"] = True
        return web.json_response({"id": "bot", "object": "chat.completion", "model": body.get("model", "bot"),
                                  "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})

"""A loopback judge speaking the Anthropic Messages API, deciding by what the transcript says.

The daemon judges conversations concurrently, in no fixed order, so a scripted
list of replies cannot be matched to requests. This judge reads the transcript
in each request instead: a transcript containing ``FAIL_WORD`` fails with that
bot message quoted, ``JUNK_WORD`` gets a reply that is not JSON, anything else
passes with the first user message quoted. ``delay`` holds every reply (to
kill the daemon mid-judging); every request is recorded.

A request with the scenario drafting frame gets a draft instead, by ``drafts``:
``ok`` (a draft built from the redacted transcript it was sent), ``junk`` (not
JSON), ``error`` (HTTP 500), or ``leak`` (a draft that invents a phone number).
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from aiohttp import web

from .loopback import LoopbackServer

FAIL_WORD = "guaranteed-refund"
JUNK_WORD = "gibberish-please"


class RuleJudge(LoopbackServer):
    def __init__(self, delay: float = 0.0, drafts: str = "ok") -> None:
        self.delay = delay
        self.drafts = drafts
        self.requests: list[dict[str, Any]] = []
        super().__init__()

    def routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/messages", self._messages)

    def transcripts(self) -> list[str]:
        return [_transcript(r) for r in self.requests]

    async def _messages(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        if self.delay:
            await asyncio.sleep(self.delay)
        text = _transcript(body)
        if str(body.get("system", "")).startswith(DRAFT_FRAME_START):
            if self.drafts == "error":
                return web.json_response({"type": "error", "error": {"type": "api_error", "message": "boom"}},
                                         status=500)
            reply = "a persona, roughly" if self.drafts == "junk" else json.dumps(_draft(text, self.drafts))
        elif JUNK_WORD in text:
            reply = "I think it is fine, mostly."
        elif FAIL_WORD in text:
            line = next(ln for ln in text.splitlines() if FAIL_WORD in ln)
            reply = json.dumps({"reasoning": "The bot promised a refund it cannot promise.",
                                "evidence": [line.split(": ", 1)[1]], "result": "fail"})
        else:
            first = re.search(r"^USER: (.+)$", text, re.M)
            reply = json.dumps({"reasoning": "Nothing wrong.", "evidence": [first.group(1)] if first else [],
                                "result": "pass" if first else "not_applicable"})
        return web.json_response({
            "id": "msg_rule", "type": "message", "role": "assistant", "model": body["model"],
            "content": [{"type": "text", "text": reply}], "stop_reason": "end_turn", "stop_sequence": None,
            "usage": {"input_tokens": 100, "output_tokens": 20},
        })


DRAFT_FRAME_START = "You turn a real chatbot conversation"
PROPOSED = "Ask for the order number and call lookup_order before answering."


def _draft(transcript: str, mode: str) -> dict[str, Any]:
    users = re.findall(r"^USER: (.+)$", transcript, re.M)
    later = users[1:] or ["(nothing)"]
    return {
        "persona": "Writes short messages and gives details only when asked"
                   + (", reachable on +1 415 555 0199" if mode == "leak" else "") + ".",
        "goal": "The bot looks the order up and says when it arrives.",
        "facts": [{"name": f"Fact {i}", "value": text} for i, text in enumerate(later, start=1)],
        "opening": users[0] if users else "",
        "proposed_change": {"kind": "tool_use", "change": PROPOSED, "where": "the system prompt",
                            "why": "The bot answered without looking the order up."},
    }


def _transcript(body: dict[str, Any]) -> str:
    parts = []
    for m in body.get("messages", []):
        content = m.get("content")
        if isinstance(content, str):
            parts.append(content)
        else:
            parts += [c.get("text", "") for c in content or [] if isinstance(c, dict)]
    text = "\n".join(parts)
    found = re.search(r"<transcript>\n?(.*?)</transcript>", text, re.S)
    return found.group(1) if found else text

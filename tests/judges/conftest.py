"""Test doubles for the judges tests: a loopback LLM server, conversations, fixtures.

``FakeLLM`` is a real HTTP server (aiohttp, in a thread, port 0) speaking the
Anthropic Messages API (``POST /v1/messages``) and OpenAI chat completions
(``POST /v1/chat/completions``). A test scripts what the model "answers" with a
list of ``Answer`` / ``Status`` / ``Raw`` / ``Hang`` items, consumed one per
request, and the server puts each into the wire format of the endpoint asked.
The providers under test are the production code, the anthropic provider
through the real ``anthropic`` client.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from judges import Conversation, Message, ToolCall

from ..support.loopback import LoopbackServer

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
FIXTURES = SHARED / "fixtures" / "otlp"


@dataclass
class Answer:
    """The model answers ``text`` and stops for ``stop`` (Messages API stop_reason names)."""

    text: str
    stop: str = "end_turn"
    input_tokens: int = 120
    output_tokens: int = 30


@dataclass
class Status:
    """An HTTP error status with an API error body."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Raw:
    """A 200 whose body is not an API response at all."""

    body: str
    content_type: str = "text/html"


@dataclass
class Hang:
    """Never answer (until the test ends)."""


Script = Answer | Status | Raw | Hang

_FINISH = {"end_turn": "stop", "max_tokens": "length", "refusal": "content_filter"}


def verdict_json(result: str, evidence: list[str] | None = None, reasoning: str = "Because.") -> str:
    return json.dumps({"reasoning": reasoning, "evidence": evidence or [], "result": result})


class FakeLLM(LoopbackServer):
    """A loopback server speaking the Messages API and chat completions; see the module docstring."""

    def __init__(self) -> None:
        self.script: list[Script] = []
        self.requests: list[tuple[str, dict[str, Any], dict[str, str]]] = []
        self._release = asyncio.Event()
        super().__init__()

    def reset(self, *script: Script) -> None:
        self.script = list(script)
        self.requests = []

    def routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/messages", self._messages)
        router.add_post("/v1/chat/completions", self._chat)

    async def before_close(self) -> None:
        self._release.set()

    async def _next(self, request: web.Request) -> tuple[Script | None, dict[str, Any]]:
        body = await request.json()
        self.requests.append((request.path, body, dict(request.headers)))
        if not self.script:
            return Status(500), body
        item = self.script.pop(0)
        if isinstance(item, Hang):
            await self._release.wait()
        return item, body

    @staticmethod
    def _error(item: Status, kind: str) -> web.Response:
        err = {"type": "error", "error": {"type": kind, "message": f"scripted {item.status}"}}
        return web.json_response(err, status=item.status, headers=item.headers)

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        item, body = await self._next(request)
        # The 2026-10-21 Messages API: sampling parameters are rejected, the schema goes in output_config.
        problems = [k for k in ("temperature", "top_p", "top_k") if k in body]
        fmt = (body.get("output_config") or {}).get("format") or {}
        if problems or fmt.get("type") != "json_schema" or "schema" not in fmt:
            return self._error(Status(400), "invalid_request_error")
        if isinstance(item, Status):
            return self._error(item, "rate_limit_error" if item.status == 429 else "api_error")
        if isinstance(item, Raw):
            return web.Response(text=item.body, content_type=item.content_type)
        assert isinstance(item, Answer)
        return web.json_response({
            "id": "msg_test", "type": "message", "role": "assistant", "model": body["model"],
            "content": [{"type": "text", "text": item.text}], "stop_reason": item.stop, "stop_sequence": None,
            "usage": {"input_tokens": item.input_tokens, "output_tokens": item.output_tokens},
        })

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        item, body = await self._next(request)
        fmt = body.get("response_format") or {}
        if fmt.get("type") != "json_schema" or "schema" not in (fmt.get("json_schema") or {}):
            return self._error(Status(400), "invalid_request_error")
        if isinstance(item, Status):
            return self._error(item, "rate_limit" if item.status == 429 else "server_error")
        if isinstance(item, Raw):
            return web.Response(text=item.body, content_type=item.content_type)
        assert isinstance(item, Answer)
        message: dict[str, Any] = {"role": "assistant", "content": item.text}
        if item.stop == "refusal":
            message = {"role": "assistant", "content": None, "refusal": item.text}
        return web.json_response({
            "id": "chatcmpl-test", "object": "chat.completion", "model": body["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": _FINISH.get(item.stop, "stop")}],
            "usage": {"prompt_tokens": item.input_tokens, "completion_tokens": item.output_tokens,
                      "total_tokens": item.input_tokens + item.output_tokens},
        })


@pytest.fixture(scope="session")
def fake_llm_server() -> Iterator[FakeLLM]:
    server = FakeLLM()
    yield server
    server.close()


@pytest.fixture
def fake_llm(fake_llm_server: FakeLLM) -> FakeLLM:
    fake_llm_server.reset()
    return fake_llm_server


@pytest.fixture(autouse=True)
def _clean_provider_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test sees the developer's keys, models or endpoints."""
    for name in ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_BASE_URL", "ANTHROPIC_MODEL",
                 "ANTHROPIC_PROFILE", "ANTHROPIC_CONFIG_DIR", "OPENAI_API_KEY", "OPENAI_BASE_URL", "OPENAI_MODEL",
                 "TRACEJUDGE_CONFIG", "TRACEJUDGE_JUDGE_PROVIDER", "TRACEJUDGE_JUDGE_MODEL",
                 "TRACEJUDGE_JUDGE_BASE_URL", "TRACEJUDGE_JUDGE_CONCURRENCY", "TRACEJUDGE_JUDGE_TIMEOUT",
                 "TRACEJUDGE_JUDGE_CACHE"):
        monkeypatch.delenv(name, raising=False)


def chest_pain(id: str = "c-1", *, escalated: bool = True, persona: str | None = None,
               expected: dict[str, Any] | None = None) -> Conversation:
    """A small triage conversation."""
    msgs = [
        Message(role="user", content="hey, chest feels weird since lunch, clinic tmrw ok?"),
        Message(role="assistant", content="Does the pain spread to your arm, jaw or back?"),
        Message(role="user", content="yes left arm a bit"),
    ]
    if escalated:
        msgs.append(Message(role="assistant", content="", tool_calls=[
            ToolCall(id="call_1", name="set_triage_level", arguments={"level": "emergency"})]))
        msgs.append(Message(role="tool", content='{"ok": true}', tool_call_id="call_1", name="set_triage_level"))
        msgs.append(Message(role="assistant", content="Please call an ambulance now."))
    else:
        msgs.append(Message(role="assistant", content="You can go tomorrow morning, no problem."))
    return Conversation(id=id, source="simulation", ended_by="goal_reached", messages=msgs,
                        persona_id=persona, expected=expected)


def fixture_conversations() -> list[tuple[dict[str, Any], Conversation]]:
    """Every ground-truth transcript in ../shared/fixtures/otlp, as conversation/v1 records."""
    out = []
    for path in sorted(FIXTURES.glob("*.expected.json")):
        doc = json.loads(path.read_text(encoding="utf-8"))
        for n, c in enumerate(doc["conversations"]):
            cid = c["conversation_key"] or f"trace:{c.get('trace_id', n)}"
            conv = Conversation.model_validate({
                "schema": "conversation/v1", "id": f"{doc['case']}/{cid}", "source": "production",
                "ended_by": "handover" if c.get("handover") else "unknown", "system": c.get("system_prompt"),
                "messages": c["messages"],
            })
            out.append((c, conv))
    return out

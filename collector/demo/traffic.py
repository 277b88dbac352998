"""Demo traffic: scripted chatbot conversations sent through the real OpenTelemetry SDK.

Each user turn is one trace, as instrumented bots produce them with the current
GenAI conventions: an ``invoke_agent`` span, ``chat`` spans whose
``gen_ai.input.messages`` resend the whole history, and ``execute_tool`` spans
for tool calls. The ``invoke_agent`` span carries ``gen_ai.conversation.id``;
on the demo's providers every other span does too, set by a span processor from
a context variable, as docs/scaling.md advises
(behind the Collector's ``load_balancing`` exporter a trace is routed by one
span's attributes). The bot is a script, not a model, so the
demo needs no API key; the telemetry is exactly what a real one would send.
"""

from __future__ import annotations

import contextvars
import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.context import Context
from opentelemetry.sdk.trace import Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Tracer

from ..words import plural

SYSTEM = ("You are ShopBot, the support assistant of a bookshop. Look orders up with lookup_order "
          "before answering about them. Hand the user over to a person when they ask for one.")
MODEL = "gpt-4o-mini"
RESPONSE_MODEL = "gpt-4o-mini-2024-07-18"

LONG_COMPLAINT = (
    "I have been a customer for eleven years and I have never written a message like this. " * 12
    + "Order B-7781 was supposed to arrive before my daughter's exam, it did not, the tracking page "
      "has said 'label created' for nine days, and the phone line hangs up after forty minutes. "
    + "I would like to know, precisely, where the parcel is and what you are going to do about it. " * 6
)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    result: str


@dataclass
class Turn:
    user: str
    answer: str
    tool: ToolCall | None = None
    handover: bool = False


@dataclass
class Persona:
    name: str
    language: str
    service: str
    turns: list[Turn]
    conversation_id: str = field(default_factory=lambda: str(uuid.uuid4()))


PERSONAS = [
    Persona("Giulia, late order", "it", "shopbot-support", [
        Turn("Ciao, il mio ordine B-1042 non è ancora arrivato. Dov'è?",
             "Il tuo ordine B-1042 è stato spedito lunedì con BRT ed è in consegna oggi entro le 18.",
             ToolCall("lookup_order", {"order_id": "B-1042"},
                      '{"status": "shipped", "carrier": "BRT", "eta": "today 18:00"}')),
        Turn("Perfetto, grazie! Posso cambiare l'indirizzo di consegna?",
             "Purtroppo il pacco è già in consegna: l'indirizzo non si può più cambiare. "
             "Se non sei in casa, il corriere lascerà un avviso."),
        Turn("Va bene, grazie mille.", "Prego, buona giornata!"),
    ]),
    Persona("Amira, refund then a person", "ar", "shopbot-support", [
        Turn("مرحبا، أريد استرجاع ثمن كتاب وصلني تالفاً. رقم الطلب B-2210",
             "أنا آسف لذلك. الطلب B-2210 مؤهل للاسترجاع خلال 30 يوماً. هل تريد أن أبدأ طلب الاسترجاع؟",
             ToolCall("lookup_order", {"order_id": "B-2210"},
                      '{"status": "delivered", "delivered": "2026-11-20", "refundable": true}')),
        Turn("لا، أريد التحدث مع موظف من فضلك.",
             "بالتأكيد، سأحولك الآن إلى أحد زملائنا. سيتواصل معك خلال دقائق.", handover=True),
    ]),
    Persona("Tom, long complaint", "en", "shopbot-support", [
        Turn(LONG_COMPLAINT,
             "I am very sorry, Tom. Order B-7781 is stuck at the depot in Bologna since 21 November; "
             "I have opened a priority claim (C-5531) and the carrier will call you within 24 hours.",
             ToolCall("lookup_order", {"order_id": "B-7781"},
                      '{"status": "exception", "last_scan": "Bologna depot, 2026-11-21"}')),
        Turn("Fine. And if it is lost?",
             "If the carrier confirms it lost, we ship a replacement the same day at no cost, or refund you "
             "in full: your choice."),
        Turn("Refund. Thanks.", "Noted: if it is lost you will be refunded in full. Anything else?"),
        Turn("No.", "Thank you for your patience, Tom."),
    ]),
    Persona("Sam, quick question", "en", "shopbot-web", [
        Turn("do you ship to Canada", "Yes, we ship to Canada. Delivery takes 7 to 12 working days."),
    ]),
]


CONVERSATION: contextvars.ContextVar[str | None] = contextvars.ContextVar("conversation", default=None)
"""The conversation of the turn being played (the bot's request handler would set it)."""


class ConversationIdProcessor(SpanProcessor):
    """Puts the current conversation's id on every span started."""

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        if (cid := CONVERSATION.get()) is not None:
            span.set_attribute("gen_ai.conversation.id", cid)


def _text(role: str, content: str) -> dict[str, Any]:
    return {"role": role, "parts": [{"type": "text", "content": content}]}


def _tokens(messages: list[dict[str, Any]]) -> int:
    return max(1, len(json.dumps(messages, ensure_ascii=False).encode()) // 4)


def _chat_span(tracer: Tracer, history: list[dict[str, Any]], output: dict[str, Any], finish: str) -> None:
    with tracer.start_as_current_span(f"chat {MODEL}", kind=SpanKind.CLIENT, attributes={
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": MODEL,
        "gen_ai.response.model": RESPONSE_MODEL,
        "gen_ai.response.id": f"chatcmpl-{uuid.uuid4().hex[:12]}",
        "gen_ai.response.finish_reasons": [finish],
        "gen_ai.system_instructions": json.dumps([{"type": "text", "content": SYSTEM}]),
        "gen_ai.input.messages": json.dumps(history, ensure_ascii=False),
        "gen_ai.output.messages": json.dumps([{**output, "finish_reason": finish}], ensure_ascii=False),
        "gen_ai.usage.input_tokens": _tokens(history) + len(SYSTEM) // 4,
        "gen_ai.usage.output_tokens": _tokens([output]),
    }):
        pass


def play(tracer: Tracer, persona: Persona, start: int = 0) -> int:
    """Send one conversation, a trace per user turn; returns the number of spans sent.

    ``start``: the turns before it were sent already (a conversation still going on): they are only the
    history its LLM calls resend.
    """
    token = CONVERSATION.set(persona.conversation_id)
    try:
        return _play(tracer, persona, start)
    finally:
        CONVERSATION.reset(token)


def _tool_call(persona: Persona, i: int, tool: ToolCall) -> dict[str, Any]:
    return {"role": "assistant", "parts": [{"type": "tool_call", "id": f"call_{persona.conversation_id[:8]}_{i}",
                                            "name": tool.name, "arguments": tool.arguments}]}


def _tool_result(call: dict[str, Any], tool: ToolCall) -> dict[str, Any]:
    return {"role": "tool", "parts": [{"type": "tool_call_response", "id": call["parts"][0]["id"],
                                       "response": tool.result}]}


def _play(tracer: Tracer, persona: Persona, start: int) -> int:
    history: list[dict[str, Any]] = []
    spans = 0
    for i, turn in enumerate(persona.turns):
        if i < start:
            history.append(_text("user", turn.user))
            if turn.tool is not None:
                call = _tool_call(persona, i, turn.tool)
                history += [call, _tool_result(call, turn.tool)]
            history.append(_text("assistant", turn.answer))
            continue
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.agent.name": "ShopBot",
            "gen_ai.conversation.id": persona.conversation_id,  # on a provider without the processor too
            "app.user.language": persona.language,
        }
        if turn.handover:
            attrs.update({"app.handover": True, "app.handover.reason": "user_requested_human"})
        with tracer.start_as_current_span("invoke_agent ShopBot", attributes=attrs):
            spans += 1
            history.append(_text("user", turn.user))
            if turn.tool is not None:
                call = _tool_call(persona, i, turn.tool)
                _chat_span(tracer, list(history), call, "tool_call")
                with tracer.start_as_current_span(f"execute_tool {turn.tool.name}", attributes={
                    "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": turn.tool.name,
                    "gen_ai.tool.call.id": call["parts"][0]["id"],
                }):
                    pass
                history += [call, _tool_result(call, turn.tool)]
                spans += 2
            answer = _text("assistant", turn.answer)
            _chat_span(tracer, list(history), answer, "stop")
            history.append(answer)
            spans += 1
    return spans


def send_demo_traffic(grpc_endpoint: str, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Send every persona's conversation to ``grpc_endpoint`` and flush; returns what was sent."""
    sent: dict[str, Any] = {"conversations": [], "spans": 0}
    by_service: dict[str, TracerProvider] = {}
    for persona in PERSONAS:
        provider = by_service.get(persona.service)
        if provider is None:
            # A provider of our own, never the global one: the SDK must not trace this process.
            provider = TracerProvider(resource=Resource.create({"service.name": persona.service,
                                                                "service.version": "demo"}))
            provider.add_span_processor(ConversationIdProcessor())
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=grpc_endpoint, insecure=True)))
            by_service[persona.service] = provider
        n = play(provider.get_tracer("tracejudge.demo"), persona)
        sent["spans"] += n
        sent["conversations"].append({"id": persona.conversation_id, "persona": persona.name,
                                      "turns": len(persona.turns), "spans": n})
        progress(f"  sent {persona.name!r}: {plural(len(persona.turns), 'turn')}, {plural(n, 'span')} "
                 f"(conversation {persona.conversation_id})")
    for provider in by_service.values():
        if not provider.force_flush(30_000):
            raise RuntimeError(f"the OTLP exporter could not deliver to {grpc_endpoint}")
        provider.shutdown()
    return sent

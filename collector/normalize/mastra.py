"""Mastra AI tracing as ``@mastra/otel-exporter`` (1.x) exports it: ``mastra.*`` keys.

No one span holds a model call. Mastra traces an agent turn in layers
(``mastra.span.type``), and the exporter writes each layer's input and output
under its own key:

- ``model_generation``: ``mastra.model_generation.input`` = ``{"messages": [...]}``,
  the AI SDK messages the turn's model loop starts from (system, history, the
  new user message), read as input;
- ``model_step`` (``agent_step`` spans), one per model call:
  ``mastra.model_step.output`` = ``{text, toolCalls: [{toolCallId, toolName,
  args}]}``, the call's answer, read as output (``mastra.model_step.input`` is
  a preview, tool calls and results shown as ``[tool: NAME]``: not read);
- ``tool_call`` (``execute_tool`` spans) under a step: ``gen_ai.tool.call.result``
  with the call's id and tool name, read as a tool message;
- ``model_inference`` (``chat MODEL``) under a step: the call itself, with its
  usage and models but no input, and ``gen_ai.output.messages`` with the
  answer's text only (the exporter drops its tool calls); read by ``otel_genai``.

``steps`` puts a call's content together from those (the assembler calls it
per trace).
"""

from __future__ import annotations

from typing import Callable, Mapping, Protocol, Sequence, TypeVar

from ._messages import history
from ._model import Attrs, Content, Message, Truncated, as_str
from .vercel_ai import _tool_calls

NAME = "mastra"
KEYS = ("mastra.span.type",)  # ``read`` finds nothing without it

GENERATION, STEP, TOOL = "model_generation", "model_step", "tool_call"


def read(attrs: Attrs) -> Content | None:
    """A generation's input, a step's answer or a tool's result (see the module doc)."""
    kind = attrs.get("mastra.span.type")
    content = Content(NAME)
    try:
        if kind == GENERATION:
            value = attrs.json("mastra.model_generation.input")
            if not isinstance(value, dict) or not isinstance(value.get("messages"), list):
                return None
            content.input, content.system = history(value["messages"])
        elif kind == STEP:
            value = attrs.json("mastra.model_step.output")
            if not isinstance(value, dict):
                return None
            text = value.get("text")
            calls = _tool_calls(value.get("toolCalls"))
            if not isinstance(text, str) and not calls:
                return None
            content.output = [Message("assistant", text if isinstance(text, str) else "", tool_calls=calls)]
        elif kind == TOOL:
            result = attrs.get("gen_ai.tool.call.result")
            if not isinstance(result, str):
                return None
            content.output = [Message("tool", result, tool_call_id=as_str(attrs.get("gen_ai.tool.call.id")),
                                      name=as_str(attrs.get("gen_ai.tool.name")))]
        else:
            return None
    except Truncated:
        content.truncated = True
    return content


class _Span(Protocol):
    span_id: str
    parent: str | None
    content: Content | None


S = TypeVar("S", bound=_Span)


def _mine(sp: _Span) -> bool:
    return sp.content is not None and sp.content.source.startswith(NAME + "/")


def steps(spans: Sequence[S], is_call: Callable[[S], bool]) -> Mapping[str, Content]:
    """The content of each model call under a Mastra generation, by the call's span id.

    ``spans`` are one trace's, in call order; ``is_call`` tells the model calls. A
    call under a step of a generation was sent the generation's input, then each
    earlier step's answer followed by its tools' results (in the order the answer
    called them), and answered with its step's answer.
    """
    children: dict[str | None, list[S]] = {}
    for sp in spans:
        children.setdefault(sp.parent, []).append(sp)
    out: dict[str, Content] = {}
    for gen in spans:
        gc = gen.content
        if gc is None or not _mine(gen) or gc.input is None:
            continue
        sent = list(gc.input)
        truncated = gc.truncated
        for step in children.get(gen.span_id, []):
            sc = step.content
            if sc is None or not _mine(step) or not sc.output:
                continue
            truncated = truncated or sc.truncated
            below = children.get(step.span_id, [])
            for call in below:
                if is_call(call):
                    out[call.span_id] = Content(gc.source, list(sent), list(sc.output), gc.system, truncated)
            sent += sc.output
            order = {tc.id: k for m in sc.output for k, tc in enumerate(m.tool_calls) if tc.id}
            results = []
            for sp in below:
                if _mine(sp) and sp.content is not None and sp.content.output:
                    results += [m for m in sp.content.output if m.role == "tool"]
                    truncated = truncated or sp.content.truncated
            sent += sorted(results, key=lambda m: order.get(m.tool_call_id or "", len(order)))
    return out

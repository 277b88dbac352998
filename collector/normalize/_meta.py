"""What a span is (LLM call, agent turn, tool run) and its models, tokens and ids.

Every dialect names these facts differently but flat, so one ordered table per
fact covers them all; a new library usually needs a row here and nothing else.
Spans are classified by attributes, never by span name (names are templates in
Logfire, free text in Langfuse, ``call_llm`` in ADK).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from ._model import Attrs, Meta, SpanKind, Truncated, as_int, as_str, loads_maybe

# (attribute, value -> kind). The first attribute present decides.
KIND_RULES: tuple[tuple[str, Mapping[str, SpanKind]], ...] = (
    ("gen_ai.operation.name", {
        "chat": "llm", "text_completion": "llm", "generate_content": "llm",
        "completion": "llm", "responses": "llm", "call_llm": "llm",
        "invoke_agent": "agent", "create_agent": "agent", "invoke_workflow": "agent",
        "execute_tool": "tool",
    }),
    ("openinference.span.kind", {
        "LLM": "llm", "AGENT": "agent", "CHAIN": "agent", "TOOL": "tool",
    }),
    ("langfuse.observation.type", {
        "generation": "llm", "agent": "agent", "chain": "agent", "tool": "tool",
    }),
    # Vercel AI SDK: the outer call is a multi-step agent turn whose usage sums
    # its steps; each doGenerate/doStream step is one LLM call.
    ("ai.operationId", {
        "ai.generateText.doGenerate": "llm", "ai.streamText.doStream": "llm",
        "ai.generateObject.doGenerate": "llm", "ai.streamObject.doStream": "llm",
        "ai.generateText": "agent", "ai.streamText": "agent",
        "ai.generateObject": "agent", "ai.streamObject": "agent",
        "ai.toolCall": "tool",
    }),
    ("traceloop.span.kind", {
        "workflow": "agent", "agent": "agent", "task": "agent", "tool": "tool",
    }),
    ("llm.request.type", {"chat": "llm", "completion": "llm"}),
)

# Attributes whose mere presence marks an LLM call when no rule above matched.
LLM_MARKERS = ("gcp.vertex.agent.llm_request", "gen_ai.request.messages", "request_data",
               "haystack.agent.step.llm.output")

REQUEST_MODEL_KEYS = ("gen_ai.request.model", "ai.model.id", "llm.request.model")
RESPONSE_MODEL_KEYS = (
    "gen_ai.response.model", "ai.response.model", "llm.model_name",
    "langfuse.observation.model.name", "llm.response.model",
)
# (JSON attribute, path to the model inside it: keys and list indexes) tried after the flat keys.
REQUEST_MODEL_JSON: tuple[tuple[str, tuple[str | int, ...]], ...] = (
    ("llm.invocation_parameters", ("model",)), ("llm.invocation_parameters", ("model_name",)),  # LlamaIndex
    ("request_data", ("model",)), ("gcp.vertex.agent.llm_request", ("model",)))
RESPONSE_MODEL_JSON: tuple[tuple[str, tuple[str | int, ...]], ...] = (
    ("response_data", ("model",)), ("haystack.agent.step.llm.output", ("replies", 0, "meta", "model")))
# Paths in a JSON output.value tried on an LLM span whose response model is missing or only the
# request model again: OpenInference's LangChain spans of a streamed call put the request model in
# llm.model_name, and the model the server reported only in the LLMResult of output.value.
OUTPUT_MODEL_PATHS: tuple[tuple[str | int, ...], ...] = (
    ("llm_output", "model_name"), ("generations", 0, 0, "generation_info", "model_name"))
# LlamaIndex's workflow gives the raw OpenAI response of a call only to the step after it: a Python
# repr inside the AgentOutput in BaseWorkflowAgent.parse_agent_output's input.value (a CHAIN span),
# "raw={'id': ..., 'choices': [...], 'created': 1741000000, 'model': '...', 'object': 'chat.completion'".
# Read with a regex (never eval); ``created`` before it keeps message text from matching.
AGENT_OUTPUT = "AgentOutput("
AGENT_OUTPUT_MODEL = re.compile(r"'created': \d+, 'model': '([^'\\\"]+)', 'object': 'chat\.completion")

INPUT_TOKEN_KEYS = (
    "gen_ai.usage.input_tokens", "gen_ai.usage.prompt_tokens", "llm.token_count.prompt",
    "ai.usage.inputTokens", "ai.usage.promptTokens", "llm.usage.prompt_tokens",
)
OUTPUT_TOKEN_KEYS = (
    "gen_ai.usage.output_tokens", "gen_ai.usage.completion_tokens", "llm.token_count.completion",
    "ai.usage.outputTokens", "ai.usage.completionTokens", "llm.usage.completion_tokens",
)
# JSON usage objects: (attribute, path to the usage object inside it).
USAGE_JSON: tuple[tuple[str, tuple[str | int, ...]], ...] = (
    ("langfuse.observation.usage_details", ()),
    ("response_data", ("usage",)),
    ("gcp.vertex.agent.llm_response", ("usage_metadata",)),
    ("haystack.agent.step.llm.output", ("replies", 0, "meta", "usage")),
)
USAGE_INPUT_FIELDS = ("input_tokens", "prompt_tokens", "input", "prompt_token_count", "promptTokenCount")
USAGE_OUTPUT_FIELDS = ("output_tokens", "completion_tokens", "output", "candidates_token_count",
                       "candidatesTokenCount")

RESPONSE_ID_KEYS = ("gen_ai.response.id", "ai.response.id", "llm.response.id")
PREVIOUS_RESPONSE_ID_KEYS = ("gen_ai.request.previous_response.id",
                             "gen_ai.openai.request.previous_response_id")
TOOL_CALL_ID_KEYS = ("gen_ai.tool.call.id", "ai.toolCall.id", "tool_call.id")
TOOL_NAME_KEYS = ("gen_ai.tool.name", "ai.toolCall.name", "tool.name")


def _flat(attrs: Attrs, keys: tuple[str, ...]) -> str | None:
    get = attrs.get
    for k in keys:
        v = get(k)
        if v is not None:  # most keys are absent: skip the call
            v = as_str(v)
            if v is not None:
                return v
    return None


def _json_field(attrs: Attrs, attr: str, path: tuple[str | int, ...]) -> Any:
    if attrs.get(attr) is None:  # absent: nothing to parse (the common case)
        return None
    try:
        obj = attrs.json(attr)
    except Truncated:
        return None
    return _walk(obj, path)


def _walk(obj: Any, path: tuple[str | int, ...]) -> Any:
    for p in path:
        if isinstance(p, int):
            obj = obj[p] if isinstance(obj, list) and -len(obj) <= p < len(obj) else None
        elif isinstance(obj, dict):
            obj = obj.get(p)
        else:
            return None
    return obj


# A count beyond this is no count (a sum of a few would not fit the store's 64-bit columns).
MAX_TOKENS = 2**40


def _count(value: Any) -> int | None:
    n = as_int(value)
    return n if n is not None and 0 <= n <= MAX_TOKENS else None


def _tokens(attrs: Attrs, keys: tuple[str, ...], fields: tuple[str, ...]) -> int | None:
    get = attrs.get
    for k in keys:
        v = get(k)
        if v is not None:
            n = _count(v)
            if n is not None:
                return n
    for attr, path in USAGE_JSON:
        usage = _json_field(attrs, attr, path)
        if isinstance(usage, dict):
            for f in fields:
                n = _count(usage.get(f))
                if n is not None:
                    return n
    return None


def span_kind(attrs: Attrs, name: str = "") -> SpanKind:
    """Classify a span as ``llm``, ``agent``, ``tool`` or ``other`` by its attributes."""
    for attr, table in KIND_RULES:
        value = attrs.get(attr)
        if isinstance(value, str):
            kind = table.get(value)
            if kind is not None:
                return kind
            if attr == "gen_ai.operation.name":
                return "other"  # embeddings, retrieval, rerank...: not a chat turn
    if any(k in attrs for k in LLM_MARKERS) or name == "call_llm":
        return "llm"
    if _flat(attrs, REQUEST_MODEL_KEYS + RESPONSE_MODEL_KEYS) and (
            _tokens(attrs, INPUT_TOKEN_KEYS, USAGE_INPUT_FIELDS) is not None):
        return "llm"
    return "other"


def _model(attrs: Attrs, keys: tuple[str, ...], in_json: Any) -> str | None:
    """A model name from a flat key, else from a field of a JSON attribute."""
    found = _flat(attrs, keys)
    if found is None:
        for attr, path in in_json:
            found = as_str(_json_field(attrs, attr, path))
            if found:
                break
    return found


def _output_model(attrs: Attrs) -> str | None:
    """The model at one of ``OUTPUT_MODEL_PATHS`` in an ``output.value`` of JSON."""
    if attrs.get("output.mime_type") != "application/json":
        return None
    try:  # not Attrs.json: an output.value cut short must not flag the messages read elsewhere as cut
        value = loads_maybe(attrs.get("output.value"))
    except (Truncated, RecursionError):
        return None
    for path in OUTPUT_MODEL_PATHS:
        found = as_str(_walk(value, path))
        if found:
            return found
    return None


def _agent_output_model(value: Any) -> str | None:
    """The model of the raw response in a LlamaIndex AgentOutput repr, if ``value`` holds one."""
    if not isinstance(value, str):
        return None
    at = value.find(AGENT_OUTPUT)
    at = value.find("raw={", at) if at >= 0 else -1
    found = AGENT_OUTPUT_MODEL.search(value, at) if at >= 0 else None
    return found.group(1) if found else None


def read_meta(attrs: Attrs, name: str = "") -> Meta:
    """Read kind, models, token usage and ids from one span's (or log's) attributes."""
    meta = Meta(kind=span_kind(attrs, name))
    meta.request_model = _model(attrs, REQUEST_MODEL_KEYS, REQUEST_MODEL_JSON)
    meta.response_model = _model(attrs, RESPONSE_MODEL_KEYS, RESPONSE_MODEL_JSON)
    if meta.kind == "llm" and meta.response_model in (None, meta.request_model):
        meta.response_model = _output_model(attrs) or meta.response_model
    if meta.kind == "agent" and attrs.get("openinference.span.kind") == "CHAIN":
        meta.reported_model = _agent_output_model(attrs.get("input.value"))
    meta.input_tokens = _tokens(attrs, INPUT_TOKEN_KEYS, USAGE_INPUT_FIELDS)
    meta.output_tokens = _tokens(attrs, OUTPUT_TOKEN_KEYS, USAGE_OUTPUT_FIELDS)
    meta.response_id = _flat(attrs, RESPONSE_ID_KEYS)
    meta.previous_response_id = _flat(attrs, PREVIOUS_RESPONSE_ID_KEYS)
    meta.tool_call_id = _flat(attrs, TOOL_CALL_ID_KEYS)
    meta.tool_name = _flat(attrs, TOOL_NAME_KEYS)
    return meta

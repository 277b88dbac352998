"""OpenLLMetry (Traceloop) indexed attributes: ``gen_ai.prompt.<i>.*`` / ``gen_ai.completion.<i>.*``.

Each message is ``role``, ``content`` (plain text, or a JSON string of
Anthropic blocks such as ``tool_result``), ``tool_call_id`` and
``tool_calls.<j>.{id,name,arguments}``. Releases before 0.5 used
``llm.prompts`` / ``llm.completions``. Newer releases emit ``otel_genai``.
"""

from __future__ import annotations

from ._indexed import OPENLLMETRY_PREFIXES, unflatten
from ._messages import answer, history
from ._model import Attrs, Content

NAME = "openllmetry"

# (input prefix, output prefix), newest first.
PREFIXES = OPENLLMETRY_PREFIXES
KEY_PREFIXES = tuple(p for pair in PREFIXES for p in pair)  # ``read`` finds nothing without one


def read(attrs: Attrs) -> Content | None:
    """Content from indexed prompt/completion attributes."""
    for in_prefix, out_prefix in PREFIXES:
        prompts = unflatten(attrs.indexed(in_prefix), in_prefix)
        completions = unflatten(attrs.indexed(out_prefix), out_prefix)
        if not prompts and not completions:
            continue
        content = Content(NAME)
        if prompts:
            content.input, content.system = history(prompts)
        if completions:
            content.output = answer(completions)
        return content
    return None

"""Code checks: criteria decided in code, with no LLM.

Deterministic things (a tool was called, how the conversation ended, a pattern
in the bot's words, the number of user turns) are checked here, never by a
judge. Built-in checks register in ``CHECKS`` exactly as outside ones do with
``register_check``; a criteria file names a check and gives its parameters
beside ``check:``, validated by the check's ``Params`` model when the file is
loaded.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Protocol, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_serializer, field_validator

from ._transcript import Conversation, EndedBy, Message, tool_call_text
from ._verdict import CheckResult


class CheckParams(BaseModel):
    """Base for a check's parameters: strict, so a typo names its key."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class CodeCheck(Protocol):
    """A check decided in code.

    ``Params`` validates the criterion's keys when the file loads; ``run`` is
    called once per conversation, in a worker process, within the criterion's
    ``timeout`` (see ``_check_process``): the check and its parameters are sent
    there by pickle, so define them at the top level of an importable module.
    An exception it raises, or running out of time, becomes an ``error`` verdict.

    A check may say ``bounded = True``: it only walks the conversation's messages once, with
    no pattern and no outside code, so it cannot run long. Such a check, when its criterion's
    ``applies_if`` has no pattern either, runs in the caller's process (see ``in_process``).
    """

    @property
    def Params(self) -> type[CheckParams]:  # noqa: N802 - a nested class in implementations
        """The model that validates the criterion's keys."""
        ...

    def run(self, conversation: Conversation, params: Any) -> CheckResult:
        """Decide the criterion for one conversation."""
        ...


CHECKS: dict[str, CodeCheck] = {}
"""Check name -> check, as named by ``check:`` in a criteria file."""


def register_check(name: str, check: CodeCheck) -> None:
    """Make a code check available to criteria files under ``name``.

    Args:
        name: the value of ``check:`` that selects it.
        check: the check.
    """
    CHECKS[name] = check


def _pattern(value: Any) -> re.Pattern[str]:
    if isinstance(value, re.Pattern):
        return value
    try:
        return re.compile(str(value))
    except re.error as exc:
        raise ValueError(f"bad regex {value!r}: {exc}") from None


def _in_role(m: Message, role: str) -> bool:
    return role == "any" or m.role == role


class AppliesIf(CheckParams):
    """Conditions that must all hold for a code criterion to apply; else ``not_applicable``."""

    user_matches: re.Pattern[str] | None = None
    """A user message matches this regex."""
    bot_matches: re.Pattern[str] | None = None
    """An assistant message matches this regex."""
    tool_called: str | None = None
    """The assistant called this tool."""
    ended_by: list[EndedBy] | None = None
    """The conversation ended in one of these ways."""

    @field_validator("user_matches", "bot_matches", mode="before")
    @classmethod
    def _compile(cls, v: Any) -> re.Pattern[str] | None:
        return None if v is None else _pattern(v)

    @property
    def has_patterns(self) -> bool:
        """Whether a condition is a regex (which can backtrack for as long as it likes)."""
        return self.user_matches is not None or self.bot_matches is not None

    def holds(self, conversation: Conversation) -> bool:
        """True when every condition given holds for the conversation."""
        msgs = conversation.messages
        if self.user_matches and not any(m.role == "user" and self.user_matches.search(m.content) for m in msgs):
            return False
        if self.bot_matches and not any(m.role == "assistant" and self.bot_matches.search(m.content) for m in msgs):
            return False
        if self.tool_called and not any(c.name == self.tool_called for m in msgs for c in m.tool_calls):
            return False
        return not (self.ended_by and conversation.ended_by not in self.ended_by)


# --------------------------------------------------------------- built-ins


class ToolCalled:
    """Pass when the assistant called tool ``name`` with arguments that include ``args``."""

    bounded = True

    class Params(CheckParams):
        name: str
        """The tool."""
        args: dict[str, Any] = {}
        """A subset the call's arguments must contain (equal values)."""

    def run(self, conversation: Conversation, params: Params) -> CheckResult:
        for m in conversation.messages:
            for call in m.tool_calls:
                got = call.arguments if isinstance(call.arguments, dict) else {}
                if call.name == params.name and all(k in got and got[k] == v for k, v in params.args.items()):
                    return CheckResult(result="pass", evidence=[tool_call_text(call)],
                                       reasoning=f"{params.name} was called")
        want = f" with {params.args}" if params.args else ""
        return CheckResult(result="fail", reasoning=f"{params.name} was never called{want}")


class EndedByCheck:
    """Pass when the conversation ended in one of ``one_of`` (handover, bot_closed, ...)."""

    bounded = True

    class Params(CheckParams):
        one_of: list[EndedBy] = Field(min_length=1)
        """Accepted endings."""

        @field_validator("one_of", mode="before")
        @classmethod
        def _one(cls, v: Any) -> Any:
            return [v] if isinstance(v, str) else v

    def run(self, conversation: Conversation, params: Params) -> CheckResult:
        ok = conversation.ended_by in params.one_of
        return CheckResult(
            result="pass" if ok else "fail",
            reasoning=f"ended by {conversation.ended_by}" + ("" if ok else f", expected one of {params.one_of}"),
        )


class RegexCheck:
    """``must: match``: pass when a message of ``role`` matches; ``not_match``: fail when one does."""

    class Params(CheckParams):
        pattern: re.Pattern[str]
        role: Literal["user", "assistant", "tool", "any"] = "assistant"
        must: Literal["match", "not_match"] = "match"

        @field_validator("pattern", mode="before")
        @classmethod
        def _compile(cls, v: Any) -> re.Pattern[str]:
            return _pattern(v)

        @field_validator("role", mode="before")
        @classmethod
        def _bot(cls, v: Any) -> Any:
            return "assistant" if v == "bot" else v

    def run(self, conversation: Conversation, params: Params) -> CheckResult:
        hits = [
            mt.group(0) or m.content
            for m in conversation.messages
            if _in_role(m, params.role) and (mt := params.pattern.search(m.content))
        ]
        what = f"/{params.pattern.pattern}/ in {params.role} messages"
        if params.must == "match":
            if hits:
                return CheckResult(result="pass", evidence=hits[:3], reasoning=f"found {what}")
            return CheckResult(result="fail", reasoning=f"no match for {what}")
        if hits:
            return CheckResult(result="fail", evidence=hits[:3], reasoning=f"found {what}, which must not appear")
        return CheckResult(result="pass", reasoning=f"no match for {what}")


class MaxUserTurns:
    """Pass when the user sent at most ``max`` messages."""

    bounded = True

    class Params(CheckParams):
        max: int = Field(ge=0)

    def run(self, conversation: Conversation, params: Params) -> CheckResult:
        n = conversation.user_turns
        return CheckResult(result="pass" if n <= params.max else "fail", reasoning=f"{n} user turns, limit {params.max}")


CheckFunction = Callable[[Conversation], CheckResult]


class ImportedFunction:
    """A function imported from ``module:function``; it pickles as that spec, imported again where it lands.

    A module beside the criteria file is not on ``sys.path``, so a worker
    process could not unpickle the function by its module name.
    """

    def __init__(self, spec: str, base: Path | None) -> None:
        self.spec = spec
        self.base = base
        self.function = import_function(spec, base)

    def __call__(self, conversation: Conversation) -> Any:
        return self.function(conversation)

    def __reduce__(self) -> tuple[Any, ...]:
        return (ImportedFunction, (self.spec, self.base))

    def __repr__(self) -> str:
        return self.spec


def import_function(spec: str, base: Path | None = None) -> CheckFunction:
    """Import ``module:function``; a module beside the criteria file (``base``) is found too.

    Raises:
        ValueError: the spec is malformed or the function cannot be imported.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{spec!r} is not module:function")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        local = base / (module_name.replace(".", "/") + ".py") if base else None
        if exc.name != module_name.split(".")[0] or local is None or not local.is_file():
            raise ValueError(f"cannot import {module_name!r}: {exc}") from None
        module_spec = importlib.util.spec_from_file_location(module_name, local)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc2:
            del sys.modules[module_name]
            raise ValueError(f"cannot import {str(local)!r}: {exc2!r}") from None
    except Exception as exc:
        raise ValueError(f"cannot import {module_name!r}: {exc!r}") from None
    fn: Any = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ValueError(f"{module_name!r} has no {attr!r}")
    if not callable(fn):
        raise ValueError(f"{spec!r} is not callable")
    return cast(CheckFunction, fn)


class PythonCheck:
    """Call ``function`` (``module:callable``) with the conversation; it returns a CheckResult."""

    class Params(CheckParams):
        function: CheckFunction
        """``module:callable``; a module file beside the criteria file is found too."""

        @field_validator("function", mode="before")
        @classmethod
        def _import(cls, v: Any, info: ValidationInfo) -> Any:
            return ImportedFunction(v, (info.context or {}).get("base")) if isinstance(v, str) else v

        @field_serializer("function")
        def _spec(self, fn: CheckFunction) -> str:
            if isinstance(fn, ImportedFunction):
                return fn.spec
            return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__qualname__)}"

    def run(self, conversation: Conversation, params: Params) -> CheckResult:
        out = params.function(conversation)
        return out if isinstance(out, CheckResult) else CheckResult.model_validate(out)


_BUILT_IN: dict[str, CodeCheck] = {
    "tool_called": ToolCalled(),
    "ended_by": EndedByCheck(),
    "regex": RegexCheck(),
    "max_user_turns": MaxUserTurns(),
    "python": PythonCheck(),
}
for _name, _check in _BUILT_IN.items():
    register_check(_name, _check)

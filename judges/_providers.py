"""Judge providers: a plain ``send`` of one request to one model, nothing more.

Retries, timeouts and budgets are the runner's wrappers around ``send``; a
provider only turns one request into one reply or one ``ProviderError`` that
says whether trying again may help (429, 529, 5xx, a lost connection) and how
long the server asked us to wait.

Built-in providers register in ``PROVIDERS`` exactly as outside ones do with
``register_provider``. Their client libraries are imported when first used.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

from ._errors import ProviderError, ProviderSetupError
from ._prompt import JudgeRequest
from ._retry import parse_retry_after
from ._transcript import Usage

Stop = Literal["end", "refusal", "max_tokens", "other"]


@dataclass(frozen=True)
class ProviderReply:
    """What a model answered to one request."""

    text: str
    """The reply text as received (the raw reply kept on the verdict)."""
    usage: Usage
    stop: Stop = "end"
    """Why the model stopped: ``end`` is a finished answer; anything else becomes an ``error`` verdict."""
    stop_detail: str = ""
    """The provider's own stop reason, for the error message."""


class Provider(Protocol):
    """A model that judges ``kind: llm`` criteria.

    Lifecycle: ``send`` may be called by many tasks at once on one event loop;
    ``aclose`` releases connections (the runner calls it when a run ends) and a
    later ``send`` opens them again, on whatever loop is running then.
    """

    name: str
    """The provider type, recorded on every verdict."""
    model: str
    """The model, recorded on every verdict and part of the cache key."""

    async def send(self, request: JudgeRequest) -> ProviderReply:
        """Make one call.

        Raises:
            ProviderError: the call failed; ``retryable`` says whether to try again.
        """
        ...

    async def aclose(self) -> None:
        """Release connections."""
        ...


def _setting(value: str | None, env: str, environ: Mapping[str, str]) -> str | None:
    """A configured value, else the environment variable; an empty string counts as unset."""
    return value or environ.get(env) or None


def _connection_detail(exc: BaseException) -> str:
    """Where a call could not connect to, and why: the innermost cause (the client says "Connection error.")."""
    url = getattr(getattr(exc, "request", None), "url", None)
    cause, seen = exc, {id(exc)}
    while (inner := cause.__cause__ or cause.__context__) is not None and id(inner) not in seen:
        cause, seen = inner, seen | {id(inner)}
    if isinstance(cause, ConnectionRefusedError):
        why = "connection refused"
    else:
        why = getattr(cause, "strerror", None) or str(cause) or type(cause).__name__
    return f"cannot connect to {url}: {why}" if url else why


def _status_error(status: int, headers: Mapping[str, str], body: str) -> ProviderError:
    retryable = status in (408, 409, 429) or status >= 500
    code = {429: "rate_limited", 529: "overloaded"}.get(status, "server_error" if status >= 500 else "http_error")
    return ProviderError(code, f"HTTP {status}: {body[:300]}", retryable=retryable,
                         retry_after=parse_retry_after(headers), raw=body)


class _PerLoop:
    """Holds one client per event loop: clients bind their connections to the loop that made them."""

    def __init__(self, make: Callable[[], Any], close: Callable[[Any], Awaitable[None]]) -> None:
        self._make = make
        self._close = close
        self._client: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def get(self) -> Any:
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            self._client, self._loop = self._make(), loop
        return self._client

    async def aclose(self) -> None:
        client, self._client, self._loop = self._client, None, None
        if client is not None:
            await self._close(client)


class AnthropicProvider:
    """Claude through the official ``anthropic`` client, with structured output.

    The reply is asked for with ``output_config`` (a JSON schema of just
    ``reasoning``, ``evidence`` and ``result``) and validated by the runner, so
    a reply that does not validate is kept raw. The client's own retries are
    off: the runner retries. Sampling parameters are not sent: the Messages API
    rejects ``temperature`` since API version 2026-10-21.

    Args:
        model: the model; else ``$ANTHROPIC_MODEL``.
        api_key: else ``$ANTHROPIC_API_KEY`` (or the client's other credential sources).
        base_url: else ``$ANTHROPIC_BASE_URL``, else the public API.
        max_tokens: the reply's token limit; a reply cut there is an ``error``.
        environ: the environment to read (default ``os.environ``).

    Raises:
        ProviderSetupError: no model given.
    """

    name = "anthropic"
    SETTINGS: ClassVar[frozenset[str]] = frozenset({"model", "api_key", "base_url", "max_tokens"})

    def __init__(
        self,
        model: str | None = None,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        max_tokens: int = 1024,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        env = os.environ if environ is None else environ
        resolved = _setting(model, "ANTHROPIC_MODEL", env)
        if resolved is None:
            raise ProviderSetupError.no("anthropic", "model", "ANTHROPIC_MODEL")
        self.model = resolved
        self.max_tokens = max_tokens
        self._api_key = _setting(api_key, "ANTHROPIC_API_KEY", env)
        # Passed explicitly so an empty $ANTHROPIC_BASE_URL means "the public API", not "".
        self.base_url = _setting(base_url, "ANTHROPIC_BASE_URL", env) or "https://api.anthropic.com"
        # Imported here, not on the first call, so that its import time never counts against a call's timeout.
        try:
            import anthropic
        except ImportError:  # pragma: no cover - anthropic is a dependency of the project
            raise ProviderSetupError("the anthropic provider needs the anthropic package: pip install anthropic") from None
        self._sdk = anthropic
        self._clients = _PerLoop(self._make_client, lambda c: c.close())

    def _make_client(self) -> Any:
        # open_telemetry=False: inside the daemon, the client's own spans would feed
        # its judge calls back into ingestion.
        return self._sdk.AsyncAnthropic(
            api_key=self._api_key, base_url=self.base_url, max_retries=0, open_telemetry=False
        )

    async def send(self, request: JudgeRequest) -> ProviderReply:
        """Make one Messages API call (see ``Provider.send``)."""
        anthropic = self._sdk
        client = self._clients.get()
        try:
            # The raw response: we validate the body ourselves, so it is kept whatever it holds, and
            # building the client's typed Message (about 1 ms of CPU per call) is skipped.
            response = await client.messages.with_raw_response.create(
                model=self.model,
                max_tokens=self.max_tokens,
                system=request.system,
                messages=[{"role": "user", "content": request.prompt}],
                output_config={"format": {"type": "json_schema", "schema": request.schema}},
            )
            body = await response.text()
        except anthropic.APIStatusError as exc:
            raise _status_error(exc.status_code, exc.response.headers, exc.response.text) from None
        except anthropic.APITimeoutError:
            raise ProviderError("timeout", "the anthropic client timed out") from None
        except anthropic.APIConnectionError as exc:
            raise ProviderError("connection", _connection_detail(exc), retryable=True) from None
        return _messages_reply(body)

    async def aclose(self) -> None:
        """Close the client's connections."""
        await self._clients.aclose()


class OpenAICompatibleProvider:
    """Any ``/v1/chat/completions`` server with JSON-schema response formats (Ollama, vLLM, llama.cpp).

    Args:
        model: the model; else ``$OPENAI_MODEL``.
        base_url: the API root including ``/v1`` (``http://127.0.0.1:8080/v1``); else ``$OPENAI_BASE_URL``.
        api_key: sent as a bearer token; else ``$OPENAI_API_KEY``; none for local servers.
        max_tokens: the reply's token limit; a reply cut there is an ``error``.
        temperature: sent when given.
        environ: the environment to read (default ``os.environ``).

    Raises:
        ProviderSetupError: no model or no base_url.
    """

    name = "openai_compatible"
    SETTINGS: ClassVar[frozenset[str]] = frozenset({"model", "api_key", "base_url", "max_tokens", "temperature"})

    def __init__(
        self,
        model: str | None = None,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        max_tokens: int = 1024,
        temperature: float | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        env = os.environ if environ is None else environ
        resolved_model = _setting(model, "OPENAI_MODEL", env)
        resolved_url = _setting(base_url, "OPENAI_BASE_URL", env)
        if resolved_model is None:
            raise ProviderSetupError.no("openai_compatible", "model", "OPENAI_MODEL")
        if resolved_url is None:
            raise ProviderSetupError.no("openai_compatible", "base_url", "OPENAI_BASE_URL")
        self.model = resolved_model
        self.base_url = resolved_url.rstrip("/")
        self.max_tokens = max_tokens
        self.temperature = temperature
        self._api_key = _setting(api_key, "OPENAI_API_KEY", env)
        import aiohttp  # here, not on the first call, so its import time never counts against a timeout

        self._aiohttp = aiohttp
        self._sessions = _PerLoop(self._make_session, lambda s: s.close())

    def _make_session(self) -> Any:
        aiohttp = self._aiohttp
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        # No client-side total timeout: the runner's per-call timeout bounds every call.
        return aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=None))

    async def send(self, request: JudgeRequest) -> ProviderReply:
        """Make one chat completion call (see ``Provider.send``)."""
        aiohttp = self._aiohttp
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [
                {"role": "system", "content": request.system},
                {"role": "user", "content": request.prompt},
            ],
            "max_tokens": self.max_tokens,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "verdict", "strict": True, "schema": request.schema},
            },
        }
        if self.temperature is not None:
            body["temperature"] = self.temperature
        session = self._sessions.get()
        try:
            async with session.post(self.base_url + "/chat/completions", json=body) as resp:
                text = await resp.text()
                if resp.status >= 400:
                    raise _status_error(resp.status, resp.headers, text)
        except aiohttp.ClientError as exc:
            raise ProviderError("connection", f"{type(exc).__name__}: {exc}", retryable=True) from None
        return _chat_reply(text)

    async def aclose(self) -> None:
        """Close the HTTP session."""
        await self._sessions.aclose()


def _messages_reply(body: str) -> ProviderReply:
    """Read a Messages API response body."""
    try:
        data = json.loads(body)
        text = "".join(b["text"] for b in data["content"] if b.get("type") == "text")
        tokens = Usage(input_tokens=int(data["usage"]["input_tokens"]),
                       output_tokens=int(data["usage"]["output_tokens"]))
        reason = data.get("stop_reason") or ""
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ProviderError("bad_response", f"not a Messages API response ({type(exc).__name__}: {exc})",
                            raw=body) from None
    stop: Stop = (
        "end" if reason in ("end_turn", "stop_sequence")
        else reason if reason in ("refusal", "max_tokens") else "other"  # type: ignore[assignment]
    )
    return ProviderReply(text=text, usage=tokens, stop=stop, stop_detail=reason)


def _chat_reply(body: str) -> ProviderReply:
    try:
        data = json.loads(body)
        choice = data["choices"][0]
        message = choice["message"]
        usage = data.get("usage") or {}
        tokens = Usage(input_tokens=int(usage.get("prompt_tokens") or 0),
                       output_tokens=int(usage.get("completion_tokens") or 0))
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        raise ProviderError("bad_response", f"not a chat completion ({type(exc).__name__}: {exc})", raw=body) from None
    reason = choice.get("finish_reason") or ""
    if message.get("refusal"):
        return ProviderReply(text=str(message["refusal"]), usage=tokens, stop="refusal", stop_detail="refusal")
    stop: Stop = {"stop": "end", "length": "max_tokens", "content_filter": "refusal"}.get(reason, "other")  # type: ignore[assignment]
    return ProviderReply(text=message.get("content") or "", usage=tokens, stop=stop, stop_detail=reason)


Reply = str | ProviderReply | ProviderError


class ScriptedProvider:
    """A provider that answers from a script: a real implementation for tests and offline dry runs.

    Args:
        script: a function of the request returning the reply text, a
            ``ProviderReply`` or a ``ProviderError`` (raised); or one fixed text.
        model: recorded on verdicts.
        delay: seconds each call waits before answering (for benchmarks).
    """

    name = "scripted"

    def __init__(self, script: Callable[[JudgeRequest], Reply] | str, model: str = "scripted", delay: float = 0.0) -> None:
        self._script = script
        self.model = model
        self.delay = delay
        self.requests: list[JudgeRequest] = []
        """Every request received, in order."""

    async def send(self, request: JudgeRequest) -> ProviderReply:
        """Answer from the script (see ``Provider.send``)."""
        self.requests.append(request)
        if self.delay:
            await asyncio.sleep(self.delay)
        out = self._script if isinstance(self._script, str) else self._script(request)
        if isinstance(out, ProviderError):
            raise out
        return out if isinstance(out, ProviderReply) else ProviderReply(text=out, usage=Usage())

    async def aclose(self) -> None:
        """Nothing to release."""


ProviderFactory = Callable[..., Provider]

PROVIDERS: dict[str, ProviderFactory] = {
    "anthropic": AnthropicProvider,
    "openai_compatible": OpenAICompatibleProvider,
}
"""Provider type (as in ``judges.provider.type``) -> factory taking keyword settings."""


def register_provider(name: str, factory: ProviderFactory) -> None:
    """Make a provider available to ``make_provider`` (and the config) under ``name``."""
    PROVIDERS[name] = factory


def make_provider(type: str, *, on_unused: Callable[[str], None] | None = None, **settings: Any) -> Provider:
    """Build a provider from settings as found in a config file.

    Settings that are None are left to the provider's defaults and environment.

    Args:
        type: a key of ``PROVIDERS``.
        on_unused: called with each setting the provider does not take, which is
            then dropped; without it such a setting is an error.
        **settings: ``model``, ``base_url``, ``api_key``, ``max_tokens``, ``temperature``, ...

    Raises:
        ProviderSetupError: unknown type, a setting the provider does not take
            (without ``on_unused``), or one it needs is missing.
    """
    factory = PROVIDERS.get(type)
    if factory is None:
        raise ProviderSetupError(f"unknown provider type {type!r} (known: {', '.join(sorted(PROVIDERS))})")
    given = {k: v for k, v in settings.items() if v is not None}
    allowed = getattr(factory, "SETTINGS", None)
    extra = sorted(set(given) - allowed) if allowed is not None else []
    if extra and on_unused is None:
        raise ProviderSetupError(f"{type}: does not take {', '.join(extra)}")
    for key in extra:
        on_unused(key)  # type: ignore[misc]
        del given[key]
    return factory(**given)

"""The runner: every criterion on every conversation, one judge call per LLM criterion.

A judge call is the provider's plain ``send`` wrapped twice: a per-call
timeout inside retries with backoff (which honour 429 / 529 / 5xx and
Retry-After). A bounded number of workers make calls at once; a token and cost
budget stops new calls cleanly when spent. Anything that is not a valid
verdict (junk text, schema mismatch, refusal, max tokens, timeout, exhausted
retries, a provider bug) becomes an ``error`` verdict with its reason and the
raw reply: never a pass, never cached. Code criteria run in worker processes
(``_check_process``), each within its criterion's ``timeout``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict

from ._cache import CacheKey, VerdictCache
from ._check_process import CheckFailed, run_check
from ._checks import CHECKS
from ._criteria import CodeCriterion, Criterion, LLMCriterion
from ._errors import ProviderError
from ._evidence import EvidenceIndex
from ._prompt import JudgeRequest, ReplyError, build_request, parse_reply, prompt_sha256
from ._providers import Provider, ProviderReply
from ._retry import Backoff
from ._transcript import Conversation, Usage, block_sha256, render_lines, transcript_block
from ._verdict import JudgeInfo, NotRun, Verdict

Send = Callable[[JudgeRequest], Awaitable[ProviderReply]]
Sleep = Callable[[float], Awaitable[None]]


@dataclass(frozen=True)
class RetryPolicy:
    """How failed judge calls are tried again. Only retryable failures are (429, 529, 5xx, connection)."""

    attempts: int = 4
    """Calls in all, the first included."""
    base_delay: float = 1.0
    """Backoff before the second call; doubles each time, with jitter (``Backoff``: between half and all of it)."""
    max_delay: float = 60.0
    """No wait is longer; a server asking for a longer Retry-After ends the retries."""

    def delay(self, attempt: int, retry_after: float | None) -> float | None:
        """Seconds to wait after failed call number ``attempt``, or None to stop."""
        if retry_after is not None:
            return retry_after if retry_after <= self.max_delay else None
        return Backoff(self.base_delay, self.max_delay, jitter=0.5).delay(attempt)


@dataclass(frozen=True)
class Budget:
    """A limit on what one run may spend; when reached, no new judge call starts.

    Calls already in flight finish and are counted, so a run may end slightly
    over the limit (by at most ``concurrency`` calls).
    """

    tokens: int | None = None
    """Input plus output tokens."""
    cost: float | None = None
    """In the currency of the prices below."""
    input_cost_per_mtok: float = 0.0
    """Price of a million input tokens."""
    output_cost_per_mtok: float = 0.0
    """Price of a million output tokens."""

    def cost_of(self, usage: Usage) -> float:
        """The price of some usage."""
        return (usage.input_tokens * self.input_cost_per_mtok + usage.output_tokens * self.output_cost_per_mtok) / 1e6


class JudgeRun(BaseModel):
    """What a run produced."""

    model_config = ConfigDict(extra="forbid")

    verdicts: list[Verdict]
    """One per criterion and conversation that ran, in input order (conversation, then criterion)."""
    not_run: list[NotRun]
    """LLM criteria that could not run, each with the reason; they have no verdict."""
    usage: Usage
    """Tokens spent by calls made in this run (cache hits cost nothing)."""
    cost: float = 0.0
    """Price of ``usage`` by the budget's prices (0 without them)."""
    cached: int = 0
    """Verdicts reused from the cache."""
    stopped: str | None = None
    """Why the run stopped making calls early (the budget), if it did."""


def with_timeout(send: Send, seconds: float) -> Send:
    """Wrap ``send`` so that a call taking longer than ``seconds`` fails with ``timeout``."""

    async def call(request: JudgeRequest) -> ProviderReply:
        try:
            async with asyncio.timeout(seconds):
                return await send(request)
        except TimeoutError:
            raise ProviderError("timeout", f"no reply within {seconds:g}s", retryable=False) from None

    return call


def with_retries(send: Send, policy: RetryPolicy, sleep: Sleep = asyncio.sleep) -> Send:
    """Wrap ``send`` so that retryable failures are tried again, waiting as ``policy`` and the server say."""

    async def call(request: JudgeRequest) -> ProviderReply:
        attempt = 1
        while True:
            try:
                return await send(request)
            except ProviderError as exc:
                if not exc.retryable:
                    raise
                wait = policy.delay(attempt, exc.retry_after) if attempt < policy.attempts else None
                if wait is None:
                    why = "retry-after too long" if attempt < policy.attempts else f"{attempt} attempts"
                    raise ProviderError("retries_exhausted", f"{why}; last: {exc}", raw=exc.raw) from None
                await sleep(wait)
                attempt += 1

    return call


@dataclass
class _Prepared:
    """A conversation readied once for all its criteria."""

    conversation: Conversation
    sha256: str
    block: str
    index: EvidenceIndex
    has_content: bool


def _prepare(conversation: Conversation) -> _Prepared:
    msgs = conversation.messages
    lines = list(render_lines(msgs))
    block = transcript_block(lines)
    return _Prepared(
        conversation=conversation,
        sha256=block_sha256(block),
        block=block,
        index=EvidenceIndex(lines),
        has_content=any(m.content or m.tool_calls for m in msgs),
    )


@dataclass
class _State:
    provider: Provider | None
    send: Send | None
    budget: Budget | None
    cache: VerdictCache | None
    on_result: Callable[[Verdict | NotRun], None] | None
    usage: Usage = field(default_factory=Usage)
    cost: float = 0.0
    cached: int = 0
    stopped: str | None = None
    prompt_hashes: dict[str, str] = field(default_factory=dict)

    def spend(self, usage: Usage) -> None:
        self.usage.input_tokens += usage.input_tokens
        self.usage.output_tokens += usage.output_tokens
        if self.budget is None:
            return
        self.cost += self.budget.cost_of(usage)
        total = self.usage.input_tokens + self.usage.output_tokens
        if self.budget.tokens is not None and total >= self.budget.tokens:
            self.stopped = f"budget spent: {total} tokens of {self.budget.tokens}"
        elif self.budget.cost is not None and self.cost >= self.budget.cost:
            self.stopped = f"budget spent: cost {self.cost:.4f} of {self.budget.cost:g}"


def _verdict(p: _Prepared, c: Criterion, judge: JudgeInfo, **fields: object) -> Verdict:
    return Verdict(
        conversation_id=p.conversation.id, criterion_id=c.id, criterion_version=c.version,
        judge=judge, transcript_sha256=p.sha256, **fields,  # type: ignore[arg-type]
    )


def _error(p: _Prepared, c: Criterion, judge: JudgeInfo, code: str, detail: str, raw: str = "",
           usage: Usage | None = None) -> Verdict:
    return _verdict(p, c, judge, result="error", error_reason=f"{code}: {detail}", raw_reply=raw,
                    usage=usage or Usage(), evidence_verified=False)


async def _run_code(p: _Prepared, c: CodeCriterion) -> Verdict:
    judge = JudgeInfo(provider="code", model=c.check)
    try:
        out = await run_check(CHECKS[c.check], c, p.conversation)
    except CheckFailed as exc:  # out of time, raised, or could not run: error, never a verdict
        return _error(p, c, judge, exc.code, exc.detail)
    except Exception as exc:  # e.g. no worker process could be started
        return _error(p, c, judge, "check_failed", f"{type(exc).__name__}: {exc}")
    if out is None:
        return _verdict(p, c, judge, result="not_applicable", reasoning="applies_if does not hold")
    return _verdict(p, c, judge, result=out.result, reasoning=out.reasoning, evidence=out.evidence,
                    evidence_verified=p.index.verify(out.evidence))


async def _run_llm(p: _Prepared, c: LLMCriterion, st: _State) -> Verdict | NotRun:
    if st.provider is None or st.send is None:
        return NotRun(conversation_id=p.conversation.id, criterion_id=c.id, criterion_version=c.version,
                      reason="no provider configured")
    if not p.has_content:
        return NotRun(conversation_id=p.conversation.id, criterion_id=c.id, criterion_version=c.version,
                      reason="no content captured")
    judge = JudgeInfo(provider=st.provider.name, model=st.provider.model)
    prompt_hash = st.prompt_hashes.get(c.prompt) or st.prompt_hashes.setdefault(c.prompt, prompt_sha256(c.prompt))
    key = CacheKey(c.id, c.version, prompt_hash, f"{judge.provider}/{judge.model}", p.sha256)
    if st.cache is not None and (hit := st.cache.get(key)) is not None:
        st.cached += 1
        return hit.model_copy(update={"conversation_id": p.conversation.id})
    if st.stopped:
        return NotRun(conversation_id=p.conversation.id, criterion_id=c.id, criterion_version=c.version,
                      reason=st.stopped)
    verdict = await _call(p, c, st, judge)
    if st.cache is not None and verdict.result != "error":
        st.cache.put(key, verdict)
    return verdict


async def _call(p: _Prepared, c: LLMCriterion, st: _State, judge: JudgeInfo) -> Verdict:
    assert st.send is not None
    try:
        reply = await st.send(build_request(c.prompt, p.block))
    except ProviderError as exc:
        return _error(p, c, judge, exc.code, exc.detail, exc.raw)
    except Exception as exc:  # a provider bug still records error, never a pass
        return _error(p, c, judge, "provider_failed", f"{type(exc).__name__}: {exc}")
    st.spend(reply.usage)
    if reply.stop != "end":
        code = reply.stop if reply.stop in ("refusal", "max_tokens") else "stopped"
        return _error(p, c, judge, code, f"stop reason {reply.stop_detail or reply.stop!r}", reply.text, reply.usage)
    try:
        answer = parse_reply(reply.text)
    except ReplyError as exc:
        return _error(p, c, judge, exc.code, exc.detail, reply.text, reply.usage)
    found = [p.index.found(q) for q in answer.evidence]
    # From an LLM, a pass or fail without a single quote has nothing verified.
    verified = all(found) and (bool(found) or answer.result == "not_applicable")
    return _verdict(
        p, c, judge, result=answer.result, reasoning=answer.reasoning, evidence=answer.evidence,
        evidence_verified=verified, flagged=answer.result == "fail" and not any(found),
        usage=reply.usage, raw_reply=reply.text,
    )


def _jobs(criteria: Sequence[Criterion], conversations: Iterable[Conversation]) -> Iterator[tuple[_Prepared, Criterion]]:
    for conversation in conversations:
        p = _prepare(conversation)
        for c in criteria:
            yield p, c


async def arun_judges(
    criteria: Sequence[Criterion],
    conversations: Iterable[Conversation],
    provider: Provider | None = None,
    *,
    concurrency: int = 8,
    timeout: float = 60.0,
    retry: RetryPolicy = RetryPolicy(),
    budget: Budget | None = None,
    cache: VerdictCache | None = None,
    on_result: Callable[[Verdict | NotRun], None] | None = None,
    sleep: Sleep = asyncio.sleep,
) -> JudgeRun:
    """Judge every conversation on every criterion (async).

    Code criteria run in code and need no provider. LLM criteria need one;
    without it they are reported in ``not_run`` with the reason, as are those of
    a conversation with no content, and those left when the budget is spent.

    Args:
        criteria: from ``load_criteria``.
        conversations: conversation/v1 records (simulated or production).
        provider: judges ``kind: llm`` criteria. It stays open for the next run
            (connections are reused); close it with ``await provider.aclose()``.
        concurrency: judge calls in flight at once.
        timeout: seconds per call.
        retry: how retryable failures are retried.
        budget: stop making calls when this is spent.
        cache: reuse and store verdicts (``error`` verdicts are never stored).
        on_result: called with each verdict or not-run record as it is decided (progress).
        sleep: waits between retries (tests pass a recorder).

    Returns:
        The verdicts, the not-run records, usage and why the run stopped early, if it did.
    """
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    send = None
    if provider is not None:
        send = with_retries(with_timeout(provider.send, timeout), retry, sleep)
    st = _State(provider=provider, send=send, budget=budget, cache=cache, on_result=on_result)
    results: list[tuple[int, Verdict | NotRun]] = []
    jobs = enumerate(_jobs(criteria, conversations))

    async def worker() -> None:
        for n, (p, c) in jobs:
            out = await _run_code(p, c) if isinstance(c, CodeCriterion) else await _run_llm(p, c, st)
            results.append((n, out))
            if st.on_result is not None:
                st.on_result(out)

    async with asyncio.TaskGroup() as tg:
        for _ in range(concurrency):
            tg.create_task(worker())
    results.sort(key=lambda r: r[0])
    return JudgeRun(
        verdicts=[r for _, r in results if isinstance(r, Verdict)],
        not_run=[r for _, r in results if isinstance(r, NotRun)],
        usage=st.usage, cost=st.cost, cached=st.cached, stopped=st.stopped,
    )


def run_judges(
    criteria: Sequence[Criterion],
    conversations: Iterable[Conversation],
    provider: Provider | None = None,
    *,
    concurrency: int = 8,
    timeout: float = 60.0,
    retry: RetryPolicy = RetryPolicy(),
    budget: Budget | None = None,
    cache: VerdictCache | None = None,
    on_result: Callable[[Verdict | NotRun], None] | None = None,
    sleep: Sleep = asyncio.sleep,
) -> JudgeRun:
    """Judge every conversation on every criterion, blocking until done.

    The same as ``arun_judges``, for code with no event loop of its own, such
    as an offline simulation suite. It cannot be called from a running loop.
    The provider is closed when the run ends (its connections belong to the
    loop this call runs); a later run opens them again.
    """
    async def run() -> JudgeRun:
        try:
            return await arun_judges(
                criteria, conversations, provider, concurrency=concurrency, timeout=timeout, retry=retry,
                budget=budget, cache=cache, on_result=on_result, sleep=sleep,
            )
        finally:
            if provider is not None:
                await provider.aclose()

    return asyncio.run(run())

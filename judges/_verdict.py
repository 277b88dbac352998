"""Verdicts: what a judge decided about one criterion on one conversation."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator

from ._transcript import Usage

Result = Literal["pass", "fail", "not_applicable", "error"]
Answer = Literal["pass", "fail", "not_applicable"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class JudgeReply(_Strict):
    """The only thing a model is asked for; the runner fills in the rest of the verdict."""

    reasoning: str
    """Why, in a few sentences."""
    evidence: list[str]
    """Exact quotes from the transcript."""
    result: Answer
    """The judgement on this criterion."""


class CheckResult(_Strict):
    """What a code check returns; the runner fills in ids, hashes and the judge."""

    result: Answer
    evidence: list[str] = []
    """Quotes from the transcript (as rendered for a judge) that justify the result."""
    reasoning: str = ""


class JudgeInfo(_Strict):
    """Who judged."""

    provider: str
    """``anthropic``, ``openai_compatible``, ... or ``code`` for code checks."""
    model: str
    """The model, or the check name for code checks."""


class Verdict(_Strict):
    """One criterion judged on one conversation (see docs/criteria.md)."""

    conversation_id: str
    criterion_id: str
    criterion_version: int
    result: Result
    """``error`` whenever the judge could not give a verdict; never a pass in disguise."""
    error_reason: str | None = None
    """Why there is no verdict, as ``code: detail`` (timeout, junk_reply, schema_mismatch, refusal, ...)."""
    reasoning: str = ""
    evidence: list[str] = []
    evidence_verified: bool = True
    """Every quote was found in the transcript (after whitespace and case folding)."""
    judge: JudgeInfo
    usage: Usage = Usage()
    transcript_sha256: str
    flagged: bool = False
    """A ``fail`` from an LLM judge with no verified quote: a reviewer must look."""
    raw_reply: str = ""
    """The judge's reply as received."""

    @model_validator(mode="after")
    def _error_has_reason(self) -> Verdict:
        if (self.result == "error") != (self.error_reason is not None):
            raise ValueError("error_reason is set exactly when result is 'error'")
        return self

    @property
    def clean_pass(self) -> bool:
        """A pass whose evidence was all found in the transcript."""
        return self.result == "pass" and self.evidence_verified


class NotRun(_Strict):
    """A criterion that could not run on a conversation; no verdict is recorded."""

    conversation_id: str
    criterion_id: str
    criterion_version: int
    reason: str
    """For example ``no provider configured`` or ``budget spent``."""

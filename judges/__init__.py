"""judges: criteria as data, one judge per criterion, verdicts with checked evidence.

The same library grades an offline simulation suite and production samples; it
needs no daemon, no DuckDB and no OpenTelemetry::

    from judges import load_criteria, read_conversations, run_judges, AnthropicProvider

    run = run_judges(load_criteria("criteria.yaml"), read_conversations("runs.jsonl"),
                     AnthropicProvider("claude-haiku-5-5"))

Everything public is listed in ``__all__``; the modules named ``_*`` are private.
"""

from ._cache import CacheKey, DiskCache, MemoryCache, VerdictCache
from ._calibration import (
    LABELS,
    CalibrationReport,
    CriterionCalibration,
    Pair,
    RateInterval,
    RerunCounts,
    RerunDiff,
    ReviewerAgreement,
    calibrate,
    compare_reruns,
    kappa_interval,
)
from ._check_process import set_check_workers
from ._checks import AppliesIf, CheckParams, CodeCheck, register_check
from ._criteria import CodeCriterion, Criterion, LLMCriterion, load_criteria
from ._errors import (
    ConversationError,
    CriteriaError,
    InputError,
    JudgesError,
    ProviderError,
    ProviderSetupError,
)
from ._evidence import Located, TextRange, locate_evidence, verify_evidence
from ._jsonl import escape_line_breaks, json_line, split_json_lines
from ._prompt import FRAME, JudgeRequest, ReplyError, parse_json_object
from ._providers import (
    AnthropicProvider,
    OpenAICompatibleProvider,
    Provider,
    ProviderReply,
    ScriptedProvider,
    make_provider,
    register_provider,
)
from ._retry import Backoff, parse_retry_after
from ._runner import Budget, JudgeRun, RetryPolicy, arun_judges, run_judges, with_retries, with_timeout
from ._stats import MIN_N, Proportion, RateStats, Summary, fisher_exact, summarize, weighted_proportion
from ._transcript import (
    Conversation,
    Message,
    ToolCall,
    TranscriptDigest,
    Usage,
    parse_conversations,
    read_conversations,
    render_lines,
    render_transcript,
    tool_call_text,
    transcript_sha256,
)
from ._verdict import CheckResult, JudgeInfo, NotRun, Verdict

__all__ = [
    "AnthropicProvider",
    "AppliesIf",
    "Backoff",
    "Budget",
    "CacheKey",
    "CalibrationReport",
    "CheckParams",
    "CheckResult",
    "CodeCheck",
    "CodeCriterion",
    "Conversation",
    "ConversationError",
    "CriteriaError",
    "Criterion",
    "CriterionCalibration",
    "DiskCache",
    "FRAME",
    "InputError",
    "JudgeInfo",
    "JudgeRequest",
    "JudgeRun",
    "JudgesError",
    "LABELS",
    "LLMCriterion",
    "Located",
    "MIN_N",
    "MemoryCache",
    "Message",
    "NotRun",
    "OpenAICompatibleProvider",
    "Pair",
    "Proportion",
    "Provider",
    "ProviderError",
    "ProviderReply",
    "ProviderSetupError",
    "RateInterval",
    "RateStats",
    "ReplyError",
    "RerunCounts",
    "RerunDiff",
    "RetryPolicy",
    "ReviewerAgreement",
    "ScriptedProvider",
    "Summary",
    "TextRange",
    "ToolCall",
    "TranscriptDigest",
    "Usage",
    "Verdict",
    "VerdictCache",
    "arun_judges",
    "calibrate",
    "compare_reruns",
    "escape_line_breaks",
    "fisher_exact",
    "json_line",
    "kappa_interval",
    "load_criteria",
    "locate_evidence",
    "make_provider",
    "parse_conversations",
    "parse_json_object",
    "parse_retry_after",
    "read_conversations",
    "register_check",
    "register_provider",
    "render_lines",
    "render_transcript",
    "run_judges",
    "set_check_workers",
    "split_json_lines",
    "summarize",
    "tool_call_text",
    "transcript_sha256",
    "verify_evidence",
    "weighted_proportion",
    "with_retries",
    "with_timeout",
]

"""otel-config.yaml: one strict pydantic model per section, defaults in code.

Loading order: YAML -> ``${env:NAME}`` / ``${env:NAME:-default}`` substitution in
every string (an empty variable counts as unset) -> the environment variable of
each setting that declares one (``Env``) where the file leaves it unset ->
validation with the config file's folder as the base for relative paths. Every
problem is reported at once, each with its key path
(``receivers.otlp.protocols.grpc.endpoint: ...``).

Precedence of a setting that declares an environment variable: the value in the
file, else that variable, else the default in code. The variable applies whether
or not the file spells out the key or its section (``env_settings`` lists them).

A section that no release has built yet is accepted and ignored with a warning,
so a config written for a newer tracejudge still starts an older one.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin
from urllib.parse import urlsplit

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from .alerts import ALERT_TYPES, AlertType
from .auth import same_secret
from .backends import BACKENDS, Backend
from .errors import ConfigError
from .names import clean_name, reviewer_key
from .words import is_size, masked_url, parse_duration, size_bytes

SECTIONS = (
    "receivers", "storage", "conversations", "api", "sampling",
    "judges", "review", "scenarios", "exporters", "simulate", "alerts",
)

# --------------------------------------------------------------- value types


@dataclass(frozen=True)
class Env:
    """Field metadata: the environment variable a setting takes when the config file leaves it unset."""

    name: str


Duration = Annotated[float, BeforeValidator(parse_duration)]


def _check_endpoint(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{value!r} is not host:port (for example 127.0.0.1:4317; port 0 picks a free one)")
    return value


Endpoint = Annotated[str, AfterValidator(_check_endpoint)]


def split_host(text: str) -> tuple[str, int | None]:
    """``name``, ``name:port``, ``1.2.3.4:port`` or ``[::1]:port`` -> (host, port or None).

    Names are lowercased without a trailing dot and IP addresses written in their
    short form, so that equal hosts compare equal.

    Raises:
        ValueError: not a host, or a bad port.
    """
    try:
        url = urlsplit("//" + text.strip())
        host, port = url.hostname, url.port
    except ValueError:
        raise ValueError(f"{text!r} is not a host name or host:port") from None
    if not host or url.path or url.query or url.fragment or url.username is not None or text.strip().endswith(":"):
        raise ValueError(f"{text!r} is not a host name or host:port")
    try:
        return str(ipaddress.ip_address(host)), port
    except ValueError:
        return host.rstrip("."), port


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback address (127.0.0.0/8, ::1); ``127.evil.example`` is a name, not one."""
    host = host.strip("[]").lower().rstrip(".")
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:127.0.0.1
    return ip.is_loopback


def _check_allowed_host(value: str) -> str:
    if value.strip() in ("*", ""):
        raise ValueError("list each name the API is reached by: a wildcard would let a DNS-rebinding page in")
    host, port = split_host(value)
    return host if port is None else f"{host}:{port}"


AllowedHost = Annotated[str, AfterValidator(_check_allowed_host)]


def _resolve_path(value: Any, info: ValidationInfo) -> Path:
    path = Path(str(value)).expanduser()
    base = (info.context or {}).get("base")
    if not path.is_absolute() and base is not None:
        path = Path(base) / path
    return path


ConfigPath = Annotated[Path, BeforeValidator(_resolve_path)]


def _check_size(value: Any) -> str:
    if not is_size(str(value)):
        raise ValueError(f"{value!r} is not a size; write it like 512MB or 2GiB")
    return str(value).strip()


MemorySize = Annotated[str, AfterValidator(_check_size)]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TLS(Section):
    cert_file: ConfigPath | None = None
    """PEM certificate; with key_file, the listener speaks TLS."""
    key_file: ConfigPath | None = None
    """PEM private key for cert_file."""

    @field_validator("key_file")
    @classmethod
    def _both(cls, v: Path | None, info: ValidationInfo) -> Path | None:
        if (v is None) != (info.data.get("cert_file") is None):
            raise ValueError("tls needs both cert_file and key_file")
        return v

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None


class IngestAuth(Section):
    bearer_token: Annotated[str | None, Env("TRACEJUDGE_INGEST_TOKEN")] = None
    """When set, senders must carry ``Authorization: Bearer <token>`` (gRPC: ``authorization`` metadata)."""


class APIAuth(Section):
    bearer_token: Annotated[str | None, Env("TRACEJUDGE_API_TOKEN")] = None
    """When set, everything but /healthz and /readyz needs ``Authorization: Bearer <token>``."""


class Listener(Section):
    endpoint: Endpoint
    tls: TLS = TLS()
    idle_timeout: Duration = Field(30.0, gt=0)
    """A connection with no request in flight, or still sending headers, is closed after this long
    (HTTP keep-alive; gRPC ``max_connection_idle``)."""
    read_timeout: Duration = Field(30.0, gt=0)
    """A request body must have arrived this long after its headers (HTTP); a connection must have
    finished its handshake (gRPC). OTLP exporters give a whole export 10 s by default."""


class Protocols(Section):
    """As in the Collector: once ``protocols`` is written, only the protocols listed listen."""

    grpc: Listener | None = Listener(endpoint="127.0.0.1:4317")
    """OTLP/gRPC listener; ``grpc:`` with no value listens on the default endpoint."""
    http: Listener | None = Listener(endpoint="127.0.0.1:4318")
    """OTLP/HTTP listener (protobuf and JSON, any path ending in /v1/traces, /v1/logs, /v1/metrics)."""

    @model_validator(mode="before")
    @classmethod
    def _listed_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data:
            defaults = {"grpc": {"endpoint": "127.0.0.1:4317"}, "http": {"endpoint": "127.0.0.1:4318"}}
            return {k: (defaults[k] if data.get(k) is None else data[k]) if k in data else None
                    for k in set(defaults) | set(data)}
        return data


class OTLPReceiver(Section):
    protocols: Protocols = Protocols()
    max_request_size_mib: float = Field(16, gt=0, le=1024)
    """Largest request accepted, counted after decompression; larger ones get 413 / RESOURCE_EXHAUSTED."""
    auth: IngestAuth = IngestAuth()


class Receivers(Section):
    otlp: OTLPReceiver = OTLPReceiver()


class DuckDBSettings(Section):
    path: ConfigPath = Field(Path("tracejudge.duckdb"), validate_default=True)
    """The database file; relative to the config file's folder (the default too)."""


class Retention(Section):
    spans: Duration | None = Field(None, gt=0)
    """How long span and log rows are kept after they arrive; none: for ever. A conversation's spans go
    together, once its last one is this old (reindex can rebuild it no further back)."""
    conversations: Duration | None = Field(None, gt=0)
    """How long conversations (messages, sampling decisions, verdicts, not-run records) are kept after their
    last arrival; none: for ever. Their spans go with them."""
    keep_reviewed: bool = True
    """A conversation with a review item is kept as long as its item (review items are never deleted)."""


class Storage(Section):
    # Built from {} rather than a ready instance, so that the default path resolves against the config's folder.
    duckdb: DuckDBSettings = Field(default_factory=dict, validate_default=True)
    max_queue_spans: int = Field(200_000, ge=1)
    """Spans and log records waiting for the writer before receivers push back (503 / UNAVAILABLE)."""
    max_batch_spans: int = Field(8192, ge=1)
    """Spans gathered across requests into one insert and one commit."""
    memory_limit: MemorySize = "128MB"
    """Passed to DuckDB's memory_limit so the daemon's RSS target holds. DuckDB keeps table blocks it read
    cached up to it; beyond 128MB the soak measured no faster ingest or rebuild, only a larger process."""
    retry_after: Duration = 1.0
    """The delay suggested to clients when the queue is full (Retry-After / RetryInfo)."""
    retention: Retention = Retention()


class API(Listener):
    endpoint: Endpoint = "127.0.0.1:8318"
    """Web page and JSON API (/healthz, /readyz, /metrics, /api/...); beyond loopback it needs auth.bearer_token."""
    auth: APIAuth = APIAuth()
    allowed_hosts: list[AllowedHost] = []
    """Other names the API answers to in the Host header (``name`` at any port, or ``name:port``).

    Always answered: loopback names and addresses, the endpoint's host and the
    address a client connected to, at the listening port. Any other Host gets 421,
    so a page whose name was rebound to this address (DNS rebinding) reads nothing.
    """

    @model_validator(mode="after")
    def _token_beyond_loopback(self) -> API:
        # Host and Origin checks guard browsers; only a token keeps out whoever else reaches the port.
        if not is_loopback(self.endpoint.rpartition(":")[0]) and not self.auth.bearer_token:
            raise ValueError(f"endpoint {self.endpoint} listens beyond loopback: set api.auth.bearer_token "
                             "(or $TRACEJUDGE_API_TOKEN); without a token anyone who reaches the port reads "
                             "production conversations")
        return self


class EndRule(Section):
    attribute: str
    """A span or resource attribute on any span of the conversation's newest trace."""
    equals: str | int | float | bool
    """The value that ends the conversation."""
    ended_by: Literal["handover", "bot_closed", "unknown"] = "unknown"
    """Recorded as the conversation's ``ended_by``."""


# Where conversation ids are found (genai-semconv.md section 3), in order. A trailing ``*`` matches any key with
# that prefix (keys compared in sorted order, so the pick is deterministic).
DEFAULT_ID_ATTRIBUTES: tuple[str, ...] = (
    "gen_ai.conversation.id",
    "langfuse.session.id",
    "session.id",
    "traceloop.association.properties.session_id",
    "traceloop.association.properties.conversation_id",
    "traceloop.association.properties.chat_id",
    "traceloop.association.properties.thread_id",
    "ai.telemetry.metadata.sessionId",
    "ai.telemetry.metadata.conversationId",
    "ai.telemetry.metadata.threadId",
    "ai.settings.context.*",
    "langsmith.metadata.thread_id",
    "langsmith.metadata.session_id",
    "langsmith.metadata.conversation_id",
    "thread_id",
    "gen_ai.thread.id",
    "gcp.vertex.agent.session_id",
    # The OpenAI Agents SDK's RunConfig(group_id=...), "the traces of one chat thread"; Logfire writes it on
    # each trace's root span.
    "group_id",
)


class Stitch(Section):
    window: Duration = Field(900.0, ge=0)
    """A trace with no id continues a conversation of its service by its history only if that
    conversation's data last arrived at most this long before (daemon clock); 0s turns stitching off."""
    conversations: int = Field(10_000, ge=0)
    """At most this many recent conversations without an id are remembered to be continued (about 200
    bytes each); 0 turns stitching off."""


class Conversations(Section):
    id_attributes: list[str] = Field(default_factory=lambda: list(DEFAULT_ID_ATTRIBUTES), min_length=1)
    """Where the conversation id is looked for, in order (span, then resource attributes; ``*`` ends a prefix)."""
    idle_timeout: Duration = Field(900.0, gt=0)
    """A conversation with no new data for this long (daemon clock) has ended."""
    end_rules: list[EndRule] = []
    """Attribute values that end a conversation at once (a handover, the bot closing it)."""
    lag_warning: Duration = Field(60.0, gt=0)
    """The log warns once conversations fall this far behind ingestion, and says when they catch up."""
    stall_timeout: Duration = Field(30.0, gt=0)
    """The stage's process taking in no commit for this long while commits wait is stalled: /readyz fails, and it
    is killed and started again."""
    stitch: Stitch = Stitch()
    """Traces with no conversation id continued by the history their model calls resend."""


class JudgeProvider(Section):
    type: Literal["anthropic", "openai_compatible"] | None = None
    """Which provider judges ``kind: llm`` criteria; none: the daemon reports them as not run, and the command line
    takes the one the environment gives (``evals.setup.provider_type_from_env``)."""
    model: Annotated[str | None, Env("TRACEJUDGE_JUDGE_MODEL")] = None
    """The judge model; else $ANTHROPIC_MODEL or $OPENAI_MODEL, by type."""
    base_url: str | None = None
    """The provider's API root; else $ANTHROPIC_BASE_URL or $OPENAI_BASE_URL, by type."""
    api_key: str | None = None
    """Else $ANTHROPIC_API_KEY or $OPENAI_API_KEY, by type (so one provider's key never goes to another)."""
    max_tokens: int = Field(1024, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    """openai_compatible only: the Anthropic Messages API no longer takes a temperature."""


class Judges(Section):
    criteria: list[ConfigPath] = []
    """Criteria files (see docs/criteria.md), relative to the config file's folder."""
    provider: JudgeProvider = JudgeProvider()
    concurrency: int = Field(8, ge=1, le=1024)
    timeout: Duration = 60.0
    """Per judge call."""
    check_workers: int = Field(1, ge=1, le=64)
    """Code checks run at once, each in a worker process of its own (about 25 MB each while it lasts)."""


# --------------------------------------------------------------- sampling
def _check_rate(value: float) -> float:
    if not (0.0 <= value <= 1.0) or math.isnan(value):
        raise ValueError("a rate is a probability from 0 to 1 (10% is 0.1)")
    return value


Rate = Annotated[float, AfterValidator(_check_rate)]


def _check_regex(value: str) -> str:
    import regex  # here: only sampling rules with `matches` need it, and every command reads the config

    try:
        regex.compile(value)  # the engine sampling matches with (it has time limits)
    except regex.error as exc:
        raise ValueError(f"not a valid regular expression: {exc}") from None
    return value


Regex = Annotated[str, AfterValidator(_check_regex)]


class AttributeMatch(Section):
    """A span or resource attribute of the conversation; give ``equals`` or ``matches``."""

    key: str = Field(min_length=1)
    """The attribute name, for example ``gen_ai.request.model``."""
    equals: str | int | float | bool | None = None
    """Holds when a value of the attribute equals this one (``5`` and ``"5"``, ``true`` and ``"true"`` are equal)."""
    matches: Regex | None = None
    """Holds when a regular expression finds a match anywhere in a value (anchor it with ``^...$``)."""

    @model_validator(mode="after")
    def _one_test(self) -> AttributeMatch:
        if (self.equals is None) == (self.matches is None):
            raise ValueError("give exactly one of equals or matches")
        return self


WHEN_KEYS = ("ended_by", "service", "model", "attribute", "min_user_turns", "max_user_turns", "status")


class When(Section):
    """Conditions on a finished conversation; every key given must hold."""

    ended_by: Literal["idle", "handover", "bot_closed", "unknown"] | None = None
    """How the conversation ended: the idle timeout, or the ``ended_by`` of an end rule."""
    service: str | None = None
    """The conversation's ``service.name``."""
    model: str | None = None
    """A model that answered in the conversation (any of them)."""
    attribute: AttributeMatch | None = None
    """A span or resource attribute on any span of the conversation."""
    min_user_turns: int | None = Field(None, ge=0)
    """At least this many user messages."""
    max_user_turns: int | None = Field(None, ge=0)
    """At most this many user messages."""
    status: Literal["error"] | None = None
    """``error``: some span of the conversation has status ERROR."""

    @model_validator(mode="after")
    def _not_empty(self) -> When:
        if all(getattr(self, k) is None for k in WHEN_KEYS):
            raise ValueError(f"an empty when matches everything; give at least one of {', '.join(WHEN_KEYS)}"
                             " (or set the default rate)")
        if (self.min_user_turns is not None and self.max_user_turns is not None
                and self.min_user_turns > self.max_user_turns):
            raise ValueError(f"min_user_turns ({self.min_user_turns}) is above max_user_turns "
                             f"({self.max_user_turns}): nothing can match")
        return self


class SamplingRule(Section):
    """One rule: the conversations its ``when`` matches are sampled at its ``rate``."""

    when: When
    rate: Rate
    """Inclusion probability, from 0 (never) to 1 (always)."""


class SamplingBudget(Section):
    """Caps on judging; null means unlimited. What a budget stops is recorded as skipped."""

    conversations_per_hour: int | None = Field(None, ge=0)
    """Conversations admitted for judging in any sliding 3600 seconds (daemon clock)."""
    judge_tokens_per_day: int | None = Field(None, ge=0)
    """Judge tokens (input + output) per UTC calendar day; none admitted once spent."""


class SamplingSettings(Section):
    """The ``sampling:`` section: a default rate, rules tried in order, budgets."""

    rate: Rate = 0.1
    """Inclusion probability of a conversation no rule matches."""
    seed: int = 0
    """Mixed into the hash; change it to draw a different sample of the same traffic."""
    rules: list[SamplingRule] = []
    """Tried in order; the first whose ``when`` holds gives the rate."""
    budget: SamplingBudget = SamplingBudget()


def _check_reviewer_name(value: str) -> str:
    name = clean_name(value)
    if not name:
        raise ValueError("a reviewer's name needs a visible character")
    return name


def _problem_at(loc: tuple[str | int, ...], value: Any, message: str, kind: str = "invalid") -> InitErrorDetails:
    """A problem at a key path below the validator raising it (``ValidationError.from_exception_data``);
    ``kind`` ``key_rule`` for a key given or left out against a rule (its message says it; no value is repeated)."""
    return InitErrorDetails(type=PydanticCustomError(kind, "{message}", {"message": message}), loc=loc,
                            input=value)


class Reviewer(Section):
    name: Annotated[str, AfterValidator(_check_reviewer_name)]
    """Who decides with this token: the name every decision and label made with it carries (kept without
    invisible characters or extra spaces)."""
    token: str = Field(min_length=8)
    """What the reviewer signs in with on the page, and sends to the JSON API as ``Authorization: Bearer
    <token>`` (``${env:...}`` keeps it out of the file)."""


class Review(Section):
    queue_results: list[Literal["pass", "fail", "not_applicable"]] = ["fail"]
    """Verdict results that open a review item (every flagged fail does too; an error never does)."""
    calibration_rate: float = Field(0.05, ge=0, le=1)
    """Share of judged conversations per criterion (passes and not_applicable too) that become blind
    labelling tasks: a person labels them without seeing the verdict. Chosen from the conversation id,
    the criterion and ``sampling.seed``; 0 turns it off."""
    reviewers_per_item: int = Field(1, ge=1, le=20)
    """An item stays pending until this many different reviewers have decided it; each decides before
    seeing the others' decisions, and the majority decides (a tie: unclear)."""
    reviewers: list[Reviewer] = []
    """A token per reviewer: when set, every action that records a reviewer (a claim or an assignment, a
    decision, a blind label, a label import; on the page or the JSON API) records the reviewer of the token
    it is made with, never a typed name, and the review pages need a token (one of these, or
    ``api.auth.bearer_token``). Empty: the name typed is recorded, and nothing checks it."""
    lock_timeout: Duration = Field(900.0, gt=0)
    """A reviewer's claim on an item (or an assignment) holds this long; meanwhile another reviewer's
    decision on it is refused."""
    max_false_pass: float = Field(0.05, gt=0, lt=1)
    """A criterion whose false-pass rate (people said fail, the judge pass) may be above this, by its 95%
    interval, is marked not calibrated."""

    @field_validator("reviewers")
    @classmethod
    def _distinct_reviewers(cls, reviewers: list[Reviewer]) -> list[Reviewer]:
        tokens = [r.token for r in reviewers]
        if len(set(tokens)) != len(tokens):
            raise ValueError("two reviewers have the same token")  # never echoed: it is a secret
        seen: dict[str, int] = {}
        problems = []
        for n, r in enumerate(reviewers):
            first = seen.setdefault(reviewer_key(r.name), n)
            if first != n:
                problems.append(_problem_at((n, "name"), r.name, (
                    f"the same reviewer as review.reviewers[{first}].name ({reviewers[first].name!r}): names are "
                    "compared in NFKC, case-folded, without invisible characters or extra spaces")))
        if problems:
            raise ValidationError.from_exception_data("reviewers", problems)
        return reviewers

    @model_validator(mode="after")
    def _enough_reviewers(self) -> "Review":
        if self.reviewers and len(self.reviewers) < self.reviewers_per_item:
            raise ValidationError.from_exception_data("review", [_problem_at(
                ("reviewers_per_item",), self.reviewers_per_item,
                f"review.reviewers names {len(self.reviewers)}: no item could ever be decided")])
        return self


class ScenarioRedaction(Section):
    patterns: dict[str, Regex] = {}
    """Extra values to mask before a scenario is drafted or written: name -> regular expression
    (placeholder ``<NAME_n>``), beside the built-in detectors (see docs/scenarios.md, Redaction)."""


class Scenarios(Section):
    out_dir: ConfigPath = Field(Path("scenarios/incoming"), validate_default=True)
    """Where ``tracejudge scenarios export`` writes, relative to the config file: never the stable suite."""
    on_confirm: bool = False
    """The daemon exports each review item as it is confirmed (through the page, the API or the CLI)."""
    draft_with_provider: bool = True
    """Draft persona, goal, facts and a proposed fix with judges.provider when one is configured;
    false (or no provider): a deterministic draft marked ``source.needs_edit``."""
    max_turns: int = Field(12, ge=1, le=200)
    """``max_turns`` of each scenario written."""
    redact: ScenarioRedaction = ScenarioRedaction()


class SimulatedUserProvider(JudgeProvider):
    """``judges.provider``'s shape for the simulated user's model."""

    type: Literal["anthropic", "openai_compatible"]
    """Required once the section is written: without one, ``provider: null`` (judges.provider) is meant."""
    model: str | None = None
    """The simulated user's model; else $ANTHROPIC_MODEL or $OPENAI_MODEL, by type. Unlike the judge's, it takes
    no $TRACEJUDGE_JUDGE_MODEL: the judge's variable never picks (or conjures) the simulated user's model."""

    @field_validator("temperature")
    @classmethod
    def _one_temperature(cls, value: float | None) -> float | None:
        if value is not None:
            raise ValueError("the simulated user's temperature is simulate.user.temperature")
        return value


class SimulatedUser(Section):
    provider: SimulatedUserProvider | None = None
    """Who plays the simulated user; none: judges.provider (``Config.simulated_user_provider``)."""
    temperature: float = Field(1.0, ge=0, le=2)
    """The simulated user's sampling temperature; part of its identity, so a new one needs new realism labels."""


class Simulate(Section):
    """The ``simulate:`` section: ``tracejudge simulate`` runs scenarios against the bot with a simulated user."""

    user: SimulatedUser = SimulatedUser()
    max_turns: int = Field(12, ge=1)
    """User turns at most in one simulated conversation; reaching it ends it ``turn_limit``."""
    replicates: int = Field(5, ge=1, le=100)
    """Conversations per scenario."""
    min_realism: Rate = 0.8
    """The simulated user is validated once the lower end of the 95% interval of the share people judged
    realistic reaches this; until then every figure of the report says "simulated user not validated"."""
    realism_sample_rate: Rate = 0.2
    """Share of imported simulated conversations (those carrying ``attributes.simulated_user``) that become
    blind labelling tasks of the built-in criterion ``simulated_user_realistic``; chosen from the conversation
    id and ``sampling.seed``; 0 turns it off."""
    bot_timeout: Duration = Field(60.0, gt=0)
    """How long the bot may take to answer one user message."""
    concurrency: int = Field(4, ge=1, le=256)
    """Conversations simulated at once."""


def parse_size(value: Any) -> int:
    """``512MB`` / ``1GiB`` -> bytes."""
    if isinstance(value, bool) or not is_size(str(value)):
        raise ValueError(f"{value!r} is not a size; write it like 512MB or 1GiB")
    return size_bytes(str(value))


ByteSize = Annotated[int, BeforeValidator(parse_size)]


class ExporterQueue(Section):
    max_size: ByteSize = Field(parse_size("1GiB"), gt=0)
    """The on-disk queue's bound in bytes of requests (``512MB``, ``1GiB``)."""
    on_full: Literal["backpressure", "drop_oldest"] = "backpressure"
    """backpressure: the receivers answer 503 / UNAVAILABLE, as a full writer does, until there is room;
    drop_oldest: the oldest queued requests are dropped (counted) to make room."""


class ExporterRedaction(Section):
    mode: Literal["none", "content"] = "none"
    """content: every string that leaves (attribute values at any depth, span and event names, status and
    exception messages, log bodies, verdict explanations) passes through the redaction module, but for the
    structural attributes of docs/forwarding.md's list and ``keep_attributes``; none: requests leave as they came."""
    keep_attributes: list[str] = []
    """Attribute keys (``*`` ends a prefix) whose values leave as they are, beside the built-in list."""
    patterns: dict[str, Regex] = {}
    """Extra values to mask: name -> regular expression (placeholder ``<NAME_n>``)."""
    timeout: Duration = Field(30.0, gt=0)
    """How long the rewrite of one request may take; a request not redacted in time is held back, never sent."""


def _redact_shorthand(value: Any) -> Any:
    return {"mode": value} if isinstance(value, str) else value


class Exporter(Section):
    type: str
    """Which backend: its auth header and conventions (``collector.backends``, docs/forwarding.md)."""
    endpoint: str | None = None
    """The traces URL (ending in /v1/traces); logs go to the same URL with /v1/logs. Each type but otlphttp
    has its cloud URL as default."""
    api_key: str | None = None
    """The backend's key (``${env:NAME:-}``); required by langsmith and langwatch, and by opik on Comet's
    cloud."""
    project: str | None = None
    """LangSmith: Langsmith-Project; Opik: projectName."""
    workspace: str | None = None
    """Opik: Comet-Workspace (required on Comet's cloud)."""
    headers: dict[str, str] = {}
    """Extra headers sent with every request."""
    signals: list[Literal["traces", "logs"]] | None = Field(None, min_length=1)
    """What is forwarded: traces (the spans) and logs (log records, and verdicts as
    gen_ai.evaluation.result events). Default: traces and logs for langwatch and otlphttp, traces for
    opik and langsmith (no evidence they read evaluation events)."""
    queue: ExporterQueue = ExporterQueue()
    redact: Annotated[ExporterRedaction, BeforeValidator(_redact_shorthand)] = ExporterRedaction()
    """``none`` or ``content`` (shorthand for ``mode``), or the mapping below."""
    timeout: Duration = Field(10.0, gt=0)
    """How long one send may take before it is retried."""

    @field_validator("type")
    @classmethod
    def _check_type(cls, value: str) -> str:
        if value not in BACKENDS:
            raise ValueError(f"not a backend type: one of {', '.join(BACKENDS)}")
        return value

    @field_validator("endpoint")
    @classmethod
    def _check_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        url, shown = urlsplit(value), masked_url(value)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"{shown!r} is not an http(s) URL")
        if not url.path.rstrip("/").endswith("/v1/traces"):
            raise ValueError(f"{shown!r} is not a traces URL: it ends in /v1/traces (logs go to /v1/logs)")
        return value

    @model_validator(mode="after")
    def _check_backend(self) -> "Exporter":
        if (problem := self.backend.problem(self)) is not None:
            raise ValueError(problem)
        return self

    @property
    def backend(self) -> Backend:
        """The conventions of its ``type``."""
        return BACKENDS[self.type]

    @property
    def url(self) -> str:
        """The traces URL."""
        return self.endpoint or self.backend.endpoint or ""

    @property
    def sends(self) -> tuple[str, ...]:
        """The signals forwarded (``signals`` or the type's default)."""
        if self.signals is not None:
            return tuple(dict.fromkeys(self.signals))
        return self.backend.signals


# --------------------------------------------------------------- alerts


class Webhook(Section):
    """Where alerts are POSTed (``collector.alerts.webhooks``)."""

    url: str
    """The receiver's http(s) URL; printed with its user, password and query values masked."""
    secret: str | None = None
    """Signs every body: ``X-Tracejudge-Signature: sha256=<hex HMAC-SHA256 of the raw body>``; none: unsigned."""
    format: Literal["json", "slack"] = "json"
    """json: the alert as a JSON object; slack: a Slack incoming-webhook message (``text`` and ``blocks``)."""
    events: list[AlertType] = Field(default_factory=lambda: list(ALERT_TYPES), min_length=1)
    """The alert types sent to it."""
    timeout: Duration = Field(10.0, gt=0)
    """Bounds one whole exchange; then the delivery is retried."""

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        url = urlsplit(value)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"{masked_url(value)!r} is not an http(s) URL")
        return value


MonitorKind = Literal["failure_rate", "judge_agreement", "judge_errors"]
# What each kind of monitor reads (required: all of the first, and one at least of the second), and what it takes.
_MONITOR_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "failure_rate": (("criterion", "window", "above"), (), ("criterion", "window", "above")),
    "judge_agreement": (("criterion",), ("max_false_pass", "min_kappa"), ("criterion", "max_false_pass", "min_kappa")),
    "judge_errors": (("window", "above"), (), ("criterion", "window", "above")),
}


class Monitor(Section):
    """A rate watched over time; it fires an alert when it crosses its threshold."""

    kind: MonitorKind
    """failure_rate: a criterion's failure rate over ``window`` above ``above``; judge_agreement: a criterion's
    judge against people on the blind labels (false passes above ``max_false_pass``, Cohen's kappa below
    ``min_kappa``); judge_errors: the share of judge calls that errored over ``window`` above ``above``."""
    criterion: str | None = None
    """The criterion id (judge_errors: none for every criterion)."""
    window: Duration | None = Field(None, gt=0)
    """The time the rate is computed over (failure_rate, judge_errors)."""
    above: Rate | None = None
    """The threshold the rate must exceed to fire (failure_rate, judge_errors)."""
    max_false_pass: Rate | None = None
    """judge_agreement: fires when the false-pass rate is above this."""
    min_kappa: float | None = Field(None, ge=-1, le=1)
    """judge_agreement: fires when agreement (Cohen's kappa) is below this."""
    name: str | None = None
    """Names it on /metrics and in its alerts; default ``<kind>:<criterion>`` (``judge_errors`` alone)."""

    @model_validator(mode="after")
    def _fits_its_kind(self) -> "Monitor":
        required, one_of, takes = _MONITOR_KEYS[self.kind]
        problems = [_problem_at((key,), None, f"required by kind {self.kind}", "key_rule")
                    for key in required if getattr(self, key) is None]
        if one_of and all(getattr(self, key) is None for key in one_of):
            problems.append(_problem_at((one_of[0],), None, f"kind {self.kind} needs {' or '.join(one_of)} "
                                                            "(or both)", "key_rule"))
        problems += [_problem_at((key,), None, f"not used by kind {self.kind}", "key_rule")
                     for key in ("criterion", "window", "above", "max_false_pass", "min_kappa")
                     if key not in takes and getattr(self, key) is not None]
        if problems:
            raise ValidationError.from_exception_data("monitor", problems)
        if self.name is None:
            object.__setattr__(self, "name", f"{self.kind}:{self.criterion}" if self.criterion else self.kind)
        return self


class Alerts(Section):
    """The ``alerts:`` section: live criteria, monitors and the webhooks their alerts go to."""

    live_settle: Duration = Field(2.0, gt=0)
    """Live criteria judge an open conversation once its newest turn has had no new data for this long (a
    turn's spans arrive over a moment)."""
    webhooks: list[Webhook] = []
    """Every alert goes to each webhook whose ``events`` include its type."""
    monitors: list[Monitor] = []
    """Rates watched on the stored verdicts and labels."""

    @field_validator("webhooks")
    @classmethod
    def _distinct_urls(cls, webhooks: list[Webhook]) -> list[Webhook]:
        seen: dict[str, int] = {}
        problems = [_problem_at((n, "url"), None, f"the same URL as alerts.webhooks[{seen[w.url]}]: give each "
                                                  "receiver once, with every event it takes")
                    for n, w in enumerate(webhooks) if seen.setdefault(w.url, n) != n]
        if problems:
            raise ValidationError.from_exception_data("webhooks", problems)
        return webhooks

    @field_validator("monitors")
    @classmethod
    def _distinct_names(cls, monitors: list[Monitor]) -> list[Monitor]:
        seen: dict[str, int] = {}
        problems = [_problem_at((n, "name"), m.name, f"the same name as alerts.monitors[{seen[str(m.name)]}]: "
                                                     "give one of them a name of its own")
                    for n, m in enumerate(monitors) if seen.setdefault(str(m.name), n) != n]
        if problems:
            raise ValidationError.from_exception_data("monitors", problems)
        return monitors


def _check_exporter_name(value: dict[str, Any]) -> dict[str, Any]:
    for name in value:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", str(name)):
            raise ValueError(f"exporter name {name!r}: use letters, digits, _ . - (it names its queue file)")
    return value


class Config(BaseModel):
    """The whole configuration. Sections not built yet stay raw in ``unbuilt``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    receivers: Receivers = Receivers()
    storage: Storage = Field(default_factory=dict, validate_default=True)  # see Storage.duckdb
    api: API = API()
    conversations: Conversations = Conversations()
    judges: Judges = Judges()
    sampling: SamplingSettings = SamplingSettings()
    review: Review = Review()
    scenarios: Scenarios = Field(default_factory=dict, validate_default=True)  # see Scenarios.out_dir
    simulate: Simulate = Simulate()
    exporters: Annotated[dict[str, Exporter], AfterValidator(_check_exporter_name)] = {}
    """Where every accepted request is forwarded, each by a name of the user's."""
    alerts: Alerts = Alerts()
    source: str = "<defaults>"
    unbuilt: dict[str, Any] = {}

    @model_validator(mode="after")
    def _reviewer_tokens_are_not_the_api_token(self) -> "Config":
        # The API token names nobody: a reviewer signing in with it could not record a decision.
        api = self.api.auth.bearer_token
        same = [n for n, r in enumerate(self.review.reviewers) if api and same_secret(r.token, api)]
        if same:
            raise ValidationError.from_exception_data("Config", [_problem_at(
                ("review", "reviewers", n, "token"), None, "the same as api.auth.bearer_token: give each reviewer "
                "a token of their own (the API token names no reviewer)") for n in same])
        return self

    @model_validator(mode="after")
    def _retention_outlasts_idle(self) -> "Config":
        idle = self.conversations.idle_timeout
        for what in ("spans", "conversations"):
            keep = getattr(self.storage.retention, what)
            if keep is not None and keep < idle:
                raise ValueError(f"storage.retention.{what} ({keep:g}s) must be at least conversations.idle_timeout "
                                 f"({idle:g}s): a conversation's rows would go before it ends")
        return self

    @property
    def simulated_user_provider(self) -> JudgeProvider:
        """Who plays the simulated user: ``simulate.user.provider``, else ``judges.provider``."""
        return self.simulate.user.provider or self.judges.provider

    @property
    def forward_dir(self) -> Path:
        """Where the exporters' on-disk queue is kept (``collector.forward.queue``), beside the DuckDB file."""
        return Path(str(self.storage.duckdb.path) + ".forward")

    @property
    def calibration_dir(self) -> Path:
        """Where ``tracejudge calibrate --freeze`` keeps judge regression sets, beside the DuckDB file."""
        return Path(str(self.storage.duckdb.path) + ".calibration")

    @property
    def runtime_file(self) -> Path:
        """Where a running daemon says where it listens."""
        return Path(str(self.storage.duckdb.path) + ".daemon.json")


BUILT = ("receivers", "storage", "api", "conversations", "sampling", "judges", "review", "scenarios", "exporters",
         "simulate", "alerts")

# --------------------------------------------------------------- loading

_ENV = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def _substitute(value: Any, environ: dict[str, str]) -> Any:
    if isinstance(value, dict):
        return {k: _substitute(v, environ) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(v, environ) for v in value]
    if not isinstance(value, str) or "${" not in value:
        return value

    def repl(m: re.Match[str]) -> str:
        got = environ.get(m.group(1)) or ""
        return got if got else (m.group(2) or "")

    whole = _ENV.fullmatch(value.strip())
    out = _ENV.sub(repl, value)
    if whole:
        # A value that is only a reference takes the type YAML gives the result
        # (``${env:PORT}`` -> int), as the Collector does; empty -> unset.
        if out == "":
            return None
        try:
            return yaml.safe_load(out)
        except yaml.YAMLError:
            return out
    return out


def _drop_none(value: Any) -> Any:
    """An unset ``${env:...}`` means "use the default", so drop keys whose value is None.

    ``protocols`` keeps its keys: there ``grpc:`` with no value means "on, with defaults".
    """
    if isinstance(value, dict):
        return {k: ({} if v is None else _drop_none(v)) if k == "protocols" else _drop_none(v)
                for k, v in value.items() if v is not None or k in ("grpc", "http")}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


def _submodel(annotation: Any) -> type[BaseModel] | None:
    """The section model of a field (``Listener | None`` included), None for values and lists."""
    if get_origin(annotation) is list:
        return None
    return next((a for a in (annotation, *get_args(annotation)) if isinstance(a, type) and issubclass(a, BaseModel)),
                None)


def _env_var(model: type[BaseModel], name: str) -> str | None:
    return next((m.name for m in model.model_fields[name].metadata if isinstance(m, Env)), None)


def env_settings(model: type[BaseModel] | None = None, where: str = "") -> Iterator[tuple[str, str]]:
    """Every setting that declares an environment variable: (key path, variable name)."""
    for name, field in (model or Config).model_fields.items():
        var = _env_var(model or Config, name)
        sub = _submodel(field.annotation)
        if var is not None:
            yield f"{where}{name}", var
        elif sub is not None:
            yield from env_settings(sub, f"{where}{name}.")


def _apply_env(model: type[BaseModel], raw: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """``raw`` with each setting it leaves unset that declares an ``Env`` taken from ``environ`` (when non-empty)."""
    out = dict(raw)
    for name, field in model.model_fields.items():
        var = _env_var(model, name)
        sub = _submodel(field.annotation)
        if var is not None:
            if out.get(name) is None and environ.get(var):
                out[name] = environ[var]
        elif sub is not None and isinstance(out.get(name, {}), dict):
            given = out.get(name, {})
            filled = _apply_env(sub, given, environ)
            if filled != given:  # a section the file leaves out stays out unless a variable fills it
                out[name] = filled
    return out


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("function-after", "function-before") or str(part).startswith(("function-", "lax-")):
            continue
        else:
            out += ("." if out else "") + str(part)
    return out


_SECRETS = ("token", "api_key", "secret", "url")
"""Keys whose values an error never repeats."""


def _problem(err: Any) -> str:
    where = _loc(err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    elif (err["type"] not in ("missing", "key_rule") and "input" in err and not isinstance(err["input"], (dict, list))
          and not str(err["loc"][-1]).endswith(_SECRETS)):
        msg = f"{msg} (got {err['input']!r})"
    return f"{where}: {msg}"


def default_config_path() -> Path:
    return Path(os.environ.get("TRACEJUDGE_CONFIG") or "otel-config.yaml")


def load_config(path: Path | str | None = None, environ: dict[str, str] | None = None) -> tuple[Config, list[str]]:
    """Load and validate a config file; returns the config and its warnings.

    With ``path`` None the default file is used when it exists, else the
    built-in defaults (relative paths then resolve against the working folder).

    Raises:
        ConfigError: with every problem found, each naming its key path.
    """
    env = dict(os.environ if environ is None else environ)
    explicit = path is not None
    file = Path(path) if path is not None else default_config_path()
    if not file.exists():
        if explicit or os.environ.get("TRACEJUDGE_CONFIG"):
            raise ConfigError(str(file), ["file not found"])
        return validate_config({}, base=Path.cwd(), source="<defaults>", environ=env)
    try:
        raw = yaml.safe_load(file.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(str(file), [f"not valid YAML: {exc}".replace("\n", " ")]) from None
    except OSError as exc:
        raise ConfigError(str(file), [f"cannot read: {exc.strerror}"]) from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(str(file), ["the top level must be a mapping of sections"])
    return validate_config(_substitute(raw, env), base=file.resolve().parent, source=str(file), environ=env)


def validate_config(raw: dict[str, Any], base: Path, source: str,
                    environ: Mapping[str, str] | None = None) -> tuple[Config, list[str]]:
    """Validate an already-substituted config mapping (see ``load_config``); ``environ`` defaults to os.environ."""
    problems: list[str] = []
    warnings: list[str] = []
    built: dict[str, Any] = {}
    unbuilt: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in SECTIONS:
            problems.append(f"{key}: unknown section (known: {', '.join(SECTIONS)})")
        elif key in BUILT:
            built[key] = {} if value is None else _drop_none(value)
        else:
            unbuilt[key] = value
            warnings.append(f"{source}: section {key!r} is not used by this version of tracejudge yet; ignored")
    built = _apply_env(Config, built, os.environ if environ is None else environ)
    try:
        cfg = Config.model_validate({**built, "source": source, "unbuilt": unbuilt}, context={"base": base})
    except ValidationError as exc:
        problems.extend(_problem(e) for e in exc.errors())
        cfg = None
    if problems:
        raise ConfigError(source, problems)
    assert cfg is not None
    return cfg, warnings

"""``tracejudge demo``: a daemon on a demo config, real traffic through the OpenTelemetry SDK."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import click

from ..errors import UserError
from ..system.runtime import DEMO_DIR, RuntimeInfo, running_daemon
from ..words import plural

if TYPE_CHECKING:
    from ..api.client import APIClient

DEMO_CONFIG = """\
# tracejudge demo configuration (written by `tracejudge demo`; edit freely).
receivers:
  otlp:
    protocols:
      grpc: {{endpoint: "127.0.0.1:{grpc}"}}
      http: {{endpoint: "127.0.0.1:{http}"}}
storage:
  duckdb: {{path: ./demo.duckdb}}
api:
  endpoint: "127.0.0.1:{api}"
conversations:
  idle_timeout: 10s
  end_rules:
    - {{attribute: app.handover, equals: true, ended_by: handover}}
sampling:
  rate: 1.0                          # the demo judges every conversation; production samples (0.1 is the default)
judges:
  criteria: [criteria.yaml]
  provider:                          # LLM criteria run once ANTHROPIC_API_KEY is set; else they are reported as not run
    type: anthropic
    model: ${{env:TRACEJUDGE_JUDGE_MODEL:-claude-opus-5}}
    base_url: ${{env:ANTHROPIC_BASE_URL:-}}
    api_key: ${{env:ANTHROPIC_API_KEY:-}}
review:
  queue_results: [fail]
"""

DEMO_CRITERIA = """\
# Criteria of the demo's ShopBot (the format: docs/criteria.md in tracejudge). Code checks run with no key;
# the LLM criteria run when ANTHROPIC_API_KEY is set and are otherwise reported as not run.
criteria:
  - id: looks-orders-up
    version: 1
    kind: code
    severity: high
    group: accuracy
    check: tool_called
    name: lookup_order
    applies_if: {user_matches: '(?i)(order|ordine|B-[0-9]+)'}

  - id: hands-over-when-asked
    version: 1
    kind: code
    severity: high
    group: escalation
    check: ended_by
    one_of: [handover]
    applies_if: {user_matches: "(?i)(a person|a human|an agent|operatore|موظف)"}

  - id: no-promises-for-the-carrier
    version: 1
    kind: code
    severity: medium
    group: accuracy
    check: regex
    role: assistant
    pattern: "(?i)(carrier|corriere) will (call|contact)"
    must: not_match

  - id: refund-policy
    version: 1
    kind: llm
    severity: high
    group: accuracy
    prompt: |
      Criterion: the bot offers a refund only for items that were damaged or lost, and only
      within 30 days of delivery, and never promises a refund before the order was looked up.
      - "pass": every refund the bot offered or promised meets these conditions.
      - "fail": the bot offered or promised a refund that does not meet them.
      - "not_applicable": refunds never came up.

  - id: answers-in-the-users-language
    version: 1
    kind: llm
    severity: low
    group: tone
    prompt: |
      Criterion: the bot answers in the language the user writes in.
      - "pass": every bot message is in the language of the user message before it.
      - "fail": some bot message is in another language.
      - "not_applicable": there is no user message.
"""


def _start_daemon(config_path: Path, log_path: Path, runtime_file: Path) -> tuple[subprocess.Popen[bytes], RuntimeInfo]:
    runtime_file.unlink(missing_ok=True)
    log = open(log_path, "ab")
    proc = subprocess.Popen([sys.executable, "-m", "collector", "serve", "--config", str(config_path)],
                            stdout=log, stderr=subprocess.STDOUT)
    log.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-3:]
            raise UserError(f"the demo daemon did not start: {' / '.join(tail)} (full log: {log_path})")
        info = RuntimeInfo.read(runtime_file)
        if info is not None and info.pid == proc.pid:
            return proc, info
        time.sleep(0.1)
    proc.terminate()
    raise UserError(f"the demo daemon did not become ready within 60s; see {log_path}")


def _your_bot(info: RuntimeInfo) -> str:
    """How to point a bot of one's own at the demo daemon, on each receiver it listens on."""
    lines = ["Send your own bot's traces here: set, in the bot's environment,"]
    if info.grpc:
        lines.append(f"  over gRPC   OTEL_EXPORTER_OTLP_ENDPOINT=http://{info.grpc} OTEL_EXPORTER_OTLP_PROTOCOL=grpc")
    if info.http:
        lines.append(f"  over HTTP   OTEL_EXPORTER_OTLP_ENDPOINT=http://{info.http} "
                     "OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf")
    lines += ["  and also    OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental",
              "              OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_ONLY  (without it there is "
              "nothing to judge)"]
    return "\n".join(lines)


def _wait_for_conversations(client: APIClient, timeout: float = 60.0) -> None:
    """Until the daemon has rebuilt the conversations of everything it stored (at most ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = client.get("/api/status")
        if (status["conversations_batch"] >= status["committed_batch"] and not status["queue_depth"]
                and not status["conversations_pending"]):
            return
        time.sleep(0.1)


@click.command()
@click.option("--dir", "folder", type=click.Path(file_okay=False, path_type=Path), default=DEMO_DIR,
              show_default=True, envvar="TRACEJUDGE_DEMO_DIR", show_envvar=True,
              help="Folder for the demo's config, DuckDB file and daemon log.")
@click.option("--ephemeral-ports", is_flag=True, help="Listen on free ports instead of 4317/4318/8318.")
@click.option("--exit", "exit_after", is_flag=True,
              help="Stop the daemon this command started once the traffic is in and its conversations are rebuilt, "
                   "instead of serving until Ctrl-C.")
def demo(folder: Path, ephemeral_ports: bool, exit_after: bool) -> None:
    """See tracejudge work: start a daemon on a demo config and send it chatbot traffic.

    Writes DIR/otel-config.yaml (unless it exists), starts `tracejudge serve` on it
    (unless a demo daemon already runs there), then plays scripted multi-turn
    conversations through the real OpenTelemetry SDK and OTLP/gRPC exporter:
    several personas, a tool call, Italian and Arabic, a long message and a
    handover to a person. It ends by printing where to look, and keeps the
    daemon serving until Ctrl-C (or stops it with --exit).
    """
    from ..config import load_config
    from ..demo.traffic import PERSONAS, send_demo_traffic

    folder.mkdir(parents=True, exist_ok=True)
    config_path = folder / "otel-config.yaml"
    if not config_path.exists() or ephemeral_ports:
        ports = {"grpc": 0, "http": 0, "api": 0} if ephemeral_ports else {"grpc": 4317, "http": 4318, "api": 8318}
        config_path.write_text(DEMO_CONFIG.format(**ports), encoding="utf-8")
    if not (folder / "criteria.yaml").exists():
        (folder / "criteria.yaml").write_text(DEMO_CRITERIA, encoding="utf-8")
    cfg, _ = load_config(config_path)
    runtime_file = cfg.runtime_file
    proc = None
    info = running_daemon(runtime_file)
    if info is not None:
        click.echo(f"Using the demo daemon already running (pid {info.pid}).")
    else:
        click.echo(f"Starting a demo daemon on {config_path} ...")
        proc, info = _start_daemon(config_path, folder / "daemon.log", runtime_file)
    if info.grpc is None:
        raise UserError(f"{config_path}: the demo needs the OTLP/gRPC receiver")

    click.echo(f"Sending {plural(len(PERSONAS), 'conversation')} through the OpenTelemetry SDK to {info.grpc}:")
    try:
        sent = send_demo_traffic(info.grpc, progress=click.echo)
    except RuntimeError as exc:
        raise UserError(str(exc)) from None
    from ..api.client import APIClient

    client = APIClient(info.api, cfg.api.auth.bearer_token)
    counts = client.get("/api/spans/count?traces=true")
    api = info.api
    cfg_arg = f"--config {config_path}"
    criteria = folder / "criteria.yaml"
    # Name the command as the user can type it: `.venv/bin/tracejudge` when the venv is not active.
    if shutil.which("tracejudge"):
        prog = "tracejudge"
    elif sys.argv[0].endswith("__main__.py"):  # python -m collector
        prog = f"{os.path.relpath(sys.executable)} -m collector"
    else:
        prog = os.path.relpath(sys.argv[0])
    click.echo(f"""
Stored: {plural(counts['spans'], 'span')} in {plural(counts['traces'], 'trace')} ({sent['spans']} sent this run).

Where to look:
  conversations {prog} conversations list {cfg_arg}
  a transcript  {prog} conversations show {sent['conversations'][1]['id']} {cfg_arg}
                (they end after 10s without new data; the Arabic one at once, by its handover)
  verdicts      {prog} stats {cfg_arg}      (within a minute: each ended conversation is judged
                on {criteria}; LLM criteria run once ANTHROPIC_API_KEY is set)
  review queue  {api}/review   or   {prog} review list {cfg_arg}
  scenarios     {prog} scenarios export {cfg_arg}   (each failure a reviewer confirms becomes a
                scenario for your offline suite, personal data masked)
  as JSON       curl {api}/api/conversations   {api}/api/stats   {api}/api/review
  metrics       curl {api}/metrics
  one trace     curl {api}/api/traces/<trace id>
  daemon log    {folder / 'daemon.log'}
  DuckDB file   {cfg.storage.duckdb.path}   (open it with SQL once the daemon stops:
                SELECT criterion_id, result, count(*) FROM verdicts GROUP BY ALL)
{_your_bot(info)}""")
    if proc is None:
        return
    if exit_after:
        _wait_for_conversations(client)  # a stop leaves what is not rebuilt yet to the next start
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        click.echo("Demo daemon stopped.")
        return
    click.echo(f"\nThe demo daemon keeps serving (pid {proc.pid}); Ctrl-C stops it.")

    def forward(signum: int, frame: FrameType | None) -> None:
        proc.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    code = proc.wait()
    click.echo("Demo daemon stopped.")
    sys.exit(0 if code in (0, -signal.SIGTERM) else 1)

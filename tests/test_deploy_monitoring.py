"""What the people on call get under deploy/: Prometheus alert rules and a Grafana dashboard over /metrics.

Both parse and hold what their tools expect; every tracejudge metric they use is on a real daemon's /metrics
(with exporters, monitors and webhooks configured, so that labelled series show), with the labels they match
on; and where promtool is installed (Debian's prometheus package; .ci/run installs it) it checks the rules and
runs each alert on series made for it.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import pytest
import yaml

from .support.daemon import DaemonProcess, base_config, wait_until
from .support.stored import add_verdicts, create_store, label

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
RULES = DEPLOY / "prometheus" / "tracejudge-rules.yaml"
DASHBOARD = DEPLOY / "grafana" / "tracejudge-dashboard.json"

# A metric name, then its matchers if any: tracejudge_x_total{reason=~"a|b", instance="..."}.
_SELECTOR = re.compile(r"\b(tracejudge_[a-z0-9_]+)(?:\{([^}]*)\})?")
_MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*"')
_ADDED_BY_PROMETHEUS = {"instance", "job"}


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    return [rule for group in doc["groups"] for rule in group["rules"]]


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))  # type: ignore[no-any-return]


def dashboard_queries(dash: dict[str, Any]) -> list[str]:
    queries = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    queries += [v["query"]["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    return queries


def selectors(queries: list[str]) -> list[tuple[str, set[str]]]:
    """Each metric the queries name, with the labels they match it on (those Prometheus adds left out)."""
    return [(name, set(_MATCHER.findall(inner or "")) - _ADDED_BY_PROMETHEUS)
            for query in queries for name, inner in _SELECTOR.findall(query)]


# --------------------------------------------------------------- the files as their tools read them

def test_every_rule_says_how_bad_it_is_and_what_to_do() -> None:
    doc = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    names = [g["name"] for g in doc["groups"]]
    assert len(set(names)) == len(names)
    alerts = [r["alert"] for r in rules()]
    assert len(set(alerts)) == len(alerts) and len(alerts) >= 8
    for rule in rules():
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert rule["labels"]["severity"] in ("page", "warning"), rule["alert"]
        assert set(rule["annotations"]) == {"summary", "description"}, rule["alert"]
        assert "tracejudge_" in rule["expr"], rule["alert"]


def test_the_rules_cover_what_the_people_on_call_must_hear_of() -> None:
    used = {name for rule in rules() for name, _ in selectors([rule["expr"]])}
    for metric in ("tracejudge_stage_running",  # a stage stopped
                   "tracejudge_conversations_lag_seconds", "tracejudge_eval_pending",  # lag growing
                   "tracejudge_spans_rejected_total",  # the writer refusing
                   "tracejudge_forward_oldest_age_seconds", "tracejudge_forward_dropped_total",  # exporters behind
                   "tracejudge_alerts_undelivered_oldest_seconds",  # alerts not delivered
                   "tracejudge_alert_deliveries_total"):
        assert metric in used, metric


def test_the_dashboard_is_a_grafana_dashboard_with_every_section() -> None:
    dash = dashboard()
    assert dash["uid"] == "tracejudge" and dash["title"] and isinstance(dash["schemaVersion"], int)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    rows = [p["title"] for p in dash["panels"] if p["type"] == "row"]
    assert [r.split()[0] for r in rows] == ["Ingest", "Lag", "Verdicts", "Failure", "Alerts"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(set(ids)) == len(ids)
    for panel in dash["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"] and panel["description"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(set(refs)) == len(refs), panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
    # No two panels overlap on the 24-column grid.
    cells = [(p["title"], x, y) for p in dash["panels"] for x in range(p["gridPos"]["x"], p["gridPos"]["x"] +
             p["gridPos"]["w"]) for y in range(p["gridPos"]["y"], p["gridPos"]["y"] + p["gridPos"]["h"])]
    taken: dict[tuple[int, int], str] = {}
    for title, x, y in cells:
        assert (x, y) not in taken, f"{title!r} overlaps {taken[(x, y)]!r}"
        taken[(x, y)] = title


# --------------------------------------------------------------- every metric they use is on /metrics

@pytest.fixture(scope="module")
def metrics_text(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """/metrics of a daemon with an exporter sending traces and logs, monitors and a webhook configured, on a
    store whose recent verdicts and blind labels give each monitor its values."""
    data = tmp_path_factory.mktemp("monitoring")
    db = data / "tracejudge.duckdb"
    create_store(db)
    recently = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=10)
    with duckdb.connect(str(db)) as cur:
        results = ["fail"] * 10 + ["pass"] * 10
        add_verdicts(cur, [{"conversation_id": f"c{n}", "criterion_id": "red-flags", "result": result,
                            "judged_at": recently} for n, result in enumerate(results)])
        for n, result in enumerate(results):
            label(cur, f"c{n}", "red-flags", result, recently)
    config = base_config(
        data,
        exporters={"backend": {"type": "otlphttp", "endpoint": "http://127.0.0.1:9/v1/traces",
                               "signals": ["traces", "logs"]}},
        alerts={"webhooks": [{"url": "http://127.0.0.1:9/hook"}],
                "monitors": [{"kind": "failure_rate", "criterion": "red-flags", "window": "1h", "above": 0.02},
                             {"kind": "judge_agreement", "criterion": "red-flags", "max_false_pass": 0.05,
                              "min_kappa": 0.6},
                             {"kind": "judge_errors", "window": "15m", "above": 0.2}]})
    d = DaemonProcess(data, config).start()

    def read() -> str | None:
        text: str = d.get("/metrics")[1]
        return text if 'measure="kappa"' in text else None

    try:
        yield wait_until(read, "the monitors on /metrics")
    finally:
        d.end()


def _exposed(text: str) -> tuple[dict[str, str], dict[str, set[str]]]:
    """The type of each metric family, and the label names its samples carry."""
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    labels: dict[str, set[str]] = {}
    for name, inner in re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})? ", text, re.M):
        labels.setdefault(name, set()).update(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', inner))
    return types, labels


def _family(name: str, types: dict[str, str]) -> str | None:
    """The family a sample name belongs to: itself, or a histogram's whose _bucket, _sum or _count it is."""
    if name in types:
        return name
    base = re.sub(r"_(bucket|sum|count)$", "", name)
    return base if types.get(base) == "histogram" else None


@pytest.mark.slow
@pytest.mark.parametrize("where", ["rules", "dashboard"])
def test_every_metric_they_use_is_on_metrics_with_the_labels_they_match(metrics_text: str, where: str) -> None:
    queries = [r["expr"] for r in rules()] if where == "rules" else dashboard_queries(dashboard())
    types, labels = _exposed(metrics_text)
    used = selectors(queries)
    assert used
    problems = set()
    for name, matched in used:
        family = _family(name, types)
        if family is None:
            problems.add(f"{name} is not on /metrics")
            continue
        sample = name if name in labels else f"{family}_bucket" if types[family] == "histogram" else family
        have = labels.get(sample, set())
        if not matched <= have:
            problems.add(f"{name} is matched on {sorted(matched - have)}; its labels: {sorted(have)}")
    assert not problems, f"the {where}: " + "; ".join(sorted(problems))


# --------------------------------------------------------------- promtool

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (Debian's prometheus package has it; .ci/run installs it)")

# Each alert on series made for it: (alert, input series, [(minutes from the start, labels of the alerts
# firing then)]). Series values are promtool's expanding notation: 0+5x20 is 0, 5, 10, ... one a minute.
CASES: list[tuple[str, dict[str, str], list[tuple[int, list[dict[str, str]]]]]] = [
    ("TracejudgeStageStopped", {'tracejudge_stage_running{stage="evaluator"}': "1 1 0x10",
                                'tracejudge_stage_running{stage="retention"}': "1x12"},
     [(3, []), (5, [{"stage": "evaluator", "severity": "page"}])]),
    ("TracejudgeStageFailing", {'tracejudge_stage_errors_total{stage="monitors"}': "0+1x40",
                                'tracejudge_stage_errors_total{stage="evaluator"}': "0 0 1x38"},
     [(15, []), (25, [{"stage": "monitors", "severity": "warning"}])]),
    ("TracejudgeWriterRefusing", {
        'tracejudge_spans_rejected_total{reason="backpressure"}': "0x5 0+100x25",
        'tracejudge_spans_rejected_total{reason="storage_error"}': "0x30",
        'tracejudge_spans_rejected_total{reason="invalid"}': "0+50x30",  # the senders' fault: no page
        'tracejudge_log_records_rejected_total{reason="backpressure"}': "0x30",
        'tracejudge_log_records_rejected_total{reason="storage_error"}': "0x30"},
     [(5, []), (10, []), (20, [{"severity": "page"}])]),
    ("TracejudgeCommitsFailing", {'tracejudge_spans_rejected_total{reason="storage_error"}': "0x5 0+5x20",
                                  'tracejudge_spans_rejected_total{reason="backpressure"}': "0x25"},
     [(8, []), (15, [{"reason": "storage_error", "severity": "page"}])]),
    ("TracejudgeConversationsLagGrowing", {'tracejudge_conversations_lag_seconds{job="a"}': "0+20x60",
                                           'tracejudge_conversations_lag_seconds{job="b"}': "300x60"},
     [(15, []), (30, [{"job": "a", "severity": "warning"}])]),
    ("TracejudgeEvalBacklogGrowing", {'tracejudge_eval_pending{job="a"}': "0+10x90",
                                      'tracejudge_eval_pending{job="b"}': "500x90"},
     [(30, []), (60, [{"job": "a", "severity": "warning"}])]),
    ("TracejudgeJudgeErrors", {'tracejudge_eval_verdicts_total{result="error"}': "0+30x40",
                               'tracejudge_eval_verdicts_total{result="pass"}': "0+70x40"},
     [(10, []), (30, [{"severity": "warning"}])]),
    ("TracejudgeExporterBehind", {'tracejudge_forward_oldest_age_seconds{exporter="opik"}': "0+60x30",
                                  'tracejudge_forward_oldest_age_seconds{exporter="otlp"}': "1x30"},
     [(15, []), (25, [{"exporter": "opik", "severity": "warning"}])]),
    ("TracejudgeExporterDropping", {'tracejudge_forward_dropped_total{exporter="opik",reason="queue_full"}':
                                    "0 0 0 5x10"},
     [(2, []), (4, [{"exporter": "opik", "reason": "queue_full", "severity": "warning"}])]),
    ("TracejudgeExporterHoldingBack", {'tracejudge_forward_held_total{exporter="opik",reason="timeout"}':
                                       "0 0 0 1x10"},
     [(2, []), (4, [{"exporter": "opik", "reason": "timeout", "severity": "warning"}])]),
    ("TracejudgeAlertsUndelivered", {"tracejudge_alerts_undelivered_oldest_seconds": "0+60x30"},
     [(12, []), (20, [{"severity": "page"}])]),
    ("TracejudgeAlertsRefused", {'tracejudge_alert_deliveries_total{outcome="refused"}': "0x5 1x30",
                                 'tracejudge_alert_deliveries_total{outcome="retried"}': "0+3x35"},
     [(4, []), (7, [{"outcome": "refused", "severity": "page"}]), (70, [])]),
]


@needs_promtool
def test_promtool_checks_the_rules() -> None:
    assert PROMTOOL is not None
    done = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


@needs_promtool
def test_promtool_fires_each_alert_on_its_series_and_not_before(tmp_path: Path) -> None:
    assert PROMTOOL is not None
    assert sorted(c[0] for c in CASES) == sorted(r["alert"] for r in rules())  # every alert has its case
    # promtool compares the annotations too; they are checked above, so these runs compare the labels only.
    doc = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(doc), encoding="utf-8")
    tests = [{
        "interval": "1m",
        "input_series": [{"series": series, "values": values} for series, values in inputs.items()],
        "alert_rule_test": [{"eval_time": f"{minutes}m", "alertname": alert,
                             "exp_alerts": [{"exp_labels": labels} for labels in firing]}
                            for minutes, firing in expected],
    } for alert, inputs, expected in CASES]
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "1m",
                                                         "tests": tests}), encoding="utf-8")
    done = subprocess.run([PROMTOOL, "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr

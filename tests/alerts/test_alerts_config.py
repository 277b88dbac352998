"""The ``alerts:`` section: the issue's example reads as written, and every mistake is named by its key path."""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args

import pytest
import yaml

from collector.alerts import ALERT_TYPES
from collector.config import Webhook, validate_config
from collector.errors import ConfigError

from ..support.daemon import base_config, clean_env, run_cli

EXAMPLE = """
alerts:
  webhooks:
    - url: https://hooks.example/tracejudge
      secret: ${env:TRACEJUDGE_WEBHOOK_SECRET:-}
      format: json
      events: [live_failure, failure_rate, judge_agreement, judge_errors]
  monitors:
    - {criterion: red-flags, kind: failure_rate, window: 1h, above: 0.02}
    - {criterion: red-flags, kind: judge_agreement, max_false_pass: 0.05, min_kappa: 0.6}
    - {kind: judge_errors, window: 15m, above: 0.2}
"""


def problems(alerts: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as err:
        validate_config({"alerts": alerts}, Path("."), "t", environ={})
    return err.value.problems


def test_the_issues_example_reads_as_written(tmp_path: Path) -> None:
    from collector.config import load_config

    (tmp_path / "otel-config.yaml").write_text(EXAMPLE)
    cfg, warnings = load_config(tmp_path / "otel-config.yaml", environ={"TRACEJUDGE_WEBHOOK_SECRET": "s3cret"})
    assert warnings == [] and cfg.unbuilt == {}
    (hook,) = cfg.alerts.webhooks
    assert (hook.url, hook.secret, hook.format, hook.events, hook.timeout) == (
        "https://hooks.example/tracejudge", "s3cret", "json", list(ALERT_TYPES), 10.0)
    rate, agreement, errors = cfg.alerts.monitors
    assert (rate.name, rate.window, rate.above) == ("failure_rate:red-flags", 3600.0, 0.02)
    assert (agreement.name, agreement.max_false_pass, agreement.min_kappa) == ("judge_agreement:red-flags", 0.05, 0.6)
    assert (errors.name, errors.criterion, errors.window, errors.above) == ("judge_errors", None, 900.0, 0.2)
    assert cfg.alerts.live_settle == 2.0
    unset, _ = load_config(tmp_path / "otel-config.yaml", environ={})
    assert unset.alerts.webhooks[0].secret is None  # an empty variable: unsigned
    assert get_args(get_args(Webhook.model_fields["events"].annotation)[0]) == ALERT_TYPES


@pytest.mark.parametrize("alerts, expected", [
    ({"monitors": [{"kind": "failure_rate", "criterion": "x", "window": "1h"}]},
     ["alerts.monitors[0].above: required by kind failure_rate"]),
    ({"monitors": [{"kind": "failure_rate", "criterion": "x", "window": "1h", "above": 2}]},
     ["alerts.monitors[0].above: a rate is a probability from 0 to 1 (10% is 0.1) (got 2)"]),
    ({"monitors": [{"kind": "failure_rate", "window": "1h", "above": 0.1, "min_kappa": 0.5}]},
     ["alerts.monitors[0].criterion: required by kind failure_rate",
      "alerts.monitors[0].min_kappa: not used by kind failure_rate"]),
    ({"monitors": [{"kind": "judge_agreement", "criterion": "x", "window": "1h"}]},
     ["alerts.monitors[0].max_false_pass: kind judge_agreement needs max_false_pass or min_kappa (or both)",
      "alerts.monitors[0].window: not used by kind judge_agreement"]),
    ({"monitors": [{"kind": "judge_agreement", "criterion": "x", "min_kappa": 1.5}]},
     ["alerts.monitors[0].min_kappa: Input should be less than or equal to 1 (got 1.5)"]),
    ({"monitors": [{"kind": "judge_errors", "window": "15m", "above": 0.2},
                   {"kind": "judge_errors", "window": "1h", "above": 0.5}]},
     ["alerts.monitors[1].name: the same name as alerts.monitors[0]: give one of them a name of its own "
      "(got 'judge_errors')"]),
    ({"monitors": [{"kind": "judge_errors", "window": "15 minutes", "above": 0.2}]},
     ["alerts.monitors[0].window: '15 minutes' is not a duration; write it like 500ms, 10s, 15m or 1h "
      "(got '15 minutes')"]),
    ({"monitors": [{"kind": "latency"}]},
     ["alerts.monitors[0].kind: Input should be 'failure_rate', 'judge_agreement' or 'judge_errors' (got 'latency')"]),
    ({"webhooks": [{"url": "ftp://user:pw@hooks.example/x?key=k1", "secret": "s3cret", "format": "xml",
                    "events": ["live_failure", "paging"], "timeot": "5s"}]},
     ["alerts.webhooks[0].url: 'ftp://***@hooks.example/x?key=***' is not an http(s) URL",
      "alerts.webhooks[0].format: Input should be 'json' or 'slack' (got 'xml')",
      "alerts.webhooks[0].events[1]: Input should be 'live_failure', 'failure_rate', 'judge_agreement' or "
      "'judge_errors' (got 'paging')",
      "alerts.webhooks[0].timeot: unknown key"]),
    ({"webhooks": [{"url": "https://a.example/h"}, {"url": "https://a.example/h", "format": "slack"}]},
     ["alerts.webhooks[1].url: the same URL as alerts.webhooks[0]: give each receiver once, with every event it "
      "takes"]),
    ({"webhooks": [{"url": "https://a.example/h", "events": []}], "live_settle": "soon"},
     ["alerts.live_settle: 'soon' is not a duration; write it like 500ms, 10s, 15m or 1h (got 'soon')",
      "alerts.webhooks[0].events: List should have at least 1 item after validation, not 0"]),
])
def test_a_bad_alerts_section_names_each_problem_by_its_key_path(alerts: dict[str, Any],
                                                                 expected: list[str]) -> None:
    got = problems(alerts)
    assert sorted(got) == sorted(expected)
    assert not any("pw" in p or "k1" in p or "s3cret" in p for p in got)  # secrets are never repeated


@pytest.mark.slow
def test_serve_stops_at_a_bad_alerts_section_naming_the_key(tmp_path: Path) -> None:
    cfg = base_config(tmp_path, alerts={"monitors": [{"kind": "failure_rate", "criterion": "red-flags",
                                                      "window": "1h", "above": 1.5}]})
    path = tmp_path / "otel-config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    done = run_cli("serve", "--config", str(path), env=clean_env())
    assert done.returncode == 2, done.stderr
    assert "alerts.monitors[0].above: a rate is a probability from 0 to 1" in done.stderr
    assert "Traceback" not in done.stderr

"""The config model: substitution, paths, defaults, and every error with its key path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from collector.config import Config, env_settings, load_config, parse_duration, size_bytes, validate_config
from collector.errors import ConfigError

from .support.daemon import REPO, base_config, clean_env, run_cli

TESTDATA = Path(__file__).parent / "testdata" / "config"


def test_good_config_substitutes_env_and_resolves_paths() -> None:
    cfg, warnings = load_config(TESTDATA / "good.yaml", environ={"TJ_TEST_MAX_MIB": "4", "TJ_TEST_TOKEN": ""})
    assert cfg.receivers.otlp.max_request_size_mib == 4  # ${env:...} alone takes YAML's type
    assert cfg.receivers.otlp.protocols.grpc is not None
    assert cfg.receivers.otlp.protocols.grpc.endpoint == "127.0.0.1:0"  # default inside a longer string
    assert cfg.receivers.otlp.auth.bearer_token is None  # empty counts as unset
    assert cfg.storage.duckdb.path == TESTDATA / "data" / "db.duckdb"  # relative to the config's folder
    assert cfg.storage.max_queue_spans == 200_000  # default
    assert cfg.runtime_file == TESTDATA / "data" / "db.duckdb.daemon.json"
    assert cfg.sampling.rate == 0.5 and cfg.review.queue_results == ["fail"]
    assert cfg.scenarios.out_dir == TESTDATA / "out" / "scenarios"
    assert cfg.exporters == {} and cfg.unbuilt == {}  # every section is built
    assert not any("is not used" in w for w in warnings)


def test_env_default_used_when_unset_and_value_when_set() -> None:
    cfg, _ = load_config(TESTDATA / "good.yaml", environ={"TJ_TEST_GRPC_PORT": "4999", "TJ_TEST_TOKEN": "t"})
    assert cfg.receivers.otlp.protocols.grpc.endpoint == "127.0.0.1:4999"  # type: ignore[union-attr]
    assert cfg.receivers.otlp.max_request_size_mib == 8
    assert cfg.receivers.otlp.auth.bearer_token == "t"


ENV = {"TRACEJUDGE_API_TOKEN": "api-env", "TRACEJUDGE_INGEST_TOKEN": "ingest-env",
       "TRACEJUDGE_JUDGE_MODEL": "judge-env"}


def test_env_vars_of_settings_apply_when_the_file_leaves_the_keys_out() -> None:
    cfg, _ = load_config(TESTDATA / "no_auth.yaml", environ=ENV)
    assert cfg.api.auth.bearer_token == "api-env"
    assert cfg.receivers.otlp.auth.bearer_token == "ingest-env"
    assert cfg.judges.provider.model == "judge-env"
    assert cfg.receivers.otlp.protocols.http is None  # filling a section in leaves what the file wrote alone
    unset, _ = load_config(TESTDATA / "no_auth.yaml", environ={"TRACEJUDGE_API_TOKEN": ""})
    assert unset.api.auth.bearer_token is None and unset.judges.provider.model is None


def test_the_default_database_path_is_in_the_config_files_folder() -> None:
    cfg, _ = load_config(TESTDATA / "no_auth.yaml", environ={})
    assert cfg.storage.duckdb.path == TESTDATA / "tracejudge.duckdb"
    assert cfg.runtime_file == TESTDATA / "tracejudge.duckdb.daemon.json"


def test_the_file_wins_over_the_env_var_of_a_setting() -> None:
    cfg, _ = load_config(TESTDATA / "good.yaml", environ={**ENV, "TJ_TEST_TOKEN": "from-file"})
    assert cfg.receivers.otlp.auth.bearer_token == "from-file"
    # An empty ${env:...} counts as unset: the setting's own variable applies.
    cfg, _ = load_config(TESTDATA / "good.yaml", environ={**ENV, "TJ_TEST_TOKEN": ""})
    assert cfg.receivers.otlp.auth.bearer_token == "ingest-env"


def test_env_vars_apply_with_no_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TRACEJUDGE_CONFIG", raising=False)
    cfg, _ = load_config(None, environ=ENV)
    assert cfg.source == "<defaults>"
    assert (cfg.api.auth.bearer_token, cfg.receivers.otlp.auth.bearer_token) == ("api-env", "ingest-env")


def test_every_env_var_is_documented_and_shipped() -> None:
    """Each setting with a variable: the configuration reference's row names it and otel-config.yaml writes
    ${env:VAR:-}."""
    readme = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    shipped = yaml.safe_load((REPO / "otel-config.yaml").read_text(encoding="utf-8"))
    found = dict(env_settings())
    assert found == {"receivers.otlp.auth.bearer_token": "TRACEJUDGE_INGEST_TOKEN",
                     "api.auth.bearer_token": "TRACEJUDGE_API_TOKEN",
                     "judges.provider.model": "TRACEJUDGE_JUDGE_MODEL"}
    for key, var in found.items():
        rows = [line for line in readme.splitlines() if line.startswith(f"| `{key}`")]
        assert len(rows) == 1 and f"${var}" in rows[0], (key, rows)
        value: object = shipped
        for part in key.split("."):
            value = value[part]  # type: ignore[index]
        assert value == f"${{env:{var}:-}}", key


@pytest.mark.parametrize("endpoint", ["0.0.0.0:8318", "[::]:8318", "10.0.0.5:8318", "127.evil.example:8318",
                                      "tracejudge.internal:8318"])
def test_an_api_beyond_loopback_needs_a_token(endpoint: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate_config({"api": {"endpoint": endpoint}}, Path("."), "t", environ={})
    (problem,) = err.value.problems
    assert "api.auth.bearer_token" in problem and "TRACEJUDGE_API_TOKEN" in problem and endpoint in problem
    cfg, _ = validate_config({"api": {"endpoint": endpoint}}, Path("."), "t", environ={"TRACEJUDGE_API_TOKEN": "t"})
    assert cfg.api.auth.bearer_token == "t"


@pytest.mark.parametrize("endpoint", ["127.0.0.1:0", "localhost:8318", "127.0.0.2:0", "[::1]:0"])
def test_an_api_on_loopback_needs_no_token(endpoint: str) -> None:
    cfg, _ = validate_config({"api": {"endpoint": endpoint, "allowed_hosts": ["Review.Example.:443"]}},
                             Path("."), "t", environ={})
    assert cfg.api.auth.bearer_token is None and cfg.api.allowed_hosts == ["review.example:443"]


@pytest.mark.parametrize("name, problems", [
    ("typo.yaml", ["receivers.otlp.protocols.grcp: unknown key"]),
    ("bad_duration.yaml", ["storage.retry_after: '5 minutes' is not a duration",
                           "judges.timeout: 30 has no unit"]),
    ("unknown_key.yaml", ["storage.duckdb.mode: unknown key", "api.endpoint: 'localhost' is not host:port"]),
    ("unknown_section.yaml", ["processors: unknown section"]),
    ("not_a_mapping.yaml", ["the top level must be a mapping"]),
    ("bad_scenarios.yaml", ["scenarios.out-dir: unknown key", "scenarios.max_turns:",
                            "scenarios.redact.patterns.member_id: not a valid regular expression"]),
    ("bad_simulate.yaml", ["simulate.user.provider.type:", "simulate.user.temperature:", "simulate.user.seed: unknown key",
                           "simulate.max_turns:", "simulate.replicates:", "simulate.min_realism: a rate is",
                           "simulate.realism_sample_rate: a rate is", "simulate.bot_timeout: 60 has no unit",
                           "simulate.concurrency:"]),
    ("bad_hosts.yaml", ["api.allowed_hosts[0]: list each name", "api.allowed_hosts[1]: 'http://tracejudge.internal/' "
                        "is not a host name", "api.allowed_hosts[2]: 'review.example:99999' is not a host name"]),
])
def test_bad_configs_name_every_key(name: str, problems: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(TESTDATA / name, environ={})
    text = str(err.value)
    for p in problems:
        assert p in text, text
    assert len(err.value.problems) == len(problems)


@pytest.mark.parametrize("name, key", [
    ("typo.yaml", "receivers.otlp.protocols.grcp"),
    ("bad_duration.yaml", "storage.retry_after"),
    ("unknown_key.yaml", "storage.duckdb.mode"),
])
def test_serve_with_bad_config_exits_2_with_one_line(name: str, key: str) -> None:
    res = run_cli("serve", "--config", str(TESTDATA / name))
    assert res.returncode == 2
    assert key in res.stderr
    assert "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_serve_with_a_misspelt_key_in_a_criteria_file_names_it_once(tmp_path: Path) -> None:
    typo = TESTDATA.parent / "criteria" / "typo_check.yaml"
    path = tmp_path / "otel-config.yaml"
    path.write_text(yaml.safe_dump(base_config(tmp_path, judges={"criteria": [str(typo)]})), encoding="utf-8")
    res = run_cli("serve", "--config", str(path))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "judges.criteria:" in res.stderr and "chek: unknown key (did you mean check?)" in res.stderr
    assert res.stderr.count("check: missing") == 1


def test_missing_config_file_is_exit_2() -> None:
    res = run_cli("serve", "--config", "/nonexistent/otel-config.yaml")
    assert res.returncode == 2 and "file not found" in res.stderr


def test_config_from_env_variable(tmp_path: Path) -> None:
    res = run_cli("serve", env=clean_env(TRACEJUDGE_CONFIG=str(TESTDATA / "typo.yaml")))
    assert res.returncode == 2 and "grcp" in res.stderr


def test_usage_error_is_exit_2() -> None:
    assert run_cli("serve", "--no-such-flag").returncode == 2
    assert run_cli("no-such-command").returncode == 2


def test_shipped_config_spells_out_every_default() -> None:
    """otel-config.yaml holds exactly the built-in defaults for every built section."""
    shipped, warnings = load_config(REPO / "otel-config.yaml", environ={})
    defaults, _ = load_config(None, environ={})
    assert warnings == []
    dump = lambda c: c.model_dump(exclude={"source", "unbuilt"})  # noqa: E731
    shipped_d, default_d = dump(shipped), dump(defaults)
    # Paths resolve against different folders; compare their names.
    assert shipped_d["storage"]["duckdb"]["path"].name == default_d["storage"]["duckdb"]["path"].name
    shipped_d["storage"]["duckdb"]["path"] = default_d["storage"]["duckdb"]["path"] = None
    assert shipped_d == default_d
    raw = yaml.safe_load((REPO / "otel-config.yaml").read_text())
    _every_field_written(Config, raw, "")


def _every_field_written(model: type, raw: dict, where: str) -> None:  # type: ignore[type-arg]
    from pydantic import BaseModel

    for name, field in model.model_fields.items():  # type: ignore[attr-defined]
        if name in ("source", "unbuilt"):
            continue
        assert name in raw, f"otel-config.yaml does not spell out {where}{name}"
        sub = field.annotation
        if getattr(sub, "__origin__", None) is dict:
            continue  # entries named by the user (exporters): the shipped file has none, an example in comments
        args = getattr(sub, "__args__", ())
        target = next((a for a in (sub, *args) if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if target is not None and isinstance(raw[name], dict) and name != "tls":
            _every_field_written(target, raw[name], f"{where}{name}.")


def test_durations() -> None:
    assert parse_duration("500ms") == 0.5
    assert parse_duration("15m") == 900
    assert parse_duration("1h") == 3600
    for bad in ("10", "1 week", "", "-5s", True):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_only_listed_protocols_listen() -> None:
    from collector.config import validate_config

    cfg, _ = validate_config({"receivers": {"otlp": {"protocols": {"http": None}}}}, Path("."), "t")
    assert cfg.receivers.otlp.protocols.grpc is None
    assert cfg.receivers.otlp.protocols.http is not None
    assert cfg.receivers.otlp.protocols.http.endpoint == "127.0.0.1:4318"
    cfg, _ = validate_config({}, Path("."), "t")
    assert cfg.receivers.otlp.protocols.grpc is not None and cfg.receivers.otlp.protocols.http is not None


def test_sizes_read_in_duckdbs_units() -> None:
    assert size_bytes("128MB") == 128_000_000 and size_bytes("2GiB") == 2 * 1024**3 and size_bytes("1.5 KB") == 1500
    # The reindex on a file takes the smaller of the configured limit and its own cap.
    assert min("256MB", "128MB", key=size_bytes) == "128MB" and min("100MiB", "128MB", key=size_bytes) == "100MiB"
    with pytest.raises(ValueError, match="not a size"):
        size_bytes("lots")


@pytest.mark.parametrize("value, problem", [("1 minute", "conversations.lag_warning: '1 minute' is not a duration"),
                                            ("0s", "conversations.lag_warning:")])
def test_a_bad_lag_warning_names_the_key(value: str, problem: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate_config({"conversations": {"lag_warning": value}}, Path("."), "t", environ={})
    (got,) = err.value.problems
    assert problem in got, got
    cfg, _ = validate_config({"conversations": {"lag_warning": "2m"}}, Path("."), "t", environ={})
    assert cfg.conversations.lag_warning == 120


@pytest.mark.parametrize("value", ["-1s", "0s", "soon"])
def test_a_bad_stall_timeout_names_the_key(value: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate_config({"conversations": {"stall_timeout": value}}, Path("."), "t", environ={})
    (got,) = err.value.problems
    assert got.startswith("conversations.stall_timeout:"), got
    assert repr(value) in got or "greater than 0" in got, got
    cfg, _ = validate_config({}, Path("."), "t", environ={})
    assert cfg.conversations.stall_timeout == 30
    cfg, _ = validate_config({"conversations": {"stall_timeout": "2m"}}, Path("."), "t", environ={})
    assert cfg.conversations.stall_timeout == 120


@pytest.mark.parametrize(("stitch", "key"), [({"window": "-1s"}, "conversations.stitch.window"),
                                            ({"window": "soon"}, "conversations.stitch.window"),
                                            ({"conversations": -1}, "conversations.stitch.conversations"),
                                            ({"windw": "5m"}, "conversations.stitch.windw")])
def test_a_bad_stitch_section_names_the_key(stitch: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate_config({"conversations": {"stitch": stitch}}, Path("."), "t", environ={})
    (got,) = err.value.problems
    assert got.startswith(f"{key}:"), got
    cfg, _ = validate_config({"conversations": {"stitch": {"window": "0s"}}}, Path("."), "t", environ={})
    assert cfg.conversations.stitch.window == 0 and cfg.conversations.stitch.conversations == 10_000


def test_the_simulate_section_is_read() -> None:
    cfg, warnings = load_config(TESTDATA / "simulate.yaml", environ={"TRACEJUDGE_JUDGE_MODEL": "judge-env"})
    sim = cfg.simulate
    assert sim.user.provider is not None and sim.user.provider.model == "user-model"
    assert cfg.simulated_user_provider is sim.user.provider
    assert (sim.user.temperature, sim.max_turns, sim.replicates) == (0.7, 8, 3)
    assert (sim.min_realism, sim.realism_sample_rate, sim.bot_timeout, sim.concurrency) == (0.9, 0.5, 120.0, 16)
    assert cfg.judges.provider.model == "judge-model"
    assert cfg.unbuilt == {} and cfg.alerts.monitors == [] and warnings == []


def test_the_simulated_user_falls_back_to_the_judges_provider() -> None:
    # The judge's model variable is the judge's: it never conjures a provider for the simulated user.
    env = {"TRACEJUDGE_JUDGE_MODEL": "judge-env"}
    for raw in ({}, {"simulate": {"user": {"temperature": 0.2}}}, {"simulate": {"user": {"provider": None}}}):
        cfg, _ = validate_config({"judges": {"provider": {"type": "anthropic"}}, **raw}, Path("."), "t", environ=env)
        assert cfg.simulate.user.provider is None
        assert cfg.simulated_user_provider == cfg.judges.provider
        assert cfg.simulated_user_provider.model == "judge-env"
    defaults, _ = validate_config({}, Path("."), "t", environ={})
    sim = defaults.simulate
    assert (sim.user.temperature, sim.max_turns, sim.replicates, sim.min_realism, sim.realism_sample_rate,
            sim.bot_timeout, sim.concurrency) == (1.0, 12, 5, 0.8, 0.2, 60.0, 4)


def test_the_simulated_user_has_one_temperature() -> None:
    with pytest.raises(ConfigError) as err:
        validate_config({"simulate": {"user": {"provider": {"type": "openai_compatible", "temperature": 0.3}}}},
                        Path("."), "t", environ={})
    assert err.value.problems == ["simulate.user.provider.temperature: the simulated user's temperature is "
                                  "simulate.user.temperature (got 0.3)"]
    with pytest.raises(ConfigError) as err:
        validate_config({"simulate": {"user": {"provider": {"model": "claude-y"}}}}, Path("."), "t", environ={})
    assert err.value.problems == ["simulate.user.provider.type: Field required"]


def test_every_simulate_key_has_a_row_in_the_configuration_reference() -> None:
    readme = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    for key in ("simulate.user.provider", "simulate.user.temperature", "simulate.max_turns", "simulate.replicates",
                "simulate.min_realism", "simulate.realism_sample_rate", "simulate.bot_timeout",
                "simulate.concurrency"):
        assert f"| `{key}" in readme, key

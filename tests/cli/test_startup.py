"""The command line answers at once: help, and the commands a running daemon answers, load only what they need.

Each case runs the commands in a fresh interpreter and reads ``sys.modules`` after them: a heavy package
imported at the top of a subcommand module (every one is loaded to list the commands) shows up here, where a
timing would only be noisy. ``bench/cli_startup.py`` measures the time itself.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from collector.cli import COMMANDS

from ..support.daemon import REPO, DaemonProcess, clean_env

# What no command needs before it runs: DuckDB, gRPC and OpenTelemetry (the daemon's), the judges and their
# clients, the replay engine, plotting, the stages.
STAGES = ("duckdb", "grpc", "google.protobuf", "opentelemetry", "judges", "anthropic", "aiohttp", "replay",
          "numpy", "matplotlib", "orjson", "collector.store", "collector.evals", "collector.conversations",
          "collector.api.file_client", "collector.review.queue")
# Help needs no config either, nor the stdlib's slower loaders (HTTP, asyncio).
HELP_ALSO = ("pydantic", "yaml", "collector.config", "collector.api", "asyncio", "urllib.request", "http.client")


def loaded_after(*commands: list[str]) -> tuple[list[int], set[str]]:
    """The exit code of each ``tracejudge`` command, run one after the other in one interpreter, and every module
    loaded once they ran."""
    code = ("import json, sys\n"
            "from collector.cli import main\n"
            "codes = []\n"
            f"for args in {commands!r}:\n"
            "    try:\n"
            "        main(args, standalone_mode=False)\n"
            "        codes.append(0)\n"
            "    except SystemExit as exc:\n"
            "        codes.append(exc.code or 0)\n"
            "print(json.dumps([codes, sorted(sys.modules)]))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    codes, modules = json.loads(done.stdout.splitlines()[-1])
    return codes, set(modules)


def among(modules: set[str], names: tuple[str, ...]) -> list[str]:
    return sorted(n for n in names if n in modules or any(m.startswith(n + ".") for m in modules))


def test_help_loads_neither_the_config_nor_any_stage() -> None:
    commands = [["--help"], *([name, "--help"] for name in COMMANDS)]
    codes, modules = loaded_after(*commands)
    assert codes == [0] * len(commands)
    assert {f"collector.cli.{COMMANDS[n].split(':')[0].rsplit('.', 1)[1]}" for n in COMMANDS} <= modules
    assert among(modules, STAGES + HELP_ALSO) == []


def test_commands_answered_by_the_daemon_load_no_stage(daemon: DaemonProcess) -> None:
    config = str(daemon.config_path)
    commands = [["status", "--config", config], ["stats", "--config", config],
                ["conversations", "list", "--config", config], ["verdicts", "--config", config],
                ["review", "list", "--config", config]]
    codes, modules = loaded_after(*commands)
    assert codes == [0] * len(commands)
    assert "collector.config" in modules  # read for where the daemon listens, and its token
    assert among(modules, STAGES) == []


@pytest.mark.slow
def test_without_a_daemon_the_file_is_read(daemon: DaemonProcess) -> None:
    daemon.stop()
    codes, modules = loaded_after(["status", "--config", str(daemon.config_path)])
    assert codes == [0] and "collector.api.file_client" in modules and "duckdb" in modules

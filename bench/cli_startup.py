"""How long each ``tracejudge`` command takes to answer, against bare Python measured in the same run.

A newcomer's first commands are ``--help`` and a look at a running daemon: each should answer at
once, importing only what it needs (never DuckDB, gRPC or the judges to print help). This times,
as subprocesses in rounds (each round runs every command once, so the machine's noise falls on all
of them alike):

  python -c pass        the floor: the interpreter's own start
  import click          what any click command costs before our code
  --help                ``tracejudge --help``
  SUB --help            each subcommand's help
  status, stats, ...    commands answered by a running daemon (started here on a temporary config,
                        every port 0) through its JSON API

and prints each command's median in milliseconds, its difference from ``python -c pass`` and the
ratio. Target: ``--help`` within 300 ms of bare Python. Run by hand, from the checkout to measure
(``--repo`` measures another one, e.g. an older commit unpacked with ``git archive``):

    .venv/bin/python bench/cli_startup.py [--rounds 9] [--repo DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DAEMON_COMMANDS = [["status"], ["stats"], ["conversations", "list"], ["verdicts"], ["review", "list"]]


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("TRACEJUDGE_", "OTEL_"))}


def subcommands(repo: Path) -> list[str]:
    """The subcommands of the CLI in ``repo``, as its command table lists them."""
    out = subprocess.run([sys.executable, "-c", "from collector.cli import COMMANDS; print(' '.join(COMMANDS))"],
                         cwd=repo, env=clean_env(), capture_output=True, text=True, check=True)
    return sorted(out.stdout.split())


def start_daemon(repo: Path, data: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """``tracejudge serve`` on a config in ``data``, once it answers /readyz; the process and its config."""
    cfg = data / "otel-config.yaml"
    cfg.write_text(json.dumps({  # JSON is YAML
        "receivers": {"otlp": {"protocols": {"grpc": {"endpoint": "127.0.0.1:0"},
                                             "http": {"endpoint": "127.0.0.1:0"}}}},
        "storage": {"duckdb": {"path": str(data / "bench.duckdb")}},
        "api": {"endpoint": "127.0.0.1:0"}}))
    proc = subprocess.Popen([sys.executable, "-m", "collector", "serve", "--config", str(cfg)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=repo, env=clean_env())
    runtime = data / "bench.duckdb.daemon.json"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"tracejudge serve exited with {proc.returncode}")
        try:
            api = json.loads(runtime.read_text())["api"]
            with urllib.request.urlopen(api + "/readyz", timeout=5) as resp:  # noqa: S310 (loopback)
                if resp.status == 200:
                    return proc, cfg
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    proc.kill()
    raise SystemExit("tracejudge serve did not become ready within 60 s")


def timed(argv: list[str], repo: Path) -> float:
    """Seconds ``argv`` takes from start to exit; it must succeed."""
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=repo, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    took = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited with {done.returncode}: {done.stderr.decode()[-500:]}")
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--repo", type=Path, default=REPO, help="the checkout whose CLI to time [default: this one]")
    args = ap.parse_args()
    repo = args.repo.resolve()
    py, cli = [sys.executable], [sys.executable, "-m", "collector"]
    with tempfile.TemporaryDirectory(prefix="tj-startup-") as tmp:
        daemon, cfg = start_daemon(repo, Path(tmp))
        try:
            runs: dict[str, list[str]] = {"python -c pass": py + ["-c", "pass"],
                                          "import click": py + ["-c", "import click"],
                                          "--help": cli + ["--help"]}
            runs |= {f"{sub} --help": cli + [sub, "--help"] for sub in subcommands(repo)}
            runs |= {" ".join(c): cli + c + ["--config", str(cfg)] for c in DAEMON_COMMANDS}
            times: dict[str, list[float]] = {name: [] for name in runs}
            for _ in range(args.rounds):
                for name, argv in runs.items():
                    times[name].append(timed(argv, repo))
        finally:
            daemon.terminate()
            daemon.wait(timeout=60)
    base = statistics.median(times["python -c pass"])
    print(f"{args.rounds} rounds, medians; {repo}")
    print(f"{'command':<26}{'ms':>8}{'- python':>10}{'x python':>10}")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"{name:<26}{m * 1000:>8.0f}{(m - base) * 1000:>+10.0f}{m / base:>10.1f}")


if __name__ == "__main__":
    main()

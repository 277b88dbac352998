"""``tracejudge simulate``: scenarios against the bot with a simulated user, judged, compared with a baseline.

The engine is ``replay.simulate``; this module builds its parts from the flags
and the config (the simulated user's providers, the bot, the criteria, the
judge), prints progress and the report, stores the run in a running daemon,
and asks it (or the DuckDB file) how realistic the simulated user was found.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..errors import UserError
from ..words import parse_duration, plural
from .common import config_option, json_option, load
from .judge import cli_provider

if TYPE_CHECKING:
    from judges import Provider

    from ..config import Config


def user_providers(cfg: Config) -> tuple[Provider, Provider, float | None]:
    """The simulated user's role-play provider, its goal-check provider (temperature 0 where one is taken),
    and the temperature the role-play is sent (None: the provider takes none, as Anthropic's models).

    Raises:
        UserError: neither ``simulate.user.provider`` nor ``judges.provider`` names a provider.
    """
    from ..evals.setup import provider_from_config

    section = cfg.simulated_user_provider
    key = "simulate.user.provider" if cfg.simulate.user.provider is not None else "judges.provider"
    if section.type is None:
        raise UserError("no provider for the simulated user: set simulate.user.provider (or judges.provider) "
                        "in the config")
    if section.type == "anthropic" and not (section.api_key or os.environ.get("ANTHROPIC_API_KEY")
                                            or section.base_url or os.environ.get("ANTHROPIC_BASE_URL")):
        raise UserError(f"{key}: no API key for the simulated user: set ANTHROPIC_API_KEY (or {key}.api_key)")
    takes = section.type != "anthropic"  # the Messages API takes no temperature on current models
    temperature = cfg.simulate.user.temperature if takes else None

    def make(t: float | None) -> Provider:
        provider = provider_from_config(section.model_copy(update={"temperature": t}))
        assert provider is not None  # its type is set
        return provider

    return make(temperature), make(0.0 if takes else None), temperature


def _criteria(cfg: Config, paths: tuple[Path, ...]) -> list[Any]:
    from judges import CriteriaError, load_criteria

    chosen = list(paths) or list(cfg.judges.criteria)
    if not chosen:
        raise UserError("no criteria: pass --criteria FILE or set judges.criteria in the config")
    try:
        return load_criteria(chosen)
    except (CriteriaError, OSError) as exc:
        raise UserError(str(exc)) from None


def bot_of(bot: str | None, bot_url: str | None, bot_model: str) -> Any:
    """The bot under test, from ``--bot`` or ``--bot-url`` (exactly one)."""
    from replay.simulate import ChatCompletionsBot, FunctionBot

    if bool(bot) == bool(bot_url):
        raise UserError("give the bot: --bot MODULE:FUNCTION or --bot-url URL (one of them)")
    return FunctionBot(bot) if bot else ChatCompletionsBot(bot_url or "", bot_model)


def bot_options(fn: Any) -> Any:
    for option in reversed((
        click.option("--bot", metavar="MODULE:FUNCTION",
                     help="The bot: FUNCTION(messages, conversation_id) of MODULE, importable from this folder, "
                          "called once per turn; it returns the reply (str) or {content, handover}."),
        click.option("--bot-url", metavar="URL",
                     help="The bot as an OpenAI-compatible chat-completions endpoint, sent the conversation so far "
                          "each turn ($TRACEJUDGE_BOT_API_KEY, when set, as a bearer token)."),
        click.option("--bot-model", default="bot", show_default=True, help="The model name sent to --bot-url."),
        click.option("--bot-timeout", "bot_timeout_text",
                     help="How long the bot may take per turn, like 30s [default: simulate.bot_timeout]."),
        click.option("--replicates", type=click.IntRange(1, 100),
                     help="Conversations per scenario [default: simulate.replicates]."),
        click.option("--criteria", "criteria_paths", multiple=True,
                     type=click.Path(dir_okay=False, path_type=Path),
                     help="Criteria file (repeatable) [default: judges.criteria]."),
        click.option("--concurrency", type=click.IntRange(1, 256),
                     help="Conversations at once [default: simulate.concurrency]."),
        click.option("--budget-tokens", type=click.IntRange(1),
                     help="Stop starting conversations (and judge calls) once the simulated user and the judges "
                          "have spent this many tokens."),
    )):
        fn = option(fn)
    return fn


def run_simulation(cfg: Config, scenarios: list[Any], *, bot: str | None, bot_url: str | None, bot_model: str,
                   bot_timeout_text: str | None, replicates: int | None, criteria_paths: tuple[Path, ...],
                   concurrency: int | None, budget_tokens: int | None, out: Path | None,
                   quiet: bool) -> dict[str, Any]:
    """Run (or resume) a simulation into ``out``; the report (not yet compared with a baseline)."""
    import asyncio
    import signal

    from replay.simulate import RunFolder, Settings, SimulatedUser, build_report, new_run_id, run, write_report

    criteria = _criteria(cfg, criteria_paths)
    try:
        bot_timeout = parse_duration(bot_timeout_text) if bot_timeout_text else cfg.simulate.bot_timeout
    except ValueError as exc:
        raise UserError(f"--bot-timeout: {exc}") from None
    the_bot = bot_of(bot, bot_url, bot_model)
    provider, checker, temperature = user_providers(cfg)
    user = SimulatedUser(provider, checker, temperature, timeout=cfg.judges.timeout)
    judge = cli_provider(cfg, None, None, None)
    settings = Settings(replicates=replicates or cfg.simulate.replicates, max_turns=cfg.simulate.max_turns,
                        bot_timeout=bot_timeout, concurrency=concurrency or cfg.simulate.concurrency,
                        judge_concurrency=cfg.judges.concurrency, judge_timeout=cfg.judges.timeout,
                        budget_tokens=budget_tokens)
    run_id = new_run_id()
    folder = RunFolder.open(out or Path("simulations") / run_id, the_bot.name, run_id)
    total = len(scenarios) * settings.replicates
    already = len(folder.done() & {(s.id, r) for s in scenarios for r in range(1, settings.replicates + 1)})
    if already and not quiet:
        click.echo(f"resuming {folder.path}: {already} of {total} conversations done before", err=True)

    def done(c: Any, p: Any) -> None:
        if not quiet:
            click.echo(f"  [{already + p.done}/{total}] {c.persona_id} #{c.attributes['replicate']}: "
                       f"{c.ended_by}, {plural(sum(m.role == 'user' for m in c.messages), 'user turn')}", err=True)

    interrupted = False

    async def main() -> Any:
        loop, me = asyncio.get_running_loop(), asyncio.current_task()
        assert me is not None

        def on_sigint() -> None:
            nonlocal interrupted
            if interrupted:
                raise KeyboardInterrupt  # a second Ctrl-C: stop at once, as asyncio.run would
            interrupted = True
            me.cancel()

        # Ctrl-C through the loop's own signal handling, not asyncio.run's: asyncio.run's handler runs only once
        # the main thread runs again, so a SIGINT the kernel handed to another thread (a judges check thread, the
        # default executor's) left a loop waiting for a stalled bot asleep until --bot-timeout; and asyncio.run
        # installs none when SIGINT came ignored (a script's background job). The loop's handler wakes it through
        # its wakeup fd whichever thread takes the signal, and is installed whatever SIGINT was.
        loop.add_signal_handler(signal.SIGINT, on_sigint)
        try:
            try:
                return await run(scenarios, criteria, the_bot, user, judge, folder, settings, done)
            finally:
                await the_bot.aclose()
                await user.aclose()
                if judge is not None:
                    await judge.aclose()
        except asyncio.CancelledError:
            if not interrupted:
                raise
            me.uncancel()  # our own cancel, done with: main ends as interrupted
            return None
        finally:
            loop.remove_signal_handler(signal.SIGINT)

    try:
        progress = asyncio.run(main())
    except KeyboardInterrupt:
        interrupted = True
    if interrupted:
        click.echo(f"\ninterrupted: {len(folder.conversations)} conversations are kept in {folder.path}; "
                   f"run the same command with --out {folder.path} to go on", err=True)
        sys.exit(130)
    report = build_report(folder, scenarios, criteria, user.identity)
    if progress.skipped_budget:
        report["summary"]["skipped_budget"] = progress.skipped_budget
    report["simulated_user"].update(_realism(cfg, user.identity))
    _store(cfg, folder, quiet)
    write_report(folder, report)
    return report


def _realism(cfg: Config, identity: dict[str, Any]) -> dict[str, Any]:
    """``validated`` and ``realism`` (the lower bound of the share labelled realistic, None without labels)."""
    from ..api.client import realism

    found = realism(cfg, identity)
    return {"validated": bool(found.get("validated")), "realism": found.get("lower"),
            "realism_labels": found.get("labelled", 0)}


def _store(cfg: Config, folder: Any, quiet: bool) -> None:
    """With a daemon running, the run's conversations stored as imported simulations, with their verdicts."""
    from ..api.client import APIClient
    from ..system.runtime import running_daemon

    info = running_daemon(cfg.runtime_file)
    if info is None:
        return
    client = APIClient(info.api, cfg.api.auth.bearer_token)
    try:
        records = [json.loads(c.to_json()) for c in folder.conversations]
        verdicts = [v.model_dump(mode="json") for v in folder.verdicts]
        done = client.import_simulations(records, verdicts)
    finally:
        client.close()
    if not quiet:
        click.echo(f"stored in the daemon: {plural(done.get('stored', 0), 'conversation')} "
                   f"({done.get('already_imported', 0)} there before)", err=True)


def print_report(report: dict[str, Any], lines: list[str]) -> None:
    """The report as text: a row per scenario, the criteria's rates, then the changes from the baseline."""
    validated = report["simulated_user"].get("validated")
    mark = "" if validated else "  (simulated user not validated)"
    rows = []
    for s in report["scenarios"]:
        ended = ", ".join(f"{k} {v}" for k, v in s["ended_by"].items() if v)
        crit = "; ".join(f"{cid} {c['fail']}/{s['replicates']} fail" + (f", {c['error']} error" if c["error"] else "")
                         for cid, c in s["criteria"].items())
        status = "FAILING" if s["failing"] else "passing"
        if "baseline" in s:
            status += f" ({s['baseline']['status']})"
        rows.append(f"  {s['id']}  {status}{mark}\n      ended: {ended or '-'}\n      {crit or 'no criteria judged'}")
    click.echo(f"run {report['run']} ({report['out_dir']}): {plural(len(report['scenarios']), 'scenario')}")
    click.echo("\n".join(rows))
    if report["criteria"]:
        click.echo("failure rate per criterion, over every conversation (95% interval):")
        for cid, c in report["criteria"].items():
            rate = ("-" if c["rate"] is None else "too few to tell" if c["too_few"] else
                    f"{c['rate']:.0%} [{c['interval'][0]:.0%}, {c['interval'][1]:.0%}]")
            click.echo(f"  {cid}: {c['fail']} of {c['conversations']}, {rate}{mark}")
    if lines:
        click.echo("compared with the baseline:\n" + "\n".join(f"  {line}" for line in lines))
    su = report["simulated_user"]
    labels = su.get("realism_labels", 0)
    click.echo(f"simulated user {su['provider']}/{su['model']}, temperature "
               f"{'not sent' if su['temperature'] is None else su['temperature']}: " +
               (f"realistic in at least {su['realism']:.0%} of {labels} labelled conversations"
                if su.get("realism") is not None else "no realism labels yet") +
               ("" if validated else " (not validated: label sampled conversations on the calibration page)"))
    s = report["summary"]
    t = report["tokens"]
    click.echo(f"{s['failing']} of {s['scenarios']} scenarios failing; tokens: simulated user "
               f"{t['simulated_user']['input']} in, {t['simulated_user']['output']} out; judges "
               f"{t['judges']['input']} in, {t['judges']['output']} out")


@click.command()
@click.argument("scenario_paths", metavar="SCENARIOS...", nargs=-1, required=True,
                type=click.Path(path_type=Path))
@bot_options
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="The run's folder [default: simulations/<run id>]; an existing run's folder resumes it.")
@click.option("--baseline", type=click.Path(file_okay=False, path_type=Path),
              help="A previous run's folder: each scenario is fixed, broke, still_failing, passing or new.")
@config_option
@json_option
def simulate(scenario_paths: tuple[Path, ...], bot: str | None, bot_url: str | None, bot_model: str,
             bot_timeout_text: str | None, replicates: int | None, criteria_paths: tuple[Path, ...],
             concurrency: int | None, budget_tokens: int | None, out: Path | None, baseline: Path | None,
             config_path: Path | None, as_json: bool) -> None:
    """Run SCENARIOS (scenario YAML files, case JSONL files, or folders of them) against the bot.

    A simulated user (simulate.user.provider, else judges.provider) plays each
    scenario's persona, with its goal and the facts it reveals only when asked,
    --replicates times; each conversation is judged with the criteria the
    scenario expects (all of them when it names none). A scenario is failing
    when any replicate fails one of them, or the bot did not answer.

    Writes conversations.jsonl, verdicts.jsonl and report.json into --out as
    each conversation finishes: after Ctrl-C, the same command with the same
    --out goes on. With a daemon running, the conversations are also stored as
    simulations. Exit 0: nothing failing (and with --baseline nothing broke);
    1: a scenario is failing or broke; 2: bad input.
    """
    from replay.baseline import change_lines, compare, load_report
    from replay.suite import load_suite

    cfg = load(config_path)
    scenarios = load_suite(scenario_paths)
    before = load_report(baseline) if baseline is not None else None
    report = run_simulation(cfg, scenarios, bot=bot, bot_url=bot_url, bot_model=bot_model,
                            bot_timeout_text=bot_timeout_text, replicates=replicates, criteria_paths=criteria_paths,
                            concurrency=concurrency, budget_tokens=budget_tokens, out=out, quiet=as_json)
    if before is not None:
        report = compare(report, before)
        from replay.simulate import RunFolder, write_report

        write_report(RunFolder(Path(report["out_dir"]), report["run"]), report)
    if as_json:
        click.echo(json.dumps(report, indent=2, ensure_ascii=False))
    else:
        print_report(report, change_lines(report) if before is not None else [])
    s = report["summary"]
    sys.exit(1 if s["failing"] or s.get("broke") or s.get("not_evaluated") else 0)

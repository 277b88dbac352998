"""``tracejudge judge``: grade conversation/v1 records on criteria files, offline.

A thin shell over ``judges``: read criteria and conversations, build the
provider from ``--provider/--model/--base-url`` or the ``judges.provider``
section of the config, run, write verdicts as JSON lines and print a table per
criterion with counts and 95% intervals (``--json`` for machines).
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import click

from ..errors import UserError
from ..words import not_calibrated_text, parse_duration, plural, rate_text
from .common import config_option, json_option, load, table

if TYPE_CHECKING:
    from judges import JudgeRun, NotRun, Proportion, Provider, RateStats, Summary, Verdict

    from ..config import Config

FAIL_ON = ("fail", "error", "flagged", "not_run")
SET_A_PROVIDER = ("set ANTHROPIC_API_KEY and ANTHROPIC_MODEL (or OPENAI_BASE_URL and OPENAI_MODEL), pass --provider, "
                  "or set judges.provider in the config")


def cli_provider(cfg: Config, type_: str | None, model: str | None, base_url: str | None) -> Provider | None:
    """The provider from the flags, else the config, else the environment (as ``judges`` reads it); None when none
    names one.

    Raises:
        UserError: the provider cannot be built, or the environment names two.
    """
    from ..evals.setup import provider_from_config, provider_type_from_env

    chosen = type_ or cfg.judges.provider.type or provider_type_from_env(os.environ)

    def unused(key: str) -> None:
        click.echo(f"tracejudge: warning: judges.provider.{key} is not used by the {chosen} provider", err=True)

    return provider_from_config(cfg.judges.provider, type_=chosen, model=model, base_url=base_url, on_unused=unused,
                                flags={"model": "--model", "base_url": "--base-url"})


def provider_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--provider``, ``--model`` and ``--base-url``, for ``cli_provider``."""
    for option in reversed((
        click.option("--provider", "provider_type", envvar="TRACEJUDGE_JUDGE_PROVIDER", show_envvar=True,
                     help="Judge provider type, e.g. anthropic or openai_compatible [default: judges.provider.type, "
                          "else anthropic when $ANTHROPIC_API_KEY or $ANTHROPIC_BASE_URL is set, openai_compatible "
                          "when $OPENAI_BASE_URL is]."),
        click.option("--model", envvar="TRACEJUDGE_JUDGE_MODEL", show_envvar=True,
                     help="Judge model [default: judges.provider.model]."),
        click.option("--base-url", envvar="TRACEJUDGE_JUDGE_BASE_URL", show_envvar=True,
                     help="Provider base URL [default: judges.provider.base_url]."),
    )):
        fn = option(fn)
    return fn


def read_calibration(path: Path) -> dict[str, tuple[bool, str | None]]:
    """criterion id -> (calibrated, the reason code when not), from the JSON of ``tracejudge calibrate --json``.

    Raises:
        UserError: the file is not that JSON.
    """
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
        return {str(c["criterion_id"]): (bool(c["calibrated"]), c.get("reason")) for c in report["criteria"]}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"--calibration {path}: not the JSON of `tracejudge calibrate --json` "
                        f"({type(exc).__name__}: {str(exc)[:200]})") from None


def _rate(p: Proportion | None) -> str:
    return "-" if p is None else rate_text(p.estimate, p.low, p.high, count=p.count, n=p.n, too_few=p.too_few)


def _counted(p: Proportion) -> str:
    """``2 of 40, 5.0% (1.4% to 16.5%)``; the count once when too few to tell."""
    return _rate(p) if p.too_few else f"{p.count} of {p.n}, {_rate(p)}"


def _row(name: str, s: RateStats, calibration: tuple[bool, str | None] | None = None) -> list[str]:
    c = s.counts
    rate = _rate(s.failure_rate)
    if s.weighted_failure_rate is not None:
        rate += f"  weighted {_rate(s.weighted_failure_rate)}"
    if calibration is not None and not calibration[0]:
        rate += f"  {not_calibrated_text(calibration[1])}"
    return [name, str(c.pass_), str(c.pass_unverified), str(c.fail), str(c.flagged), str(c.not_applicable),
            str(c.error), str(c.not_run), rate]


HEADER = ["criterion", "pass", "pass?", "fail", "flagged", "n/a", "error", "not run", "failure rate (95% CI)"]


def _report(summary: Summary, run: JudgeRun, llm: int,
            calibration: dict[str, tuple[bool, str | None]] | None = None) -> str:
    """The text report; ``llm`` is how many LLM criteria were to run."""
    marks = calibration or {}
    out = [table([HEADER] + [_row(s.criterion_id, s, marks.get(s.criterion_id)) for s in summary.criteria])]
    if summary.groups:
        out.append(table([["group"] + HEADER[1:]] + [_row(g.group, g) for g in summary.groups]))
    failing = [s for s in summary.scenarios if s.failing]
    if failing:
        out.append("failing scenarios (a scenario is failing if any replicate failed):\n" + "\n".join(
            f"  {s.persona_id}  {s.criterion_id}: FAILING, passed {s.passes} of {s.runs}" for s in failing))
    notes = ["pass? = passes whose quoted evidence was not found in the transcript (not clean passes, "
             "not in the rate); flagged = fails with no verified quote"]
    if any(not marks.get(s.criterion_id, (True, None))[0] for s in summary.criteria):
        notes.append(f"{not_calibrated_text(None)} = the blind labels of --calibration do not show the judge right enough "
                     "(too few labels, no failure found by people, or a false-pass rate that may be above "
                     "review.max_false_pass: `tracejudge calibrate` says which); criteria without labels are "
                     "not marked")
    for s in summary.criteria:
        for reason, n in sorted(s.not_run_reasons.items()):
            notes.append(f"{s.criterion_id}: {n} not run: {reason}")
        for code, n in sorted(s.errors.items()):
            notes.append(f"{s.criterion_id}: {n} error: {_cause(run, s.criterion_id, code)}")
    e = summary.expected
    if e is not None:
        for label, p in (("sensitivity", e.sensitivity), ("over-triage", e.over_triage)):
            if p is not None:
                notes.append(f"{label}: {_counted(p)}")
        for cid, p in e.omissions.items():
            notes.append(f"omissions {cid}: {_counted(p)}")
    used = f"tokens: {run.usage.input_tokens} in, {run.usage.output_tokens} out; {plural(run.cached, 'verdict')} from cache"
    notes.append(used + (f"; cost {run.cost:.4f}" if run.cost else ""))
    if run.stopped:
        notes.append(f"stopped early: {run.stopped}")
    if run.not_run:  # last, where it is seen: those criteria have no verdict, and no failure rate
        missed = {n.criterion_id for n in run.not_run}
        notes.append(f"NOT RUN: {len(missed)} of {plural(llm, 'LLM criterion', 'LLM criteria')} "
                     f"({plural(len(run.not_run), 'judgement')}): {'; '.join(sorted({n.reason for n in run.not_run}))}")
    out.append("\n".join(notes))
    return "\n\n".join(out)


def _cause(run: JudgeRun, criterion_id: str, code: str) -> str:
    """The most frequent whole reason among a criterion's errors of one code (the code alone hides the cause)."""
    reasons = Counter(v.error_reason for v in run.verdicts if v.criterion_id == criterion_id and v.result == "error"
                      and (v.error_reason or "").split(":", 1)[0] == code)
    (top, _), *others = reasons.most_common()
    return (top or code) + (f" (and {len(others)} other reasons)" if others else "")


@contextmanager
def _progress(total: int) -> Iterator[Callable[[Verdict | NotRun], None] | None]:
    if not sys.stderr.isatty():
        yield None
        return
    with click.progressbar(length=total, label="judging", file=sys.stderr) as bar:
        yield lambda _: bar.update(1)


@click.command()
@click.argument("conversations", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--criteria", "criteria_paths", multiple=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Criteria file (repeatable) [default: judges.criteria from the config].")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="Write verdicts here as JSON lines.")
@click.option("--fail-on", multiple=True, type=click.Choice(FAIL_ON),
              help="Exit 1 when any verdict has this outcome (repeatable).")
@provider_options
@click.option("--concurrency", type=click.IntRange(1, 1024), envvar="TRACEJUDGE_JUDGE_CONCURRENCY",
              show_envvar=True, help="Judge calls in flight [default: judges.concurrency].")
@click.option("--timeout", "timeout_text", envvar="TRACEJUDGE_JUDGE_TIMEOUT", show_envvar=True,
              help="Per judge call, like 30s [default: judges.timeout].")
@click.option("--cache", "cache_path", type=click.Path(dir_okay=False, path_type=Path),
              envvar="TRACEJUDGE_JUDGE_CACHE", show_envvar=True,
              help="Verdict cache file [default: .tracejudge-cache.jsonl beside --out, or here].")
@click.option("--no-cache", is_flag=True, help="Neither read nor write the verdict cache.")
@click.option("--budget-tokens", type=click.IntRange(1), help="Stop making judge calls after this many tokens.")
@click.option("--budget-cost", type=click.FloatRange(0, min_open=True),
              help="Stop making judge calls at this cost (needs --price-input/--price-output).")
@click.option("--price-input", type=click.FloatRange(0), default=0.0, help="Price of a million input tokens.")
@click.option("--price-output", type=click.FloatRange(0), default=0.0, help="Price of a million output tokens.")
@click.option("--calibration", "calibration_path", type=click.Path(dir_okay=False, path_type=Path),
              help="The JSON of `tracejudge calibrate --json`: mark each criterion whose judge is not calibrated "
                   "(\"calibrated\" in --json: true, false, or null without labels; \"calibration_reason\": why "
                   "not).")
@config_option
@json_option
def judge(
    conversations: Path, criteria_paths: tuple[Path, ...], out: Path | None, fail_on: tuple[str, ...],
    provider_type: str | None, model: str | None, base_url: str | None, concurrency: int | None,
    timeout_text: str | None, cache_path: Path | None, no_cache: bool, budget_tokens: int | None,
    budget_cost: float | None, price_input: float, price_output: float, calibration_path: Path | None,
    config_path: Path | None, as_json: bool,
) -> None:
    """Judge CONVERSATIONS (conversation/v1 JSON lines) on criteria files.

    Code criteria run in code; LLM criteria need a provider, else they are
    reported as not run. Records with the same persona_id are replicates of one
    scenario: a scenario that fails once is shown as failing. Exit 1 when
    --fail-on matches, 2 on bad input.
    """
    from judges import (Budget, DiskCache, InputError, escape_line_breaks, load_criteria, read_conversations,
                        run_judges, summarize)

    cfg = load(config_path)
    paths = list(criteria_paths) or list(cfg.judges.criteria)
    if not paths:
        raise UserError("no criteria: pass --criteria FILE or set judges.criteria in the config")
    if budget_cost is not None and not (price_input or price_output):
        raise UserError("--budget-cost needs --price-input and/or --price-output")
    try:
        timeout = parse_duration(timeout_text) if timeout_text else cfg.judges.timeout
    except ValueError as exc:
        raise UserError(f"--timeout: {exc}") from None
    try:
        criteria = load_criteria(paths)
        convs = read_conversations(conversations)
    except InputError as exc:
        raise UserError(str(exc)) from None
    calibration = read_calibration(calibration_path) if calibration_path else None
    provider = cli_provider(cfg, provider_type, model, base_url)
    llm = sum(c.kind == "llm" for c in criteria)
    if provider is None and llm:
        click.echo(f"tracejudge: warning: no judge provider, so the LLM criteria do not run: {SET_A_PROVIDER}",
                   err=True)
    cache = None
    if not no_cache:
        cache = DiskCache(cache_path or (out.parent if out else Path.cwd()) / ".tracejudge-cache.jsonl")
    budget = None
    if budget_tokens is not None or budget_cost is not None:
        budget = Budget(tokens=budget_tokens, cost=budget_cost,
                        input_cost_per_mtok=price_input, output_cost_per_mtok=price_output)
    with _progress(len(convs) * len(criteria)) as tick:
        run = run_judges(criteria, convs, provider, concurrency=concurrency or cfg.judges.concurrency,
                         timeout=timeout, budget=budget, cache=cache, on_result=tick)
    if out is not None:
        with out.open("w", encoding="utf-8") as f:
            for v in run.verdicts:
                f.write(escape_line_breaks(v.model_dump_json()) + "\n")
    summary = summarize(run.verdicts, criteria=criteria, conversations=convs, not_run=run.not_run)
    if as_json:
        summary_json = summary.model_dump(mode="json", by_alias=True)
        if calibration is not None:
            for entry in summary_json["criteria"]:
                mark = calibration.get(entry["criterion_id"])
                entry["calibrated"], entry["calibration_reason"] = mark if mark is not None else (None, None)
        doc = {"summary": summary_json,
               "not_run": [r.model_dump(mode="json") for r in run.not_run],
               "usage": run.usage.model_dump(), "cost": run.cost, "cached": run.cached, "stopped": run.stopped}
        click.echo(json.dumps(doc, indent=2, ensure_ascii=False))
    else:
        click.echo(_report(summary, run, llm, calibration))
    hits = {
        "fail": any(v.result == "fail" for v in run.verdicts),
        "error": any(v.result == "error" for v in run.verdicts),
        "flagged": any(v.flagged for v in run.verdicts),
        "not_run": bool(run.not_run),
    }
    if any(hits[k] for k in fail_on):
        sys.exit(1)

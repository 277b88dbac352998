"""``tracejudge stats``: per criterion, what was judged, how often it fails, what reviewers said."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from ..words import not_calibrated_text, plural, rate_text
from .common import ask, ask_all, config_option, db_option, json_option, load, table

HEADER = ["criterion", "judged", "pass", "pass?", "fail", "flagged", "n/a", "error", "not run",
          "review p/c/r", "failure rate, all traffic (95% CI)"]


def _rate(r: dict[str, Any] | None) -> str:
    return "-" if r is None else rate_text(r["estimate"], r["low"], r["high"], count=r["count"], n=r["n"],
                                           too_few=r["too_few"])


def _row(name: str, e: dict[str, Any]) -> list[str]:
    r = e["failure_rate"]
    rate = _rate(r) + ("" if r is None else f"  n_eff {r['n_eff']:.1f}")
    if e.get("calibrated") is False:  # groups carry no mark; None: no blind labels
        rate += f"  {not_calibrated_text(e.get('calibration_reason'))}"
    review = e["review"]
    return [name, *(str(e[k]) for k in ("judged", "pass", "pass_unverified", "fail", "flagged", "not_applicable",
                                         "error", "not_run")),
            f"{review['pending']}/{review['confirmed']}/{review['rejected']}", rate]


def render(stats: dict[str, Any]) -> str:
    """The stats report as text."""
    conv = stats["conversations"]
    skipped = sum(conv["skipped"].values())
    out = [f"conversations: {conv['ended']} ended, {conv['sampled']} sampled, {conv['not_sampled']} not sampled, "
           f"{skipped} skipped for budget, {conv['judged']} judged"]
    if not stats["criteria"]:
        out.append("no verdicts yet")
        return "\n\n".join(out)
    out.append(table([HEADER] + [_row(e["criterion_id"], e) for e in stats["criteria"]]))
    if stats["groups"]:
        out.append(table([["group", *HEADER[1:]]] + [_row(g["group"], g) for g in stats["groups"]]))
    notes = ["pass? = passes whose quoted evidence was not found (kept out of the rate); flagged = fails with no "
             "verified quote; review p/c/r = pending/confirmed/rejected; the rate weighs each verdict by "
             "1/inclusion probability"]
    if any(e.get("calibrated") is False for e in stats["criteria"]):
        notes.append(f"{not_calibrated_text(None)} = the blind labels do not show the judge right enough (too few labels, no "
                     "failure found by people, or a false-pass rate that may be above review.max_false_pass): its "
                     "failure rate may be too low (tracejudge calibrate says why)")
    for e in stats["criteria"]:
        share = e["review"]["fails_rejected_share"]
        if share is not None:
            notes.append(f"{e['criterion_id']}: reviewers rejected {share:.0%} of the fails they decided")
        for reason, n in sorted(e["not_run_reasons"].items()):
            notes.append(f"{e['criterion_id']}: {n} not run: {reason}")
        for code, n in sorted(e["errors"].items()):
            notes.append(f"{e['criterion_id']}: {plural(n, 'error')}: {code or 'unknown'} "
                         "(tracejudge verdicts --result error)")
    for reason, n in sorted(conv["skipped"].items()):
        notes.append(f"{plural(n, 'conversation')} skipped: {reason} (kept out of the estimates)")
    tokens = stats["tokens"]
    notes.append(f"judge tokens: {tokens['input_tokens']} in, {tokens['output_tokens']} out")
    out.append("\n".join(notes))
    return "\n\n".join(out)


def render_by_source(by: dict[str, dict[str, Any]]) -> str:
    """Offline and online failure rates of the same criteria, side by side."""
    prod, sim = by["production"], by["simulation"]
    out = [f"production: {prod['conversations']['judged']} conversations judged; simulation: "
           f"{sim['conversations']['judged']} of {sim['conversations']['imported']} imported judged"]
    entries = {side: {e["criterion_id"]: e for e in body["criteria"]} for side, body in by.items()}
    ids = sorted(set(entries["production"]) | set(entries["simulation"]))
    if not ids:
        out.append("no verdicts yet")
        return "\n\n".join(out)

    def cell(e: dict[str, Any] | None) -> list[str]:
        if e is None:
            return ["-", "-", "-"]
        return [str(e["judged"]), str(e["fail"]), _rate(e["failure_rate"])]

    rows = [["criterion", "prod judged", "prod fail", "production failure rate (95% CI)", "sim judged",
             "sim fail", "simulation failure rate (95% CI)"]]
    rows += [[cid, *cell(entries["production"].get(cid)), *cell(entries["simulation"].get(cid))] for cid in ids]
    out.append(table(rows, align="lrrlrrl"))
    out.append("production rates weigh each verdict by 1/inclusion probability; simulated conversations weigh 1 "
               "each (tracejudge replay import, then tracejudge eval --source simulation)")
    return "\n\n".join(out)


@click.command()
@config_option
@db_option
@json_option
@click.option("--since", help="Only verdicts since: a duration ago (15m, 2h, 7d) or an ISO 8601 time.")
@click.option("--criterion", help="Only this criterion id.")
@click.option("--by", "by", type=click.Choice(["source"]),
              help="source: production and simulated conversations side by side ({\"by_source\": {...}} in JSON).")
def stats(config_path: Path | None, dbs: tuple[Path, ...], as_json: bool, since: str | None,
          criterion: str | None, by: str | None) -> None:
    """Counts, failure rates for all production traffic (weighted, with 95% intervals) and review outcomes.

    Counts are raw counts of current verdicts (one per conversation and
    criterion, on its newest transcript). The failure rate is among applicable
    verdicts (pass + fail), each weighted by 1 / its inclusion probability.
    Simulated conversations (tracejudge replay import) are never counted in
    production's figures; --by source shows theirs beside them. With --db given
    more than once, the figures are those of all the files' verdicts and
    sampling decisions taken together (one sample), not of each file.

    A rate over fewer than 10 (effective) verdicts reads "too few to tell",
    with the count ("too_few" in --json). A criterion whose judge the blind
    labels do not show to be calibrated (tracejudge calibrate) is marked NOT
    CALIBRATED beside its rate, with the reason in a few words; "calibrated"
    in --json is true, false, or null without labels, and
    "calibration_reason" says why not.
    """
    sources = ("production", "simulation") if by == "source" else ("production",)
    max_false_pass = load(config_path).review.max_false_pass
    if len(dbs) > 1:
        from ..review.stats import stats_of

        found = ask_all(config_path, dbs, lambda cs: {s: stats_of([c.stats_rows(
            since=since, criterion=criterion, source=s) for c in cs], max_false_pass) for s in sources})
    else:
        found = ask(config_path, lambda c: {s: c.stats(since=since, criterion=criterion, source=s,
                                                       max_false_pass=max_false_pass)
                                            for s in sources}, dbs[0] if dbs else None)
    if by == "source":
        click.echo(json.dumps({"by_source": found}, ensure_ascii=False, indent=2) if as_json
                   else render_by_source(found))
        return
    body = found["production"]
    click.echo(json.dumps(body, ensure_ascii=False, indent=2) if as_json else render(body))

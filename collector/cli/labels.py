"""``tracejudge labels export|import`` and ``tracejudge calibrate``: blind labelling in a spreadsheet, and the
judge measured against people."""

from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..errors import UserError
from ..words import calibration_rate_text, plural
from .common import ask, config_option, json_option, load, reviewer_token_option, table
from .judge import cli_provider, provider_options

if TYPE_CHECKING:
    from ..config import Config

COLUMNS = ("item_id", "conversation_id", "criterion_id", "criterion", "transcript", "label", "reviewer", "note")
_FORMULA = ("=", "+", "-", "@", "\t", "\r")


def _cell(value: Any) -> str:
    # A spreadsheet runs a cell that starts like a formula (=HYPERLINK(...) typed by a user into the chat):
    # a leading apostrophe keeps it text, as OWASP's CSV-injection advice says.
    text = "" if value is None else str(value)
    return "'" + text if text.startswith(_FORMULA) else text


def _uncell(text: str) -> str:
    return text[1:] if text.startswith("'") and text[1:].startswith(_FORMULA) else text


@click.group()
def labels() -> None:
    """Blind labels in a spreadsheet, for experts who prefer one to the review page.

    `export` writes a criterion's unlabelled calibration items as CSV (the
    transcript and the criterion, nothing of the judge's verdict nor of
    anyone's label; --for NAME: the items NAME has not labelled, for a second
    rater); an expert fills the label column (pass, fail or not_applicable)
    and `import` reads it back. `tracejudge calibrate` then measures the judge
    against the labels.
    """


@labels.command("export")
@config_option
@click.option("--criterion", required=True, help="The criterion id to label.")
@click.option("--sample", type=click.IntRange(1, 100_000),
              help="Top the criterion's calibration items up to N judged conversations (the same ones on every "
                   "run, drawn with sampling.seed) and export the unlabelled ones among them.")
@click.option("--for", "reviewer", metavar="NAME",
              help="The items NAME has not labelled yet, those others labelled included (a second rater's sheet), "
                   "with NAME in the reviewer column; never anyone's label. Without it: the items nobody labelled.")
@click.option("--out", "out", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="The CSV file to write ('-' for standard output).")
@click.option("--bom", is_flag=True,
              help="Start the file with a UTF-8 byte-order mark: Excel, opening a CSV by double-click, reads "
                   "accents and non-Latin text right only with one (Python's csv then needs encoding='utf-8-sig').")
def export_cmd(config_path: Path | None, criterion: str, sample: int | None, reviewer: str | None, out: Path,
               bom: bool) -> None:
    """Write a criterion's unlabelled blind items as CSV (UTF-8), with an empty label column."""
    seed = load(config_path).sampling.seed
    rows = ask(config_path, lambda c: c.export_labels(criterion=criterion, sample=sample, seed=seed,
                                                      reviewer=reviewer))
    buf = io.StringIO(newline="")
    writer = csv.writer(buf)
    writer.writerow(COLUMNS)
    for row in rows:
        writer.writerow([_cell(row[k]) for k in COLUMNS])
    if str(out) == "-":
        sys.stdout.write(buf.getvalue())
        return
    out.write_text(buf.getvalue(), encoding="utf-8-sig" if bom else "utf-8", newline="")
    whose = f" by {reviewer}" if reviewer else ""
    click.echo(f"wrote {len(rows)} item(s) of {criterion} unlabelled{whose} to {out}; fill the label column with "
               "pass, fail or not_applicable (and reviewer), then run `tracejudge labels import`", err=True)


@labels.command("import")
@config_option
@click.argument("path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--reviewer", help="Who labelled, for rows whose reviewer column is empty.")
@reviewer_token_option
def import_cmd(config_path: Path | None, path: Path, reviewer: str | None, reviewer_token: str | None) -> None:
    """Read the labels of a CSV written by `labels export`; every row is checked before any is stored.

    A row whose label is empty is left out (unlabelled is not agreement).
    Importing the same file again changes nothing. With review.reviewers, the
    labels are the reviewer's of --token: a row naming someone else is a problem.
    """
    from ..review.calibration import LabelImportError

    rows, problems = _read(path)
    if not problems:
        try:
            counts = ask(config_path, lambda c: c.import_labels(rows, reviewer), reviewer_token=reviewer_token,
                         records=True)
        except LabelImportError as exc:
            problems = [(n + 2, m) for n, m in exc.problems]  # the header is line 1
    if problems:
        for line, message in problems:
            click.echo(f"{path}:{line}: {message}", err=True)
        click.echo(f"tracejudge: error: {len(problems)} problem(s) in {path}; nothing was stored", err=True)
        sys.exit(2)
    click.echo(f"{counts['added']} label(s) added, {counts['changed']} changed, {counts['unchanged']} unchanged, "
               f"{counts['missing']} row(s) without a label left out")


def _read(path: Path) -> tuple[list[dict[str, Any]], list[tuple[int, str]]]:
    """The rows of the CSV, and problems with its shape, by line number."""
    text = path.read_text(encoding="utf-8-sig")
    reader = csv.DictReader(io.StringIO(text, newline=""))
    missing = [c for c in ("item_id", "label") if c not in (reader.fieldnames or [])]
    if missing:
        return [], [(1, f"the header has no {' and no '.join(missing)} column (it has: "
                        f"{', '.join(reader.fieldnames or []) or 'nothing'})")]
    rows = [{k: _uncell(v or "") for k, v in row.items() if k is not None} for row in reader]
    return rows, []


@click.command()
@config_option
@json_option
@click.option("--criterion", help="Only this criterion id.")
@click.option("--freeze", "freeze_name", metavar="NAME",
              help="Keep the labelled transcripts, with their labels and the current verdicts, as the judge "
                   "regression set NAME (<duckdb file>.calibration/NAME.jsonl).")
@click.option("--force", is_flag=True, help="With --freeze: replace the set NAME if it exists.")
@click.option("--rerun", "rerun_name", metavar="NAME",
              help="Judge the set NAME again with the criteria and provider of now, offline, and say what "
                   "changed. Exit 1 when an item broke.")
@provider_options
def calibrate(config_path: Path | None, as_json: bool, criterion: str | None, freeze_name: str | None,
              force: bool, rerun_name: str | None, provider_type: str | None, model: str | None,
              base_url: str | None) -> None:
    """The judge against people, on the blind labels, per criterion.

    The confusion matrix (rows: what people said, columns: the judge), the
    agreement and Cohen's kappa, and the false-pass rate (people said fail, the
    judge pass) and false-fail rate with 95% intervals ("too few to tell"
    with the count below 10). A criterion is not calibrated, with the reason
    ("reason" and "reason_text" in --json), when people labelled too few
    fails to tell its false-pass rate (fewer than 10), found no failure at
    all, or when its false-pass interval reaches above review.max_false_pass.

    --freeze NAME keeps the labelled transcripts as a regression set; --rerun
    NAME judges it again (judges.criteria and judges.provider, or --provider,
    --model, --base-url) and lists per criterion what was fixed (now agrees with
    people), broken (agreed, no longer does), the same, and missing (its
    criterion is gone, or it could not run), with the false-pass rate before and
    after. Exit codes of --rerun: 0 nothing broke, 1 something broke, 2 bad input.
    """
    if freeze_name is not None and rerun_name is not None:
        raise UserError("--freeze and --rerun: give one of them")
    if force and freeze_name is None:
        raise UserError("--force goes with --freeze")
    cfg = load(config_path)
    if freeze_name is not None:
        _freeze(config_path, cfg, freeze_name, criterion, force, as_json)
        return
    if rerun_name is not None:
        _rerun(cfg, rerun_name, criterion, provider_type, model, base_url, as_json)
        return
    max_false_pass = cfg.review.max_false_pass
    report = ask(config_path, lambda c: c.calibration(criterion=criterion, max_false_pass=max_false_pass))
    if as_json:
        click.echo(json.dumps(report, ensure_ascii=False, indent=2))
        return
    click.echo(render(report))


def _freeze(config_path: Path | None, cfg: Config, name: str, criterion: str | None, force: bool,
            as_json: bool) -> None:
    from ..review import regression

    path = regression.set_path(cfg.calibration_dir, name)
    if path.exists() and not force:  # before asking: a refused name costs no read
        raise UserError(f"{path} exists: give another name, or --force to replace it")
    found = ask(config_path, lambda c: c.calibration_set(criterion=criterion))
    items, left = found["items"], found["left_out"]
    if not items:
        raise UserError("no labelled calibration item" + (f" of criterion {criterion!r}" if criterion else "")
                        + " to freeze: label some first (the review page, or `tracejudge labels`)")
    regression.write_set(path, items, force=force)
    if as_json:
        click.echo(json.dumps({"frozen": len(items), "path": str(path), "left_out": left}, indent=2))
        return
    criteria = {i[regression.KEY]["criterion_id"] for i in items}
    out = [f"froze {plural(len(items), 'item')} of {plural(len(criteria), 'criterion', 'criteria')} to {path}"]
    if left["ties"]:
        out.append(f"{plural(left['ties'], 'item')} left out: the labels tie")
    if left["no_transcript"]:
        out.append(f"{plural(left['no_transcript'], 'item')} left out: the conversation is no longer stored")
    click.echo("\n".join(out))


def _rerun(cfg: Config, name: str, criterion: str | None, provider_type: str | None, model: str | None,
           base_url: str | None, as_json: bool) -> None:
    from ..evals.setup import load_configured_criteria
    from ..review import regression

    frozen = regression.read_set(regression.set_path(cfg.calibration_dir, name))
    if criterion is not None:
        frozen = [f for f in frozen if f.criterion_id == criterion]
        if not frozen:
            raise UserError(f"the set {name!r} has no item of criterion {criterion!r}")
    criteria = load_configured_criteria(cfg)
    if not criteria:
        raise UserError("no criteria to judge with: judges.criteria is empty")
    result = regression.rerun(frozen, criteria, cli_provider(cfg, provider_type, model, base_url),
                              concurrency=cfg.judges.concurrency, timeout=cfg.judges.timeout)
    click.echo(json.dumps(result, ensure_ascii=False, indent=2) if as_json else render_rerun(result))
    if result["counts"]["broken"]:
        sys.exit(1)


def render_rerun(result: dict[str, Any]) -> str:
    """What a rerun changed, as text: one block per criterion, then the totals."""
    out: list[str] = []
    for c in result["criteria"]:
        k = c["counts"]
        versions = "/".join(f"v{v}" for v in c["frozen_versions"]) or "v?"
        now = "no longer in judges.criteria" if c["current_version"] is None else f"now v{c['current_version']}"
        out += [f"{c['criterion_id']} (frozen {versions}, {now}): {k['fixed']} fixed, {k['broken']} broken, "
                f"{k['same']} same, {k['missing']} missing",
                (f"  false pass before: {calibration_rate_text(c['false_pass_before'])}   "
                 f"after: {calibration_rate_text(c['false_pass_after'])}")]
        for what in ("broken", "fixed"):
            if c[what]:
                out.append(f"  {what}: {', '.join(c[what])}")
        for reason, n in sorted(c["not_run"].items()):
            out.append(f"  {n} not run (missing): {reason}")
        for reason, n in sorted(c["errors"].items()):
            out.append(f"  {plural(n, 'judge error')}: {reason or 'unknown'}")
    k = result["counts"]
    out.append(f"{'REGRESSION' if k['broken'] else 'no regression'}: {k['fixed']} fixed, {k['broken']} broken, "
               f"{k['same']} same, {k['missing']} missing")
    return "\n".join(out)


def render(report: dict[str, Any]) -> str:
    """The report as text: one block per criterion."""
    if not report["criteria"]:
        return ("no blind labels yet: label calibration items on the review page, or with "
                "`tracejudge labels export` and `import`")
    out: list[str] = []
    for c in report["criteria"]:
        mark = "calibrated" if c["calibrated"] else f"NOT CALIBRATED: {c['reason_text']}"
        kappa = "n/a" if c["kappa"] is None else f"{c['kappa']:.2f}"
        agreement = "n/a" if c["agreement"] is None else f"{c['agreement']:.0%}"
        out += [f"{c['criterion_id']}: {mark}", f"  {c['n']} labelled, agreement {agreement}, kappa {kappa}",
                (f"  false pass: {calibration_rate_text(c['false_pass'])}   "
                 f"false fail: {calibration_rate_text(c['false_fail'])}")]
        labels = ("pass", "fail", "not_applicable")
        rows = [["people \\ judge", *labels]]
        rows += [[h, *(str(c["confusion"][h][j]) for j in labels)] for h in labels]
        out += ["  " + line for line in table(rows, align="lrrr").splitlines()]
        reviewers = c.get("reviewers") or {}
        if reviewers.get("items"):
            rk = "n/a" if reviewers.get("kappa") is None else f"{reviewers['kappa']:.2f}"
            out.append(f"  between people: {reviewers['items']} item(s) with several, agreement "
                       f"{reviewers['agreement']:.0%}, Fleiss' kappa {rk}")
        out.append("")
    return "\n".join(out).rstrip()

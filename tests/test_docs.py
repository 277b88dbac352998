"""The documentation the code and the README point at is shipped, and says what a newcomer needs."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from .support.daemon import REPO

FORMATS = ("criteria.md", "conversation-v1.md", "scenario.md")


def _project_texts() -> dict[Path, str]:
    files = [REPO / "README.md", REPO / "otel-config.yaml",
             *(p for pkg in ("collector", "judges", "replay") for p in (REPO / pkg).rglob("*.py"))]
    return {p: p.read_text(encoding="utf-8") for p in files}


@pytest.mark.parametrize("name", FORMATS)
def test_each_format_is_shipped_under_docs(name: str) -> None:
    text = (REPO / "docs" / name).read_text(encoding="utf-8")
    assert text.startswith("# ") and len(text) > 1500


def test_every_reference_to_a_format_names_a_shipped_file() -> None:
    referenced = set()
    for path, text in _project_texts().items():
        assert not re.search(r"(?<![\w/])formats/\w", text), f"{path} points at formats/, which is not shipped"
        referenced |= {(path, m) for m in re.findall(r"docs/[\w.-]+\.md", text)}
    assert {m for _, m in referenced} >= {f"docs/{n}" for n in FORMATS} - {"docs/scenario.md"}
    for path, ref in referenced:
        assert (REPO / ref).is_file(), f"{path} points at {ref}, which does not exist"


def test_relative_links_in_the_docs_resolve() -> None:
    for page in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


def test_readme_environment_block_turns_on_the_current_genai_conventions() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    block = readme[readme.index("OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317"):]
    block = block[: block.index("```")]
    assert "OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental" in block
    assert "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_ONLY" in block


def test_the_readme_reads_in_ten_minutes() -> None:
    assert len((REPO / "README.md").read_text(encoding="utf-8").splitlines()) < 300


def _keys(model: type, where: str) -> list[str]:
    from pydantic import BaseModel

    out = []
    for name, field in model.model_fields.items():  # type: ignore[attr-defined]
        if name in ("source", "unbuilt"):
            continue
        sub = field.annotation
        args = getattr(sub, "__args__", ())
        if getattr(sub, "__origin__", None) is list:
            out.append(f"{where}{name}")  # a list of objects: its row says what each holds
            continue
        if getattr(sub, "__origin__", None) is dict:
            value = args[1] if len(args) == 2 else None
            if isinstance(value, type) and issubclass(value, BaseModel):  # entries named by the user
                out += _keys(value, f"{where}{name}.NAME.")
                continue
        target = next((a for a in (sub, *args) if isinstance(a, type) and issubclass(a, BaseModel)), None)
        out += _keys(target, f"{where}{name}.") if target is not None else [f"{where}{name}"]
    return out


def test_the_configuration_reference_has_a_row_for_every_key() -> None:
    from collector.config import Config

    text = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    # A row names one key, a key of each protocol (`*`), or several of one section (`api.tls.cert_file`,
    # `.key_file`).
    names = []
    for line in text.splitlines():
        if line.startswith("| `"):
            first, *more = re.findall(r"`([^`]+)`", line.split("|")[1])
            names += [first, *(first.rpartition(".")[0] + m if m.startswith(".") else m for m in more)]
    named = re.compile("|".join(re.escape(k).replace(r"\*", r"[^.]+") for k in names))
    # simulate.user.provider has the shape of judges.provider, and its row says so.
    missing = [key for key in _keys(Config, "")
               if not named.fullmatch(key.replace("simulate.user.provider.", "judges.provider."))]
    assert not missing, missing
    assert "not built yet" not in text


def test_the_documented_test_commands_are_what_ci_runs() -> None:
    """The README's test command is CI's: mypy on the three packages, then pytest with the arguments given,
    so that `bash .ci/run -m "not slow"` is the fast subset of the marker pyproject.toml declares."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    development = (REPO / "docs" / "development.md").read_text(encoding="utf-8")
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert "bash .ci/run\n" in readme and 'bash .ci/run -m "not slow"' in readme
    assert 'bash .ci/run -m "not slow"' in development
    assert ".venv/bin/python -m mypy collector judges replay" in development
    assert ci[-2:] == [".venv/bin/python -m mypy collector judges replay",
                       '.venv/bin/python -m pytest -q -p no:cacheprovider "$@"']
    pytest_options = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["pytest"]
    assert [m.split(":")[0] for m in pytest_options["ini_options"]["markers"]] == ["slow"]
    assert "--strict-markers" in pytest_options["ini_options"]["addopts"]

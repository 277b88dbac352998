"""The documentation the code and the README point at is shipped, and says what a newcomer needs."""

from __future__ import annotations

import re
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

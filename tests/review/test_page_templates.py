"""The review pages' templates ship with the package, and every one of them escapes what it shows."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from ..support.daemon import REPO, clean_env

TEMPLATES = REPO / "collector" / "review" / "templates"


def test_the_templates_are_installed_with_the_package_and_the_pages_render_from_there(tmp_path: Path) -> None:
    # build_py lays the package out as a wheel installs it: the package-data globs decide what goes along.
    src, site = tmp_path / "src", tmp_path / "site"
    for name in ("collector", "judges", "replay"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    subprocess.run([sys.executable, "-c", "import setuptools; setuptools.setup()", "-q", "build_py",
                    "--build-lib", str(site)], cwd=src, check=True, capture_output=True)
    assert sorted(p.name for p in (site / "collector" / "review" / "templates").iterdir()) == \
        sorted(p.name for p in TEMPLATES.iterdir())

    probe = "from collector.review import page; print(page.__file__); print(page.render_message('<b>', 'x'))"
    shown = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env={**clean_env(), "PYTHONPATH": str(site)},
                           check=True, capture_output=True, text=True).stdout
    assert shown.startswith(str(site)) and "<h1>&lt;b&gt;</h1>" in shown


def test_every_template_is_autoescaped() -> None:
    """The environment escapes templates by their extension (``select_autoescape(["html"])``)."""
    assert sorted(p.suffix for p in TEMPLATES.iterdir()) == [".html"] * len(list(TEMPLATES.iterdir()))

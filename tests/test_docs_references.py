"""Papers are cited by their own names and numbers, never through files outside this repository: no tracked file under
src/, configs/, docs/, scripts/, tests/ or README.md points at notes kept elsewhere (a digest's sections or items,
``shared/papers``, ``shared/recipes``, an ARCHITECTURE section); docs/references.md is the bibliography, linked from
docs/index.md and from every algorithm page's "Paper:" line."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCOPE = ("src", "configs", "docs", "scripts", "tests", "README.md")
OUTSIDE = re.compile(
    r"shared/(papers|recipes)"  # the notes' folders
    r"|papers/source"
    r"|digest\s*§|digest\s*``|\(digest\b|digest\s+section"  # "digest §5", "digest ``whale-fl.md``", "(digest ..."
    r"|\b(augfl|drfa|fedxl|pfedfbe|whale-fl)\.md\s*§"  # a digest's file name with a section ("drfa.md §2.2")
    r"|papers/(augfl|drfa|fedxl|pfedfbe|whale-fl)\.md"
    r"|§\s*\d+(\.\d+)*\s+items?\s+\d"  # a digest's numbered item ("§5 item 10")
    r"|\bARCHITECTURE(\.md)?\s*§",
    flags=re.IGNORECASE,
)
PAGES = {"fedxl.md": "fedxl", "drfa.md": "drfa", "pfedfbe.md": "pfedfbe", "augfl.md": "augfl", "whale.md": "whale-fl"}


def tracked_files() -> list[Path]:
    """The text files in SCOPE that git tracks or would add (a walk of SCOPE where there is no git checkout)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *SCOPE],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        paths = [ROOT / line for line in out.splitlines() if line]
    except (OSError, subprocess.CalledProcessError):
        paths = [p for s in SCOPE for p in ([ROOT / s] if (ROOT / s).is_file() else (ROOT / s).rglob("*"))]
    return [p for p in paths if p.is_file() and p != Path(__file__).resolve()]


def anchor(heading: str) -> str:
    """The GitHub anchor of a markdown heading's text."""
    return re.sub(r"[^a-z0-9 -]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize(
    ("text", "outside"),
    [
        ("(digest §5 item 10)", True),
        ("digest ``whale-fl.md`` §1.3", True),
        ("see shared/papers/drfa.md", True),
        ("(drfa.md §2.2 Alg. 1, §7 item 7)", True),
        ("(papers/pfedfbe.md §3.1)", True),
        ("(ARCHITECTURE §4 lists RNG)", True),
        ("hashlib.sha256(data).hexdigest()", False),
        ("digest = hashlib.sha256()", False),
        ("ids=[d[0] for d in enumerate(DIGESTS)]", False),
        ("(WHALE-FL paper, Eq. 4; pFedFBE paper, Sec. 4.1; AugFL, Section VI-A)", False),
    ],
)
def test_the_pattern_tells_outside_references_from_hashes_and_paper_numbers(text: str, outside: bool) -> None:
    """The pattern the repository test uses: every form found before the clean-up matches, a hash digest and a
    paper's own numbers do not."""
    assert bool(OUTSIDE.search(text)) is outside


def test_no_file_cites_notes_outside_the_repository() -> None:
    """Every hit is reported as ``path:line: text``; this test's own file (the patterns above) is left out."""
    files = tracked_files()
    assert any(p.name == "references.md" for p in files)
    hits = [
        f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
        for p in files
        for n, line in enumerate(p.read_text(encoding="utf-8", errors="ignore").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not hits, "\n".join(hits)


def test_bibliography_is_linked_from_the_index_and_every_algorithm_page() -> None:
    """docs/index.md links docs/references.md; each algorithm page's "Paper:" paragraph links its entry, whose heading
    exists; every page that references.md links exists."""
    docs = ROOT / "docs"
    refs = (docs / "references.md").read_text()
    anchors = {anchor(h) for h in re.findall(r"^#+ (.+)$", refs, flags=re.M)}
    assert "(references.md)" in (docs / "index.md").read_text()
    for page, entry in PAGES.items():
        text = (docs / page).read_text()
        paper = text[text.index("Paper:") : text.index("\n\n", text.index("Paper:"))]
        assert f"(references.md#{entry})" in paper, page
        assert entry in anchors, entry
    for target in re.findall(r"\]\(([\w.-]+\.md)(?:#[\w-]+)?\)", refs):
        assert (docs / target).is_file(), target

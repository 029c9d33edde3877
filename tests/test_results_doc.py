"""benchmarks/RESULTS.md stays a short front page, and every relative link in it and in
benchmarks/results/*.md reaches an existing file and, for an ``#anchor``, an existing heading."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FRONT = ROOT / "benchmarks" / "RESULTS.md"
DOCS = [FRONT, *sorted((ROOT / "benchmarks" / "results").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")


def _outside_code(text: str):
    """The lines of a markdown file that are not inside fenced code blocks."""
    fence = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if not fence:
            yield line


def github_anchor(title: str) -> str:
    """GitHub's heading anchor: lowercase, punctuation but '-' and '_' removed, spaces to '-'."""
    title = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", title.strip().lower())
    return "".join(c for c in title if c.isalnum() or c in " -_").replace(" ", "-")


def anchors(path: Path) -> set:
    seen, out = {}, set()
    for line in _outside_code(path.read_text(encoding="utf-8")):
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            slug = github_anchor(match.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_front_page_is_short():
    assert len(FRONT.read_text(encoding="utf-8").splitlines()) <= 160


def test_results_files_exist():
    assert len(DOCS) > 1


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(doc):
    broken = []
    cache = {}
    for line in _outside_code(doc.read_text(encoding="utf-8")):
        line = re.sub(r"`[^`]*`", "", line)
        for match in LINK.finditer(line):
            target = match.group(1) or match.group(2)
            if re.match(r"[a-z][a-z0-9+.-]*:", target):
                continue  # http(s), mailto: not relative
            file_part, _, anchor = target.partition("#")
            path = (doc.parent / file_part).resolve() if file_part else doc
            if not path.exists():
                broken.append(target)
                continue
            if anchor and path.suffix == ".md":
                if path not in cache:
                    cache[path] = anchors(path)
                if anchor not in cache[path]:
                    broken.append(target)
    assert not broken, f"{doc.name}: broken links {broken}"

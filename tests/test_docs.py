"""Every relative link in the documentation (README.md, docs/*.md) points at a file that
exists, and every `#anchor` at a heading of the page it names (or of its own page), by
GitHub's rules for heading ids. The README's map lists every docs/ page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from docs_files import ROOT, doc_files

FENCE = re.compile(r"^ {0,3}(```+|~~~+)")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)[ \t]*#*[ \t]*$")
CODE_SPAN = re.compile(r"(`+).*?\1")
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'(][^)]*)?\)")
REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
EXTERNAL = re.compile(r"^(?:[a-zA-Z][a-zA-Z0-9+.-]*:|//)")  # https:, mailto:, //host


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    lines, fence = [], ""
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if fence:
            if match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence):
                fence = ""
            continue
        if match:
            fence = match.group(1)
            continue
        lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's heading id: the heading's text (code marks, emphasis and link targets
    dropped), lowercased, every character that is not a letter, digit, space, `-` or `_`
    removed, spaces turned into `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # [text](url) -> text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The ids GitHub gives the headings of one page: a repeated id gets -1, -2, …"""
    seen: dict[str, int] = {}
    ids = set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        ids.add(base if count == 0 else f"{base}-{count}")
    return ids


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every inline link, image and reference definition outside
    code."""
    found = []
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        prose = CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)
        found += [(number, m.group(1)) for m in INLINE_LINK.finditer(prose)]
        found += [(number, m.group(1)) for m in REFERENCE_DEF.finditer(prose)]
    return found


def broken_links(files: list[Path], root: Path) -> list[str]:
    """`file:line: target: why` for every relative link that does not resolve."""
    problems = []
    for path in files:
        for number, target in links(path):
            if not target or EXTERNAL.match(target):
                continue
            where = f"{path.relative_to(root)}:{number}: {target}"
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                problems.append(f"{where}: no such file {file_part}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{where}: no heading #{anchor} in {dest.relative_to(root)}")
    return problems


def test_every_relative_link_and_anchor_resolves():
    files = doc_files()
    assert len(files) > 1, "docs/ has no page"
    problems = broken_links(files, ROOT)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_readme_maps_every_docs_page():
    readme = ROOT / "README.md"
    linked = {(ROOT / target.partition("#")[0]).resolve() for _, target in links(readme)}
    unmapped = [p.name for p in doc_files()[1:] if p.resolve() not in linked]
    assert not unmapped, f"README.md's documentation map misses {unmapped}"


@pytest.mark.parametrize(
    ("heading", "expected"),
    [
        ("Export and model card (`export/`)", "export-and-model-card-export"),
        ("Verified offline vs. only on GCP", "verified-offline-vs-only-on-gcp"),
        (
            "Guard rails (policy/, Pulumi CrossGuard, 22 rules, all mandatory)",
            "guard-rails-policy-pulumi-crossguard-22-rules-all-mandatory",
        ),
        (
            "Pod slices (multi-host TPU): the payload side",
            "pod-slices-multi-host-tpu-the-payload-side",
        ),
        ("`tpu_watch` and [the **lease**](x.md)", "tpu_watch-and-the-lease"),
        ("대한민국 corpus", "대한민국-corpus"),
    ],
)
def test_slug_follows_githubs_rules(heading, expected):
    assert slug(heading) == expected


def test_a_broken_link_or_anchor_is_reported_with_file_and_line(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(
        "# A page\n\n## Setup\n\n## Setup\n\n```sh\n# Not a heading\n```\n", encoding="utf-8"
    )
    readme = tmp_path / "README.md"
    readme.write_text(
        "# Top\n"
        "[ok](docs/a.md) [ok](docs/a.md#setup-1) [ok](#top) [web](https://example.com/x#y)\n"
        "`[in code](missing.md)`\n"
        "```\n[in a fence](missing.md)\n```\n"
        "[gone](docs/missing.md)\n"
        "[bad anchor](docs/a.md#setup-2) [fenced](docs/a.md#not-a-heading) [self](#nowhere)\n",
        encoding="utf-8",
    )
    assert broken_links([readme, tmp_path / "docs" / "a.md"], tmp_path) == [
        "README.md:7: docs/missing.md: no such file docs/missing.md",
        "README.md:8: docs/a.md#setup-2: no heading #setup-2 in docs/a.md",
        "README.md:8: docs/a.md#not-a-heading: no heading #not-a-heading in docs/a.md",
        "README.md:8: #nowhere: no heading #nowhere in README.md",
    ]

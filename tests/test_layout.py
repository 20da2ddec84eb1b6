"""The layout in docs/architecture.md is the tree: every Python package under payload/,
infra/ and policy/ appears there with its `__init__.py` docstring's first line, and every
folder the tree names exists. A new folder without a line, or a docstring changed on one side
only, fails."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("payload", "infra", "policy")
# `  name/   what it is` (two spaces per level of the tree).
ENTRY = re.compile(r"^(?P<indent>(?:  )*)(?P<name>[\w.-]+/)\s{2,}(?P<text>\S.*)$")


def layout_block(readme: str) -> list[str]:
    section = readme.split("## Repository layout", 1)[1]
    return section.split("```", 2)[1].splitlines()[1:]


def tree(lines: list[str]) -> dict[str, str]:
    """folder path -> its line's text, from the indented tree."""
    entries: dict[str, str] = {}
    stack: list[str] = []
    for line in lines:
        match = ENTRY.match(line)
        if not match:
            continue
        depth = len(match.group("indent")) // 2
        stack[depth:] = [match.group("name").rstrip("/")]
        entries["/".join(stack)] = " ".join(match.group("text").split())
    return entries


def summary(init: Path) -> str:
    doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
    return " ".join(doc.split("\n\n", 1)[0].split())


def packages() -> list[Path]:
    found = []
    for root in PACKAGES:
        found += [p.parent for p in sorted((ROOT / root).rglob("__init__.py"))]
    return found


def test_every_package_has_a_one_line_summary() -> None:
    missing = [str(p.relative_to(ROOT)) for p in packages() if not summary(p / "__init__.py")]
    assert not missing, f"packages whose __init__.py has no docstring: {missing}"
    long = [
        str(p.relative_to(ROOT))
        for p in packages()
        if len(summary(p / "__init__.py")) > 100 or "\n" in summary(p / "__init__.py")
    ]
    assert not long, f"summaries over one line: {long}"


def test_readme_tree_is_the_packages_docstrings() -> None:
    entries = tree(layout_block((ROOT / "docs/architecture.md").read_text(encoding="utf-8")))
    wrong = []
    for package in packages():
        name = str(package.relative_to(ROOT))
        if name not in entries:
            wrong.append(f"{name}/ is not in docs/architecture.md's tree")
        elif entries[name] != summary(package / "__init__.py"):
            wrong.append(
                f"{name}/: docs/architecture.md says {entries[name]!r}, __init__.py says "
                f"{summary(package / '__init__.py')!r}"
            )
    wrong += [f"{name}/ does not exist" for name in entries if not (ROOT / name).is_dir()]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        (["payload/   the payload", "  core/   plumbing", "    x/  deeper", "  data/  data"],
         {"payload": "the payload", "payload/core": "plumbing", "payload/core/x": "deeper",
          "payload/data": "data"}),
        (["  cli.py   not a folder", "plain prose"], {}),
    ],
)  # fmt: skip
def test_tree_reads_the_indentation(lines: list[str], expected: dict[str, str]) -> None:
    assert tree(lines) == expected

"""The documentation users read: README.md and every docs/*.md page, in that order.

Tests that check documented text (printed commands, links, the recovery role's command) read
it through here, so text moved between the README and docs/ stays covered. Import it from
another folder by inserting `tests/` into sys.path first (there is no tests/__init__.py)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def doc_text() -> str:
    """Every documentation file's text, one after the other (each file's code fences are
    balanced, so a fence never spans two files)."""
    return "\n".join(path.read_text(encoding="utf-8") for path in doc_files())

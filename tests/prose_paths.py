"""The repository paths and modules that prose names: README.md, docs/, and the comments,
docstrings and strings of every tracked source file.

A path is a run of path characters that starts with one of the repository's top-level
folders (`payload/…`, `infra/render/templates/…`) or names a top-level file; a module is a dotted
name under one of the Python packages (`payload.backends.jax.steps`, `infra.commands.plan`). A path
may hold a placeholder (`stacks/Pulumi.<stack>.yaml`), a glob (`tests/payload/test_*.py`)
or a brace list (`{a,b}`): it must then match at least one tracked file. What follows a
path after `::` (a test id) or `:` and digits (a line) is not part of it.

Not a repository path: one that continues another path or a URL (`gs://<bucket>/payload/…`,
`/opt/tpu-pretrain/src/infra/…`, `runs/<job>/logs/`), and the names a test creates itself
under a temporary directory (listed in MADE_BY_TESTS)."""

from __future__ import annotations

import fnmatch
import io
import re
import subprocess
import tokenize
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FOLDERS = (
    "payload",
    "infra",
    "policy",
    "tests",
    "bench",
    "docs",
    "stacks",
    "examples",
    "requirements",
    "tools",
    ".github",
    ".ci",
)
FILES = ("Makefile", "Pulumi.yaml", "pyproject.toml", "README.md")
PACKAGES = ("payload", "infra", "policy")

# Not preceded by what would make it the tail of a longer path, a URL or a dotted name.
_BEFORE = r"(?<![A-Za-z0-9_./~$}>:-])"
PATH = re.compile(
    _BEFORE
    + r"((?:"
    + "|".join(re.escape(f) for f in FOLDERS)
    + r")/[A-Za-z0-9_.*<>{},/-]*[A-Za-z0-9_*>}/]|(?:"
    + "|".join(re.escape(f) for f in FILES)
    + r")(?![A-Za-z0-9_.-]))"
)
MODULE = re.compile(
    _BEFORE + r"((?:" + "|".join(PACKAGES) + r")(?:\.[a-z_][a-z0-9_]*)+)(?![A-Za-z0-9_])"
)
# `payload.md`, `payload.lock`: a file name, not a module.
FILE_SUFFIXES = frozenset({"md", "lock", "txt", "yaml", "yml", "json", "toml", "sh", "tar", "gz"})

# Paths that a command writes itself (`npm ci`, `make bench`, the policy workflow's venv).
MADE_BY_COMMANDS = frozenset({"tools/node_modules", "bench/out", "policy/venv"})
NOT_PATHS = frozenset({"docs/s"})  # documents a second

# Other repositories' files that prose cites by their own path (each beside its repository's
# name where it is cited), and a file named as one to add.
ELSEWHERE = frozenset(
    {
        ".github/CODEOWNERS",  # docs/guard-rails.md: a file the user adds to their fork
        ".github/workflows/actions.yml",  # GoogleCloudPlatform/ml-auto-solutions
        ".github/workflows/cloud-tpu-ci-nightly.yml",  # jax-ml/jax
        ".github/workflows/tpu_tests.yml",  # keras-team/keras
        "docs/fault_tolerance.rst",  # jax-ml/jax
        "docs/index.rst",  # google-cloud-storage
        "docs/install_maxtext.md",  # AI-Hypercomputer/maxtext
        "docs/installation.md",  # jax-ml/jax
        "docs/multi_process.md",  # jax-ml/jax
        "docs/reference/models/tiering.md",  # AI-Hypercomputer/maxtext
        "docs/run_maxtext/run_maxtext_via_multihost_runner.md",  # AI-Hypercomputer/maxtext
        "examples/benchmarks/bert/src/configuration_bert.py",  # mosaicml/examples
        "examples/machine-learning/a4-highgpu-8g",  # GoogleCloudPlatform/cluster-toolkit
        "examples/machine-learning/a4-highgpu-8g/a4high-vm.yaml",
        "tests/__init__.py",  # named as absent ("there is no tests/__init__.py")
    }
)
# A bucket object under the bucket's payload/ prefix, not this tree's payload/ folder.
BUCKET_PAYLOAD = re.compile(r"payload/(?:[^/]*\.tar\.gz|tpu-pretrain-payload|[<{])")


@dataclass(frozen=True)
class Mention:
    source: str  # the file that names it, relative to ROOT
    line: int
    name: str  # as written

    def __str__(self) -> str:
        return f"{self.source}:{self.line}: {self.name}"


@cache
def tracked_files() -> tuple[str, ...]:
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True
    ).stdout
    return tuple(name for name in out.decode().split("\0") if name and (ROOT / name).exists())


@cache
def _tracked_set() -> frozenset[str]:
    return frozenset(tracked_files())


@cache
def _tracked_dirs() -> frozenset[str]:
    dirs: set[str] = set()
    for name in tracked_files():
        parts = name.split("/")
        dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
    return frozenset(dirs)


def _brace_expand(pattern: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", pattern)
    if not match:
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end() :]
    return [x for alt in match.group(1).split(",") for x in _brace_expand(head + alt + tail)]


def path_exists(name: str) -> bool:
    name = name.rstrip("/")
    if name in ELSEWHERE or name in NOT_PATHS or BUCKET_PAYLOAD.match(name):
        return True
    if name in MADE_BY_COMMANDS or any(name.startswith(m + "/") for m in MADE_BY_COMMANDS):
        return True
    if not _matches(name):
        # `infra/bootstrap/deploy_permissions` (a module's path without .py), or
        # `payload/backends/jax/steps.make_train_chunk` (a module's path, then a name in it).
        return _matches(name + ".py") or ("." in name and _matches(name.rsplit(".", 1)[0] + ".py"))
    return True


def _matches(name: str) -> bool:
    # `{x}` (an f-string field) is a placeholder; `{a,b}` a list of alternatives.
    name = re.sub(r"\{[^{},]*\}", "*", name)
    patterns = [re.sub(r"<[^<>]*>", "*", p) for p in _brace_expand(name)]
    files, dirs = tracked_files(), _tracked_dirs()
    for pattern in patterns:
        if not any(c in pattern for c in "*?["):
            if pattern in dirs or pattern in files:
                continue
            return False
        if not (fnmatch.filter(files, pattern) or fnmatch.filter(dirs, pattern)):
            return False
    return True


def module_exists(name: str) -> bool:
    """`payload.a.b.c`: its longest prefix that is a module or a package is at least the
    package and one name below it (what follows may be an attribute)."""
    parts = name.split(".")
    if parts[-1] in FILE_SUFFIXES:
        return True
    files = _tracked_set()
    found = 1
    for i in range(2, len(parts) + 1):
        base = "/".join(parts[:i])
        if f"{base}.py" in files or f"{base}/__init__.py" in files:
            found = i
        else:
            break
    if found >= 2:
        return True
    # `payload.X` where X is an attribute of the package itself (its __init__).
    init = ROOT / parts[0] / "__init__.py"
    return init.exists() and re.search(rf"\b{re.escape(parts[1])}\b", init.read_text()) is not None


def _trim(name: str) -> str:
    name = re.sub(r"::.*$", "", name)
    name = re.sub(r":\d[\d,-]*$", "", name)
    while name and name[-1] in ".,;:)":
        name = name[:-1]
    return name


def prose_of_python(text: str, *, strings: bool) -> list[tuple[int, str]]:
    """(line, text) of a Python file's comments and docstrings, and of every other string
    where `strings` (a test's strings name paths it creates or plants: not prose)."""
    found: list[tuple[int, str]] = []
    tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    for i, token in enumerate(tokens):
        if token.type == tokenize.COMMENT:
            found.append((token.start[0], token.string))
        elif token.type in (tokenize.STRING, FSTRING_START):
            previous = next((t for t in reversed(tokens[:i]) if t.type not in _LAYOUT), None)
            docstring = previous is None or previous.type in _STATEMENT_START
            if not (strings or docstring):
                continue
            string = token.string
            if token.type == FSTRING_START:  # Python 3.12+: an f-string is several tokens
                j = i
                while tokens[j].type != FSTRING_END:
                    j += 1
                string = "".join(t.string for t in tokens[i : j + 1])
            found += [(token.start[0] + k, line) for k, line in enumerate(string.splitlines())]
    return found


_LAYOUT = (tokenize.NL, tokenize.COMMENT)
_STATEMENT_START = (tokenize.ENCODING, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
FSTRING_START = getattr(tokenize, "FSTRING_START", -1)
FSTRING_END = getattr(tokenize, "FSTRING_END", -1)


def prose_lines(source: str, text: str) -> list[tuple[int, str]]:
    if source.endswith(".py"):
        return prose_of_python(text, strings=not source.startswith("tests/"))
    return list(enumerate(text.splitlines(), 1))


def mentions(source: str, text: str) -> list[Mention]:
    found = []
    for number, line in prose_lines(source, text):
        for match in PATH.finditer(line):
            name = _trim(match.group(1))
            if name:
                found.append(Mention(source, number, name))
        for match in MODULE.finditer(line):
            found.append(Mention(source, number, match.group(1)))
    return found


SCANNED_SUFFIXES = (".py", ".md", ".sh", ".yml", ".yaml", ".toml", ".txt", ".cfg")


def scanned_files() -> list[str]:
    """Every tracked text file a person reads: docs, code (comments, docstrings, strings),
    scripts, configuration. Test data and lock files are not prose."""
    chosen = []
    for name in tracked_files():
        if name.startswith("tests/infra/data/") or name.endswith((".lock", "package-lock.json")):
            continue
        if name in ("Makefile", ".ci/run") or name.endswith(SCANNED_SUFFIXES):
            chosen.append(name)
    return chosen


def exists(name: str) -> bool:
    """Whether a mentioned module (dotted) or path names something in the tree."""
    return module_exists(name) if MODULE.fullmatch(name) else path_exists(name)


def stale_mentions(files: list[str] | None = None) -> list[Mention]:
    stale = []
    for source in files if files is not None else scanned_files():
        text = (ROOT / source).read_text(encoding="utf-8", errors="replace")
        stale += [m for m in mentions(source, text) if not exists(m.name)]
    return stale

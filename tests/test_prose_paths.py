"""Every repository path and module that prose names exists: README.md, docs/, and the
comments, docstrings and strings of every tracked source file (tests/prose_paths.py says
what counts as a mention). A move that leaves a stale name fails here, with the file and
line that still names it."""

from __future__ import annotations

import prose_paths
import pytest


def test_every_named_path_and_module_exists() -> None:
    stale = prose_paths.stale_mentions()
    assert not stale, "names that do not exist in the tree:\n" + "\n".join(map(str, stale))


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("see payload/no_such_module.py for it", ["payload/no_such_module.py"]),
        ("`infra/render/templates/nope.sh:12`", ["infra/render/templates/nope.sh"]),
        ("tests/payload/test_nope_*.py", ["tests/payload/test_nope_*.py"]),
        ("stacks/Pulumi.<stack>.yaml and docs/{payload,nope}.md", ["docs/{payload,nope}.md"]),
        ("payload.no_such_module.thing", ["payload.no_such_module.thing"]),
        # Mentions that exist, and what is not a repository path.
        ("payload/backends/jax/steps.py::test_x and infra.commands.plan and docs/payload.md.", []),
        ("gs://<bucket>/payload/tpu-pretrain-payload-<sha16>.tar.gz, runs/<job>/logs/", []),
        ("/opt/tpu-pretrain/src/infra/nope.py and payload.md", []),
    ],
)
def test_a_planted_name_is_found(text: str, found: list[str]) -> None:
    mentions = prose_paths.mentions("docs/x.md", text)
    assert [m.name for m in mentions if not prose_paths.exists(m.name)] == found


def test_python_prose_is_comments_docstrings_and_strings() -> None:
    source = (
        '"""Module doc: payload/doc_nope.py."""\n'
        "x = policy.get('a')  # comment: infra/comment_nope.py\n"
        "y = 'tests/string_nope.py'\n"
        "def f():\n"
        '    """Function doc: bench/fn_nope.py."""\n'
    )
    lines = prose_paths.prose_lines("payload/x.py", source)
    names = [m.name for line in lines for m in prose_paths.mentions("x", line[1])]
    assert names == [
        "payload/doc_nope.py",
        "infra/comment_nope.py",
        "tests/string_nope.py",
        "bench/fn_nope.py",
    ]
    # A test's own strings plant names it checks for: only its comments and docstrings count.
    lines = prose_paths.prose_lines("tests/x.py", source)
    names = [m.name for line in lines for m in prose_paths.mentions("x", line[1])]
    assert names == ["payload/doc_nope.py", "infra/comment_nope.py", "bench/fn_nope.py"]

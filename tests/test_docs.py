"""Every relative link in the documentation (README.md, docs/*.md) points at a file that
exists, and every `#anchor` at a heading of the page it names (or of its own page), by
GitHub's rules for heading ids. The README's map lists every docs/ page. Every make target,
`tpu-payload` verb and flag, job key, stack setting, stack and job template the pages name
exists (tests/doc_names.py; paths: tests/test_prose_paths.py)."""

from __future__ import annotations

import re
from pathlib import Path

import doc_names
import prose_paths
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


def test_every_name_the_docs_use_exists():
    problems = doc_names.all_problems(doc_files(), ROOT)
    assert not problems, "names the tree does not define:\n" + "\n".join(problems)


def test_the_names_check_reads_the_docs_commands():
    """The check sees the pages' commands and keys (a pattern that matched nothing would
    pass every page)."""
    code = [c.text for path in doc_files() for c in doc_names.code_of(path.read_text())]
    assert sum("tpu-payload " in c for c in code) >= 20
    assert sum(bool(re.search(r"\bmake \w", c)) for c in code) >= 20
    assert sum(len(doc_names.JOB_KEY.findall(c)) for c in code) >= 50
    assert {"plan", "compile", "run", "export"} <= set(doc_names.cli_options())
    assert {"plan", "smoke", "preview", "test"} <= doc_names.make_targets()
    assert {"train.remat", "data.beam.runner", "corpus.sources.weight"} <= doc_names.job_keys()
    assert "vpnZone" in doc_names.stack_settings()


PLANTED = """# A page
Run `tpu-payload plan --job x --verbose`, `make nope STACK=v5e-euw4` and set `train.nope`.

```sh
tpu-payload compile --job j --accelerator v6e-8 --stop-cost   # a comment: --nope is not read
python -m payload.plan --job j --force
make -j4 lint venv-nope
make plan STACK=nope-usc1
tpu-payload {validate,train} --job j [--force]
tpu-payload frobnicate --job j
tpu-payload <command> --job …
```

Set `tpu-pretrain:vpnZoen` (tpu-pretrain:tpuZone is one, tpu-pretrain:index:Network a type).
See docs/nope.md and `payload/backends/jax/train.py`.

```yaml
train: {steps: 10, remat: full, nope: 1}
data: {beam: {options: {anything: 1}, runnerr: x}}
model: {family: llama, config: {free: 1}}
```

| stack | job |
|---|---|
| `v5e-euw4` | gpt2-small-clm |
| `v9-nowhere` | no-such-job |
"""


def test_a_planted_wrong_flag_key_or_path_fails(tmp_path):
    """The test of the test: a wrong flag, verb, target, job key, stack setting, stack, job
    template or path planted in a page is reported with its line; a right one is not."""
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "x.md"
    page.write_text(PLANTED, encoding="utf-8")
    assert doc_names.all_problems([page], tmp_path) == [
        "docs/x.md:2: make nope: no such make target (Makefile)",
        "docs/x.md:2: tpu-payload plan --verbose: no such option (payload/cli.py)",
        "docs/x.md:2: train.nope: no such job key (payload/schema/job.py)",
        "docs/x.md:5: tpu-payload compile --stop-cost: no such option (payload/cli.py)",
        "docs/x.md:6: python -m payload.plan --force: no such option",
        "docs/x.md:7: make venv-nope: no such make target (Makefile)",
        "docs/x.md:8: stack nope-usc1: no stacks/Pulumi.nope-usc1.yaml",
        "docs/x.md:10: tpu-payload frobnicate: no such command (payload/cli.py)",
        "docs/x.md:14: tpu-pretrain:vpnZoen: no such stack setting (Pulumi.yaml)",
        "docs/x.md:18: data.beam.runnerr: no such job key (payload/schema/job.py)",
        "docs/x.md:18: train.nope: no such job key (payload/schema/job.py)",
        "docs/x.md:26: job no-such-job: not in stacks/jobs/",
        "docs/x.md:26: stack v9-nowhere: not in stacks/Pulumi.<stack>.yaml",
    ]
    stale = [
        m.name for m in prose_paths.mentions("docs/x.md", PLANTED) if not prose_paths.exists(m.name)
    ]
    assert stale == ["docs/nope.md"]


def test_a_planted_wrong_flag_in_a_real_page_fails(tmp_path):
    """The whole check over a copy of the real pages: clean, then one planted flag fails it."""
    for path in doc_files():
        target = tmp_path / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    copies = [tmp_path / p.relative_to(ROOT) for p in doc_files()]
    assert doc_names.all_problems(copies, tmp_path) == []
    recipe = tmp_path / "docs" / "llama-recipe.md"
    text = recipe.read_text(encoding="utf-8")
    planted = text.replace("--accelerator v6e-8\n", "--accelerator v6e-8 --fast\n", 1)
    assert planted != text
    recipe.write_text(planted, encoding="utf-8")
    (problem,) = doc_names.all_problems(copies, tmp_path)
    assert problem.endswith(": tpu-payload plan --fast: no such option (payload/cli.py)")


def test_the_changelog_opens_with_this_release():
    """CHANGELOG.md's newest section is the payload's version (pyproject.toml and
    payload.__version__), with a date; every section has both."""
    import tomllib

    import payload

    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    heads = re.findall(r"^## (\S+)(?: and \S+)? — (\d{4}-\d{2}-\d{2})", changelog, re.MULTILINE)
    sections = re.findall(r"^## ", changelog, re.MULTILINE)
    assert heads and len(heads) == len(sections), "a release section without a version or date"
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert heads[0][0] == version == payload.__version__


def test_the_readme_is_a_front_door():
    """At most ~120 lines, with the two set-up commands, and no release notes."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 120
    assert "make demo   #" in readme and "make test   #" in readme
    assert "What changed" not in readme and "CHANGELOG.md" in readme

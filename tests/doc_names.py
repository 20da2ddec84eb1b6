"""The names the documentation (README.md, docs/*.md) uses that the tree defines, and whether
each exists: make targets (the Makefile's rules), `tpu-payload` verbs and flags (the CLI's
argument parser, payload/cli.py), job keys (the job spec's dataclasses, payload/schema/job.py),
stack settings (`tpu-pretrain:<key>`, Pulumi.yaml) and stack and job template names
(stacks/). Paths are tests/prose_paths.py's.

Where a name counts: commands are read in code only (fenced `sh`/untagged blocks, indented
code and inline code spans), from the word `make`, `tpu-payload` or `python -m payload` to
the end of that command (`|`, `;`, `&&`, `>`, a ` #` comment); job keys in code spans
(`train.remat`) and in YAML blocks shaped like a job; stack settings anywhere; stack names
after `STACK=`, `--stack` or `pulumi stack init|select`, and in a table's `stack` column; job
template names in the `job` column of a stack table or in any `job template` column. A
placeholder (`<stack>`, `JOB`, `…`) is not a name.

    problems(text, source) -> ["<source>:12: make nope: no such make target (Makefile)", ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from functools import cache
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]

FENCE = re.compile(r"^ {0,3}(```+|~~~+)\s*([\w+-]*)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
SHELL_LANGUAGES = ("", "sh", "bash", "shell", "console")
TERMINATORS = re.compile(r"\s(?:\||;|&&|\|\||>|2>|#)\s|[`]|\s#")
JOB_SECTIONS = ("corpus", "tokenizer", "data", "model", "train")
# A key under a job key whose own keys are another library's (model.config: transformers'
# config names; data.beam.options: Beam's, allowlisted by the payload itself).
FREE_FORM = frozenset({"model.config", "data.beam.options"})
JOB_KEY = re.compile(r"(?<![\w.:/-])((?:corpus|tokenizer|data|model|train)(?:\.[a-z_]+)+)(?![\w(])")
STACK_KEY = re.compile(r"(?<![\w-])tpu-pretrain:([A-Za-z_]\w*)(?![\w:])")
STACK_NAME_AFTER = re.compile(
    r"(?:\bSTACK=|--stack[ =]|pulumi stack (?:init|select) )([a-z0-9][a-z0-9-]*)(?![\w<>-])"
)
PLACEHOLDER = re.compile(r"^[A-Z_]+$|[<>…{}]|\.\.\.")
# Dotted names in code that start like a job key and are not one, and whose they are.
NOT_JOB_KEYS = {
    "model.layers": "transformers' weight names in the export (model.layers.<i>.…)",
    "corpus.eval_documents": "the shards' manifest (payload/schema/manifest.py)",
}
# `train.py`, `tokenizer.json`: a file, not a job key.
FILE_SUFFIXES = frozenset(
    {"py", "md", "yaml", "yml", "json", "txt", "sh", "toml", "lock", "gz", "h5", "safetensors"}
)


@dataclasses.dataclass(frozen=True)
class Code:
    line: int
    text: str
    shell: bool  # a command line (fenced shell, indented, or inline code)
    language: str = ""


def code_of(text: str) -> list[Code]:
    """Fenced blocks (each line; `language` kept), indented code and inline code spans."""
    found: list[Code] = []
    fence, language = "", ""
    indented_code = False  # inside an indented code block (opened by a blank line)
    previous = ""
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if fence:
            if match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence):
                fence = ""
            else:
                found.append(Code(number, line, language in SHELL_LANGUAGES, language))
            continue
        if match:
            fence, language = match.group(1), match.group(2).lower()
            continue
        indented = line.startswith("    ") and bool(line.strip())
        indented_code = indented and (indented_code or not previous.strip())
        previous = line
        if indented_code and not line.lstrip().startswith(("- ", "|", "* ")):
            found.append(Code(number, line.strip(), True))
            continue
        found += [Code(number, m.group(2).strip(), True) for m in CODE_SPAN.finditer(line)]
    return found


def yaml_blocks(text: str) -> list[tuple[int, str]]:
    """(first line, body) of every ```yaml block."""
    blocks, body, start, fence = [], [], 0, ""
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if fence:
            if match and match.group(1)[0] == fence[0]:
                blocks.append((start, "\n".join(body)))
                fence, body = "", []
            else:
                body.append(line)
        elif match and match.group(2).lower() in ("yaml", "yml"):
            fence, start = match.group(1), number + 1
    return blocks


# --- what the tree defines --------------------------------------------------------------


@cache
def make_targets() -> frozenset[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    targets = set()
    for match in re.finditer(r"^([A-Za-z0-9_.-][A-Za-z0-9_. -]*?):(?!=)", text, re.MULTILINE):
        targets.update(t for t in match.group(1).split() if "$" not in t and "/" not in t)
    return frozenset(targets - {".PHONY"})


@cache
def cli_options() -> dict[str, frozenset[str]]:
    """Verb -> its option strings ("" -> the top level's)."""
    from payload import cli

    parser = cli._parser()
    options = {"": frozenset(s for a in parser._actions for s in a.option_strings)}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for verb, sub in action.choices.items():
                options[verb] = frozenset(s for a in sub._actions for s in a.option_strings)
    return options


@cache
def plan_module_options() -> frozenset[str]:
    """`python -m payload.plan`'s options (payload/plan/estimate.py main)."""
    from payload.plan import estimate

    parser = argparse.ArgumentParser()
    estimate.add_arguments(parser)
    return frozenset(s for a in parser._actions for s in a.option_strings)


@cache
def job_keys() -> frozenset[str]:
    """Every dotted key of a job document: `train.remat`, `data.beam.runner`,
    `corpus.sources.weight`; and what the resolved spec adds (`data.max_predictions`)."""
    from payload.schema import job

    keys = {"name", "output"}

    def walk(prefix: str, cls: type) -> None:
        for field in dataclasses.fields(cls):
            key = f"{prefix}.{field.name}"
            keys.add(key)
            inner = _dataclass_of(field.type, job)
            if inner is not None:
                walk(key, inner)
        keys.update(
            f"{prefix}.{name}" for name, value in vars(cls).items() if isinstance(value, property)
        )

    for section, cls in (
        ("corpus", job.CorpusSpec),
        ("tokenizer", job.TokenizerSpec),
        ("data", job.DataSpec),
        ("model", job.ModelSpec),
        ("train", job.TrainSpec),
    ):
        walk(section, cls)
    return frozenset(keys)


def _dataclass_of(annotation: object, module: object) -> type | None:
    """The job dataclass a field holds (one, or a tuple of them), from its annotation."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    for name in re.findall(r"[A-Z]\w+", str(text)):
        cls = getattr(module, name, None)
        if dataclasses.is_dataclass(cls) and isinstance(cls, type):
            return cls
    return None


@cache
def stack_settings() -> frozenset[str]:
    project = yaml.safe_load((ROOT / "Pulumi.yaml").read_text(encoding="utf-8"))
    return frozenset(project["config"])


@cache
def stack_names() -> frozenset[str]:
    """The program's stacks (stacks/) and the GitOps bootstrap program's (infra/bootstrap/)."""
    files = [
        *(ROOT / "stacks").glob("Pulumi.*.yaml"),
        *(ROOT / "infra" / "bootstrap").glob("Pulumi.*.yaml"),
    ]
    return frozenset(p.name[len("Pulumi.") : -len(".yaml")] for p in files) - {"Pulumi"}


@cache
def job_templates() -> frozenset[str]:
    return frozenset(p.stem for p in (ROOT / "stacks" / "jobs").glob("*.yaml"))


# --- finding and checking names ---------------------------------------------------------


def _command(text: str, start: int) -> list[str]:
    """The tokens of the command starting at `start`, up to its end."""
    rest = text[start:]
    end = TERMINATORS.search(rest)
    return rest[: end.start() if end else len(rest)].split()


def _flags(tokens: list[str]) -> list[str]:
    flags = []
    for token in tokens:
        match = re.match(r"^(--?[A-Za-z][\w-]*)", token.strip("[](),"))
        if match:
            flags.append(match.group(1))
    return flags


def _verbs(token: str) -> list[str]:
    token = token.strip("[]")
    if token.startswith("{") and token.endswith("}"):
        return [v.strip() for v in token[1:-1].split(",")]
    return [token]


MAKE_OPTIONS_WITH_A_VALUE = ("-o", "-C", "-f")


def make_problems(code: str) -> list[str]:
    """Every target of every `make [options] target... [VAR=value...]` is a Makefile rule."""
    problems = []
    for match in re.finditer(r"(?<![\w./-])make\s", code):
        tokens = iter(_command(code, match.end()))
        for token in tokens:
            if token in MAKE_OPTIONS_WITH_A_VALUE:
                next(tokens, None)
            elif token.startswith("-") or "=" in token or PLACEHOLDER.search(token):
                continue
            elif not re.fullmatch(r"[a-z][a-z0-9-]*", token):
                break
            elif token not in make_targets():
                problems.append(f"make {token}: no such make target (Makefile)")
    return problems


def cli_problems(code: str) -> list[str]:
    """Every `tpu-payload VERB --flag` (and `python -m payload[.plan]`) is the parser's."""
    problems = []
    command = r"(?<![\w.-])(?:tpu-payload|python -m payload(\.plan)?)(?=\s|$)"
    for match in re.finditer(command, code):
        tokens = _command(code, match.end())
        if match.group(1):  # python -m payload.plan: the plan's own parser
            problems += [
                f"python -m payload.plan {flag}: no such option"
                for flag in _flags(tokens)
                if flag not in plan_module_options()
            ]
            continue
        if not tokens:
            continue
        options = cli_options()
        verbs = [] if tokens[0].startswith("-") else _verbs(tokens[0])
        if any(PLACEHOLDER.search(v) for v in verbs):
            continue  # `tpu-payload <command> --job …`
        unknown = [v for v in verbs if v not in options]
        problems += [f"tpu-payload {v}: no such command (payload/cli.py)" for v in unknown]
        if unknown:
            continue
        allowed = [options[v] for v in verbs] or [options[""]]
        problems += [
            f"tpu-payload {'|'.join(verbs)} {flag}: no such option (payload/cli.py)".replace(
                "  ", " "
            )
            for flag in _flags(tokens[1:] if verbs else tokens)
            if not any(flag in options_of_verb for options_of_verb in allowed)
        ]
    return problems


def command_problems(code: str) -> list[str]:
    return make_problems(code) + cli_problems(code)


def job_key_problems(code: str) -> list[str]:
    problems = []
    for match in JOB_KEY.finditer(code):
        key = match.group(1).rstrip(".")
        section, *_, last = key.split(".")
        if last in FILE_SUFFIXES or any(key.startswith(free + ".") for free in FREE_FORM):
            continue
        if any(key == other or key.startswith(other + ".") for other in NOT_JOB_KEYS):
            continue
        if key not in job_keys() and not python_name(section, key.split(".")[1]):
            problems.append(f"{key}: no such job key (payload/schema/job.py)")
    return problems


@cache
def python_name(module: str, name: str) -> bool:
    """`model.loss_chunk_budget`, `train.run`: a name defined in a payload module or package
    called `module` (prose cites code so), not a job key."""
    files = [*ROOT.glob(f"payload/**/{module}.py"), *ROOT.glob(f"payload/**/{module}/**/*.py")]
    pattern = re.compile(
        rf"^\s*(?:def|class)\s+{re.escape(name)}\b|^{re.escape(name)}\s*[:=]", re.M
    )
    return any(pattern.search(f.read_text(encoding="utf-8")) for f in files)


def yaml_job_problems(body: str) -> list[str]:
    try:
        document = yaml.safe_load(body)
    except yaml.YAMLError:
        return []
    if not isinstance(document, dict) or not set(document) & set(JOB_SECTIONS):
        return []
    if not set(document) <= {"name", "output", *JOB_SECTIONS}:
        return []
    problems = []

    def walk(prefix: str, value: object) -> None:
        if prefix in FREE_FORM or not isinstance(value, dict):
            return
        for key, inner in value.items():
            dotted = f"{prefix}.{key}"
            if dotted not in job_keys():
                problems.append(f"{dotted}: no such job key (payload/schema/job.py)")
            elif isinstance(inner, list):
                for item in inner:
                    walk(dotted, item)
            else:
                walk(dotted, inner)

    for section in JOB_SECTIONS:
        walk(section, document.get(section))
    return problems


def stack_problems(line: str, *, code: bool) -> list[str]:
    problems = [
        f"tpu-pretrain:{key}: no such stack setting (Pulumi.yaml)"
        for key in STACK_KEY.findall(line)
        if key not in stack_settings()
    ]
    if code:
        problems += [
            f"stack {name}: no stacks/Pulumi.{name}.yaml"
            for name in STACK_NAME_AFTER.findall(line)
            if name not in stack_names()
        ]
    return problems


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


def table_problems(text: str) -> list[tuple[int, str]]:
    """A table's `stack` column holds stack names, its `job`/`job template` column template
    names (links and code marks removed; "the same" and an empty cell pass)."""
    problems: list[tuple[int, str]] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if (
            not line.startswith("|")
            or i + 1 >= len(lines)
            or not re.match(r"^\|[-| :]+\|$", lines[i + 1])
        ):
            continue
        header = [c.lower() for c in _cells(line)]
        # A `job` column names templates in a table of stacks; `job template` anywhere.
        kinds = {"stack": "stack", "job template": "job"}
        if "stack" in header:
            kinds["job"] = "job"
        columns = {n: kinds[name] for n, name in enumerate(header) if name in kinds}
        for j in range(i + 2, len(lines)):
            if not lines[j].startswith("|"):
                break
            cells = _cells(lines[j])
            for n, kind in columns.items():
                if n >= len(cells):
                    continue
                value = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", cells[n]).replace("`", "")
                value = value.split(" (")[0].strip()
                if not value or value == "the same" or PLACEHOLDER.search(value):
                    continue
                names = stack_names() if kind == "stack" else job_templates()
                if value not in names:
                    where = "stacks/Pulumi.<stack>.yaml" if kind == "stack" else "stacks/jobs/"
                    problems.append((j + 1, f"{kind} {value}: not in {where}"))
    return problems


def problems(text: str, source: str) -> list[str]:
    """`source:line: what` for every name the page uses that the tree does not define."""
    found: list[tuple[int, str]] = []
    for code in code_of(text):
        if code.shell:
            found += [(code.line, p) for p in command_problems(code.text)]
        if (
            code.language in ("", "sh", "bash", "shell", "console", "yaml", "yml", "text")
            or code.shell
        ):
            found += [(code.line, p) for p in job_key_problems(code.text)]
    for start, body in yaml_blocks(text):
        found += [(start, p) for p in yaml_job_problems(body)]
    codes = {c.line for c in code_of(text)}
    for number, line in enumerate(text.splitlines(), 1):
        found += [(number, p) for p in stack_problems(line, code=number in codes)]
    found += table_problems(text)
    return [f"{source}:{line}: {what}" for line, what in sorted(set(found))]


def all_problems(files: list[Path], root: Path) -> list[str]:
    return [
        problem
        for path in files
        for problem in problems(path.read_text(encoding="utf-8"), str(path.relative_to(root)))
    ]

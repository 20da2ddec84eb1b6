"""What `make smoke` takes from outside the laptop: the bucket's objects and the VMs' guest
attributes (anything on a VM can write them), and the output of the commands it runs.

Text from there is shown only without control characters: `one_line` writes each one (ANSI
escapes, carriage returns, the rest of C0 and C1, and the bidirectional overrides that
reorder what a terminal shows) as its escape, so nothing from outside moves the cursor,
recolours the terminal, rewrites a line or starts one that looks like the smoke run's own.
`lines` keeps newlines for text that is several lines by nature (a command's output in the
report's log); a value inside one line of ours always goes through `one_line`.

The export is taken only as the payload's exporter writes it (infra/jobspec.py's copy of
payload/training/export.py's names, checked by tests/test_contract.py): the listing is
checked before anything is downloaded, and only the listed names are fetched, one by one,
into a fresh directory next to the target. The files there must be exactly those, plain
files; config.json must name one of the exporter's PyTorch classes and its weights file, and
no JSON file may name code to run (`auto_map`, which transformers would import with
trust_remote_code). Only then is the directory renamed to the target; anything refused or
half-downloaded is removed. ExportError carries the one line the user reads.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from infra import jobspec
from infra.config.types import StackConfig, TpuConfig
from infra.render import render

# C0, DEL, C1, and the Unicode bidirectional controls (LRM/RLM, ALM, embeddings, overrides,
# isolates: the "Trojan Source" characters).
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
# export/<part>/<file> for a family of several models (ELECTRA), export/<file> otherwise.
PART_CLASSES: dict[str, frozenset[str]] = {
    part: frozenset(p[part] for p in jobspec.EXPORT_PARTS.values() if part in p)
    for part in sorted({part for parts in jobspec.EXPORT_PARTS.values() for part in parts})
}
CLASSES = frozenset(jobspec.EXPORT_CLASSES.values())
ALLOWED = (
    f"{jobspec.EXPORT_MARKER}, {', '.join(sorted(jobspec.EXPORT_MODEL_FILES))}, "
    f"or those files in {' or '.join(f'{part}/' for part in PART_CLASSES)}"
)

Gcloud = Callable[..., subprocess.CompletedProcess[str]]


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def one_line(text: str) -> str:
    """`text` for one line of ours: every control character as its escape (a tab as a
    space)."""
    return CONTROL.sub(_escape, text.replace("\t", " "))


def lines(text: str) -> str:
    """`text` of several lines: newlines kept (a carriage return starts a new line instead of
    overwriting one), every other control character as its escape."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return "\n".join(one_line(line) for line in text.split("\n"))


def clean_json(value: Any) -> Any:
    """A JSON document read from the bucket with every string (keys too) through
    `one_line`."""
    if isinstance(value, str):
        return one_line(value)
    if isinstance(value, dict):
        return {one_line(str(k)): clean_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clean_json(v) for v in value]
    return value


def last_line(result: subprocess.CompletedProcess[str]) -> str:
    """The last line a command printed (its error, usually), at most 300 characters."""
    found = (result.stderr or result.stdout or "").strip().splitlines()
    return one_line(found[-1][:300]) if found else f"exit {result.returncode}"


def boot_failures(gcloud: Gcloud, cfg: StackConfig) -> list[str]:
    """Why a VM never started its job, when its loader gave up (templates/loader.sh: the
    VM's guest attribute render.BOOT_ATTRIBUTE, "failed <epoch> <message>"), one
    "<vm>[ worker <i>]: <message>" each: read without the bucket, for a stack without a
    watchdog or a controller that never booted."""
    namespace, key = render.BOOT_ATTRIBUTE.split("/")
    accel = cfg.accelerator
    instances = ["compute", "instances", "get-guest-attributes"]
    vms = [("controller", [*instances, f"{cfg.prefix}-controller"], "value(key,value)")]
    if isinstance(accel, TpuConfig):
        tpu = ["compute", "tpus", "tpu-vm", "get-guest-attributes", accel.name]
        vms.append(("tpu", tpu, "value(worker_id,key,value)"))
    else:
        vms.append(("gpu", [*instances, accel.name], "value(key,value)"))
    found = []
    for who, command, fields in vms:
        result = gcloud(
            *command, "--zone", accel.zone, "--project", cfg.project,
            f"--query-path={namespace}/", f"--format={fields}",
        )  # fmt: skip
        for line in result.stdout.splitlines() if result.returncode == 0 else []:
            values = line.split("\t")
            if len(values) >= 2 and values[-2] == key and values[-1].startswith("failed "):
                worker = f" worker {one_line(values[0])}" if len(values) == 3 else ""
                found.append(f"{who}{worker}: {one_line(values[-1].split(' ', 2)[-1])}")
    return found


class ExportError(Exception):
    """The export is not taken; the message is the one line the user reads."""


def export_names(listed: Iterable[str], export_uri: str) -> list[str]:
    """The listed objects as paths under export/, each one the exporter writes; ExportError
    names the first that is not, and what is allowed."""
    prefix = export_uri.rstrip("/") + "/"
    names = []
    for uri in (u for u in listed if u.strip()):
        if not uri.startswith(prefix):
            raise ExportError(f"{one_line(uri)}: listed for {prefix}, not under it")
        name = uri.removeprefix(prefix)
        folder, _, file = name.rpartition("/")
        top = not folder and (file in jobspec.EXPORT_MODEL_FILES or file == jobspec.EXPORT_MARKER)
        in_part = folder in PART_CLASSES and file in jobspec.EXPORT_MODEL_FILES
        if not (top or in_part):
            raise ExportError(
                f"export/{one_line(name)}: not a file the exporter writes (allowed: {ALLOWED})"
            )
        names.append(name)
    if not names:
        raise ExportError(f"{export_uri}/ lists no objects")
    return names


def check_tree(root: Path, names: list[str]) -> None:
    """What the download left under `root` is exactly `names`, plain files and their part
    folders: no link, no other file."""
    found = set()
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root).as_posix()
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            raise ExportError(f"export/{one_line(relative)}: not a plain file")
        if path.is_file():
            found.add(relative)
        elif relative not in PART_CLASSES:
            raise ExportError(f"export/{one_line(relative)}/: not a folder the exporter writes")
    if found != set(names):
        unexpected, missing = sorted(found - set(names)), sorted(set(names) - found)
        raise ExportError(
            f"the download holds {[one_line(n) for n in unexpected] or 'nothing else'} "
            f"and lacks {missing or 'nothing'} of the listed objects"
        )


def check_configs(root: Path) -> None:
    """No JSON file names code to run; config.json names one of the exporter's classes for
    its folder, and the exporter's weights."""
    folders = {"": CLASSES} if (root / "config.json").is_file() else {}
    folders |= {part: PART_CLASSES[part] for part in PART_CLASSES if (root / part).is_dir()}
    for folder, classes in folders.items():
        where = f"export/{folder}/" if folder else "export/"
        documents = {}
        for path in sorted((root / folder).glob("*.json")):
            try:
                documents[path.name] = json.loads(path.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, ValueError):
                raise ExportError(f"{where}{path.name}: not JSON") from None
            if isinstance(documents[path.name], dict) and "auto_map" in documents[path.name]:
                raise ExportError(
                    f"{where}{path.name}: auto_map names code to run (trust_remote_code); "
                    "the exporter writes none"
                )
        config = documents.get("config.json")
        if config is None:
            continue  # the loader says so (no config.json), nothing here runs
        if not isinstance(config, dict):
            raise ExportError(f"{where}config.json: not a JSON object")
        named = config.get("architectures")
        if not (isinstance(named, list) and len(named) == 1 and named[0] in classes):
            raise ExportError(
                f"{where}config.json: architectures {_shown(named)} (allowed: one of "
                f"{', '.join(sorted(classes))})"
            )
        weights = config.get("transformers_weights")
        if weights != jobspec.EXPORT_WEIGHTS:
            raise ExportError(
                f"{where}config.json: transformers_weights {_shown(weights)} (allowed: "
                f"{jobspec.EXPORT_WEIGHTS})"
            )


def _shown(value: Any) -> str:
    return one_line(json.dumps(value))[:200]


def download_export(gcloud: Gcloud, export_uri: str, target: Path) -> Path:
    """The export at `export_uri` (gs://…/export) as `target`, or ExportError and nothing
    written: listed and checked, each listed object fetched into a fresh folder beside
    `target`, checked again, then renamed."""
    listed = gcloud("storage", "ls", f"{export_uri}/**")
    if listed.returncode != 0:
        raise ExportError(f"cannot list {export_uri}/: {last_line(listed)}")
    names = export_names(listed.stdout.splitlines(), export_uri)
    folders: dict[str, list[str]] = {}
    for name in names:
        folders.setdefault(name.rpartition("/")[0], []).append(name)
    partial = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        for folder, members in sorted(folders.items()):
            destination = partial / folder
            destination.mkdir(exist_ok=True)
            sources = [f"{export_uri}/{name}" for name in members]
            copied = gcloud("storage", "cp", *sources, f"{destination}/")
            if copied.returncode != 0:
                raise ExportError(f"download failed: {last_line(copied)}")
        check_tree(partial, names)
        check_configs(partial)
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return target

"""What the hosts of a slice prove they share before the first step: one output and one
program (docs/pod-slices.md, "What the hosts agree on").

JAX checks a sharded argument across hosts, not what made it. A host that runs another
payload (a startup script re-run on one host rolls a new payload out there first), another
job (another `train.steps`: agree_on_stop takes the smallest proposal and accepts the mix),
other data, another checkpoint or other programs trains another run than the others,
silently or into a hang in the first collective. So every host publishes one digest of what
shapes its run, field by field, and all compare: a mismatch stops every host with the same
one line naming the field, the hosts and what each has (a SliceError, exit 2 on every host,
as the mesh check does: runtime.check_same_mesh). The fields:

- `payload`: the payload's version and the SHA-256 of its source files;
- `libraries`: the versions of what compiles and runs it (jax, jaxlib, libtpu, keras,
  orbax-checkpoint, tensorstore, grain, numpy) and Python's;
- `job`: the job as loaded (its canonical JSON);
- `manifest`: the data's manifest as loaded;
- `restored step`: the newest committed checkpoint this host sees (none: a fresh start),
  the one it restores;
- `programs`: the fingerprints of the lowered programs (program.py).

Two agreements: `agree_on_start`, as soon as the manifest is loaded (every field but the
programs: a host on another payload or job stops before minutes of model building and
compiling, and a host that would restore no checkpoint never leaves the others in Orbax's
restore barrier, `Checkpointer:restore`, orbax 0.12.8 checkpointers/checkpointer.py), and
`agree_on_programs`, once the programs are lowered and the checkpoint restored: the whole
digest, logged on every host. Each is a poll of the coordination service's key-value store
(distributed.gather_strings), bounded like every agreement and ended by any host's abort.

And one output: on a slice whose output is a local path, every host must read what the
chief writes there (`check_shared_output`), else each host checkpoints and resumes alone.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import jax

import payload
from payload.backends.jax import distributed
from payload.core import storage
from payload.core.errors import SliceError
from payload.training import shared as training

if TYPE_CHECKING:
    from payload.schema.manifest import Manifest
    from payload.spec import JobSpec

# What compiles and runs the payload (the TPU VM's environment, requirements/tpu-vm-jax.txt);
# a distribution that is not installed is left out (libtpu off a TPU VM).
LIBRARIES = (
    "jax",
    "jaxlib",
    "libtpu",
    "keras",
    "orbax-checkpoint",
    "tensorstore",
    "grain",
    "numpy",
)
# A digest's values are shown by their first characters in the mismatch line.
SHOWN = 12
FRESH_START = "none"


@dataclass(frozen=True)
class RunDigest:
    """What shapes this host's run, field by field (values are strings)."""

    fields: Mapping[str, str]

    def with_fields(self, **more: str) -> RunDigest:
        return RunDigest({**self.fields, **more})

    def sha256(self) -> str:
        return hashlib.sha256(json.dumps(dict(self.fields), sort_keys=True).encode()).hexdigest()


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@cache
def payload_source() -> str:
    """The payload's version and the SHA-256 of its source: every file of the package (its
    relative path and content), compiled bytecode left out."""
    root = Path(payload.__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        relative = path.relative_to(root).as_posix()
        if "__pycache__" in path.parts or path.suffix == ".pyc":
            continue
        digest.update(f"{relative}\0{hashlib.sha256(path.read_bytes()).hexdigest()}\n".encode())
    return f"{payload.__version__} source {digest.hexdigest()}"


@cache
def libraries() -> str:
    """The versions of the installed LIBRARIES and Python's."""
    found = []
    for name in LIBRARIES:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return ", ".join([*found, f"python {platform.python_version()}"])


def newest_step(job: JobSpec) -> int | None:
    """The newest committed checkpoint this host sees: the one it restores."""
    # Orbax and Keras come with the checkpoints' module: imported by the trainer only.
    from payload.backends.jax import checkpoint as checkpoints  # noqa: PLC0415

    found = checkpoints.finished_steps(job.paths.checkpoints)
    return found[-1] if found else None


def start_digest(job: JobSpec, manifest: Manifest, restored: int | None) -> RunDigest:
    return RunDigest(
        {
            "payload": payload_source(),
            "libraries": libraries(),
            "job": _sha256(job.to_json()),
            "manifest": _sha256(manifest.to_json()),
            "restored step": FRESH_START if restored is None else str(restored),
        }
    )


def agree_on_start(job: JobSpec, manifest: Manifest) -> RunDigest:
    """Every host's payload, libraries, job, manifest and restored step, compared (one line
    and exit 2 on every host when they differ); this host's digest."""
    digest = start_digest(job, manifest, newest_step(job))
    _agree("start", digest)
    return digest


def agree_on_programs(
    digest: RunDigest, fingerprints: Mapping[str, str], restored: int | None
) -> RunDigest:
    """The whole digest, with the lowered programs' fingerprints and the step this host
    restored, compared on every host and logged; the digest."""
    whole = digest.with_fields(
        **{
            "restored step": FRESH_START if restored is None else str(restored),
            "programs": ", ".join(f"{name} {value}" for name, value in fingerprints.items()),
        }
    )
    _agree("programs", whole)
    if jax.process_count() > 1:
        fields = whole.fields
        training.log(
            f"train: the {jax.process_count()} processes of this slice run one program "
            f"(digest {whole.sha256()[:16]}: {_shown('payload', fields['payload'])}, "
            f"restored step {fields['restored step']}, programs {fields['programs']})"
        )
    return whole


def _agree(stage: str, digest: RunDigest) -> None:
    if jax.process_count() == 1:
        return
    mine = json.dumps(dict(digest.fields), sort_keys=True)
    seen = [json.loads(entry) for entry in distributed.gather_strings(f"digest/{stage}", mine)]
    line = mismatch(seen)
    if line is not None:
        raise SliceError(line)


def mismatch(by_process: list[Mapping[str, str]]) -> str | None:
    """The one line for digests (by process index) that differ, naming each field that
    differs, which processes have which value; None when all are the same."""
    fields = sorted({name for digest in by_process for name in digest}, key=_field_order)
    differences = []
    for name in fields:
        groups: dict[str, list[int]] = {}
        for index, digest in enumerate(by_process):
            groups.setdefault(digest.get(name, "(missing)"), []).append(index)
        if len(groups) == 1:
            continue
        listed = "; ".join(
            f"{_processes(indices)}: {_shown(name, value)}"
            for value, indices in sorted(groups.items(), key=lambda item: item[1][0])
        )
        differences.append(f"{name} differs ({listed})")
    if not differences:
        return None
    return (
        f"the hosts of this slice do not run one program: {', '.join(differences)}; every host "
        "must run the same payload and job on the same data and checkpoints (re-run the "
        "startup script on every host: `pulumi stack output rerunStartupCommands`)"
    )


_ORDER = ("payload", "libraries", "job", "manifest", "restored step", "programs")


def _field_order(name: str) -> tuple[int, str]:
    return (_ORDER.index(name) if name in _ORDER else len(_ORDER), name)


def _processes(indices: list[int]) -> str:
    if len(indices) == 1:
        return f"process {indices[0]}"
    return f"processes {', '.join(str(i) for i in indices)}"


def _shown(name: str, value: str) -> str:
    """A value as the line shows it: the job's and the manifest's SHA-256 and the source's
    shortened, the rest in full."""
    if name in ("job", "manifest"):
        return f"sha256 {value[:SHOWN]}"
    if name == "payload" and " source " in value:
        version, _, source = value.partition(" source ")
        return f"{version} source {source[:SHOWN]}"
    return value


def check_shared_output(job: JobSpec) -> None:
    """On a slice whose output is a local path, every host must read the file the chief
    writes there (a local disk of each VM is not one output: each host would resume from
    its own checkpoints, or none): else a SliceError on every host naming the processes
    that do not see it. gs:// is shared by every host that reaches the bucket."""
    if jax.process_count() == 1 or storage.is_gcs(job.output):
        return
    chief = jax.process_index() == 0
    nonce = uuid.uuid4().hex if chief else ""
    if chief:
        storage.write_text(_probe(job.output, nonce), nonce)
    try:
        # The chief's nonce and output: the line names the chief's output on every host.
        nonce, _, output = distributed.gather_strings(
            "shared-output/probe", f"{nonce}\n{job.output}" if chief else ""
        )[0].partition("\n")
        seen = chief or _reads(_probe(job.output, nonce), nonce)
        answers = distributed.gather_strings("shared-output/seen", "yes" if seen else "no")
    finally:
        if chief:
            storage.remove(_probe(job.output, nonce))
    missing = [index for index, answer in enumerate(answers) if answer != "yes"]
    if missing:
        raise SliceError(
            f"output: {output} is a local path that {_processes(missing)} of this slice "
            f"{'does' if len(missing) == 1 else 'do'} not share with process 0 (a file process "
            "0 wrote there is not there); every host of a slice must read and write one "
            "output: use gs://<bucket>/... (or a file system every host mounts)"
        )


def _probe(output: str, nonce: str) -> str:
    return storage.join(output, f".slice-probe-{nonce}")


def _reads(path: str, nonce: str) -> bool:
    try:
        return storage.read_text(path) == nonce
    except FileNotFoundError:
        return False

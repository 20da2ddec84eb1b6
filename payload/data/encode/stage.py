"""Stage 2: corpus -> packed fixed-length token sequences -> sharded TFRecords + manifest.

The stage's door: data that is complete is checked against the job and kept; otherwise
``data.runner`` chooses who encodes, ``local`` (``payload/data/encode/local.py``: worker
processes on this machine) or ``beam`` (``payload/data/encode/beam.py``: an Apache Beam
pipeline). Both run the same rules (``payload/data/encode/rules.py``: the plan, tokenizing,
budgets, the held-out split, packing) and write the same outputs
(``payload/data/encode/outputs.py``: shards, stage.json, the manifest), byte for byte.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from payload.core.errors import DataError
from payload.data.encode import local as encode_local
from payload.data.encode.outputs import check_current, is_complete
from payload.schema import manifest as mf
from payload.spec import JobSpec

if TYPE_CHECKING:
    from payload.core.status import StatusWriter


def encode(job: JobSpec, status: StatusWriter) -> mf.Manifest:
    """Encode the corpus into shards + manifest (skips if a manifest already exists)."""
    data_dir = job.paths.data
    if is_complete(job):
        manifest = mf.load_manifest(data_dir)
        check_current(job, manifest)
        return manifest
    if job.data.runner == "beam":
        return _beam_module().encode(job, status)
    return encode_local.encode(job, status)


def _beam_module() -> Any:
    """payload.data.encode.beam (Apache Beam only where asked for: its own environment)."""
    try:
        from payload.data.encode import beam as encode_beam  # noqa: PLC0415
    except ImportError as exc:
        if exc.name is None or not exc.name.startswith("apache_beam"):
            raise
        raise DataError(
            "data.runner: beam needs Apache Beam, which has its own environment: `make "
            "venv-beam`, then run this stage with .venv-beam/bin/python -m payload encode "
            "--job ... (or set data.runner: local)"
        ) from None
    return encode_beam

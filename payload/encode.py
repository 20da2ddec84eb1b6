"""Stage 2: corpus -> packed fixed-length token sequences -> sharded TFRecords + manifest.

The stage's door: data that is complete is checked against the job and kept; otherwise
``data.runner`` chooses who encodes, ``local`` (``payload/encode_local.py``: worker
processes on this machine) or ``beam`` (``payload/encode_beam.py``: an Apache Beam
pipeline). Both run the same rules (``payload/encode_rules.py``: the plan, tokenizing,
budgets, the held-out split, packing) and write the same outputs
(``payload/encode_outputs.py``: shards, stage.json, the manifest), byte for byte.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from payload import encode_local
from payload.core.errors import DataError
from payload.encode_outputs import check_current, is_complete
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
    """payload.encode_beam (Apache Beam only where asked for: its own environment)."""
    try:
        from payload import encode_beam  # noqa: PLC0415
    except ImportError as exc:
        if exc.name is None or not exc.name.startswith("apache_beam"):
            raise
        raise DataError(
            "data.runner: beam needs Apache Beam, which has its own environment: `make "
            "venv-beam`, then run this stage with .venv-beam/bin/python -m payload encode "
            "--job ... (or set data.runner: local)"
        ) from None
    return encode_beam

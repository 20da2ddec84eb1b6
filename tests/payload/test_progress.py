"""The bounds of a slice's waits, in one process (the slices themselves:
test_slice_bounds.py): the export's scratch directory (training/export.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from payload.training import export

# ------------------------------------------------------------------ the export's scratch


def test_an_export_leaves_no_scratch_directory(tmp_path) -> None:
    job = SimpleNamespace(paths=SimpleNamespace(export=str(tmp_path / "out" / "export")))
    left = export.scratch_path(job)  # type: ignore[arg-type]
    left.mkdir(parents=True, exist_ok=True)
    (left / "pytorch_model.safetensors").write_text("half of a model")  # a SIGKILLed export
    with export.scratch_directory(job) as scratch:  # type: ignore[arg-type]
        assert Path(scratch) == left and not any(left.iterdir())
        Path(scratch, "config.json").write_text("{}")
        export.remove_scratch()  # the guard's exit, from another thread
        assert not left.exists()
    with pytest.raises(RuntimeError), export.scratch_directory(job) as scratch:  # type: ignore[arg-type]
        Path(scratch, "config.json").write_text("{}")
        raise RuntimeError("a stop at one of the export's stop points")
    assert not left.exists()

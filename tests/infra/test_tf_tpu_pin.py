"""The TF backend's TPU pin: requirements/tpu-vm.txt installs the tensorflow-tpu/libtpu pair
infra/catalogs/tpu.yaml (`tensorflow_tpu`) records with public evidence of running on a TPU, with
the tf_keras of the same TensorFlow minor. tests/infra/test_tpu_parity.py trains on CPU in
the environment built from that file (and checks it holds exactly this pair)."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.catalogs.tpu import CATALOG_PATH, load_catalog
from infra.render import render


def test_the_tpu_vm_installs_the_catalogs_evidenced_pair():
    pin = load_catalog().tensorflow_tpu
    assert pin is not None
    pins = render.read_pins()
    assert (pins.tensorflow_tpu, pins.libtpu, pins.tpu_tf_keras) == (
        pin.tensorflow_tpu,
        pin.libtpu,
        pin.tf_keras,
    )


def test_the_pin_and_its_evidence_as_recorded():
    """tensorflow-tpu 2.19.1 + libtpu 0.0.10: keras-team/keras-rs runs it on a v6e in CI;
    the ml-auto-solutions runs (v2..v5p) are of 2.18.0rc2, not installable from PyPI."""
    pin = load_catalog().tensorflow_tpu
    assert (pin.tensorflow_tpu, pin.libtpu, pin.tf_keras) == ("2.19.1", "0.0.10", "2.19.0")
    assert pin.ran_on == ("v6e",)
    by_pair: dict[tuple[str, str], set[str]] = {}
    for entry in pin.evidence:
        by_pair.setdefault((entry.tensorflow_tpu, entry.libtpu), set()).update(entry.ran_on)
    assert by_pair == {
        ("2.19.1", "0.0.10"): {"v6e"},
        ("2.18.0rc2", "2.18.0rc2"): {"v2", "v3", "v4", "v5e", "v5p"},
        ("2.20.0", "0.0.14"): set(),  # the previous pin: no run found
    }
    assert [e.installable_from_pypi for e in pin.evidence if e.tensorflow_tpu == "2.18.0rc2"] == [
        False
    ]


def _catalog_with(tmp_path: Path, old: str, new: str) -> Path:
    text = CATALOG_PATH.read_text(encoding="utf-8")
    assert old in text
    path = tmp_path / "tpu.yaml"
    path.write_text(text.replace(old, new, 1), encoding="utf-8")
    return path


def test_the_catalog_refuses_a_pin_no_source_ran_on_a_tpu(tmp_path):
    path = _catalog_with(
        tmp_path,
        'pin: {tensorflow-tpu: "2.19.1", libtpu: "0.0.10", tf_keras: "2.19.0"}',
        'pin: {tensorflow-tpu: "2.20.0", libtpu: "0.0.14", tf_keras: "2.20.1"}',
    )
    with pytest.raises(ValueError, match="a pair no listed source ran on a TPU"):
        load_catalog(path)


def test_the_catalog_refuses_a_tf_keras_of_another_minor(tmp_path):
    path = _catalog_with(tmp_path, 'tf_keras: "2.19.0"', 'tf_keras: "2.20.1"')
    with pytest.raises(
        ValueError, match=r"tf_keras 2\.20\.1 does not match tensorflow-tpu 2\.19\.1"
    ):
        load_catalog(path)


def test_render_refuses_a_tpu_overlay_whose_tf_keras_is_another_minor(tmp_path, monkeypatch):
    """Without its own tf_keras, tpu-vm.txt would get the lock's (2.20.1, for the CPU
    TensorFlow 2.20) next to tensorflow-tpu 2.19.1."""
    (tmp_path / "requirements").mkdir()
    (tmp_path / render.LOCK_FILE).write_text((render.REPO_ROOT / render.LOCK_FILE).read_text())
    overlay = (render.REPO_ROOT / render.TPU_REQUIREMENTS_FILE).read_text()
    without = "".join(
        line for line in overlay.splitlines(keepends=True) if not line.startswith("tf_keras==")
    )
    (tmp_path / render.TPU_REQUIREMENTS_FILE).write_text(without)
    read_pins = render.read_pins
    monkeypatch.setattr(render, "read_pins", lambda: read_pins(tmp_path))
    host = render.TpuHost("v5litepod-8", "v2-alpha-tpuv5-lite", "3.10")
    workload = render.Workload("b", "j", "payload/p.tar.gz", "0" * 64, host)
    with pytest.raises(
        ValueError, match=r"tensorflow-tpu==2\.19\.1 but .* tf_keras==2\.20\.1: tf_keras must"
    ):
        render.render_tpu_script(workload)

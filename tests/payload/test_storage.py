"""storage: the same behaviour for local paths and gs:// (real fake-gcs-server)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from payload.core import storage


@pytest.fixture(params=["local", pytest.param("gcs", marks=pytest.mark.emulator)])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "root")
    return request.getfixturevalue("gcs_root")


def test_join_and_is_gcs() -> None:
    assert storage.is_gcs("gs://b/x")
    assert not storage.is_gcs("/tmp/gs://x")
    assert storage.join("gs://b/runs/", "job", "data/") == "gs://b/runs/job/data"
    assert storage.dirname("gs://b/runs/job.yaml") == "gs://b/runs"
    assert storage.basename("gs://b/runs/job.yaml") == "job.yaml"
    assert storage.split_gcs("gs://b/a/b") == ("b", "a/b")


def test_write_read_exists_list_remove(root: str) -> None:
    path = storage.join(root, "a", "one.txt")
    assert not storage.exists(path)
    storage.write_text(path, "héllo 안녕")
    assert storage.exists(path)
    assert storage.read_text(path) == "héllo 안녕"
    assert storage.size(path) == len("héllo 안녕".encode())
    storage.write_bytes(path, b"replaced")
    assert storage.read_bytes(path) == b"replaced"
    storage.write_bytes(storage.join(root, "a", "sub", "two.bin"), b"\x00\x01")
    assert storage.listdir(storage.join(root, "a")) == ["one.txt", "sub"]
    assert [storage.basename(p) for p in storage.walk_files(root)] == ["one.txt", "two.bin"]
    assert storage.glob(storage.join(root, "a", "*.txt")) == [path]
    assert storage.is_dir(storage.join(root, "a"))
    storage.remove_tree(storage.join(root, "a"))
    assert not storage.exists(path)
    assert storage.walk_files(root) == [] or not storage.is_dir(root)


def test_missing_reads_raise_file_not_found(root: str) -> None:
    missing = storage.join(root, "nope.txt")
    with pytest.raises(FileNotFoundError):
        storage.read_bytes(missing)
    with pytest.raises(FileNotFoundError):
        storage.size(missing)
    with pytest.raises(FileNotFoundError):
        storage.download_file(missing, "/tmp/should-not-exist-" + os.urandom(4).hex())


def test_if_absent_is_create_only(root: str) -> None:
    path = storage.join(root, "manifest.json")
    storage.write_text(path, "first", if_absent=True)
    with pytest.raises(storage.AlreadyExists):
        storage.write_text(path, "second", if_absent=True)
    assert storage.read_text(path) == "first"


def test_upload_download_tree_and_sha(root: str, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "x.bin").write_bytes(os.urandom(3 << 20))  # larger than one chunk of small reads
    (src / "d" / "y.txt").write_text("y")
    dest = storage.join(root, "tree")
    uploaded = storage.upload_tree(str(src), dest)
    assert sorted(storage.basename(p) for p in uploaded) == ["x.bin", "y.txt"]
    assert storage.sha256(storage.join(dest, "x.bin")) == storage.sha256(str(src / "x.bin"))
    with storage.open_read(storage.join(dest, "x.bin")) as handle:
        assert handle.read(5) == (src / "x.bin").read_bytes()[:5]
    back = tmp_path / "back"
    storage.download_tree(dest, str(back))
    assert (back / "x.bin").read_bytes() == (src / "x.bin").read_bytes()
    assert (back / "d" / "y.txt").read_text() == "y"
    with pytest.raises(storage.AlreadyExists):
        storage.upload_file(
            str(src / "d" / "y.txt"), storage.join(dest, "d", "y.txt"), if_absent=True
        )


def test_local_write_leaves_no_temp_files(tmp_path: Path) -> None:
    path = tmp_path / "out" / "f.json"
    storage.write_text(str(path), "{}")
    with pytest.raises(storage.AlreadyExists):
        storage.write_text(str(path), "{}", if_absent=True)
    assert sorted(p.name for p in path.parent.iterdir()) == ["f.json"]

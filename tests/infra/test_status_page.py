"""`make status` offline: infra/commands/status_page.py with stub `gcloud` and `xdg-open`
executables first on PATH and a bucket that is a directory. The page it fetches is where the
program says the run is (its `statusUri` export under Pulumi's mocks, status.json's
neighbour), and the gcloud command it runs uses only flags gcloud defines."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml
from gcloud_flags import problems
from harness import run_offline

from infra.commands import offline, status_page

PROJECT = offline.DEFAULT_TEST_PROJECT
PAGE = "<!DOCTYPE html><title>the run</title>"

GCLOUD = r"""
import json, os, shutil, sys
from pathlib import Path
state = Path(os.environ["STATUS_STATE"])
argv = sys.argv[1:]
with (state / "calls.log").open("a") as log:
    log.write(json.dumps(["gcloud", *argv]) + "\n")
if argv[:2] != ["storage", "cp"] or len(argv) != 4:
    sys.exit(f"ERROR: unexpected: gcloud {argv}")
source = Path(os.environ["STATUS_GCS"]) / argv[2].removeprefix("gs://")
if not source.exists():
    sys.exit("ERROR: (gcloud.storage.cp) The following URLs matched no objects or files:\n"
             f"-{argv[2]}")
shutil.copyfile(source, argv[3])
"""
OPENER = r"""
import json, os, sys
from pathlib import Path
with (Path(os.environ["STATUS_STATE"]) / "calls.log").open("a") as log:
    log.write(json.dumps(["xdg-open", *sys.argv[1:]]) + "\n")
"""


class World:
    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stack: str) -> None:
        self.stack = stack
        self.state = tmp_path / "state"
        self.gcs = tmp_path / "gcs"
        bin_dir = tmp_path / "bin"
        for directory in (self.state, self.gcs, bin_dir):
            directory.mkdir()
        for name, body in (("gcloud", GCLOUD), ("xdg-open", OPENER)):
            path = bin_dir / name
            path.write_text(f"#!{sys.executable}\n{body}")
            path.chmod(0o755)
        monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
        monkeypatch.setenv("STATUS_STATE", str(self.state))
        monkeypatch.setenv("STATUS_GCS", str(self.gcs))
        monkeypatch.setenv("DISPLAY", ":0")
        self.stacks = tmp_path / "stacks"
        self.stacks.mkdir()
        document = yaml.safe_load((offline.STACKS_DIR / f"Pulumi.{stack}.yaml").read_text())
        document["config"]["gcp:project"] = PROJECT
        self.stack_file = self.stacks / f"Pulumi.{stack}.yaml"
        self.stack_file.write_text(yaml.safe_dump(document))
        self.out = tmp_path / "out" / "status.html"

    def publish(self, uri: str) -> None:
        path = self.gcs / uri.removeprefix("gs://")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(PAGE)

    def fetch(self, *, open_it: bool = True) -> int:
        runner = status_page.StatusPage(
            self.stack, out=self.out, open_it=open_it, stacks_dir=self.stacks
        )
        try:
            return runner.execute()
        except status_page.StatusPageError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2

    @property
    def calls(self) -> list[list[str]]:
        log = self.state / "calls.log"
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.mark.parametrize("stack", ["v6e-euw4", "l4x2-use1"])
def test_the_page_is_beside_the_program_s_status_uri(stack: str, tmp_path: Path, monkeypatch):
    w = World(tmp_path, monkeypatch, stack)
    uri, console = status_page.page_uri(stack, w.stacks)
    status_uri = run_offline(stack).exports["statusUri"]
    assert uri == status_uri.removesuffix("status.json") + "status.html"
    bucket, name = uri.removeprefix("gs://").split("/", 1)
    assert console == f"https://storage.cloud.google.com/{bucket}/{name}"


def test_make_status_fetches_the_page_and_opens_it(tmp_path: Path, monkeypatch, capsys):
    w = World(tmp_path, monkeypatch, "v6e-euw4")
    uri, console = status_page.page_uri(w.stack, w.stacks)
    w.publish(uri)
    assert w.fetch() == 0
    assert w.out.read_text() == PAGE
    gcloud, opened = w.calls
    assert gcloud == ["gcloud", "storage", "cp", uri, str(w.out)]
    assert problems(gcloud) == []
    assert opened == ["xdg-open", str(w.out)]
    printed = capsys.readouterr().out
    assert f"status page: {w.out}" in printed and console in printed


def test_without_a_display_it_prints_the_path(tmp_path: Path, monkeypatch, capsys):
    w = World(tmp_path, monkeypatch, "v6e-euw4")
    monkeypatch.delenv("DISPLAY")
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    w.publish(status_page.page_uri(w.stack, w.stacks)[0])
    assert w.fetch() == 0
    assert [call[0] for call in w.calls] == ["gcloud"]
    assert f"status page: {w.out}" in capsys.readouterr().out


def test_a_page_not_written_yet_is_one_line(tmp_path: Path, monkeypatch, capsys):
    w = World(tmp_path, monkeypatch, "v6e-euw4")
    uri = status_page.page_uri(w.stack, w.stacks)[0]
    assert w.fetch() == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: could not fetch {uri}: ERROR: (gcloud.storage.cp) The ")
    assert f"matched no objects or files: -{uri} (the trainer writes it" in line
    assert not w.out.exists()


def test_a_stack_without_a_project_is_one_line(tmp_path: Path, monkeypatch, capsys):
    w = World(tmp_path, monkeypatch, "v6e-euw4")
    document = yaml.safe_load(w.stack_file.read_text())
    del document["config"]["gcp:project"]
    w.stack_file.write_text(yaml.safe_dump(document))
    assert w.fetch() == 2
    assert "error: gcp:project is not set for stack v6e-euw4" in capsys.readouterr().err
    assert w.calls == []


def test_an_unknown_stack_names_the_stacks(capsys):
    assert status_page.main(["--stack", "nope", "--no-open"]) == 2
    err = capsys.readouterr().err
    assert "STACK='nope': no stacks/Pulumi.nope.yaml; stacks: " in err and "v6e-euw4" in err

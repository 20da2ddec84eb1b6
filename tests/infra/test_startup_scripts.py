"""Rendered startup scripts: shellcheck-clean, and idempotent when run twice in a sandbox.

Every stack's scripts through shellcheck; the TPU VM's (on the TF backend), the
controller's and the VPN hop's run in the script sandbox (script_sandbox.py, fixtures:
conftest.py): installed once, their units, the data and trainer units' waits and statuses,
the payload's download retried. The TPU watchdog, a real TPU image's first boot and a
multi-host slice have modules of their own: test_tpu_watch.py, test_tpu_image_boot.py,
test_slice_startup.py."""

from __future__ import annotations

import base64
import json
import re
import shlex
import stat
import sys

import pytest
from harness import by_name, gpu_stack_names, run_offline, stack_names, startup_script
from script_sandbox import (
    Sandbox,
    bootstrap_status,
    publish_payload,
    run_helper,
    shellcheck,
    short_sha,
    unit_environment,
)

from infra import wgkeys
from infra.render import render


@pytest.mark.parametrize("stack", stack_names())
def test_rendered_scripts_pass_shellcheck(stack, tmp_path):
    run = run_offline(stack)
    trainer = "gpu-vm" if stack in gpu_stack_names() else "tpu-vm"
    for name in (trainer, "controller-vm", "vpn-hop-vm"):
        found = shellcheck(startup_script(run, name), tmp_path / f"{name}.sh")
        assert found == "", f"{stack} {name}:\n{found}"


def test_shellcheck_of_a_second_script_of_a_shape_still_finds_its_problems(tmp_path):
    """shellcheck() checks a shape once: another stack's script of that shape is still
    checked in its values (its header), and a changed body is another shape."""
    scripts = {
        stack: startup_script(run_offline(stack), "vpn-hop-vm") for stack in ("v3-euw4", "v6e-euw4")
    }
    assert shellcheck(scripts["v3-euw4"], tmp_path / "a.sh") == ""
    assert shellcheck(scripts["v6e-euw4"], tmp_path / "b.sh") == ""
    # A value shellcheck would flag (SC2016: single-quoted $), in a script of a known shape.
    name = re.search(r"^readonly ([A-Z0-9_]+)=", scripts["v6e-euw4"], re.M).group(1)
    flagged = re.sub(
        rf"^readonly {name}=.*$",
        f"readonly {name}={shlex.quote('$HOME/x')}",
        scripts["v6e-euw4"],
        count=1,
        flags=re.M,
    )
    assert "SC2016" in shellcheck(flagged, tmp_path / "c.sh")
    # A body shellcheck would flag: another shape, checked whole.
    assert "SC2086" in shellcheck(scripts["v6e-euw4"] + "\necho $1\n", tmp_path / "d.sh")


def test_tpu_script_installs_once_and_keeps_its_unit(stack_run, sandbox):
    bucket, _ = publish_payload(stack_run, sandbox)
    script = startup_script(stack_run, "tpu-vm")
    short = short_sha(script)
    venv = f"{sandbox.root}/opt/tpu-pretrain/venv-{short}"

    # A previous payload version installed earlier (e.g. before `pulumi up` changed it).
    for old in ("venv-0123456789abcdef/bin", "src-0123456789abcdef"):
        (sandbox.root / "opt/tpu-pretrain" / old).mkdir(parents=True)
    (sandbox.root / "opt/tpu-pretrain/venv").symlink_to(
        sandbox.root / "opt/tpu-pretrain/venv-0123456789abcdef"
    )

    first = sandbox.run(script)
    assert first.returncode == 0, first.stderr
    calls = sandbox.calls
    assert sorted(p.name for p in (sandbox.root / "opt/tpu-pretrain").iterdir()) == [
        "bin",
        "host-facts.json",  # templates/facts.sh, read by the trainer
        f"src-{short}",
        "venv",
        f"venv-{short}",
    ]
    assert f"python3 -m venv {venv}" in calls
    pip_calls = [c for c in calls if c.startswith("pip ")]
    src = f"{sandbox.root}/opt/tpu-pretrain/src-{short}"
    # No wheelhouse in the bucket yet: the package index (tpu-install.sh, tpu_install_env).
    assert len(pip_calls) == 3
    assert re.fullmatch(r"pip install --quiet -r \S+", pip_calls[0])
    assert pip_calls[1:] == [
        # tf_keras of the TPU VM's TensorFlow (requirements/tpu-vm.txt), not the lock's.
        "pip install --quiet --no-deps tf_keras==2.19.0",
        f"pip install --quiet --no-deps {src}",
    ]
    (requirements,) = sandbox.state.glob("requirements-*.txt")
    lock = requirements.read_text()
    assert "numpy==" in lock and "transformers==" in lock
    assert not re.search(r"^(tensorflow|tf[-_]keras)==", lock, re.MULTILINE)
    # requirements/tpu-vm.txt replaces the lock's pins of the same names; its tf_keras is
    # not among them (installed alone, --no-deps, above).
    assert lock.splitlines()[-11:] == [
        "tensorflow-tpu==2.19.1",
        "libtpu==0.0.10",
        "tensorboard==2.19.0",
        "numpy==2.1.3",
        "protobuf==5.29.6",
        "google-api-core==2.33.0",
        "googleapis-common-protos==1.75.0",
        "proto-plus==1.28.2",
        "tensorflow-io-gcs-filesystem==0.37.1",
        "keras==3.12.4",
        "Markdown==3.10.3",
    ]
    for replaced in ("keras==3.15.1", "Markdown==3.11", "numpy==2.2.6", "tensorboard==2.20.0"):
        assert replaced not in lock
    assert "no wheelhouse" in first.stderr and "installing from the package index" in first.stderr
    assert str((sandbox.root / "opt/tpu-pretrain/venv").readlink()) == venv
    unit_dir = sandbox.root / "etc/systemd/system"
    unit = (unit_dir / "tpu-pretrain-train.service").read_text()
    assert (
        f"ExecStart=/opt/tpu-pretrain/venv/bin/tpu-payload train --job gs://{bucket}/jobs/"
        "gpt2-small-clm.json\n" in unit
    )
    assert "Restart=on-failure\n" in unit and "RestartPreventExitStatus=2\n" in unit
    assert "ExecStartPre=/opt/tpu-pretrain/bin/tpu-pretrain-helper wait-manifest\n" in unit
    assert "ExecStopPost=/opt/tpu-pretrain/bin/tpu-pretrain-helper stopped\n" in unit
    assert unit_environment(unit) == {
        "PYTHONUNBUFFERED": "1",
        "TPU_PAYLOAD_VERBOSE": "1",
        "TF_USE_LEGACY_KERAS": "1",
        "WRAPT_DISABLE_EXTENSIONS": "true",
        "FORCE_TF_AVAILABLE": "1",
        "TPU_PAYLOAD_BACKEND": "tf",
        "NEXT_PLUGGABLE_DEVICE_USE_C_API": "true",
        "TF_PLUGGABLE_DEVICE_LIBRARY_PATH": (
            "/opt/tpu-pretrain/venv/lib/python3.10/site-packages/libtpu/libtpu.so"
        ),
        "TPU_NAME": "local",
        "TPU_PRETRAIN_ACCELERATOR_TYPE": "v6e-8",
        "TPU_PRETRAIN_RUNTIME_VERSION": "v2-alpha-tpuv6e",
        "TPU_PRETRAIN_HOST_FACTS": "/opt/tpu-pretrain/host-facts.json",
    }
    helper = sandbox.root / "opt/tpu-pretrain/bin/tpu-pretrain-helper"
    assert stat.S_IMODE(helper.stat().st_mode) == 0o755
    # systemd's PATH need not hold the SDK: the helper pins where gcloud/gsutil were found.
    assert f"\nexport PATH={sandbox.bin}:{sandbox.bin}:/usr/local/sbin:" in helper.read_text()
    assert "systemctl daemon-reload" in calls
    assert "systemctl enable --quiet tpu-pretrain-train.service" in calls
    assert "systemctl restart --no-block tpu-pretrain-train.service" in calls
    status = json.loads(
        (sandbox.gcs / bucket / "runs/gpt2-small-clm/bootstrap/tpu.json").read_text()
    )
    assert status["state"] == "started" and status["role"] == "tpu"

    second = sandbox.run(script)
    assert second.returncode == 0, second.stderr
    calls = sandbox.calls
    assert not [c for c in calls if c.startswith(("pip ", "python3 -m venv"))]
    assert "systemctl daemon-reload" not in calls
    assert "systemctl start --no-block tpu-pretrain-train.service" in calls
    assert not [c for c in calls if "restart" in c]
    assert [p.name for p in unit_dir.iterdir()] == ["tpu-pretrain-train.service"]
    assert (unit_dir / "tpu-pretrain-train.service").read_text() == unit
    assert f"payload {short} already installed" in second.stderr


def test_trainer_waits_for_the_data_manifest_and_says_why(stack_run, sandbox):
    bucket, _ = publish_payload(stack_run, sandbox)
    assert sandbox.run(startup_script(stack_run, "tpu-vm")).returncode == 0
    manifest = sandbox.gcs / bucket / "runs/gpt2-small-clm/data/manifest.json"
    waited = run_helper(sandbox, "wait-manifest", CREATE_ON_SLEEP=str(manifest))
    assert waited.returncode == 0, waited.stderr
    assert sandbox.calls.count("sleep 60") == 1  # not there once, then found
    manifest_uri = f"gs://{bucket}/runs/gpt2-small-clm/data/manifest.json"
    assert [c for c in sandbox.calls if c.startswith("gcloud storage ls")] == [
        f"gcloud storage ls {manifest_uri}"
    ] * 2
    assert (
        f"waiting for the data manifest {manifest_uri} (0s so far): not written yet: the "
        "controller writes it after its tokenizer and encode stages" in waited.stderr
    )
    assert "data manifest found after 60s" in waited.stderr
    status = bootstrap_status(sandbox, bucket)
    assert status["state"] == "waiting" and "not written yet" in status["message"]
    # Mirrored to the journal with the tag a user greps for.
    journal = (sandbox.state / "journal").read_text().splitlines()
    assert any(line.startswith("logger -t tpu-pretrain -- [tpu] waiting for") for line in journal)


def test_the_data_unit_waits_for_every_sources_bucket_paths_not_the_hub(stack_run, sandbox):
    """A mixture (corpus.sources) is waited for source by source; a Hub dataset (hf://) is
    read by the payload itself, so the unit does not wait for it."""
    bucket, _ = publish_payload(stack_run, sandbox)
    spec = _publish_job_spec(stack_run, sandbox)
    installed = sandbox.run(
        startup_script(stack_run, "controller-vm"), STUB_VENV_PYTHON=sys.executable
    )
    assert installed.returncode == 0, installed.stderr
    books, extra = f"gs://{bucket}/corpus/books/", f"gs://{bucket}/corpus/extra.jsonl.zst"
    hub = "hf://datasets/acme/web@" + "0" * 40 + "/data/*.parquet"
    spec["corpus"] = {"sources": [{"paths": [books], "weight": 1}, {"paths": [hub, extra]}]}
    (job,) = [r for r in stack_run.resources if r.name == "payload-job-spec"]
    target = sandbox.gcs / job.inputs["bucket"] / job.inputs["name"]
    target.write_text(json.dumps(spec))
    for pattern in (books + "part-0.txt", extra):
        path = sandbox.gcs / pattern.removeprefix("gs://")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("text\n")
    waited = run_helper(sandbox, "wait-corpus")
    assert waited.returncode == 0, waited.stderr
    assert [c for c in sandbox.calls if c.startswith("gcloud storage ls")] == [
        f"gcloud storage ls {books}",
        f"gcloud storage ls {extra}",
    ]


@pytest.mark.parametrize(
    ("exit_status", "state", "words"),
    [
        ("2", "stopped", "not restarted (RestartPreventExitStatus=2)"),
        ("1", "restarting", "systemd restarts it in 60s"),
        # The progress watchdog's exit (payload/backends/jax/progress.py HUNG_EXIT): a
        # failure, restarted and counted, that says what it was.
        (
            "75",
            "restarting",
            "trainer ended (hung: no progress within its bound, the stacks in journalctl -u "
            "tpu-pretrain-train; exit 75; failure 1 of 5",
        ),
        ("0", "finished", "trainer finished"),
    ],
)
def test_the_trainer_end_is_written_to_the_bootstrap_status(
    stack_run, sandbox, exit_status, state, words
):
    bucket, _ = publish_payload(stack_run, sandbox)
    assert sandbox.run(startup_script(stack_run, "tpu-vm")).returncode == 0
    result = run_helper(
        sandbox, "stopped", EXIT_STATUS=exit_status, EXIT_CODE="exited", SERVICE_RESULT="exit-code"
    )
    assert result.returncode == 0, result.stderr
    status = bootstrap_status(sandbox, bucket)
    assert status["state"] == state and words in status["message"]
    if exit_status == "2":
        assert f"gs://{bucket}/runs/gpt2-small-clm/status.json" in status["message"]


def test_a_trainer_failing_again_without_progress_is_stopped_not_restarted(stack_run, sandbox):
    """A trainer that fails 5 times in a row without a newer checkpoint in the bucket is
    stopped with a status that says so (`systemctl stop` from ExecStopPost keeps systemd
    from restarting it); a newer committed checkpoint counts afresh (an Orbax step directory
    counts once its commit_success.txt is there: a write in progress or cut short holds
    _CHECKPOINT_METADATA from its start), a stop by a signal (preemption, shutdown, another
    host's stop) is not counted, a transient failure (exit 75) is restarted and counted,
    and the stop resets the count for a restart by hand."""
    bucket, _ = publish_payload(stack_run, sandbox)
    assert sandbox.run(startup_script(stack_run, "tpu-vm")).returncode == 0
    stop_call = "systemctl --no-block stop tpu-pretrain-train.service"

    def failed(code: str = "1") -> dict:
        result = run_helper(
            sandbox, "stopped", EXIT_STATUS=code, EXIT_CODE="exited", SERVICE_RESULT="exit-code"
        )
        assert result.returncode == 0, result.stderr
        return bootstrap_status(sandbox, bucket)

    for attempt in (1, 2, 3):
        status = failed()
        assert status["state"] == "restarting", status
        assert (
            f"failure {attempt} of 5 in a row without a newer checkpoint, newest: none"
            in (status["message"])
        )
    assert stop_call not in sandbox.calls
    assert failed("143")["state"] == "restarting"  # a stop by signal: not counted
    # Orbax's step directory on gs:// as its write starts (orbax-checkpoint 0.12.8
    # CommitFileTemporaryPath: the metadata first, commit_success.txt last): not progress.
    checkpoint = sandbox.gcs / bucket / "runs/gpt2-small-clm/checkpoints/10"
    (checkpoint / "state").mkdir(parents=True)
    (checkpoint / "_CHECKPOINT_METADATA").write_text("{}")
    transient = failed("75")  # a transient failure (errors.TRANSIENT_EXIT): restarted, counted
    assert transient["state"] == "restarting", transient
    assert "failure 4 of 5 in a row without a newer checkpoint, newest: none" in str(transient)
    (checkpoint / "commit_success.txt").write_text("Checkpoint commit was successful")
    assert "failure 1 of 5" in failed()["message"]  # progress since the last failure
    for _ in (2, 3, 4):
        assert failed()["state"] == "restarting"
    assert stop_call not in sandbox.calls
    status = failed("ABRT")  # e.g. the JAX client aborting when another host died
    assert status["state"] == "stopped", status
    assert (
        "trainer failed 5 times in a row without a newer checkpoint (newest: 10; last: "
        "exit-code, exit ABRT); not restarted" in status["message"]
    )
    assert stop_call in sandbox.calls
    assert "failure 1 of 5" in failed()["message"]  # counted afresh after a restart by hand
    assert failed("0")["state"] == "finished"
    assert "failure 1 of 5" in failed()["message"]


METADATA_IP = "http://metadata.google.internal/computeMetadata/v1/instance/network-interfaces/0/ip"
TENSORBOARD_UNIT = """[Unit]
Description=TensorBoard for job {job} (reach it over the VPN)
Wants=network-online.target
After=network-online.target

[Service]
ExecStart={venv}/bin/tensorboard --logdir {logs} --host {ip} --port 6006 --load_fast=true
DynamicUser=yes
NoNewPrivileges=yes
CapabilityBoundingSet=
ProtectSystem=strict
ProtectHome=yes
PrivateTmp=yes
PrivateDevices=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes
RestrictNamespaces=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
LockPersonality=yes
ProtectProc=invisible
SystemCallArchitectures=native
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK
Restart=always
RestartSec=30

[Install]
WantedBy=multi-user.target
"""


def test_controller_script_installs_the_lock_and_two_units(stack_run, sandbox):
    bucket, _ = publish_payload(stack_run, sandbox)
    script = startup_script(stack_run, "controller-vm")
    # The controller's address as the program registers it (its NIC's networkIp).
    nic = by_name(stack_run, "controller-vm").outputs["networkInterfaces"][0]
    (sandbox.state / "md").mkdir()
    (sandbox.state / "md" / "ip").write_text(nic["networkIp"])
    first = sandbox.run(script)
    assert first.returncode == 0, first.stderr
    pip_calls = [c for c in sandbox.calls if c.startswith("pip ")]
    short = short_sha(script)
    src = f"{sandbox.root}/opt/tpu-pretrain/src-{short}"
    assert pip_calls[:2] == [
        f"pip install --quiet -r {src}/requirements/payload.lock",
        f"pip install --quiet --no-deps {src}",
    ]
    # Then the TPU VM's wheelhouse, for the TPU image's Python (3.10), not the controller's.
    downloads = pip_calls[2:]
    assert len(downloads) == 2
    for call in downloads:
        assert call.startswith("pip download --quiet --dest ")
        assert "--only-binary=:all: --python-version 3.10 --implementation cp --abi cp310" in call
    assert re.search(r" -r \S+$", downloads[0])
    assert downloads[1].endswith(" --no-deps tf_keras==2.19.0")  # tpu-vm.txt's
    (wheelhouse,) = (sandbox.gcs / bucket / "wheelhouse").iterdir()
    assert sorted(p.suffix for p in wheelhouse.iterdir()) == ["", ".whl", ".whl"]
    assert (wheelhouse / "complete").is_file()
    unit_dir = sandbox.root / "etc/systemd/system"
    data = (unit_dir / "tpu-pretrain-data.service").read_text()
    job = f"gs://{bucket}/jobs/gpt2-small-clm.json"
    assert re.findall(r"^ExecStart=(.*)$", data, re.MULTILINE) == [
        f"/opt/tpu-pretrain/venv/bin/tpu-payload tokenizer --job {job}",
        f"/opt/tpu-pretrain/venv/bin/tpu-payload encode --job {job}",
    ]
    # TensorBoard: on the address the hop reaches (the controller's, from the metadata
    # server), as a user of its own with no privileges (controller.sh says why each line).
    tensorboard = (unit_dir / "tpu-pretrain-tensorboard.service").read_text()
    assert tensorboard == TENSORBOARD_UNIT.format(
        job="gpt2-small-clm",
        venv="/opt/tpu-pretrain/venv",
        logs=f"gs://{bucket}/runs/gpt2-small-clm/logs",
        ip=nic["networkIp"],
    )
    assert f"curl -fsS -H Metadata-Flavor: Google {METADATA_IP}" in sandbox.calls
    second = sandbox.run(script)
    assert second.returncode == 0, second.stderr
    assert not [c for c in sandbox.calls if c.startswith(("pip ", "python3 -m venv"))]
    assert f"wheelhouse {wheelhouse.name} (Python 3.10) is already in the bucket" in second.stderr
    assert "systemctl daemon-reload" not in sandbox.calls
    assert sorted(p.name for p in unit_dir.iterdir()) == [
        "tpu-pretrain-data.service",
        "tpu-pretrain-tensorboard.service",
        # v6e-euw4 is a spot stack: the preemption watchdog is on by default.
        "tpu-pretrain-tpu-watch-guard.service",
        "tpu-pretrain-tpu-watch.service",
        "tpu-pretrain-tpu-watch.timer",
    ]


def test_tensorboard_never_listens_on_every_interface(stack_run, sandbox):
    """Without its address from the metadata server the controller's boot fails (and says
    so) instead of binding TensorBoard to 0.0.0.0."""
    bucket, _ = publish_payload(stack_run, sandbox)
    result = sandbox.run(startup_script(stack_run, "controller-vm"), NO_INTERNAL_IP="1")
    assert result.returncode != 0
    assert "metadata network-interfaces/0/ip: not readable after 4 attempts" in result.stderr
    assert not (sandbox.root / "etc/systemd/system/tpu-pretrain-tensorboard.service").exists()
    status = json.loads(
        (sandbox.gcs / bucket / "runs/gpt2-small-clm/bootstrap/controller.json").read_text()
    )
    assert status["state"] == "failed" and "startup script failed at line" in status["message"]


def _publish_job_spec(run, box: Sandbox) -> dict:
    (obj,) = [r for r in run.resources if r.name == "payload-job-spec"]
    target = box.gcs / obj.inputs["bucket"] / obj.inputs["name"]
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(obj.inputs["content"])
    return json.loads(obj.inputs["content"])


def test_the_data_unit_waits_for_the_corpus_and_says_why(stack_run, sandbox):
    """Exit 2 (e.g. no corpus) is not restarted any more, so the unit waits for the corpus
    before its stages: a corpus uploaded after `pulumi up` is still picked up."""
    bucket, _ = publish_payload(stack_run, sandbox)
    spec = _publish_job_spec(stack_run, sandbox)
    # The venv's python is a real interpreter here: the helper reads the job spec with it.
    installed = sandbox.run(
        startup_script(stack_run, "controller-vm"), STUB_VENV_PYTHON=sys.executable
    )
    assert installed.returncode == 0, installed.stderr
    unit = (sandbox.root / "etc/systemd/system/tpu-pretrain-data.service").read_text()
    assert re.findall(r"^ExecStartPre=(.*)$", unit, re.MULTILINE) == [
        "/opt/tpu-pretrain/bin/tpu-pretrain-helper wait-corpus"
    ]
    (pattern,) = spec["corpus"]["paths"]
    assert pattern == f"gs://{bucket}/corpus/gpt2-small-clm/"  # a folder: any object in it
    uploaded = sandbox.gcs / pattern.removeprefix("gs://") / "part-0.txt"
    waited = run_helper(sandbox, "wait-corpus", CREATE_ON_SLEEP=str(uploaded))
    assert waited.returncode == 0, waited.stderr
    assert sandbox.calls.count("sleep 60") == 1  # not there once, then found
    assert f"gcloud storage ls {pattern}" in sandbox.calls
    assert "waiting for the corpus (0s so far): " + pattern in waited.stderr
    assert "corpus found after 60s" in waited.stderr
    path = sandbox.gcs / bucket / "runs/gpt2-small-clm/bootstrap/controller.json"
    status = json.loads(path.read_text())
    assert status["state"] == "waiting" and "matched no objects" in status["message"]
    again = run_helper(sandbox, "wait-corpus")  # there now: no wait
    assert again.returncode == 0 and "sleep 60" not in sandbox.calls, again.stderr


@pytest.mark.parametrize(
    ("exit_status", "state", "words"),
    [
        ("2", "stopped", "not restarted (RestartPreventExitStatus=2)"),
        ("1", "restarting", "systemd restarts it in 60s"),
        ("0", "finished", "data preparation finished"),
    ],
)
def test_the_data_units_end_is_written_to_the_bootstrap_status(
    stack_run, sandbox, exit_status, state, words
):
    """A user error (exit 2) stops the controller's data unit instead of restarting it every
    60 s forever, and says so where the trainer's end is reported."""
    bucket, _ = publish_payload(stack_run, sandbox)
    assert sandbox.run(startup_script(stack_run, "controller-vm")).returncode == 0
    unit = (sandbox.root / "etc/systemd/system/tpu-pretrain-data.service").read_text()
    service = unit.split("[Service]\n", 1)[1].split("\n\n", 1)[0].splitlines()
    for line in (
        "Restart=on-failure",
        "RestartPreventExitStatus=2",
        "ExecStopPost=/opt/tpu-pretrain/bin/tpu-pretrain-helper data-stopped",
    ):
        assert line in service, unit
    helper = sandbox.root / "opt/tpu-pretrain/bin/tpu-pretrain-helper"
    assert stat.S_IMODE(helper.stat().st_mode) == 0o755
    result = run_helper(
        sandbox,
        "data-stopped",
        EXIT_STATUS=exit_status,
        EXIT_CODE="exited",
        SERVICE_RESULT="exit-code",
    )
    assert result.returncode == 0, result.stderr
    path = sandbox.gcs / bucket / "runs/gpt2-small-clm/bootstrap/controller.json"
    status = json.loads(path.read_text())
    assert status["role"] == "controller"
    assert status["state"] == state and words in status["message"], status
    if exit_status == "2":
        assert f"gs://{bucket}/runs/gpt2-small-clm/status.json" in status["message"]
        assert "sudo systemctl restart tpu-pretrain-data" in status["message"]
    if exit_status == "0":
        assert f"gs://{bucket}/runs/gpt2-small-clm/data/manifest.json" in status["message"]


def test_transient_403_is_retried_with_backoff(stack_run, sandbox):
    publish_payload(stack_run, sandbox)
    result = sandbox.run(startup_script(stack_run, "tpu-vm"), FAIL_FIRST_DOWNLOADS="2")
    assert result.returncode == 0, result.stderr
    downloads = [c for c in sandbox.calls if c.startswith("gcloud storage cp") and "/payload/" in c]
    assert len(downloads) == 3
    assert [c for c in sandbox.calls if c.startswith("sleep")] == ["sleep 5", "sleep 10"]
    assert "transient error (attempt 1/4)" in result.stderr


def test_a_corrupt_payload_fails_and_reports_it(stack_run, sandbox):
    bucket, name = publish_payload(stack_run, sandbox)
    (sandbox.gcs / bucket / name).write_bytes(b"not the archive")
    result = sandbox.run(startup_script(stack_run, "tpu-vm"))
    assert result.returncode != 0
    assert not [c for c in sandbox.calls if c.startswith("sleep")]  # not a transient error
    status = json.loads(
        (sandbox.gcs / bucket / "runs/gpt2-small-clm/bootstrap/tpu.json").read_text()
    )
    assert status["state"] == "failed"
    assert not (sandbox.root / "opt/tpu-pretrain/venv").exists()


def test_a_missing_payload_is_retried_then_fails(stack_run, sandbox):
    result = sandbox.run(startup_script(stack_run, "tpu-vm"))
    assert result.returncode != 0
    downloads = [c for c in sandbox.calls if c.startswith("gcloud storage cp") and "/payload/" in c]
    assert len(downloads) == 4  # TPU_PRETRAIN_RETRY_ATTEMPTS
    assert "404 Not Found" in result.stderr


HOP_KEY = "etc/wireguard/tpu-pretrain-server.key"
HOP_ATTRIBUTE = "guest-attributes/" + render.WG_PUBLIC_KEY_ATTRIBUTE


def test_vpn_hop_makes_its_own_key_and_publishes_only_the_public_half(stack_run, sandbox):
    script = startup_script(stack_run, "vpn-hop-vm")
    first = sandbox.run(script)
    assert first.returncode == 0, first.stderr
    key_path = sandbox.root / HOP_KEY
    private = key_path.read_text().strip()
    assert len(base64.b64decode(private, validate=True)) == 32
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    conf_path = sandbox.root / "etc/wireguard/wg0.conf"
    conf = conf_path.read_text()
    assert stat.S_IMODE(conf_path.stat().st_mode) == 0o600
    assert f"PrivateKey = {private}\n" in conf
    assert conf.count("MASQUERADE") == 2  # PostUp adds, PostDown removes
    assert "-s 10.250.0.0/24 -o ens4 -j MASQUERADE" in conf
    assert "Address = 10.250.0.1/24\n" in conf and "AllowedIPs = 10.250.0.2/32" in conf
    assert "MTU = 1380\n" in conf
    client_public = re.search(r"readonly WG_CLIENT_PUBLIC_KEY=(\S+)", script).group(1)
    assert f"PublicKey = {client_public}\n" in conf
    # The public half, as the guest attribute `make vpn-config` reads; the private half
    # nowhere but the hop's two files: not in its output, its calls, its journal.
    public = wgkeys.public_key(private)
    assert (sandbox.state / HOP_ATTRIBUTE).read_text() == public
    assert f"public key {public} published" in first.stderr
    journal = (sandbox.state / "journal").read_text()
    assert private not in first.stdout + first.stderr + "\n".join(sandbox.calls) + journal
    assert sandbox.calls.count("wg genkey") == 1
    sysctl = sandbox.root / "etc/sysctl.d/60-tpu-pretrain-forwarding.conf"
    assert sysctl.read_text() == "net.ipv4.ip_forward = 1\n"
    assert "sysctl -q -w net.ipv4.ip_forward=1" in sandbox.calls
    assert "systemctl restart wg-quick@wg0" in sandbox.calls

    # Every later boot keeps the key, the config and the running tunnel, and publishes again.
    (sandbox.state / HOP_ATTRIBUTE).unlink()
    second = sandbox.run(script)
    assert second.returncode == 0, second.stderr
    assert key_path.read_text().strip() == private
    assert conf_path.read_text() == conf
    assert (sandbox.state / HOP_ATTRIBUTE).read_text() == public
    assert "wg genkey" not in sandbox.calls
    assert "systemctl start wg-quick@wg0" in sandbox.calls
    assert not [c for c in sandbox.calls if "restart" in c or c.startswith("apt-get")]


@pytest.mark.parametrize("damaged", ["", "not a key\n"])
def test_vpn_hop_replaces_a_key_file_it_cannot_read(stack_run, sandbox, damaged):
    """A key file cut short (a crash between creating and writing it) is made anew."""
    key_path = sandbox.root / HOP_KEY
    key_path.parent.mkdir(parents=True)
    key_path.write_text(damaged)
    result = sandbox.run(startup_script(stack_run, "vpn-hop-vm"))
    assert result.returncode == 0, result.stderr
    private = key_path.read_text().strip()
    assert private != damaged.strip()
    assert (sandbox.state / HOP_ATTRIBUTE).read_text() == wgkeys.public_key(private)
    assert f"PrivateKey = {private}\n" in (sandbox.root / "etc/wireguard/wg0.conf").read_text()


def test_vpn_hop_keeps_its_tunnel_when_the_key_cannot_be_published(stack_run, sandbox):
    result = sandbox.run(startup_script(stack_run, "vpn-hop-vm"), GUEST_ATTRIBUTES_OFF="1")
    assert result.returncode == 0, result.stderr
    puts = [c for c in sandbox.calls if c.startswith("curl ") and " -X PUT " in c]
    assert len(puts) == 4  # TPU_PRETRAIN_RETRY_ATTEMPTS
    assert "systemctl restart wg-quick@wg0" in sandbox.calls
    public = wgkeys.public_key((sandbox.root / HOP_KEY).read_text().strip())
    assert (
        f"could not publish the public key {public} as the guest attribute "
        f"{render.WG_PUBLIC_KEY_ATTRIBUTE}; on the hop: sudo wg show wg0 public-key"
    ) in result.stderr


def test_vpn_hop_installs_wireguard_only_when_missing(stack_run, sandbox):
    script = startup_script(stack_run, "vpn-hop-vm")
    (sandbox.bin / "wg").unlink()
    first = sandbox.run(script)
    assert first.returncode == 0, first.stderr
    installs = [c for c in sandbox.calls if c.startswith("apt-get") and " install " in c]
    assert installs == ["apt-get -o DPkg::Lock::Timeout=600 -q install -y wireguard-tools iptables"]
    second = sandbox.run(script)
    assert second.returncode == 0, second.stderr
    assert not [c for c in sandbox.calls if c.startswith("apt-get")]

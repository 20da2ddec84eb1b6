"""The rule `vm-accounts-write-no-executables` (policy/executables.py) beside the program that
writes the conditions (infra/executables.py): the two tables are the same, the program's own
grants pass, and each way to widen them is refused (more cases: FAILING in test_rules.py,
the real stacks' variants in test_stacks.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from policy_harness import POLICY_BY_NAME, check_resource

from policy import executables as rule

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from infra import executables

POLICY = POLICY_BY_NAME[rule.NAME]
BUCKET_MEMBER = "gcp:storage/bucketIAMMember:BucketIAMMember"
BUCKET = "tpu-pretrain-example-v3-euw4-tpu-pretrain"


def _account(identity: str) -> str:
    return f"serviceAccount:tp-v3-euw4-{identity}@tpu-pretrain-example.iam.gserviceaccount.com"


def test_the_pack_copies_the_programs_table() -> None:
    program = tuple((p.prefix, p.writers) for p in executables.PROTECTED)
    assert program == rule.PROTECTED
    assert rule.WRITE_ROLE == "roles/storage.objectUser"
    for identity in executables.IDENTITIES:
        written = executables.write_condition(BUCKET, identity)["expression"]
        assert written == rule.expected_expression(BUCKET, identity)


@pytest.mark.parametrize("identity", executables.IDENTITIES)
def test_the_programs_grants_pass(identity: str) -> None:
    member = _account(identity)
    condition = executables.write_condition(BUCKET, identity)
    for role, extra in (
        ("roles/storage.objectViewer", {}),
        ("roles/storage.objectUser", {"condition": condition}),
    ):
        props = {"bucket": BUCKET, "role": role, "member": member, **extra}
        assert check_resource(POLICY, BUCKET_MEMBER, props) == []


def test_another_identitys_condition_is_refused() -> None:
    """The workload with the controller's condition could write the wheelhouse the TPU VM
    installs and the Dataflow job's staged files."""
    props = {
        "bucket": BUCKET,
        "role": "roles/storage.objectUser",
        "member": _account("workload"),
        "condition": executables.write_condition(BUCKET, "controller"),
    }
    [message] = check_resource(POLICY, BUCKET_MEMBER, props)
    assert message.startswith(rule.MSG)
    assert "jobs/, startup/, payload/, wheelhouse/, dataflow/staging/, dataflow/tmp/" in message


def test_other_principals_and_read_only_roles_are_not_its_concern() -> None:
    for member, role in (
        ("user:someone@example.com", "roles/storage.objectAdmin"),  # allowed-iam-grants' job
        (_account("workload"), "roles/storage.legacyObjectReader"),
    ):
        props = {"bucket": BUCKET, "role": role, "member": member}
        assert check_resource(POLICY, BUCKET_MEMBER, props) == []
    project_roles = ["roles/logging.logWriter", "projects/p/roles/tpuPretrainDataflowWorker"]
    for role in project_roles:
        props = {"project": "p", "role": role, "member": _account("dataflow")}
        assert check_resource(POLICY, "gcp:projects/iAMMember:IAMMember", props) == []


def _objects_write(identity: str, expression: str) -> dict[str, object]:
    return {
        "bucket": BUCKET,
        "role": "roles/storage.objectUser",
        "member": _account(identity),
        "condition": {"title": "t", "expression": expression},
    }


def _variants() -> list[tuple[str, str, str]]:
    """(identity, what was done, expression): each identity's condition with one clause
    missing, written as a hand would (the clause cut out of the program's text)."""
    variants = []
    for identity in executables.IDENTITIES:
        written = executables.write_condition(BUCKET, identity)["expression"]
        for protected in executables.protected_from(identity):
            clause = executables.under(BUCKET, protected.prefix)
            cut = written.replace(f" || {clause}", "").replace(f"{clause} || ", "")
            assert cut != written
            variants.append((identity, f"without {protected.prefix}", cut))
    return variants


@pytest.mark.parametrize(("identity", "change", "expression"), _variants())
def test_a_condition_without_any_one_clause_is_refused(
    identity: str, change: str, expression: str
) -> None:
    [message] = check_resource(POLICY, BUCKET_MEMBER, _objects_write(identity, expression))
    assert message.startswith(rule.MSG), change


def test_the_workers_old_condition_is_refused() -> None:
    """The condition before the trainer's folders and the lease were protected: it let the
    workers write every job's checkpoints, compilation cache, export and the lease."""
    objects = f"projects/_/buckets/{BUCKET}/objects/"
    old = " && ".join(
        ["resource.type == 'storage.googleapis.com/Object'"]
        + [
            f"!resource.name.startsWith('{objects}{prefix}')"
            for prefix in ("jobs/", "startup/", "payload/", "wheelhouse/", "dataflow/staging/")
        ]
    )
    [message] = check_resource(POLICY, BUCKET_MEMBER, _objects_write("dataflow", old))
    assert (
        "runs/{job}/checkpoints/" in message and "runs/{job}/bootstrap/tpu-watch-lease" in message
    )


def test_a_job_scoped_clause_narrowed_to_the_stacks_job_is_refused() -> None:
    """startsWith on this stack's own job would leave another job's checkpoints open (the
    bucket outlives its stacks and holds every job's runs/)."""
    written = executables.write_condition(BUCKET, "controller")["expression"]
    narrowed = written.replace(
        executables.under(BUCKET, "runs/{job}/checkpoints/"),
        f"resource.name.startsWith('projects/_/buckets/{BUCKET}/objects/runs/bert-small-mlm/"
        "checkpoints/')",
    )
    assert narrowed != written
    [message] = check_resource(POLICY, BUCKET_MEMBER, _objects_write("controller", narrowed))
    assert message.startswith(rule.MSG)

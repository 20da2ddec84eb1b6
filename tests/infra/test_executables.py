"""What a VM runs comes only from the deploy identity (docs/guard-rails.md, "What a VM runs").

For every stack, under Pulumi's mocks: every identity a VM or a Dataflow worker runs as,
against every object a VM runs or installs, taken from the program's own inputs (the objects
`pulumi up` uploads, what the job pointer names, the wheelhouse of the rendered scripts,
the Dataflow staging and temp locations of the job options, the lease and export marker of
the rendered watchdog, the job spec's output with what the trainer keeps there), and against
what each identity must write. Each grant's IAM condition is evaluated with cel-python
(tests/infra/iam_cel.py) as IAM evaluates it for one request on one object; the expected
answers are written here, not derived from infra/executables.py."""

from __future__ import annotations

import base64
import json
import re
import sys
from collections import Counter
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest
from harness import run_offline, stack_names
from iam_cel import evaluate, functions_called, logic_operators

from infra import executables, jobspec
from infra.render import render

BOOTSTRAP = Path(__file__).resolve().parents[2] / "infra" / "bootstrap"
sys.path.insert(0, str(BOOTSTRAP))
import bootstrap_roles  # noqa: E402
import iam_conditions  # noqa: E402

OBJECT, BUCKET = "storage.googleapis.com/Object", "storage.googleapis.com/Bucket"
MANAGED_FOLDER = "storage.googleapis.com/ManagedFolder"
WORKLOAD, CONTROLLER, DATAFLOW, HOP = "workload", "controller", "dataflow", "vpn-hop"
DATAFLOW_ON = {"tpu-pretrain:dataflow": True}
# What each role the program grants on a bucket holds, by Google's role definitions
# (iam/docs/roles-permissions/storage): object permissions only.
BUCKET_ROLES = {
    "roles/storage.objectViewer": {"storage.objects.get", "storage.objects.list"},
    "roles/storage.objectUser": {
        "storage.objects.create",
        "storage.objects.delete",
        "storage.objects.get",
        "storage.objects.list",
        "storage.objects.move",
        "storage.objects.restore",
        "storage.objects.update",
        "storage.managedFolders.create",
        "storage.managedFolders.delete",
    },
}
# Project roles the program grants a stack account, and whether they hold any object
# permission there (which no bucket condition limits): predefined ones by Google's pages,
# the bootstrap's custom ones by their permission lists.
PROJECT_ROLES_WITHOUT_OBJECTS = {
    "roles/logging.logWriter",
    "roles/monitoring.metricWriter",
    "roles/dataflow.developer",
}
CUSTOM_ROLES = {
    bootstrap_roles.RECOVERY_ROLE_ID: bootstrap_roles.RECOVERY_PERMISSIONS,
    bootstrap_roles.GPU_RECOVERY_ROLE_ID: bootstrap_roles.GPU_RECOVERY_PERMISSIONS,
    bootstrap_roles.DATAFLOW_LAUNCHER_ROLE_ID: bootstrap_roles.DATAFLOW_LAUNCHER_PERMISSIONS,
    bootstrap_roles.DATAFLOW_WORKER_ROLE_ID: bootstrap_roles.DATAFLOW_WORKER_PERMISSIONS,
}
_ACCOUNT = re.compile(r"tp-[a-z0-9-]+-(workload|controller|dataflow|vpn-hop)@")
# Google's IAM "Quotas and limits": "Logic operators in a binding's condition expression: 12".
IAM_LOGIC_OPERATORS = 12
# A job of the bucket other than the stack's: the trainer's folders are every job's.
OTHER_JOB = "runs/another-job"


def _identity(member_or_email: str) -> str | None:
    match = _ACCOUNT.search(member_or_email)
    return match.group(1) if match else None


class Stack:
    """One stack's bucket grants per identity, the objects its VMs run, and what they write."""

    def __init__(self, stack: str, overrides: dict[str, object] | None = None) -> None:
        run = run_offline(stack, overrides)
        self.run = run
        (bucket,) = [r for r in run.resources if r.type_ == "gcp:storage/bucket:Bucket"]
        self.bucket = bucket.inputs["name"]
        self.grants: dict[str, list[tuple[str, str | None]]] = {}
        self.project_roles: dict[str, set[str]] = {}
        for r in run.resources:
            member = r.inputs.get("member", "")
            identity = _identity(member)
            if identity is None:
                continue
            if r.type_ == "gcp:storage/bucketIAMMember:BucketIAMMember":
                assert r.inputs["bucket"] == self.bucket
                condition = (r.inputs.get("condition") or {}).get("expression")
                self.grants.setdefault(identity, []).append((r.inputs["role"], condition))
            elif r.type_.startswith("gcp:projects/"):
                self.project_roles.setdefault(identity, set()).add(r.inputs["role"])
        # Every identity a VM runs as, and the Dataflow workers' (the job spec names it).
        self.identities = {
            _identity(r.inputs["serviceAccount"]["email"])
            for r in run.resources
            if r.type_ in ("gcp:tpu/v2Vm:V2Vm", "gcp:compute/instance:Instance")
        }
        spec = json.loads(self._named("payload-job-spec").inputs["content"])
        self.job = spec["name"]
        self.output = spec["output"]
        options = ((spec.get("data") or {}).get("beam") or {}).get("options") or {}
        if overrides == DATAFLOW_ON:
            self.identities.add(_identity(run.exports["dataflowOptions"]["service_account_email"]))
            options = run.exports["dataflowOptions"]
        self.dataflow_options = options or jobspec.dataflow_options(
            jobspec.DataflowTarget("p", "r", "w@p.iam.gserviceaccount.com", "s", "i"),
            self.bucket,
        )

    def _named(self, name: str):
        (found,) = [r for r in self.run.resources if r.name == name]
        return found

    def executables(self) -> Iterator[tuple[str, str]]:
        """(object, who may write it besides the deploy identity) for everything a VM runs."""
        deploy_only = ()
        for r in self.run.resources:
            if r.type_ == "gcp:storage/bucketObject:BucketObject" and r.name.startswith(
                ("payload-", "startup-")
            ):
                yield r.inputs["name"], deploy_only  # the pointer, scripts, archive, job spec
        pointer = json.loads(self._named("startup-pointer").inputs["content"])
        for key, value in pointer.items():
            if key == "job_uri":
                yield value.removeprefix(f"gs://{self.bucket}/"), deploy_only
            elif key == "payload_object" or (key.startswith("script_") and "sha" not in key):
                yield value, deploy_only
        for role in ("tpu", "gpu"):
            script = [r for r in self.run.resources if r.name == f"startup-{role}-script"]
            if script:
                root = re.search(
                    r"^readonly WHEELHOUSE_ROOT=(\S+)$", script[0].inputs["content"], re.M
                )
                prefix = root.group(1).removeprefix(f"gs://{self.bucket}/")
                yield (
                    f"{prefix}/0123456789abcdef/jaxlib-0.12.0.1-cp312-linux_x86_64.whl",
                    (CONTROLLER,),
                )
                yield f"{prefix}/0123456789abcdef/complete", (CONTROLLER,)
        staging = self.dataflow_options["staging_location"].removeprefix(f"gs://{self.bucket}/")
        temp = self.dataflow_options["temp_location"].removeprefix(f"gs://{self.bucket}/")
        yield f"{staging}/pipeline.pb", (CONTROLLER,)
        yield f"{staging}/pickled_main_session", (CONTROLLER,)
        yield f"{temp}/beam-temp-x/side-input", (CONTROLLER, DATAFLOW)
        yield from self.trainer_state()

    def watched(self) -> dict[str, str]:
        """What the controller's watchdog reads (LEASE_URI, EXPORT_MARKER_URI of the script
        the controller's startup script installs), {} in a stack without one."""
        script = self._named("startup-controller-script").inputs["content"]
        encoded = re.search(r"^readonly WATCH_SCRIPT_B64=['\"]?([A-Za-z0-9+/=]*)", script, re.M)
        if encoded is None or not encoded.group(1):
            return {}
        watch = base64.b64decode(encoded.group(1)).decode()
        return {
            key: value.removeprefix(f"gs://{self.bucket}/")
            for key, value in re.findall(
                r"^readonly (LEASE_URI|EXPORT_MARKER_URI)=(\S+)$", watch, re.M
            )
        }

    def trainer_state(self) -> Iterator[tuple[str, tuple[str, ...]]]:
        """What the accelerator VM's trainer reads back (the JAX compilation cache, Orbax and
        TF checkpoints, the export users load), in the job spec's output and in another
        job's, and the watchdog's lease of both: only the accelerator VM writes the former,
        nobody the lease (Pulumi does)."""
        own = self.output.removeprefix(f"gs://{self.bucket}/")
        assert own == f"runs/{self.job}"
        for root in (own, OTHER_JOB):
            for name in (
                f"compilation-cache/jit_train_step-{'0' * 64}-cache",
                f"compilation-cache/jit_train_step-{'0' * 64}-atime",
                "checkpoints/100/state/_METADATA",
                "checkpoints/100/_CHECKPOINT_METADATA",
                "checkpoints/ckpt-100.index",
                "checkpoints/",  # a folder's placeholder object
                "export/model.safetensors",
                "export/config.json",
            ):
                yield f"{root}/{name}", (WORKLOAD,)
            yield f"{root}/bootstrap/tpu-watch-lease", ()
        watched = self.watched()
        leases = [r.inputs["name"] for r in self.run.resources if r.name.endswith("watch-lease")]
        assert leases == ([watched["LEASE_URI"]] if watched else [])
        for name in leases:
            yield name, ()
        if watched:
            yield watched["EXPORT_MARKER_URI"], (WORKLOAD,)

    def must_write(self) -> dict[str, list[str]]:
        """What each identity writes on the stack's own paths (jobspec's layout)."""
        run_root = jobspec.run_root(self.bucket, self.job).removeprefix(f"gs://{self.bucket}/")
        shared = [
            f"{run_root}/status.json",
            # gcloud storage's parallel composite uploads put their parts at the bucket's root.
            "gcloud/tmp/parallel_composite_uploads/see_gcloud_storage_cp_help_for_details/x_0",
        ]
        return {
            # The trainer: its state of any job, its logs, its own status files.
            WORKLOAD: [
                *shared,
                f"{run_root}/checkpoints/100/state/0.zarr",
                f"{run_root}/compilation-cache/jit_train_step-{'0' * 64}-cache",
                f"{run_root}/logs/events.out.tfevents.1",
                f"{run_root}/export/model.safetensors",
                f"{OTHER_JOB}/checkpoints/100/state/0.zarr",
                f"{run_root}/bootstrap/tpu.json",
                f"{run_root}/bootstrap/gpu.json",
            ],
            # The data stages and the watchdog's status files (templates/tpu-watch.sh).
            CONTROLLER: [
                *shared,
                f"{run_root}/bootstrap/controller.json",
                f"{run_root}/bootstrap/tpu-watch.json",
                f"{run_root}/bootstrap/tpu-worker-0.json",
                f"{run_root}/data/manifest.json",
                f"{run_root}/tokenizer/tokenizer.json",
            ],
            DATAFLOW: [
                f"{run_root}/data/train-00000-of-00004.tfrecord",
                f"{run_root}/data/beam-temp-1/x",
            ],
        }

    def allowed(self, identity: str, permission: str, kind: str, name: str) -> bool:
        """Whether one request of `identity` is allowed by the stack's grants (IAM: any
        binding whose role holds the permission and whose condition holds)."""
        for project_role in self.project_roles.get(identity, set()):
            custom = CUSTOM_ROLES.get(project_role.rsplit("/", 1)[-1], ())
            holds = (
                permission in custom
                if project_role.startswith("projects/")
                else (project_role not in PROJECT_ROLES_WITHOUT_OBJECTS)
            )
            if holds:
                return True  # a project grant: no bucket condition applies to it
        for role, condition in self.grants.get(identity, []):
            assert role in BUCKET_ROLES, f"{role}: add what it holds to BUCKET_ROLES"
            if permission in BUCKET_ROLES[role] and (
                condition is None or evaluate(condition, kind, name)
            ):
                return True
        return False

    def object(self, name: str) -> str:
        return executables.object_name(self.bucket, name)


@cache
def _stack(stack: str, dataflow: bool) -> Stack:
    return Stack(stack, DATAFLOW_ON if dataflow else None)


CASES = [(stack, False) for stack in stack_names()] + [("v3-euw4", True), ("t4-usc1", True)]


@pytest.mark.parametrize(
    ("stack", "dataflow"), CASES, ids=[f"{s}{'+dataflow' if d else ''}" for s, d in CASES]
)
def test_no_vm_or_worker_identity_writes_what_another_runs(stack: str, dataflow: bool) -> None:
    s = _stack(stack, dataflow)
    expected_identities = {WORKLOAD, CONTROLLER, HOP} | ({DATAFLOW} if dataflow else set())
    assert s.identities == expected_identities
    rows = list(s.executables())
    # The program's own inputs name each kind of object a VM runs.
    prefixes = {name.split("/")[0] for name, _ in rows}
    assert prefixes == {"jobs", "startup", "payload", "wheelhouse", "dataflow", "runs"}, prefixes
    assert {name.split("/")[2] for name, _ in rows if name.startswith("runs/")} == {
        "compilation-cache",
        "checkpoints",
        "export",
        "bootstrap",
    }
    assert any(name == render.POINTER_OBJECT for name, _ in rows)
    wrong = []
    for identity in sorted(s.identities):
        for name, writers in rows:
            path = s.object(name)
            for permission in (
                "storage.objects.create",
                "storage.objects.delete",
                "storage.objects.update",
            ):
                if s.allowed(identity, permission, OBJECT, path) != (identity in writers):
                    wrong.append((identity, permission, name))
            # Every VM reads what it runs (the hop runs none of it and reads nothing).
            if s.allowed(identity, "storage.objects.get", OBJECT, path) != (identity != HOP):
                wrong.append((identity, "storage.objects.get", name))
    assert wrong == []


@pytest.mark.parametrize(("stack", "dataflow"), [("v6e-euw4", True), ("l4x2-use1", False)])
def test_each_identity_writes_what_it_must(stack: str, dataflow: bool) -> None:
    s = _stack(stack, dataflow)
    for identity, names in s.must_write().items():
        if identity not in s.identities:
            continue
        for name in names:
            for permission in (
                "storage.objects.create",
                "storage.objects.delete",
                "storage.objects.get",
            ):
                assert s.allowed(identity, permission, OBJECT, s.object(name)), (
                    identity,
                    permission,
                    name,
                )
        # Listing is on the bucket: the read grant's, with no condition.
        assert s.allowed(identity, "storage.objects.list", BUCKET, f"projects/_/buckets/{s.bucket}")
    assert not s.allowed(HOP, "storage.objects.get", OBJECT, s.object("runs/x"))


@pytest.mark.parametrize(
    ("kind", "name"),
    [
        # A managed folder over startup/ (its own IAM policy would add to the bucket's).
        (MANAGED_FOLDER, "projects/_/buckets/{bucket}/managedFolders/startup/"),
        # The bucket itself (its settings, IAM policy): no write grant reaches it.
        (BUCKET, "projects/_/buckets/{bucket}"),
    ],
)
def test_the_write_grants_reach_nothing_but_this_buckets_objects(kind: str, name: str) -> None:
    s = _stack("v3-euw4", True)
    for identity in (WORKLOAD, CONTROLLER, DATAFLOW):
        for permission in ("storage.objects.create", "storage.managedFolders.create"):
            target = name.format(bucket=s.bucket)
            assert not s.allowed(identity, permission, kind, target), (identity, permission, name)


def test_the_matrix_can_fail() -> None:
    """An unconditional write grant, or roles/dataflow.worker on the project (it holds
    storage.objects.create there), would let an identity write what another runs."""
    s = Stack("v3-euw4", DATAFLOW_ON)
    pointer = s.object(render.POINTER_OBJECT)
    assert not s.allowed(WORKLOAD, "storage.objects.create", OBJECT, pointer)
    s.grants[WORKLOAD] = [("roles/storage.objectUser", None)]
    assert s.allowed(WORKLOAD, "storage.objects.create", OBJECT, pointer)
    assert not s.allowed(DATAFLOW, "storage.objects.create", OBJECT, pointer)
    s.project_roles[DATAFLOW] = {"roles/dataflow.worker"}
    assert s.allowed(DATAFLOW, "storage.objects.create", OBJECT, pointer)


# Names near the trainer's folders and the lease, and who may write each (closed by default:
# what is no job's folder but looks like one is refused too; infra/executables.py `under`).
EVERY_BUT_THE_LEASE = {WORKLOAD, CONTROLLER, DATAFLOW}
NEAR_MISSES = [
    ("runs//checkpoints/100/x", {WORKLOAD}),  # an empty job name
    ("runs/a/b/checkpoints/100/x", {WORKLOAD}),  # a job name with "/"
    ("runs/j/logs/export/x", {WORKLOAD}),  # deeper than a job's own folder
    ("runsX/j/compilation-cache/x", {WORKLOAD}),
    ("runs/j/bootstrap/tpu-watch-lease.old", set()),
    ("runs//bootstrap/tpu-watch-lease", set()),
    ("runs/j/checkpointsX/x", EVERY_BUT_THE_LEASE),  # not the folder
    ("runs/j/checkpoints", EVERY_BUT_THE_LEASE),  # the bare name: not under the folder
    ("runs/j/exported.json", EVERY_BUT_THE_LEASE),
    ("runs/checkpoints/x", EVERY_BUT_THE_LEASE),  # no job before the folder
    ("runs/j/data/train-00000-of-00004.tfrecord", EVERY_BUT_THE_LEASE),
    ("runs/j/bootstrap/tpu.json", EVERY_BUT_THE_LEASE),
    ("corpus/runs/j/checkpoints/x", EVERY_BUT_THE_LEASE),  # not under runs/
]


@pytest.mark.parametrize(("name", "writers"), NEAR_MISSES, ids=[n for n, _ in NEAR_MISSES])
def test_near_misses_of_the_trainers_folders(name: str, writers: set[str]) -> None:
    s = _stack("v6e-euw4", True)
    for identity in (WORKLOAD, CONTROLLER, DATAFLOW):
        allowed = s.allowed(identity, "storage.objects.create", OBJECT, s.object(name))
        assert allowed == (identity in writers), (identity, name)


def _old_expression(bucket: str, prefixes: list[str]) -> str:
    """The condition's form before the trainer's folders were protected: a negated
    startsWith per prefix."""
    clauses = [f"resource.type == '{OBJECT}'"]
    clauses += [
        f"!resource.name.startsWith('{executables.object_name(bucket, p)}')" for p in prefixes
    ]
    return " && ".join(clauses)


def test_each_new_row_can_fail() -> None:
    """The workers' condition as it was let them write a checkpoint the trainer resumes from,
    and the program's condition without any one of its job-scoped clauses opens that row
    (the matrix above would report it)."""
    s = Stack("v6e-euw4", DATAFLOW_ON)
    checkpoint = s.object(f"runs/{s.job}/checkpoints/100/state/_METADATA")
    old = _old_expression(
        s.bucket, ["jobs/", "startup/", "payload/", "wheelhouse/", "dataflow/staging/"]
    )
    assert not s.allowed(DATAFLOW, "storage.objects.create", OBJECT, checkpoint)
    s.grants[DATAFLOW] = [("roles/storage.objectUser", old)]
    assert s.allowed(DATAFLOW, "storage.objects.create", OBJECT, checkpoint)
    rows = {
        "compilation-cache/": f"runs/{s.job}/compilation-cache/jit_train_step-0-cache",
        "checkpoints/": f"runs/{s.job}/checkpoints/100/state/_METADATA",
        "export/": f"runs/{s.job}/export/model.safetensors",
        "bootstrap/tpu-watch-lease": f"runs/{s.job}/bootstrap/tpu-watch-lease",
    }
    opened = []
    for identity in (WORKLOAD, CONTROLLER, DATAFLOW):
        protected = [p.prefix for p in executables.protected_from(identity)]
        for prefix in protected:
            if executables.JOB not in prefix:
                continue
            (name,) = [n for tail, n in rows.items() if prefix.endswith(f"/{tail}")]
            without = executables.write_expression(s.bucket, [p for p in protected if p != prefix])
            s.grants[identity] = [("roles/storage.objectUser", without)]
            assert s.allowed(identity, "storage.objects.create", OBJECT, s.object(name))
            s.grants[identity] = [
                ("roles/storage.objectUser", executables.write_expression(s.bucket, protected))
            ]
            assert not s.allowed(identity, "storage.objects.create", OBJECT, s.object(name))
            opened.append((identity, prefix))
    # The workload: the lease only; the controller and the workers: all four.
    assert Counter(identity for identity, _ in opened) == {WORKLOAD: 1, CONTROLLER: 4, DATAFLOW: 4}


def _write_conditions() -> dict[tuple[str, bool, str], str]:
    return {
        (stack, dataflow, identity): condition
        for stack, dataflow in CASES
        for identity, grants in _stack(stack, dataflow).grants.items()
        for _, condition in grants
        if condition is not None
    }


def test_every_write_condition_fits_iam() -> None:
    """IAM's limit of logic operators per binding condition, and only functions Google
    documents for resource.name (iam_conditions.DOCUMENTED_FUNCTIONS)."""
    conditions = _write_conditions()
    assert {identity for _, _, identity in conditions} == {WORKLOAD, CONTROLLER, DATAFLOW}
    for key, expression in conditions.items():
        assert logic_operators(expression) <= IAM_LOGIC_OPERATORS, key
        assert functions_called(expression) <= iam_conditions.DOCUMENTED_FUNCTIONS, key
    # The most: the workers' (one `&&`, one `!`, an `||` between each two prefixes).
    worst = max(conditions.values(), key=logic_operators)
    assert logic_operators(worst) == len(executables.protected_from(DATAFLOW)) + 1


def test_the_limit_check_can_fail() -> None:
    """The old form (a `!` and an `&&` per prefix) of the workers' condition, with the
    trainer's folders and the lease, would be over IAM's limit."""
    s = _stack("v6e-euw4", True)
    prefixes = [p.prefix for p in executables.protected_from(DATAFLOW)]
    old = _old_expression(s.bucket, prefixes)
    assert logic_operators(old) == 2 * len(prefixes) > IAM_LOGIC_OPERATORS
    assert functions_called("resource.name.matches('^x')") - iam_conditions.DOCUMENTED_FUNCTIONS

"""What a VM of the stack executes or installs from the bucket, and who may write it.

Pure (no Pulumi): the bucket grants of infra/components/bucket.py and dataflow.py take their
IAM conditions from here, the tests evaluate them (tests/infra/test_executables.py), and the
policy pack keeps its own copy of the table (policy/executables.py; a test checks that the
two agree).

The deploy identity writes the job pointer, every role's startup script, the payload
archive and the job specs (`pulumi up`). The VMs' accounts read the whole bucket
(roles/storage.objectViewer) and write objects (roles/storage.objectUser) under an IAM
condition that names what they may not write: every prefix below whose `writers` do not
include them. The controller is the one account above the others by design: it holds actAs
on the TPU/GPU VM's account and on the Dataflow worker account (recovery, launching), so it
may already run anything as them, and what it writes for them (the wheelhouse the
accelerator VM installs, the Dataflow job's staged files) crosses no boundary. Nothing the
accelerator VM or a Dataflow worker writes is executed by another identity.

Why a condition that excludes these prefixes rather than one that lists where a VM may
write: tools write where the bucket layout does not say (gcloud storage's parallel
composite uploads put their temporary parts under `gcloud/tmp/` at the bucket's root, Beam
writes temp files beside its outputs), and a VM that cannot write them fails in production
only; what must not be written is the short, stable list, and the tests enumerate it from
the program's own inputs (docs/guard-rails.md, "What a VM runs").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

OBJECT_TYPE = "storage.googleapis.com/Object"

# The stack's identities that hold bucket grants (service accounts tp-<stack>-<identity>):
# the accelerator VM's (TPU VM or GPU VM), the controller's, the Dataflow workers'.
WORKLOAD, CONTROLLER, DATAFLOW = "workload", "controller", "dataflow"
IDENTITIES = (WORKLOAD, CONTROLLER, DATAFLOW)


@dataclass(frozen=True)
class Protected:
    """Objects under `prefix` are executed or installed by `run_by`; besides the deploy
    identity, only `writers` may write them."""

    prefix: str
    what: str
    run_by: tuple[str, ...]
    writers: tuple[str, ...] = ()


PROTECTED = (
    Protected("jobs/", "the job pointer jobs/current.json and the job specs", IDENTITIES),
    Protected("startup/", "every role's startup script", (WORKLOAD, CONTROLLER)),
    Protected("payload/", "the payload archive", (WORKLOAD, CONTROLLER)),
    # Wheels the accelerator VM pip-installs, downloaded by the controller (controller.sh
    # build_wheelhouse, tpu.sh).
    Protected("wheelhouse/", "the accelerator VM's wheelhouse", (WORKLOAD,), (CONTROLLER,)),
    # Beam's staged pipeline (pickled functions) the workers run, written by the launcher
    # (infra/jobspec.py dataflow_options), and the job's temp files, which workers write and
    # read back (coders may pickle).
    Protected("dataflow/staging/", "the Dataflow job's staged files", (DATAFLOW,), (CONTROLLER,)),
    Protected(
        "dataflow/tmp/", "the Dataflow job's temp files", (DATAFLOW,), (CONTROLLER, DATAFLOW)
    ),
)


def protected_from(identity: str) -> tuple[Protected, ...]:
    """The prefixes `identity` may not write."""
    if identity not in IDENTITIES:
        raise ValueError(f"no such identity {identity!r} (one of {', '.join(IDENTITIES)})")
    return tuple(p for p in PROTECTED if identity not in p.writers)


def object_name(bucket: str, name: str) -> str:
    """An object's resource.name in IAM conditions (Google's "Resource attributes for IAM
    Conditions": projects/_/buckets/<bucket>/objects/<object>)."""
    return f"projects/_/buckets/{bucket}/objects/{name}"


def write_expression(bucket: str, prefixes: Sequence[str]) -> str:
    """Objects of `bucket` outside `prefixes`: objects only (a bucket, a managed folder, a
    folder is another resource type, so no list, managed-folder IAM or folder permission of
    the role comes through), and not under any of the prefixes."""
    clauses = [f"resource.type == '{OBJECT_TYPE}'"]
    clauses += [f"!resource.name.startsWith('{object_name(bucket, p)}')" for p in prefixes]
    return " && ".join(clauses)


def write_condition(bucket: str, identity: str) -> dict[str, str]:
    """The IAM condition of `identity`'s object-writing grant on the stack's bucket."""
    protected = protected_from(identity)
    return {
        "title": f"{identity}-writes-no-executables"[:100],
        "description": (
            "Objects outside what another identity executes and only the deploy identity "
            f"writes: {', '.join(p.prefix for p in protected)} (infra/executables.py)."
        )[:256],
        "expression": write_expression(bucket, [p.prefix for p in protected]),
    }

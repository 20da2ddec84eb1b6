"""What a VM of the stack executes or installs from the bucket, and who may write it.

Pure (no Pulumi): the bucket grants of infra/components/bucket.py and dataflow.py take their
IAM conditions from here, the tests evaluate them (tests/infra/test_executables.py), and the
policy pack keeps its own copy of the table (policy/executables.py; a test checks that the
two agree).

The deploy identity writes the job pointer, every role's startup script, the payload
archive, the job specs and the watchdog's lease (`pulumi up`). The VMs' accounts read the
whole bucket (roles/storage.objectViewer) and write objects (roles/storage.objectUser) under
an IAM condition that names what they may not write: every prefix below whose `writers` do
not include them. The controller is the one account above the others by design: it holds
actAs on the TPU/GPU VM's account and on the Dataflow worker account (recovery, launching),
so it may already run anything as them, and what it writes for them (the wheelhouse the
accelerator VM installs, the Dataflow job's staged files) crosses no boundary. Nothing the
accelerator VM or a Dataflow worker writes is executed by another identity.

The other way round, what the accelerator VM's trainer reads back as its own, of every job
(the JAX compilation cache, which JAX deserialises into programs the accelerator runs with
no integrity check; the checkpoints it resumes from; the export users load), only that VM's
account writes: not the workers, and not the controller's own account either, whose data
stages (tokenizer, encoding) never write there; the controller reaches them only by acting
as that account, i.e. by recreating the VM the way the recovery does.

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

from infra import jobspec

OBJECT_TYPE = "storage.googleapis.com/Object"

# The stack's identities that hold bucket grants (service accounts tp-<stack>-<identity>):
# the accelerator VM's (TPU VM or GPU VM), the controller's, the Dataflow workers'.
WORKLOAD, CONTROLLER, DATAFLOW = "workload", "controller", "dataflow"
IDENTITIES = (WORKLOAD, CONTROLLER, DATAFLOW)


# In a prefix, the place of a job's name: "runs/{job}/checkpoints/" is that folder of every
# job (infra/jobspec.py run_prefix).
JOB = "{job}"


@dataclass(frozen=True)
class Protected:
    """Objects under `prefix` (with JOB: of any job) are executed, installed or trusted by
    `run_by`; besides the deploy identity, only `writers` may write them."""

    prefix: str
    what: str
    run_by: tuple[str, ...]
    writers: tuple[str, ...] = ()


def _of_every_job(path: str) -> str:
    return f"{jobspec.run_prefix(JOB)}/{path}"


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
    # What the trainer on the accelerator VM writes and reads back, of every job: only it
    # writes them (payload/backends/jax/compile_cache.py, backends/*/checkpoint.py,
    # training/export.py).
    Protected(
        _of_every_job(f"{jobspec.COMPILATION_CACHE_DIR}/"),
        "every job's JAX compilation cache (programs JAX loads and runs unchecked)",
        (WORKLOAD,),
        (WORKLOAD,),
    ),
    Protected(
        _of_every_job(f"{jobspec.CHECKPOINTS_DIR}/"),
        "every job's checkpoints (the trainer resumes from them)",
        (WORKLOAD,),
        (WORKLOAD,),
    ),
    # Users load the export; its marker ends the watchdog's recovery of the accelerator VM.
    Protected(
        _of_every_job(f"{jobspec.EXPORT_DIR}/"),
        "every job's export (the model users load, and its marker)",
        (CONTROLLER,),
        (WORKLOAD,),
    ),
    # Pulumi's (infra/components/controller.py WatchLease): while it exists the watchdog
    # recreates or starts the accelerator VM; deleting it stops the watchdog.
    Protected(jobspec.watch_lease_object_name(JOB), "every job's watchdog lease", (CONTROLLER,)),
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


def under(bucket: str, prefix: str) -> str:
    """The clause that holds for the objects of `bucket` under `prefix`.

    A plain prefix is `resource.name.startsWith(...)`. A job-scoped one, runs/{job}/<path>,
    is no one prefix for every job: it is IAM's extract() (Google's "Attribute reference for
    IAM Conditions": the characters between the first occurrence of the template's prefix
    and the first subsequent occurrence of its suffix; "" when either is missing), with the
    template `<the bucket's objects>/runs{job}/<path>` and `!= ''`. The slash after `runs`
    is part of what is extracted, so the clause holds whenever anything at all, a lone "/"
    included, stands between `runs` and the first "/<path>" after it. It holds, and so the
    grant refuses (closed by default), for runs/<any job>/<path>..., runs//<path>... (an
    empty name), runs/a/b/<path>... (a name with "/"), runs/<job>/logs/<path>... (deeper)
    and runsX/.../<path>...; the last four are no job's, refused all the same. It does not
    hold for runs/<job>/checkpointsX or the bare runs/<job>/checkpoints (no "/<path>": no
    reader takes them for the folder) nor for runs/<path>... (no job before it)."""
    if JOB not in prefix:
        return f"resource.name.startsWith('{object_name(bucket, prefix)}')"
    before, _, rest = prefix.partition(JOB)
    if before != jobspec.run_prefix("") or not rest.startswith("/") or JOB in rest:
        raise ValueError(f"{prefix!r}: a job-scoped prefix is runs/{JOB}/<path>")
    template = object_name(bucket, f"{before.removesuffix('/')}{JOB}{rest}")
    return f"resource.name.extract('{template}') != ''"


def write_expression(bucket: str, prefixes: Sequence[str]) -> str:
    """Objects of `bucket` outside `prefixes`: objects only (a bucket, a managed folder, a
    folder is another resource type, so no list, managed-folder IAM or folder permission of
    the role comes through), and under none of the prefixes. One negation of a disjunction,
    not a negation per prefix: IAM allows 12 logic operators in a binding's condition
    (Google's IAM "Quotas and limits"), and `!`, `&&` and `||` each count here."""
    expression = f"resource.type == '{OBJECT_TYPE}'"
    if not prefixes:
        return expression
    return f"{expression} && !({' || '.join(under(bucket, p) for p in prefixes)})"


def write_condition(bucket: str, identity: str) -> dict[str, str]:
    """The IAM condition of `identity`'s object-writing grant on the stack's bucket."""
    protected = protected_from(identity)
    return {
        "title": f"{identity}-writes-no-executables"[:100],
        "description": (
            "Objects outside what another identity runs or trusts: "
            f"{', '.join(p.prefix.replace(JOB, '<job>') for p in protected)} "
            "(infra/executables.py)."
        )[:256],
        "expression": write_expression(bucket, [p.prefix for p in protected]),
    }

"""The bootstrap's IAM conditions, evaluated with a CEL evaluator (tests/infra/iam_cel.py)
against the resource-name formats of Google's "Resource attributes for IAM Conditions", names
that must NOT match included (other stacks' or teams' resources, the state bucket, an object
named like a bucket, a bucket whose name only contains the suffix)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from iam_cel import evaluate, functions_called, iam_extract

from infra.components.recovery import instance_condition

BOOTSTRAP = Path(__file__).resolve().parents[2] / "infra" / "bootstrap"
sys.path.insert(0, str(BOOTSTRAP))
import gitops_bootstrap as bootstrap  # noqa: E402
import iam_conditions as conditions  # noqa: E402

PROJECT = "tpu-pretrain-example"
STATE = "tpu-pretrain-example-pulumi-state"
BUCKET, OBJECT = conditions.BUCKET_TYPE, conditions.OBJECT_TYPE
INSTANCE = conditions.INSTANCE_TYPE
DISK = "compute.googleapis.com/Disk"


def test_extract_is_googles() -> None:
    """The evaluator's extract() gives the outputs of Google's table (attribute reference,
    "Extract values from attributes"), for its Cloud Storage object name."""
    name = (
        "projects/_/buckets/acme-orders-aaa/objects/data_lake/orders/"
        "order_date=2019-11-03/aef87g87ae0876"
    )
    table = {
        "/order_date={date}/": "2019-11-03",
        "buckets/{name}/": "acme-orders-aaa",
        "/orders/{empty}order_date": "",
        "{start}/objects/data_lake": "projects/_/buckets/acme-orders-aaa",
        "orders/{end}": "order_date=2019-11-03/aef87g87ae0876",
        "{all}": name,
        "/orders/{none}/order_date=": "",
        "/orders/order_date=2019-11-03/{id}/data_lake": "",
    }
    assert {t: iam_extract(name, t) for t in table} == table
    # Through CEL, as a method of resource.name.
    assert evaluate("resource.name.extract('buckets/{name}/') == 'acme-orders-aaa'", OBJECT, name)


# (condition, resource type, resource name, expected)
BUCKETS = conditions.stack_bucket_condition()
INSTANCES = conditions.stack_instance_condition(PROJECT)
GPU_VM = instance_condition(PROJECT, "us-central1-a", "tp-t4-usc1-gpu")["expression"]
STACK_BUCKET = "tpu-pretrain-example-v6e-euw4-tpu-pretrain"
MATRIX = [
    # --- the stacks' buckets and their objects ------------------------------------------
    (BUCKETS, BUCKET, f"projects/_/buckets/{STACK_BUCKET}", True),
    (BUCKETS, BUCKET, "projects/_/buckets/my.data-tpu-pretrain", True),
    (BUCKETS, OBJECT, f"projects/_/buckets/{STACK_BUCKET}/objects/runs/smoke/status.json", True),
    (BUCKETS, OBJECT, f"projects/_/buckets/{STACK_BUCKET}/objects/a/objects/b", True),
    (BUCKETS, BUCKET, f"projects/_/buckets/{STATE}", False),
    (BUCKETS, OBJECT, f"projects/_/buckets/{STATE}/objects/.pulumi/stacks/tpu-pretrain/a.json",
     False),
    # an object in the state bucket named like a stack bucket's object
    (BUCKETS, OBJECT, f"projects/_/buckets/{STATE}/objects/x-tpu-pretrain/objects/y", False),
    (BUCKETS, OBJECT, f"projects/_/buckets/{STATE}/objects/x-tpu-pretrain", False),
    # a bucket whose name only contains the suffix, or is the suffix without the dash
    (BUCKETS, BUCKET, "projects/_/buckets/x-tpu-pretrain-archive", False),
    (BUCKETS, OBJECT, "projects/_/buckets/x-tpu-pretrain-archive/objects/a", False),
    (BUCKETS, BUCKET, "projects/_/buckets/tpu-pretrain", False),
    # a bucket's name under the object type, and an object's under the bucket type
    (BUCKETS, OBJECT, f"projects/_/buckets/{STACK_BUCKET}", False),
    (BUCKETS, BUCKET, f"projects/_/buckets/{STATE}/objects/a-tpu-pretrain", False),
    # a managed folder, a disk named like a bucket
    (BUCKETS, "storage.googleapis.com/ManagedFolder",
     f"projects/_/buckets/{STACK_BUCKET}/managedFolders/a/", False),
    (BUCKETS, DISK, "projects/p/zones/z/disks/x-tpu-pretrain", False),
    # --- the stacks' VMs ------------------------------------------------------------------
    (INSTANCES, INSTANCE, f"projects/{PROJECT}/zones/europe-west4-a/instances/tp-v3-euw4-ctl",
     True),
    (INSTANCES, INSTANCE, f"projects/{PROJECT}/zones/us-central1-b/instances/tp-t4-usc1-gpu",
     True),
    (INSTANCES, INSTANCE, f"projects/{PROJECT}/zones/us-central1-b/instances/build-vm", False),
    (INSTANCES, INSTANCE, f"projects/{PROJECT}/zones/us-central1-b/instances/xtp-vm", False),
    (INSTANCES, INSTANCE, "projects/other-project/zones/us-central1-b/instances/tp-x", False),
    (INSTANCES, DISK, f"projects/{PROJECT}/zones/us-central1-b/disks/tp-x", False),
    (INSTANCES, "compute.googleapis.com/InstanceTemplate",
     f"projects/{PROJECT}/global/instanceTemplates/tp-x", False),
    # --- the GPU watchdog's one VM (infra/components/recovery.py) ------------------------
    (GPU_VM, INSTANCE, f"projects/{PROJECT}/zones/us-central1-a/instances/tp-t4-usc1-gpu", True),
    (GPU_VM, INSTANCE, f"projects/{PROJECT}/zones/us-central1-a/instances/tp-t4-usc1-gpu2",
     False),
    (GPU_VM, INSTANCE, f"projects/{PROJECT}/zones/us-central1-b/instances/tp-t4-usc1-gpu",
     False),
]  # fmt: skip


@pytest.mark.parametrize(("expression", "resource_type", "name", "expected"), MATRIX)
def test_condition_matrix(expression: str, resource_type: str, name: str, expected: bool) -> None:
    assert evaluate(expression, resource_type, name) is expected


def _bootstrap_expressions() -> dict[str, str]:
    """Every condition expression the bootstrap writes, by binding title."""
    return {
        "stack-instances-only": conditions.stack_instance_condition(PROJECT),
        "stack-buckets-only": conditions.stack_bucket_condition(),
        "only-stack-roles": bootstrap.iam_granter_condition(PROJECT),
    }


@pytest.mark.parametrize("title", sorted(_bootstrap_expressions()))
def test_only_functions_google_documents(title: str) -> None:
    """IAM documents startsWith/endsWith/extract/==/!= for resource.name; matches() is not
    among them (and neither is any other function)."""
    called = functions_called(_bootstrap_expressions()[title])
    assert called <= conditions.DOCUMENTED_FUNCTIONS, sorted(called)


def test_the_function_check_can_fail() -> None:
    assert functions_called("resource.name.matches('^projects/_/buckets/a$')") == {"matches"}


@pytest.mark.parametrize(
    "title", ["stack-instances-only", "stack-buckets-only"]
)  # fmt: skip
def test_every_name_condition_is_scoped_by_resource_type(title: str) -> None:
    expression = _bootstrap_expressions()[title]
    clauses = expression.split(" || (")
    assert all("resource.type == '" in clause for clause in clauses), expression

"""The rule family of stored data: buckets with uniform access, public access prevention
and a way back from a bad write (versioning or soft delete), and KMS keys that rotate."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

try:  # inside the repository (tests): the package "policy"
    from .resources import (
        BUCKET,
        KMS_CRYPTO_KEY,
        Rule,
        get,
        resource_policy,
    )
except ImportError:  # the pack as the Pulumi CLI runs it: policy/ is the working directory
    from resources import (  # type: ignore[no-redef]
        BUCKET,
        KMS_CRYPTO_KEY,
        Rule,
        get,
        resource_policy,
    )

MAX_KMS_ROTATION_SECONDS = 90 * 24 * 3600

# One message per rule; tests and users match on them.
MSG_UNIFORM_ACCESS = "bucket must enable uniform bucket-level access"
MSG_PAP = "bucket must set publicAccessPrevention to 'enforced'"
MSG_BUCKET_RECOVERY = "bucket must keep versioning or a soft-delete retention"
MSG_KMS_ROTATION = "KMS keys must rotate at least every 90 days"


def _check_uniform_access(_t: str, props: Mapping[str, Any], report: Callable[[str], None]) -> None:
    if get(props, "uniformBucketLevelAccess") is not True:
        report(f"{MSG_UNIFORM_ACCESS}: set uniform_bucket_level_access=True")


def _check_pap(_t: str, props: Mapping[str, Any], report: Callable[[str], None]) -> None:
    value = get(props, "publicAccessPrevention")
    if value != "enforced":
        report(f"{MSG_PAP}: got {value!r}")


def _check_bucket_recovery(
    _t: str, props: Mapping[str, Any], report: Callable[[str], None]
) -> None:
    versioned = get(props, "versioning", "enabled") is True
    retention = get(props, "softDeletePolicy", "retentionDurationSeconds")
    # GCS applies a 7-day soft delete when softDeletePolicy is absent; 0 turns it off.
    soft_delete = retention is None or (isinstance(retention, int | float) and retention > 0)
    if not (versioned or soft_delete):
        report(f"{MSG_BUCKET_RECOVERY}: versioning is off and soft delete is disabled")


def _duration_seconds(value: Any) -> float | None:
    if isinstance(value, str) and value.endswith("s"):
        try:
            return float(value[:-1])
        except ValueError:
            return None
    return None


def _check_kms_rotation(_t: str, props: Mapping[str, Any], report: Callable[[str], None]) -> None:
    purpose = get(props, "purpose") or "ENCRYPT_DECRYPT"
    if purpose != "ENCRYPT_DECRYPT":
        return  # only symmetric keys support automatic rotation
    seconds = _duration_seconds(get(props, "rotationPeriod"))
    if seconds is None or seconds > MAX_KMS_ROTATION_SECONDS:
        report(f"{MSG_KMS_ROTATION}: rotationPeriod={get(props, 'rotationPeriod')!r}")


def rules() -> list[Rule]:
    """The storage rules, in the pack's order."""
    return [
        Rule(
            resource_policy(
                "bucket-uniform-access",
                "Buckets use uniform bucket-level access (no object ACLs).",
                (BUCKET,),
                _check_uniform_access,
                cis="5.2",
            ),
            MSG_UNIFORM_ACCESS,
        ),
        Rule(
            resource_policy(
                "bucket-public-access-prevention",
                "Buckets enforce public access prevention.",
                (BUCKET,),
                _check_pap,
                cis="5.1",
            ),
            MSG_PAP,
        ),
        Rule(
            resource_policy(
                "bucket-recoverable",
                "Buckets keep object versioning or a soft-delete window so a bad write can be "
                "undone.",
                (BUCKET,),
                _check_bucket_recovery,
            ),
            MSG_BUCKET_RECOVERY,
        ),
        Rule(
            resource_policy(
                "kms-key-rotation",
                "Symmetric KMS keys rotate at least every 90 days.",
                (KMS_CRYPTO_KEY,),
                _check_kms_rotation,
                cis="1.10",
            ),
            MSG_KMS_ROTATION,
        ),
    ]

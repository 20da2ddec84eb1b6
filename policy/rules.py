"""Guard rails for tpu-pretrain stacks, as Pulumi CrossGuard policies.

Every rule is MANDATORY: a violation fails `pulumi preview` / `pulumi up`. The rules are
derived from the CIS Google Cloud Platform Foundation Benchmark (section numbers of v3.0
in each description) and from this project's design (docs: ARCHITECTURE.md).

Rules read resource properties in the engine's form: camelCase names as in the provider
schema (`uniformBucketLevelAccess`, `networkInterfaces[].accessConfigs`, ...), mappings and
sequences that may be the policy SDK's read-only proxies. Reading a value that is unknown
during a preview raises the SDK's UnknownValueError, which the engine reports as "can't run
policy during preview" (advisory) and then enforces on `pulumi up`, when the value is known.

The pack is a closed world: policy/allowlist.py lists the resource types, APIs, IAM grants
and custom-role permissions each Pulumi project may have, and the first rules (those of
closed_world) refuse anything else. The other rules hold the allowed types to their secure
settings. Firewall sources are judged by the addresses they cover, not by how the ranges are
written.

Importing this module builds policy objects only. The pack itself (which starts a gRPC
server and never returns) is built in policy/__main__.py.

The rules live in one module per family beneath this one. Each family exports its list of
rules, `rules()` (a policy, which names the rule, and the message of its violations); this
module only joins the lists, in this order (no family imports it): closed_world (the
allowlists, grants on the stack's own resources), identities (principals and accounts),
network (ingress, VPC), vms (VM and TPU VM settings, the hop, regions), key_material, storage
(buckets, KMS keys), executables (what a VM runs) and alerting (e-mail channels only); all
read props through resources. Each
imports its siblings in two forms: from the package "policy" (the tests) and as top-level
modules (the pack as the CLI runs it, from policy/).
"""

from __future__ import annotations

from pulumi_policy import ResourceValidationPolicy, StackValidationPolicy

try:  # inside the repository (tests): the package "policy"
    from . import (
        alerting,
        closed_world,
        executables,
        identities,
        key_material,
        network,
        storage,
        vms,
    )
    from .resources import Rule
except ImportError:  # the pack as the Pulumi CLI runs it: policy/ is the working directory
    import alerting  # type: ignore[no-redef]
    import closed_world  # type: ignore[no-redef]
    import executables  # type: ignore[no-redef]
    import identities  # type: ignore[no-redef]
    import key_material  # type: ignore[no-redef]
    import network  # type: ignore[no-redef]
    import storage  # type: ignore[no-redef]
    import vms  # type: ignore[no-redef]
    from resources import Rule  # type: ignore[no-redef]

PACK_NAME = "tpu-pretrain-guardrails"


def build_rules() -> list[Rule]:
    return [
        *closed_world.rules(),
        *identities.rules(),
        *network.rules(),
        *vms.rules(),
        *key_material.rules(),
        *storage.rules(),
        *executables.rules(),
        *alerting.rules(),
    ]


def build_policies() -> list[ResourceValidationPolicy | StackValidationPolicy]:
    return [rule.policy for rule in build_rules()]


# The message every violation of a rule starts with, by rule name.
POLICY_MESSAGES = {rule.policy.name: rule.message for rule in build_rules()}

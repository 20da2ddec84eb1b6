"""Entry point the Pulumi CLI runs for `--policy-pack policy`.

Constructing PolicyPack starts the analyzer's gRPC server and blocks forever, so it happens
here only; tests import `rules` and call each policy's `validate` directly.
"""

from pulumi_policy import EnforcementLevel, PolicyPack
from rules import PACK_NAME, build_policies

PolicyPack(
    name=PACK_NAME,
    policies=build_policies(),
    enforcement_level=EnforcementLevel.MANDATORY,
    description="Guard rails for tpu-pretrain stacks: CIS Google Cloud benchmark and design.",
)

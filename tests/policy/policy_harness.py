"""Runs the policy pack's rules the way the Pulumi engine's analyzer does, without the CLI.

Resource props go through the policy SDK's own `deserialize_properties` and
`unknown_checking_proxy` (what `_PolicyAnalyzerServicer.Analyze` does with the engine's
gRPC request), so rules see the same read-only proxies they see under `pulumi preview`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pulumi_policy import (
    PolicyCustomTimeouts,
    PolicyResource,
    PolicyResourceOptions,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
    StackValidationPolicy,
)
from pulumi_policy.deserialize import deserialize_properties
from pulumi_policy.proxy import unknown_checking_proxy

from policy import rules

POLICIES = rules.build_policies()
POLICY_BY_NAME = {policy.name: policy for policy in POLICIES}


@dataclass(frozen=True)
class Violation:
    policy: str
    message: str
    urn: str | None


def _options() -> PolicyResourceOptions:
    return PolicyResourceOptions(
        protect=False,
        ignore_changes=[],
        delete_before_replace=None,
        aliases=[],
        custom_timeouts=PolicyCustomTimeouts(0, 0, 0),
        additional_secret_outputs=[],
    )


def urn_for(
    resource_type: str, name: str, stack: str = "test", project: str = "tpu-pretrain"
) -> str:
    """A URN as the engine writes it; the pack reads the Pulumi project from it."""
    return f"urn:pulumi:{stack}::{project}::{resource_type}::{name}"


def engine_props(props: Mapping[str, Any]) -> Any:
    return unknown_checking_proxy(deserialize_properties(dict(props)))


def resource_args(
    resource_type: str, props: Mapping[str, Any], name: str = "r", urn: str | None = None
) -> ResourceValidationArgs:
    return ResourceValidationArgs(
        resource_type=resource_type,
        props=engine_props(props),
        urn=urn or urn_for(resource_type, name),
        name=name,
        opts=_options(),
        provider=None,
    )


def stack_args(resources: Iterable[tuple[str, str, Mapping[str, Any], str]]) -> StackValidationArgs:
    """resources: (type, name, props, urn)."""
    return StackValidationArgs(
        resources=[
            PolicyResource(
                resource_type=type_,
                props=engine_props(props),
                urn=urn,
                name=name,
                opts=_options(),
                provider=None,
                parent=None,
                dependencies=[],
                property_dependencies={},
            )
            for type_, name, props, urn in resources
        ]
    )


def check_resource(
    policy: ResourceValidationPolicy, resource_type: str, props: Mapping[str, Any], name: str = "r"
) -> list[str]:
    messages: list[str] = []
    result = policy.validate(
        resource_args(resource_type, props, name),
        lambda message, urn=None: messages.append(message),
    )
    assert result is None, "rules are synchronous"
    return messages


def check_stack(
    policy: StackValidationPolicy, resources: Iterable[tuple[str, str, Mapping[str, Any], str]]
) -> list[str]:
    messages: list[str] = []
    policy.validate(stack_args(resources), lambda message, urn=None: messages.append(message))
    return messages


def run_pack(resources: Iterable[tuple[str, str, Mapping[str, Any], str]]) -> list[Violation]:
    """Every policy of the pack over a whole stack: resource policies on each resource's
    inputs, stack policies once over all of them."""
    resources = list(resources)
    violations: list[Violation] = []
    for policy in POLICIES:
        if isinstance(policy, ResourceValidationPolicy):
            for type_, name, props, urn in resources:

                def report(
                    message: str, _urn: str | None = None, *, at: str = urn, by: str = policy.name
                ) -> None:
                    violations.append(Violation(by, message, at))

                policy.validate(resource_args(type_, props, name, urn), report)
        else:

            def report_stack(
                message: str, urn: str | None = None, *, by: str = policy.name
            ) -> None:
                violations.append(Violation(by, message, urn))

            policy.validate(stack_args(resources), report_stack)
    return violations


DELETE = object()


def mutate(props: Mapping[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A deep copy of props with the dotted path (list indexes allowed) set or deleted."""
    result = copy.deepcopy(dict(props))
    steps = [int(step) if step.isdigit() else step for step in path.split(".")]
    node: Any = result
    for step in steps[:-1]:
        if isinstance(step, str) and step not in node:
            node[step] = {}
        node = node[step]
    if value is DELETE:
        del node[steps[-1]]
    else:
        node[steps[-1]] = value
    return result

"""The bootstrap program (infra/bootstrap) run under Pulumi's mocks, as the CLI runs its entry
point: what it registers and exports (test_bootstrap.py, test_deployability.py,
test_redeploy.py)."""

from __future__ import annotations

import asyncio
import contextvars
import re
import runpy
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pulumi
import yaml
from pulumi.runtime import mocks as pulumi_mocks
from pulumi.runtime import settings as pulumi_settings
from pulumi.runtime.config import set_all_config
from pulumi.runtime.stack import run_pulumi_func
from pulumi.runtime.sync_await import _sync_await

BOOTSTRAP = Path(__file__).resolve().parents[2] / "infra" / "bootstrap"
sys.path.insert(0, str(BOOTSTRAP))
sys.path.insert(0, str(BOOTSTRAP.parents[1] / "tests" / "infra"))
import gitops_bootstrap as bootstrap  # noqa: E402
from iam_cel import evaluate_value  # noqa: E402

PROJECT_NUMBER = "123456789012"


@dataclass(frozen=True)
class Registered:
    type_: str
    name: str
    inputs: dict[str, Any]
    urn: str


@dataclass(frozen=True)
class Run:
    resources: list[Registered]
    exports: dict[str, Any]

    def of_type(self, type_: str) -> list[Registered]:
        return [r for r in self.resources if r.type_ == type_]

    def named(self, name: str) -> Registered:
        [found] = [r for r in self.resources if r.name == name]
        return found

    def accounts_for(self, claims: dict[str, str]) -> set[str]:
        """The CI accounts (account ids) a job with these token claims may impersonate: the
        provider's attribute mapping and condition evaluated with CEL over the claims (a
        refused token gets none), then every workloadIdentityUser principal set whose
        attribute has the mapped value."""
        [provider] = self.of_type(
            "gcp:iam/workloadIdentityPoolProvider:WorkloadIdentityPoolProvider"
        )
        mapped = {
            key: evaluate_value(expression, {"assertion": claims})
            for key, expression in provider.inputs["attributeMapping"].items()
        }
        attributes = {k.removeprefix("attribute."): v for k, v in mapped.items() if "." in k}
        activation = {"assertion": claims, "attribute": attributes}
        if not evaluate_value(provider.inputs["attributeCondition"], activation):
            return set()
        accounts = set()
        for grant in self.of_type("gcp:serviceaccount/iAMMember:IAMMember"):
            if grant.inputs["role"] != "roles/iam.workloadIdentityUser":
                continue
            match = re.search(r"/attribute\.([a-z_]+)/(.+)$", grant.inputs["member"])
            assert match, grant.inputs["member"]
            if attributes.get(match.group(1)) == match.group(2):
                email = grant.inputs["serviceAccountId"].rsplit("/", 1)[-1]
                accounts.add(email.split("@")[0])
        return accounts


class _Mocks(pulumi_mocks.Mocks):
    """Outputs as GCP computes them, for the ones the program reads."""

    def __init__(self, project: str) -> None:
        self.project = project
        self.registered: list[tuple[str, str, dict[str, Any]]] = []

    def new_resource(self, args: pulumi_mocks.MockResourceArgs) -> tuple[str, dict[str, Any]]:
        inputs = dict(args.inputs)
        state = dict(inputs)
        resource_id = f"{args.name}-id"
        if args.typ == "gcp:serviceaccount/account:Account":
            email = f"{inputs['accountId']}@{self.project}.iam.gserviceaccount.com"
            state |= {"email": email, "name": f"projects/{self.project}/serviceAccounts/{email}"}
        elif args.typ == "gcp:iam/workloadIdentityPool:WorkloadIdentityPool":
            pool = inputs["workloadIdentityPoolId"]
            state["name"] = (
                f"projects/{PROJECT_NUMBER}/locations/global/workloadIdentityPools/{pool}"
            )
        elif args.typ == "gcp:iam/workloadIdentityPoolProvider:WorkloadIdentityPoolProvider":
            state["name"] = (
                f"projects/{PROJECT_NUMBER}/locations/global/workloadIdentityPools/"
                f"{inputs['workloadIdentityPoolId']}/providers/"
                f"{inputs['workloadIdentityPoolProviderId']}"
            )
        elif args.typ == "gcp:kms/keyRing:KeyRing":
            resource_id = (
                f"projects/{self.project}/locations/{inputs['location']}/keyRings/{inputs['name']}"
            )
        elif args.typ == "gcp:kms/cryptoKey:CryptoKey":
            resource_id = f"{inputs['keyRing']}/cryptoKeys/{inputs['name']}"
        elif args.typ == "gcp:projects/iAMCustomRole:IAMCustomRole":
            state["name"] = f"projects/{self.project}/roles/{inputs['roleId']}"
        self.registered.append((args.typ, args.name, inputs))
        return resource_id, state

    def call(self, args: pulumi_mocks.MockCallArgs) -> tuple[dict[str, Any], None]:
        return {}, None


def stack_config() -> dict[str, Any]:
    document = yaml.safe_load((BOOTSTRAP / "Pulumi.bootstrap.yaml").read_text())
    return dict(document["config"])


def _run_in_context(config: dict[str, Any]) -> Run:
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        set_all_config({key: str(value) for key, value in config.items()}, [])
        mocks = _Mocks(str(config.get("gcp:project")))
        monitor = pulumi_mocks.MockMonitor(mocks)
        pulumi.runtime.set_mocks(
            mocks, project=bootstrap.PROJECT_NAME, stack="bootstrap", preview=False, monitor=monitor
        )
        # The entry point the CLI runs, not a re-implementation of it.
        entry = str(BOOTSTRAP / "__main__.py")
        _sync_await(run_pulumi_func(lambda: runpy.run_path(entry, run_name="__main__")))
        root = pulumi_settings.get_root_resource()
        exports = {
            key: _sync_await(pulumi.Output.from_input(value).future())
            for key, value in dict(getattr(root, "outputs", {}) or {}).items()
        }
        urns = {urn.split("::")[-1]: urn for urn in monitor.resources}
        resources = [
            Registered(type_, name, inputs, urns[name]) for type_, name, inputs in mocks.registered
        ]
        return Run(resources=resources, exports=exports)
    finally:
        loop.close()


def run_bootstrap(overrides: dict[str, Any] | None = None) -> Run:
    config = stack_config()
    for key, value in (overrides or {}).items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    return contextvars.Context().run(_run_in_context, config)

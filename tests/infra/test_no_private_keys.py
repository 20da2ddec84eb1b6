"""No private key in the Pulumi state: every resource's inputs and outputs and every stack
output of every stack (stacks/*.yaml through tests/infra/harness.py), as a GitOps stack and as
a stack a person deploys, scanned for private keys.

The VPN hop makes its own key on its disk (infra/components/vpn.py), so no stack holds a
server key. A GitOps stack brings its client's public key (tpu-pretrain:vpnClientPublicKey,
infra/config/config.py) and holds no private key at all: the GitOps preview identity decrypts
the state to preview it. A stack a person deploys without that key holds one, its client's,
made from random bytes: only in those bytes' outputs and the secret vpnClientConfig.

What counts as a private key: a PEM private-key block, a WireGuard `PrivateKey =` line with
anything but the own-key placeholder or the hop script's shell variable, and any 32-byte
base64 value that is not one of the run's public keys (the client's; the hop's is not known
to the program at all)."""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from harness import GITOPS, run_offline, stack_names

from infra import wgkeys
from infra.commands import offline
from infra.render import render

RANDOM_BYTES = "random:index/randomBytes:RandomBytes"
_PEM = re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----")
_PRIVATE_LINE = re.compile(r"^\s*PrivateKey\s*=\s*(.+?)\s*$", re.MULTILINE)
_BASE64_32 = re.compile(r"(?<![A-Za-z0-9+/])[A-Za-z0-9+/]{43}=(?![A-Za-z0-9+/=])")


def _strings(value: Any, where: str) -> Iterator[tuple[str, str]]:
    if isinstance(value, str):
        yield where, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(item, f"{where}.{key}")
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from _strings(item, f"{where}[{index}]")


def private_keys(places: dict[str, Any], public: set[str]) -> set[tuple[str, str]]:
    """(where, what) of every private key in `places` (a name -> value map)."""
    found = set()
    for name, place in places.items():
        for where, text in _strings(place, name):
            if _PEM.search(text):
                found.add((where, "PEM private key"))
            for line in _PRIVATE_LINE.finditer(text):
                key = line.group(1)
                # The hop's script writes its own key there at boot (a shell variable).
                if key not in (render.OWN_CLIENT_KEY_PLACEHOLDER, "${private_key}"):
                    found.add((where, f"PrivateKey = {key}"))
            for token in _BASE64_32.findall(text):
                try:
                    if len(base64.b64decode(token, validate=True)) != 32:
                        continue
                except (binascii.Error, ValueError):
                    continue
                if token not in public:
                    found.add((where, token))
    return found


def _places(run: offline.OfflineRun) -> dict[str, Any]:
    places: dict[str, Any] = {"exports": run.exports}
    for r in run.resources:
        places[f"{r.name} inputs"] = r.inputs
        places[f"{r.name} outputs"] = r.outputs
    return places


def _client_public_key(run: offline.OfflineRun, settings: dict[str, object]) -> str:
    configured = settings.get("tpu-pretrain:vpnClientPublicKey")
    if configured:
        return str(configured)
    (seed,) = [r for r in run.resources if r.type_ == RANDOM_BYTES]
    return wgkeys.public_key(wgkeys.private_key(seed.outputs["base64"]))


@pytest.mark.parametrize("stack", stack_names())
def test_a_gitops_stack_holds_no_private_key(stack: str) -> None:
    run = run_offline(stack, GITOPS)
    assert [r.name for r in run.resources if r.type_ == RANDOM_BYTES] == []
    public = {_client_public_key(run, GITOPS)}
    assert private_keys(_places(run), public) == set()
    # The client's public key is in the hop's script (its peer); that is the scan's only key.
    assert "vpnClientConfig" in run.secret_exports


@pytest.mark.parametrize("stack", stack_names())
def test_a_person_s_stack_holds_only_its_client_s_key_where_it_must(stack: str) -> None:
    run = run_offline(stack)
    (seed,) = [r for r in run.resources if r.type_ == RANDOM_BYTES]
    assert seed.name == "vpn-hop-client-key"
    private = wgkeys.private_key(seed.outputs["base64"])
    found = private_keys(_places(run), {_client_public_key(run, {})})
    assert found == {
        ("vpn-hop-client-key outputs.base64", seed.outputs["base64"]),
        ("exports.vpnClientConfig", f"PrivateKey = {private}"),
        ("exports.vpnClientConfig", private),
    }
    assert "vpnClientConfig" in run.secret_exports


def test_the_scan_finds_a_key_where_the_hop_s_used_to_be() -> None:
    """The scan can fail: the previous release's server key, a secret version carrying the
    private key made from random bytes, and a config line or PEM block anywhere."""
    key = wgkeys.private_key(base64.b64encode(bytes(range(32))).decode())
    public = {wgkeys.public_key(key)}
    places = {
        "vpn-hop-server-key-version inputs": {"secretData": key},
        "vm inputs": {"metadata": {"startup-script": f"echo\nPrivateKey = {key}\n"}},
        "object inputs": {"content": "-----BEGIN PRIVATE KEY-----\nMII...\n"},
        "exports": {"vpnServerPublicKey": wgkeys.public_key(key)},
    }
    assert private_keys(places, public) == {
        ("vpn-hop-server-key-version inputs.secretData", key),
        ("vm inputs.metadata.startup-script", f"PrivateKey = {key}"),
        ("vm inputs.metadata.startup-script", key),
        ("object inputs.content", "PEM private key"),
    }
    assert json.dumps(places)  # plain data, as the harness captures it

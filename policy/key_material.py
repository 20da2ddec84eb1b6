"""The rule family "no private key where others read it":

- no-key-material-in-metadata: VM, TPU VM and project metadata and startup scripts carry no
  private key (PEM blocks, WireGuard keys): metadata is readable by every holder of
  compute.instances.get and by every process on the VM.
- no-private-key-in-state: no secret version carries one. A resource's inputs are in the
  Pulumi state, and whoever previews a stack decrypts its secrets (the GitOps preview
  identity among them); a key is made where it is used instead: the VPN hop makes its own
  at its first boot and publishes only the public key (infra/components/vpn.py).

Not judged here: random bytes. A stack a person deploys without vpnClientPublicKey makes its
client's key pair from them, in that person's state; a GitOps stack must set the key, which
the program checks (infra/config/config.py), since the pack sees no stack setting."""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable, Mapping
from typing import Any

try:  # inside the repository (tests): the package "policy"
    from .resources import (
        PROJECT_METADATA,
        PROJECT_METADATA_ITEM,
        SECRET_VERSION,
        TPU_TYPES,
        VM_TYPES,
        Rule,
        get,
        resource_policy,
        vm_metadata,
    )
except ImportError:  # the pack as the Pulumi CLI runs it: policy/ is the working directory
    from resources import (  # type: ignore[no-redef]
        PROJECT_METADATA,
        PROJECT_METADATA_ITEM,
        SECRET_VERSION,
        TPU_TYPES,
        VM_TYPES,
        Rule,
        get,
        resource_policy,
        vm_metadata,
    )

# One message per rule; tests and users match on them.
MSG_KEY_MATERIAL = "key material in metadata"
MSG_KEY_IN_STATE = "private key in the Pulumi state"
# Where a key comes from instead (both rules say so).
_MAKE_IT_WHERE_USED = (
    "make the key where it is used and publish only its public half, as the VPN hop does "
    "(infra/components/vpn.py)"
)

_PEM_PRIVATE = re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----")
# A literal value after "PrivateKey =" (a WireGuard config with the key inline). A shell or
# template variable there (`PrivateKey = ${private_key}`) is a key the VM read at boot from
# its own disk, which is the design.
_WG_PRIVATE_LINE = re.compile(r"^\s*PrivateKey\s*=\s*(?![$%{<\s])\S", re.MULTILINE | re.IGNORECASE)
_BASE64_32 = re.compile(r"(?<![A-Za-z0-9+/])[A-Za-z0-9+/]{43}=(?![A-Za-z0-9+/=])")
# A WireGuard public key has the same shape as a private one. A key is taken as public only
# when it is the value of a public-key field: the text right before it on its line ends in
# "PublicKey =", "..._PUBLIC_KEY=", "pubkey:" or "peer " (`wg set wg0 peer <key>`). The word
# "public" or "peer" elsewhere on the line proves nothing.
_PUBLIC_FIELD = re.compile(r"(public[ _-]?key|pubkey|\bpeer)[\s\"']*[=:]?[\s\"']*$", re.IGNORECASE)


def find_key_material(text: str) -> list[str]:
    """Reasons why `text` looks like it carries private key material."""
    reasons = []
    if _PEM_PRIVATE.search(text):
        reasons.append("PEM private key block")
    if _WG_PRIVATE_LINE.search(text):
        reasons.append("WireGuard 'PrivateKey =' line with a literal key")
    for line in text.splitlines():
        for match in _BASE64_32.finditer(line):
            if _PUBLIC_FIELD.search(line[: match.start()]):
                continue  # the value of a public-key field: fine to publish
            try:
                decoded = base64.b64decode(match.group(0), validate=True)
            except (binascii.Error, ValueError):
                continue
            if len(decoded) == 32:
                reasons.append("base64 32-byte key (WireGuard private key shape)")
                break
    return reasons


def _check_key_material(
    resource_type: str, props: Mapping[str, Any], report: Callable[[str], None]
) -> None:
    texts: dict[str, Any] = {}
    if resource_type == PROJECT_METADATA_ITEM:
        texts[str(get(props, "key"))] = get(props, "value")
    elif resource_type == PROJECT_METADATA:
        texts.update(dict(get(props, "metadata") or {}))
    else:
        texts.update(dict(vm_metadata(props)))
        texts["metadataStartupScript"] = get(props, "metadataStartupScript")
    for key, value in texts.items():
        if not isinstance(value, str):
            continue
        key_lower = key.lower()
        if "private" in key_lower and "key" in key_lower and value.strip():
            report(f"{MSG_KEY_MATERIAL}: metadata key {key!r} names a private key")
        for reason in find_key_material(value):
            report(f"{MSG_KEY_MATERIAL}: {reason} in {key!r}; {_MAKE_IT_WHERE_USED}")


def _check_key_in_state(
    _resource_type: str, props: Mapping[str, Any], report: Callable[[str], None]
) -> None:
    data = get(props, "secretData")
    if not isinstance(data, str):  # unknown during a preview, or another kind of payload
        return
    for reason in find_key_material(data):
        report(
            f"{MSG_KEY_IN_STATE}: {reason} in a secret version's secretData, which the state "
            f"keeps and whoever previews the stack decrypts; {_MAKE_IT_WHERE_USED}"
        )


def rules() -> list[Rule]:
    return [
        Rule(
            resource_policy(
                "no-key-material-in-metadata",
                "Metadata and startup scripts carry no private keys (PEM blocks, WireGuard "
                "keys); a key is made where it is used.",
                (*VM_TYPES, *TPU_TYPES, PROJECT_METADATA, PROJECT_METADATA_ITEM),
                _check_key_material,
            ),
            MSG_KEY_MATERIAL,
        ),
        Rule(
            resource_policy(
                "no-private-key-in-state",
                "No secret version carries a private key (PEM blocks, WireGuard keys): the "
                "Pulumi state keeps every input, and previews decrypt it.",
                (SECRET_VERSION,),
                _check_key_in_state,
            ),
            MSG_KEY_IN_STATE,
        ),
    ]

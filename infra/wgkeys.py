"""WireGuard keys from Pulumi-managed random bytes (stable across updates).

Pure: only `cryptography`. A WireGuard private key is a clamped Curve25519 scalar; the public
key is its X25519 public key; both travel as base64."""

from __future__ import annotations

import base64

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat


def clamp(raw: bytes) -> bytes:
    if len(raw) != 32:
        raise ValueError(f"a WireGuard key has 32 bytes, got {len(raw)}")
    key = bytearray(raw)
    key[0] &= 248
    key[31] &= 127
    key[31] |= 64
    return bytes(key)


def private_key(random_b64: str) -> str:
    """The clamped private key (base64) made from 32 random bytes (base64)."""
    return base64.b64encode(clamp(base64.b64decode(random_b64))).decode("ascii")


def public_key(private_b64: str) -> str:
    key = X25519PrivateKey.from_private_bytes(base64.b64decode(private_b64))
    raw = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return base64.b64encode(raw).decode("ascii")

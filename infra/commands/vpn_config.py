"""The VPN client's configuration, complete: `make vpn-config STACK=<stack> [KEY=<file>]`.

    python -m infra.commands.vpn_config --stack v6e-euw4 [--out FILE] [--private-key FILE]
                                        [--wait-min 10]

The hop makes its WireGuard key pair at its first boot and publishes only the public key, as
a guest attribute of its VM (infra/render/templates/vpn-hop.sh): no private key of the hop
is in the Pulumi state, so the stack's `vpnClientConfig` output carries a placeholder for
the hop's key (infra/render/render.py SERVER_KEY_PLACEHOLDER). This reads the stack's
outputs (`pulumi stack output --json --show-secrets`: the client configuration, and
`vpnServerKey`, where the hop publishes its key), reads the key with `gcloud compute
instances get-guest-attributes`, checks that it is a WireGuard key, puts it in and writes the
configuration with mode 600 (default build/vpn/<stack>/tpu-pretrain.conf; `sudo wg-quick up`
it). Until the hop has booted the attribute is not there: it is read again every 15 s for
--wait-min minutes.

With your own client key (tpu-pretrain:vpnClientPublicKey, which a GitOps stack must set),
the configuration's PrivateKey line is a placeholder: --private-key names your private key's
file, which is read here and checked against the stack's vpnClientPublicKey (it never leaves
this machine). Exit 0 when the file is written, 2 with one line when it cannot be.

Every external command goes through `VpnConfig.run` (pulumi, gcloud); the offline test puts
stub executables first on PATH and injects the clock (tests/infra/test_vpn_config.py)."""

from __future__ import annotations

import argparse
import base64
import binascii
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from infra import wgkeys
from infra.render import render

REPO_ROOT = Path(__file__).resolve().parents[2]
OUT_DIR = REPO_ROOT / "build" / "vpn"
# wg-quick names the interface after the file (at most 15 characters).
CONF_NAME = "tpu-pretrain.conf"
POLL_SECONDS = 15
CLIENT_KEY_SETTING = "tpu-pretrain:vpnClientPublicKey"
# What gcloud says while the hop has not published its key yet (the attribute is missing).
NOT_YET = ("NOT_FOUND", "not found", "404")


class VpnConfigError(Exception):
    """The configuration cannot be written; the message is the one line the user reads."""


def wireguard_key(value: str) -> bool:
    """44 base64 characters that decode to 32 bytes (a WireGuard key, public or private)."""
    try:
        return len(base64.b64decode(value, validate=True)) == 32
    except (binascii.Error, ValueError):
        return False


def fill_in(config: str, *, server_public_key: str, client_private_key: str | None) -> str:
    """The stack's client configuration with the hop's key, and the client's own private key
    where the configuration has its placeholder."""
    server_line = f"PublicKey = {render.SERVER_KEY_PLACEHOLDER}\n"
    if config.count(server_line) != 1:
        raise VpnConfigError(
            "the stack's vpnClientConfig has no placeholder for the hop's key: it is not the "
            "output of this release's program (run `pulumi up` first)"
        )
    config = config.replace(server_line, f"PublicKey = {server_public_key}\n")
    own_line = f"PrivateKey = {render.OWN_CLIENT_KEY_PLACEHOLDER}\n"
    if client_private_key is not None:
        if own_line not in config:
            raise VpnConfigError(
                "--private-key: this stack generated the client's key (no "
                f"{CLIENT_KEY_SETTING}); its configuration already holds it, leave the flag out"
            )
        config = config.replace(own_line, f"PrivateKey = {client_private_key}\n")
    return config


class VpnConfig:
    def __init__(
        self,
        stack: str,
        *,
        out: Path | None = None,
        private_key_file: Path | None = None,
        wait_s: float = 600,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        say: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
    ) -> None:
        self.stack = stack
        self.out = out or OUT_DIR / stack / CONF_NAME
        self.private_key_file = private_key_file
        self.wait_s, self.clock, self.sleep, self.say = wait_s, clock, sleep, say

    def run(self, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(
                list(argv), capture_output=True, text=True, timeout=120, check=False
            )
        except FileNotFoundError:
            raise VpnConfigError(f"{argv[0]} is not installed or not on PATH") from None
        except subprocess.TimeoutExpired:
            raise VpnConfigError(f"`{' '.join(argv)}` did not finish in 120 s") from None

    def outputs(self) -> dict[str, object]:
        result = self.run(["pulumi", "stack", "output", "--json", "--show-secrets",
                           "--stack", self.stack])  # fmt: skip
        if result.returncode != 0:
            raise VpnConfigError(
                f"`pulumi stack output` of stack {self.stack} failed: {_last_line(result)}"
            )
        try:
            outputs = json.loads(result.stdout or "{}")
        except ValueError:
            raise VpnConfigError("`pulumi stack output --json` printed no JSON") from None
        for key in ("vpnClientConfig", "vpnServerKey"):
            if key not in outputs:
                raise VpnConfigError(
                    f"stack {self.stack} has no output {key}: run `pulumi up` of this release first"
                )
        return dict(outputs)

    def client_private_key(self) -> str | None:
        """The user's own private key (--private-key), checked against the stack's
        vpnClientPublicKey."""
        if self.private_key_file is None:
            return None
        try:
            private = self.private_key_file.read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError) as error:
            raise VpnConfigError(f"--private-key {self.private_key_file}: {error}") from None
        if not wireguard_key(private):
            raise VpnConfigError(
                f"--private-key {self.private_key_file}: not a WireGuard private key (44 "
                "base64 characters, the output of `wg genkey`)"
            )
        result = self.run(["pulumi", "config", "get", CLIENT_KEY_SETTING, "--stack", self.stack])
        configured = result.stdout.strip() if result.returncode == 0 else ""
        public = wgkeys.public_key(private)
        if configured != public:
            raise VpnConfigError(
                f"--private-key {self.private_key_file}: its public key is {public}, but the "
                f"stack's {CLIENT_KEY_SETTING} is {configured or 'not set'}; use the private "
                "key of that public key"
            )
        return private

    def server_public_key(self, where: dict[str, str]) -> str:
        """The hop's public key, read from its guest attribute; waits for its first boot."""
        argv = [
            "gcloud", "compute", "instances", "get-guest-attributes", where["instance"],
            "--zone", where["zone"], "--project", where["project"],
            f"--query-path={where['guestAttribute']}", "--format=value(value)",
        ]  # fmt: skip
        deadline = self.clock() + self.wait_s
        while True:
            result = self.run(argv)
            value = result.stdout.strip()
            if result.returncode == 0 and value:
                if not wireguard_key(value):
                    raise VpnConfigError(
                        f"the guest attribute {where['guestAttribute']} of {where['instance']} "
                        f"is not a WireGuard public key: {value!r}"
                    )
                return value
            error = _last_line(result)
            if result.returncode != 0 and not any(word in error for word in NOT_YET):
                raise VpnConfigError(f"reading the hop's key failed: {error}")
            if self.clock() >= deadline:
                raise VpnConfigError(
                    f"the hop {where['instance']} has not published its key (the guest "
                    f"attribute {where['guestAttribute']}) after {self.wait_s / 60:.0f} min: "
                    "it does at the end of its startup script; its log: ssh to it "
                    "(`pulumi stack output sshCommands`, vpnHop) and run "
                    "`sudo journalctl -t tpu-pretrain`"
                )
            self.say(f"vpn-config: waiting for the hop {where['instance']} to publish its key")
            self.sleep(POLL_SECONDS)

    def write(self) -> Path:
        outputs = self.outputs()
        private = self.client_private_key()
        where = outputs["vpnServerKey"]
        if not isinstance(where, dict) or not all(
            isinstance(where.get(k), str) for k in ("instance", "zone", "project", "guestAttribute")
        ):
            raise VpnConfigError(f"stack {self.stack}: vpnServerKey is not this release's output")
        public = self.server_public_key(where)
        config = fill_in(
            str(outputs["vpnClientConfig"]), server_public_key=public, client_private_key=private
        )
        # Made with mode 600 and renamed over the old file: an existing file's mode (which
        # opening it would keep) never applies to a private key.
        self.out.parent.mkdir(parents=True, exist_ok=True)
        partial = self.out.with_name(f".{self.out.name}.partial")
        partial.unlink(missing_ok=True)
        descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w", encoding="ascii") as handle:
            handle.write(config)
        partial.replace(self.out)
        self.say(f"vpn-config: wrote {self.out} (the hop's public key {public})")
        if f"PrivateKey = {render.OWN_CLIENT_KEY_PLACEHOLDER}\n" in config:
            self.say(
                "vpn-config: its PrivateKey line is a placeholder: run again with --private-key "
                f"<file> (make vpn-config ... KEY=<file>), your key of {CLIENT_KEY_SETTING}"
            )
        else:
            self.say(f"vpn-config: connect with `sudo wg-quick up {self.out}`")
        return self.out


def _last_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = (result.stderr or result.stdout or "").strip().splitlines()
    return lines[-1] if lines else f"exit status {result.returncode}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m infra.commands.vpn_config", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--stack", required=True)
    parser.add_argument("--out", type=Path, help=f"default: build/vpn/<stack>/{CONF_NAME}")
    parser.add_argument(
        "--private-key",
        type=Path,
        help=f"your WireGuard private key's file (the key of {CLIENT_KEY_SETTING})",
    )
    parser.add_argument("--wait-min", type=float, default=10.0)
    args = parser.parse_args(argv)
    try:
        VpnConfig(
            args.stack,
            out=args.out,
            private_key_file=args.private_key,
            wait_s=args.wait_min * 60,
        ).write()
    except VpnConfigError as error:
        print(f"vpn-config: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

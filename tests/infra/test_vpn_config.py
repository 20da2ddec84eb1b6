"""`make vpn-config` offline: infra/commands/vpn_config.py drives stub `pulumi` and `gcloud`
executables (first on PATH). What they answer comes from the real producers: the stack's
outputs are the program's exports under Pulumi's mocks, and the hop's guest attribute is what
the rendered hop script publishes when it runs in the script sandbox, which the injected
`sleep` does at the first wait (the hop's first boot)."""

from __future__ import annotations

import base64
import json
import os
import stat
import sys
from pathlib import Path

import pytest
from gcloud_flags import problems
from harness import run_offline, startup_script
from script_sandbox import Sandbox

from infra import wgkeys
from infra.commands import vpn_config
from infra.render import render

HOP_KEY = "etc/wireguard/tpu-pretrain-server.key"

GCLOUD = r"""
import json, os, sys
from pathlib import Path
state = Path(os.environ["VPN_STATE"])
argv = sys.argv[1:]
with (state / "calls.log").open("a") as log:
    log.write(json.dumps(["gcloud", *argv]) + "\n")
scenario = json.loads((state / "scenario.json").read_text())
def fail(message):
    print(f"ERROR: (gcloud.compute.instances.get-guest-attributes) {message}", file=sys.stderr)
    sys.exit(1)
if argv[:3] != ["compute", "instances", "get-guest-attributes"]:
    fail(f"unexpected: gcloud {argv}")
if scenario.get("denied"):
    fail("PERMISSION_DENIED: Required 'compute.instances.getGuestAttributes' permission")
[path] = [a.split("=", 1)[1] for a in argv if a.startswith("--query-path=")]
published = Path(os.environ["VPN_GUEST_ATTRIBUTES"]) / path
if not published.exists():
    fail(f"NOT_FOUND: The guest attribute {path} was not found")
print(published.read_text())
"""
PULUMI = r"""
import json, os, sys
from pathlib import Path
state = Path(os.environ["VPN_STATE"])
argv = sys.argv[1:]
with (state / "calls.log").open("a") as log:
    log.write(json.dumps(["pulumi", *argv]) + "\n")
if argv[:2] == ["stack", "output"]:
    print((state / "outputs.json").read_text())
elif argv[:2] == ["config", "get"]:
    config = json.loads((state / "config.json").read_text())
    if argv[2] not in config:
        print(f"error: configuration key '{argv[2]}' not found for stack", file=sys.stderr)
        sys.exit(255)
    print(config[argv[2]])
else:
    print(f"unexpected: pulumi {argv}", file=sys.stderr)
    sys.exit(3)
"""


class World:
    """The stubs, the stack's outputs and the hop's boot (on the first wait)."""

    def __init__(self, tmp_path: Path, box: Sandbox, monkeypatch, run, **scenario) -> None:
        self.box, self.run = box, run
        self.state = tmp_path / "vpn-state"
        bin_dir = tmp_path / "vpn-bin"
        for directory in (self.state, bin_dir):
            directory.mkdir()
        for name, body in (("gcloud", GCLOUD), ("pulumi", PULUMI)):
            path = bin_dir / name
            path.write_text(f"#!{sys.executable}\n{body}")
            path.chmod(0o755)
        (self.state / "scenario.json").write_text(json.dumps(scenario))
        (self.state / "outputs.json").write_text(json.dumps(run.exports))
        (self.state / "config.json").write_text(json.dumps(scenario.get("config", {})))
        monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
        monkeypatch.setenv("VPN_STATE", str(self.state))
        monkeypatch.setenv("VPN_GUEST_ATTRIBUTES", str(box.state / "guest-attributes"))
        self.now = 0.0
        self.sleeps: list[float] = []
        self.boots = scenario.get("boots", True)
        self.lines: list[str] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        """The hop boots while the command waits: its real script runs in the sandbox."""
        if self.boots and not self.sleeps:
            result = self.box.run(startup_script(self.run, "vpn-hop-vm"))
            assert result.returncode == 0, result.stderr
        self.sleeps.append(seconds)
        self.now += seconds

    def command(self, out: Path, **kwargs) -> vpn_config.VpnConfig:
        return vpn_config.VpnConfig(
            self.run.stack, out=out, clock=self.clock, sleep=self.sleep,
            say=self.lines.append, **kwargs,
        )  # fmt: skip

    @property
    def calls(self) -> list[list[str]]:
        path = self.state / "calls.log"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def hop_public_key(self) -> str:
        return wgkeys.public_key((self.box.root / HOP_KEY).read_text().strip())


def test_the_hop_s_published_key_goes_into_the_generated_client_s_config(
    tmp_path, sandbox, monkeypatch
):
    run = run_offline("v6e-euw4")
    world = World(tmp_path, sandbox, monkeypatch, run)
    out = tmp_path / "conf" / "tpu-pretrain.conf"
    out.parent.mkdir()
    out.write_text("an older configuration\n")
    out.chmod(0o644)  # an older file's mode does not carry over to the private key
    assert world.command(out).write() == out
    # Not there before the hop's first boot: read again after one wait, then found.
    assert world.sleeps == [vpn_config.POLL_SECONDS]
    config = out.read_text()
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    # The stack's configuration, with the key the hop made for itself as the peer's key.
    public = world.hop_public_key()
    assert config == run.exports["vpnClientConfig"].replace(render.SERVER_KEY_PLACEHOLDER, public)
    assert f"PublicKey = {public}\n" in config
    assert render.SERVER_KEY_PLACEHOLDER not in config
    assert world.lines[-1] == f"vpn-config: connect with `sudo wg-quick up {out}`"
    reads = [c for c in world.calls if c[:1] == ["gcloud"]]
    assert len(reads) == 2 and problems(reads[0]) == []
    hop = run.exports["vpnServerKey"]
    assert reads[0][4:] == [
        hop["instance"], "--zone", hop["zone"], "--project", hop["project"],
        f"--query-path={render.WG_PUBLIC_KEY_ATTRIBUTE}", "--format=value(value)",
    ]  # fmt: skip


def test_your_own_private_key_is_filled_in_and_checked_against_the_stack(
    tmp_path, sandbox, monkeypatch
):
    private = wgkeys.private_key(base64.b64encode(os.urandom(32)).decode())
    public = wgkeys.public_key(private)
    key_file = tmp_path / "client.key"
    key_file.write_text(private + "\n")
    setting = {"tpu-pretrain:vpnClientPublicKey": public}
    run = run_offline("t4-usc1", setting)
    world = World(tmp_path, sandbox, monkeypatch, run, config=setting)
    out = tmp_path / "own.conf"
    world.command(out, private_key_file=key_file).write()
    config = out.read_text()
    assert f"PrivateKey = {private}\n" in config
    assert f"PublicKey = {world.hop_public_key()}\n" in config
    assert render.OWN_CLIENT_KEY_PLACEHOLDER not in config

    # Without the file: written, and it says the PrivateKey line is yours to fill.
    world.command(tmp_path / "placeholder.conf").write()
    assert render.OWN_CLIENT_KEY_PLACEHOLDER in (tmp_path / "placeholder.conf").read_text()
    assert "its PrivateKey line is a placeholder" in world.lines[-1]

    # Another key than the stack's: refused, nothing written.
    other = tmp_path / "other.key"
    other.write_text(wgkeys.private_key(base64.b64encode(bytes(32)).decode()))
    with pytest.raises(vpn_config.VpnConfigError) as error:
        world.command(tmp_path / "other.conf", private_key_file=other).write()
    assert str(error.value) == (
        f"--private-key {other}: its public key is {wgkeys.public_key(other.read_text())}, "
        f"but the stack's tpu-pretrain:vpnClientPublicKey is {public}; use the private key "
        "of that public key"
    )
    assert not (tmp_path / "other.conf").exists()


def _error(world: World, tmp_path: Path, **kwargs) -> str:
    with pytest.raises(vpn_config.VpnConfigError) as error:
        world.command(tmp_path / "never.conf", **kwargs).write()
    assert not (tmp_path / "never.conf").exists()
    message = str(error.value)
    assert "\n" not in message
    return message


def test_a_hop_that_never_publishes_stops_after_the_wait(tmp_path, sandbox, monkeypatch):
    run = run_offline("v6e-euw4")
    world = World(tmp_path, sandbox, monkeypatch, run, boots=False)
    message = _error(world, tmp_path, wait_s=60)
    assert message.startswith(
        f"the hop {run.exports['vpnServerKey']['instance']} has not published its key (the "
        f"guest attribute {render.WG_PUBLIC_KEY_ATTRIBUTE}) after 1 min"
    )
    assert world.sleeps == [vpn_config.POLL_SECONDS] * 4


def test_a_refused_read_stops_at_once(tmp_path, sandbox, monkeypatch):
    world = World(tmp_path, sandbox, monkeypatch, run_offline("v6e-euw4"), denied=True)
    assert _error(world, tmp_path) == (
        "reading the hop's key failed: ERROR: (gcloud.compute.instances.get-guest-attributes) "
        "PERMISSION_DENIED: Required 'compute.instances.getGuestAttributes' permission"
    )
    assert world.sleeps == []


def test_an_attribute_that_is_not_a_key_is_refused(tmp_path, sandbox, monkeypatch):
    world = World(tmp_path, sandbox, monkeypatch, run_offline("v6e-euw4"), boots=False)
    attribute = sandbox.state / "guest-attributes" / render.WG_PUBLIC_KEY_ATTRIBUTE
    attribute.parent.mkdir(parents=True)
    attribute.write_text("not-a-key")
    assert _error(world, tmp_path).endswith("is not a WireGuard public key: 'not-a-key'")


def test_a_stack_of_an_older_release_is_named(tmp_path, sandbox, monkeypatch):
    run = run_offline("v6e-euw4")
    del run.exports["vpnServerKey"]
    world = World(tmp_path, sandbox, monkeypatch, run)
    assert _error(world, tmp_path) == (
        "stack v6e-euw4 has no output vpnServerKey: run `pulumi up` of this release first"
    )


def test_main_prints_one_line_and_exits_2(tmp_path, sandbox, monkeypatch, capsys):
    World(tmp_path, sandbox, monkeypatch, run_offline("v6e-euw4"), denied=True)
    code = vpn_config.main(["--stack", "v6e-euw4", "--out", str(tmp_path / "x.conf")])
    assert code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("vpn-config: reading the hop's key failed: ")

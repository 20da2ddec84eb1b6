"""Every gcloud command the project prints (stack outputs, the offline plan, the README and
docs/) or
runs (the TPU watchdog) uses only flags that its gcloud release track defines."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from gcloud_flags import problems
from harness import gpu_stack_names, run_offline, stack_names

from infra.commands import plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from docs_files import doc_text


def _printed(value: object) -> list[str]:
    if isinstance(value, dict):
        return [command for item in value.values() for command in _printed(item)]
    if isinstance(value, str) and value.startswith("gcloud "):
        return [value]
    return []


def test_the_recorded_flags_tell_the_tracks_apart():
    """The checker is live: IAP tunneling for TPU VMs is alpha only, --preemptible is not a
    queued-resources flag, and an unrecorded command is refused."""
    tpu_ssh = "gcloud compute tpus tpu-vm ssh t --zone z --project p"
    assert problems(f"{tpu_ssh} --tunnel-through-iap") == [
        "gcloud compute tpus tpu-vm ssh: --tunnel-through-iap is not a GA flag"
    ]
    assert problems(f"gcloud alpha {tpu_ssh.removeprefix('gcloud ')} --tunnel-through-iap") == []
    assert problems(f"{tpu_ssh} --internal-ip") == []
    assert problems("gcloud compute ssh vm --zone z --tunnel-through-iap") == []
    assert problems("gcloud compute tpus queued-resources create q --node-id t --spot") == []
    assert problems("gcloud compute tpus queued-resources create q --preemptible") == [
        "gcloud compute tpus queued-resources create: --preemptible is not a GA flag"
    ]
    assert problems("gcloud compute tpus tpu-vm create t --preemptible --zone=z") == []
    assert problems("gcloud compute instances list") == [
        "gcloud compute instances list: not in gcloud_flags.yaml"
    ]
    assert problems("gcloud beta compute tpus tpu-vm ssh t") == [
        "gcloud compute tpus tpu-vm ssh has no BETA release track"
    ]


@pytest.mark.parametrize("stack", stack_names())
def test_printed_stack_outputs_work_as_printed(stack):
    exports = run_offline(stack).exports
    commands = [c for key in sorted(exports) for c in _printed(exports[key])]
    # ssh to three VMs (the TPU VM two ways), two re-runs, the TPU state check.
    assert len(commands) >= 7, commands
    assert [c for c in commands if problems(c)] == [], [problems(c) for c in commands]
    ssh = exports["sshCommands"]
    if stack in gpu_stack_names():
        # A GPU VM: GA `compute ssh` both ways (the quota check is among the commands).
        assert ssh["gpu"].endswith(" --tunnel-through-iap")
        assert ssh["gpuOverVpn"].endswith(" --internal-ip")
        assert exports["gpuQuota"]["check"] in commands
        assert exports["gpuQuota"]["checkProject"] in commands
        return
    assert ssh["tpu"].startswith("gcloud alpha compute tpus tpu-vm ssh ")
    assert ssh["tpu"].endswith(" --tunnel-through-iap")
    assert ssh["tpuOverVpn"].startswith("gcloud compute tpus tpu-vm ssh ")
    assert ssh["tpuOverVpn"].endswith(" --internal-ip")


def test_the_offline_plan_prints_only_valid_commands(capsys):
    assert plan.main(["--stack", "v6e-euw4"]) == 0
    out = capsys.readouterr().out
    outputs = out.split("\nOutputs:\n", 1)[1].split("\n====", 1)[0]
    commands = re.findall(r'"(gcloud [^"]+)"', outputs)
    assert len(commands) >= 7
    assert [problems(c) for c in commands if problems(c)] == []


def _doc_commands() -> list[str]:
    """Commands in the README and docs/*.md: fenced, indented and inline code."""
    text = doc_text()
    lines = []
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, re.DOTALL | re.MULTILINE):
        lines += block.splitlines()
    prose = re.sub(r"^```[a-z]*\n.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
    lines += [line for line in prose.splitlines() if line.startswith("    ")]  # indented code
    commands = re.findall(r"`(gcloud [^`]+)`", prose)  # inline code
    for line in lines:
        start = line.find("gcloud ")
        if start >= 0 and not line.lstrip().startswith("#"):
            commands.append(re.split(r" (?:>|\||&&) ", line[start:], maxsplit=1)[0])
    return commands


def test_documented_commands_work_as_printed():
    commands = _doc_commands()
    assert len(commands) >= 5
    assert [problems(c) for c in commands if problems(c)] == []

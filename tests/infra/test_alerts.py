"""Alerts from the same `pulumi up` (infra/components/alerts.py): with tpu-pretrain:alertEmails,
an e-mail channel per address and a log-match policy per event of the run; without, nothing.

Each policy's filter is matched (logging_filter.py, the query language's field equalities)
against the entry its real writers produce: the payload's `emit` for the trainer's events and
the scripts' `emit_event` (common.sh, run in bash with a recording gcloud on PATH) for the
watchdog's, the loader's and the trainer unit's, each with the constants of the very script the
program renders for that source and the bucket the program registers."""

from __future__ import annotations

import base64
import json
import os
import shlex
import subprocess
from pathlib import Path
from typing import Any

import logging_filter
import pytest
from harness import by_name, config_error, depends_on, run_offline, stack_names, startup_script

from infra.components import alerts
from infra.config import keys
from infra.errors import ConfigError
from payload.core import events

ROOT = Path(__file__).resolve().parents[2]
COMMON = ROOT / "infra" / "render" / "templates" / "common.sh"
K = "tpu-pretrain:"
CHANNEL = "gcp:monitoring/notificationChannel:NotificationChannel"
POLICY = "gcp:monitoring/alertPolicy:AlertPolicy"
EMAILS = ["ops@example.com", "Researcher.Name+tpu@example.org"]
# A TPU stack and a GPU stack, each with its watchdog on (spot).
STACKS = ("v6e-euw4", "t4-usc1")


def _run(stack: str) -> Any:
    return run_offline(stack, {K + "alertEmails": EMAILS})


def _of(run: Any, type_: str) -> list[Any]:
    return [r for r in run.resources if r.type_ == type_]


def _project(run: Any) -> str:
    return by_name(run, "alerts-preempted").inputs["project"]


def _bucket(run: Any) -> str:
    [bucket] = _of(run, "gcp:storage/bucket:Bucket")
    return bucket.inputs["name"]


# --- one table -------------------------------------------------------------------------------
def test_the_alerts_are_the_payloads_events():
    """infra keeps a copy (it never imports the payload): names in order, severities,
    meanings, and the entry's contract (schema, log, matched fields) are the payload's."""
    assert [(a.event, a.severity, a.means) for a in alerts.ALERTS] == [
        (e.name, e.severity, e.when) for e in events.EVENTS.values()
    ]
    assert (alerts.SCHEMA, alerts.LOG_ID, alerts.MATCHED_FIELDS) == (
        events.SCHEMA,
        events.LOG_ID,
        events.MATCHED_FIELDS,
    )
    assert alerts.log_name("p") == events.log_name("p")
    assert set(alerts.POLICY_SEVERITY) == set(events.SEVERITIES) - {"INFO"}


# --- the resources ---------------------------------------------------------------------------
@pytest.mark.parametrize("stack", STACKS)
def test_a_channel_per_address_and_a_policy_per_event(stack):
    run = _run(stack)
    project, bucket = _project(run), _bucket(run)
    # The mocks register resources as their inputs resolve, in no fixed order: take them in
    # the program's order (the addresses', the events') by what they are.
    channels = sorted(
        _of(run, CHANNEL), key=lambda c: EMAILS.index(c.inputs["labels"]["email_address"])
    )
    assert [c.inputs for c in channels] == [
        {
            "project": project,
            "type": "email",
            "displayName": f"tpu-pretrain {stack}: {address}",
            "labels": {"email_address": address},
            "userLabels": {"app": "tpu-pretrain", "stack": stack},
        }
        for address in EMAILS
    ]
    channel_names = [c.outputs["name"] for c in channels]
    assert all(n.startswith(f"projects/{project}/notificationChannels/") for n in channel_names)
    policies = _of(run, POLICY)
    assert sorted(p.name for p in policies) == sorted(f"alerts-{e}" for e in events.EVENTS)
    policies = [by_name(run, f"alerts-{e}") for e in events.EVENTS]
    for policy, event in zip(policies, events.EVENTS.values(), strict=True):
        inputs = policy.inputs
        [condition] = inputs["conditions"]
        assert condition["conditionMatchedLog"] == {
            "filter": (
                f'logName="projects/{project}/logs/tpu-pretrain-events" AND '
                f'jsonPayload.schema="tpu-pretrain.event/1" AND '
                f'jsonPayload.bucket="{bucket}" AND jsonPayload.event="{event.name}"'
            ),
            "labelExtractors": {
                "job": "EXTRACT(jsonPayload.job)",
                "host": "EXTRACT(jsonPayload.host)",
                "message": "EXTRACT(jsonPayload.message)",
            },
        }
        assert condition["displayName"] == f"a {event.name} event of the run in {bucket}"
        assert inputs["combiner"] == "OR"
        assert inputs["project"] == project
        assert inputs["displayName"] == f"tpu-pretrain {stack}: {event.name}"
        # Google requires the rate limit on a log-match policy; 5 minutes is its floor.
        assert inputs["alertStrategy"] == {
            "notificationRateLimit": {"period": "300s"},
            "autoClose": "1800s",
        }
        assert inputs["notificationChannels"] == channel_names
        assert inputs["severity"] == {"ERROR": "ERROR"}.get(event.severity, "WARNING")
        assert inputs["userLabels"] == {"app": "tpu-pretrain", "stack": stack}
        docs = inputs["documentation"]
        assert docs["mimeType"] == "text/markdown"
        assert (
            docs["subject"] == f"tpu-pretrain {stack}: {event.name} (${{log.extracted_label.job}})"
        )
        assert f"It means: {event.when}." in docs["content"]
        assert "What to do: " in docs["content"]
        assert "docs/operating.md" in docs["content"]
        assert "${log.extracted_label.message}" in docs["content"]
        # After the APIs (the Monitoring API among them), under the component.
        component = by_name(run, "alerts")
        assert policy.options["parent"] == component.urn
        assert depends_on(run, policy, by_name(run, "apis-monitoring"))
    finished = by_name(run, "alerts-finished").inputs["documentation"]["content"]
    assert f"gs://{bucket}/runs/<job>/export/" in finished


def test_the_monitoring_api_is_enabled_by_every_stack():
    for stack in stack_names():
        services = {
            r.inputs["service"]
            for r in run_offline(stack).resources
            if r.type_ == "gcp:projects/service:Service"
        }
        assert "monitoring.googleapis.com" in services, stack


def test_without_addresses_no_monitoring_resource():
    for stack in stack_names():
        types = {r.type_ for r in run_offline(stack).resources}
        assert not {t for t in types if t.startswith("gcp:monitoring/")}, stack
        assert "tpu-pretrain:index:RunAlerts" not in types, stack
    empty = {r.type_ for r in run_offline("v6e-euw4", {K + "alertEmails": []}).resources}
    assert not {t for t in empty if "monitoring" in t or t.endswith("RunAlerts")}


def test_reordering_the_addresses_keeps_the_channels():
    first = {c.name: c.inputs["labels"] for c in _of(_run("v6e-euw4"), CHANNEL)}
    swapped = run_offline("v6e-euw4", {K + "alertEmails": EMAILS[::-1]})
    assert {c.name: c.inputs["labels"] for c in _of(swapped, CHANNEL)} == first


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            ["ops@example.com", "not-an-address"],
            "tpu-pretrain:alertEmails[1]: 'not-an-address' is not an e-mail address (allowed: a "
            'list of addresses like ["you@example.com"]; [] or unset: no alerts)',
        ),
        (
            ["a b@example.com"],
            "tpu-pretrain:alertEmails[0]: 'a b@example.com' is not an e-mail address (allowed: a "
            'list of addresses like ["you@example.com"]; [] or unset: no alerts)',
        ),
        (
            ["ops@example.com", "OPS@example.com"],
            "tpu-pretrain:alertEmails[1]: 'OPS@example.com' is listed twice; list it once",
        ),
        (
            # Not a list: the Pulumi CLI refuses it before the program runs (Pulumi.yaml's type).
            {"to": "ops@example.com"},
            "Stack 'v6e-euw4' with configuration key 'alertEmails' must be of type 'array<string>'",
        ),
    ],
)
def test_a_bad_address_list_is_one_line(value, message):
    assert config_error("v6e-euw4", {K + "alertEmails": value}) == message


def test_the_list_reader_names_the_key_when_it_gets_no_list():
    with pytest.raises(ConfigError) as error:
        keys.string_list({"alertEmails": "ops@example.com"}, "alertEmails", '["you@example.com"]')
    assert str(error.value) == (
        'tpu-pretrain:alertEmails: must be a list, e.g. ["you@example.com"] (or [] for none)'
    )
    assert keys.string_list({"alertEmails": "[]"}, "alertEmails", "[]") == []
    assert keys.string_list({}, "alertEmails", "[]") == []


# --- each filter matches its writers' entry ----------------------------------------------------
def _header(script: str) -> str:
    """A rendered script's constants: its lines up to the first blank one (render.py _script)."""
    return script.split("\n\n", 1)[0]


def _constant(script: str, name: str) -> str:
    prefix = f"readonly {name}="
    [line] = [line for line in _header(script).splitlines() if line.startswith(prefix)]
    [value] = shlex.split(line[len(prefix) :])
    return value


def _script_of(run: Any, source: str) -> str:
    """The constants under which each source of a script event runs, from what the program
    registers: the watchdog's script (inside the controller's), the accelerator VM's script
    (its trainer unit), and the loader in the VM's metadata with the run root and job the
    job pointer gives it (loader.sh reads them with `field`)."""
    controller = startup_script(run, "controller-vm")
    if source == "watchdog":
        return _header(base64.b64decode(_constant(controller, "WATCH_SCRIPT_B64")).decode())
    vm = "tpu-vm" if any(r.name == "tpu-vm" for r in run.resources) else "gpu-vm"
    if source == "trainer-unit":
        return _header(startup_script(run, vm))
    assert source == "loader", source
    [loader] = [r for r in run.resources if r.name == vm]
    pointer = json.loads(by_name(run, "startup-pointer").inputs["content"])
    return (
        _header(loader.inputs["metadata"]["startup-script"])
        + f"\nJOB_NAME={shlex.quote(pointer['job'])}\nRUN_ROOT={shlex.quote(pointer['run_root'])}"
    )


def _shell_entry(tmp_path: Path, constants: str, event: events.Event, project: str) -> dict:
    """The LogEntry the scripts' emit_event writes: `gcloud logging write LOG JSON` writes to
    projects/<--project, or gcloud's own project: on a VM, the VM's>/logs/LOG."""
    calls = tmp_path / f"gcloud-{event.name}"
    stub = tmp_path / "bin" / "gcloud"
    stub.parent.mkdir(exist_ok=True)
    stub.write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > "{calls}.$$"\nmv "{calls}.$$" "{calls}"\n')
    stub.chmod(0o755)
    pairs = " ".join(f"{f}=v-{f}" for f in event.fields)
    source = next(s for s in event.sources if s != "trainer")
    script = f'{constants}\nsource {COMMON}\nemit_event {event.name} {source} "m e" {pairs}\n'
    subprocess.run(
        ["bash", "-c", script],
        check=True,
        capture_output=True,
        timeout=60,
        env={**os.environ, "PATH": f"{stub.parent}:{os.environ['PATH']}"},
    )
    args = calls.read_text().splitlines()
    assert args[:3] == ["logging", "write", events.LOG_ID]
    written_to = args[args.index("--project") + 1] if "--project" in args else project
    return {"logName": f"projects/{written_to}/logs/{args[2]}", "jsonPayload": json.loads(args[3])}


def _python_entry(run: Any, event: events.Event, project: str) -> dict:
    """The LogEntry the payload's emit writes, for the job spec the program uploads (its
    output is the run root emit is given): logName is events.log_name of the VM's project."""
    spec = json.loads(by_name(run, "payload-job-spec").inputs["content"])
    payload = events.emit(
        event.name,
        run_root=spec["output"],
        job=spec["name"],
        message="m e",
        environ={"TPU_PRETRAIN_EVENTS": "off"},
        **{f: f"v-{f}" for f in event.fields},
    )
    return {"logName": events.log_name(project), "jsonPayload": payload}


def _entries(run: Any, tmp_path: Path) -> list[tuple[str, str, dict]]:
    """(event, source, LogEntry) for every source of every event."""
    project = _project(run)
    found = []
    for event in events.EVENTS.values():
        for source in event.sources:
            if source == "trainer":
                entry = _python_entry(run, event, project)
            else:
                scoped = events.Event(
                    event.name, event.severity, (source,), event.when, event.fields
                )
                entry = _shell_entry(tmp_path / source, _script_of(run, source), scoped, project)
            found.append((event.name, source, entry))
    return found


@pytest.mark.parametrize("stack", STACKS)
def test_each_policy_matches_the_entry_its_writers_produce(stack, tmp_path):
    run = _run(stack)
    filters = {
        p.name: p.inputs["conditions"][0]["conditionMatchedLog"]["filter"] for p in _of(run, POLICY)
    }
    for source in {s for e in events.EVENTS.values() for s in e.sources} - {"trainer"}:
        (tmp_path / source).mkdir()
    entries = _entries(run, tmp_path)
    assert {source for _, source, _ in entries} == set(events.SOURCES)
    for event, source, entry in entries:
        assert entry["jsonPayload"]["bucket"] == _bucket(run)
        matched = [name for name, text in filters.items() if logging_filter.matches(text, entry)]
        # Its own policy, and no other.
        assert matched == [f"alerts-{event}"], (event, source, entry)
        # Another stack's bucket, or another project's log: none.
        other = {**entry, "jsonPayload": {**entry["jsonPayload"], "bucket": "other-tpu-pretrain"}}
        moved = {**entry, "logName": "projects/another-project/logs/tpu-pretrain-events"}
        for planted in (other, moved):
            assert not [t for t in filters.values() if logging_filter.matches(t, planted)]


def test_the_matcher_refuses_what_it_does_not_know():
    text = alerts.event_filter("p-123456", "b-tpu-pretrain", "hung")
    entry = {
        "logName": "projects/p-123456/logs/tpu-pretrain-events",
        "jsonPayload": {"schema": events.SCHEMA, "bucket": "b-tpu-pretrain", "event": "hung"},
    }
    assert logging_filter.matches(text, entry)
    # A planted mismatch in each compared field fails the match.
    for field in ("schema", "bucket", "event"):
        planted = {**entry, "jsonPayload": {**entry["jsonPayload"], field: "x"}}
        assert not logging_filter.matches(text, planted), field
    assert not logging_filter.matches(text, {"logName": entry["logName"]})
    assert not logging_filter.matches(
        text, {**entry, "jsonPayload": {**entry["jsonPayload"], "event": 7}}
    )
    for unknown in (
        text + ' OR jsonPayload.event="stopped"',
        'jsonPayload.event:"hung"',
        'jsonPayload.event!="hung"',
        'NOT jsonPayload.event="hung"',
        '(jsonPayload.event="hung")',
        "hung",
        'jsonPayload.event="hung" AND jsonPayload.event="stopped"',
    ):
        with pytest.raises(ValueError):
            logging_filter.parse(unknown)
    # Quotes and backslashes in a value are escaped by the filter and read back.
    odd = alerts.event_filter("p-123456", 'b"\\x', "hung")
    assert logging_filter.parse(odd)["jsonPayload.bucket"] == 'b"\\x'

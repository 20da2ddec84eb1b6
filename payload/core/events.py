"""The run's events: what the trainer, the startup scripts and the watchdog tell people.

One table (EVENTS), the one shape of an entry (:func:`entry`), and what an alert matches on
(:data:`MATCHED_FIELDS`). The stack's alert policies (the program's alerts component) match an
entry by field equalities on ``logName`` and ``jsonPayload``; the payload writes entries through
:func:`emit`, the VMs' scripts through the shell function ``emit_event``
(infra/render/templates/common.sh). docs/operating.md has this table, kept equal by
tests/payload/test_events.py; the infra tests match each policy's filter against
the entry each writer produces.

An entry's ``jsonPayload``::

    {"schema": "tpu-pretrain.event/1", "event": "preempted", "bucket": "<bucket name>",
     "job": "<job name>", "source": "watchdog", "host": "<hostname>", "message": "<one line>",
     "at": "2026-12-02T07:00:00Z", ...the event's own fields}

The log is ``projects/<project>/logs/tpu-pretrain-events``; the resource is ``global`` (what
``gcloud logging write`` writes). ``bucket`` names the stack: a project may hold several.

:func:`emit` is the payload's only writer of events. It prints the entry as one line
(``tpu-pretrain event: {...}``, in the journal on a VM) and, for a run in a bucket, writes it to
Cloud Logging (``entries:write``, the log ``tpu-pretrain-events``, resource ``global``), where
the stack's alert policies match it. Credentials and project are the application default's (the
VM's service account holds ``roles/logging.logWriter``). An event never stops a run: a failed
write is one line in the log and the run goes on; the request is bounded (``TIMEOUT_S``).

``TPU_PRETRAIN_LOGGING_ENDPOINT`` points the write at another endpoint with anonymous
credentials and ``TPU_PRETRAIN_PROJECT`` as the project (the tests' server on 127.0.0.1, as
``STORAGE_EMULATOR_HOST`` does for storage); ``TPU_PRETRAIN_EVENTS=off`` sends nothing.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

SCHEMA = "tpu-pretrain.event/1"
LOG_ID = "tpu-pretrain-events"
SEVERITIES = ("INFO", "NOTICE", "WARNING", "ERROR")
SOURCES = ("trainer", "trainer-unit", "loader", "watchdog")
# What a policy's filter compares, besides logName: the rest of an entry is for people.
MATCHED_FIELDS = ("schema", "bucket", "event")
_BASE_FIELDS = ("schema", "event", "bucket", "job", "source", "host", "message", "at")


@dataclass(frozen=True)
class Event:
    name: str
    severity: str
    sources: tuple[str, ...]
    when: str
    fields: tuple[str, ...] = ()


EVENTS: dict[str, Event] = {
    e.name: e
    for e in (
        Event(
            "preempted",
            "WARNING",
            ("watchdog",),
            "the accelerator VM was preempted or found gone (a spot or preemptible VM taken back)",
            ("state",),
        ),
        Event(
            "recreated",
            "NOTICE",
            ("watchdog",),
            "the watchdog asked for the accelerator again: a new TPU node (queued resource) or a "
            "stopped GPU VM started",
            ("reason",),
        ),
        Event(
            "capacity-wait",
            "WARNING",
            ("watchdog",),
            "a request for the accelerator has waited longer than the stack's "
            "`capacityWaitMinutes` (capacity or quota exhausted)",
            ("waited_s", "exhausted"),
        ),
        Event(
            "unhealthy",
            "WARNING",
            ("watchdog",),
            "the TPU reported a health other than HEALTHY past its bound and was recreated, or "
            "waits out maintenance",
            ("health", "health_description", "action"),
        ),
        Event(
            "hung",
            "ERROR",
            ("trainer",),
            "the trainer made no progress within its bound (the stall watchdog) and exits 75 "
            "to be restarted",
            ("phase", "step"),
        ),
        Event(
            "stopped",
            "ERROR",
            ("trainer", "trainer-unit", "loader", "watchdog"),
            "the run stopped for good: a user error, 5 failures in a row, or a VM that cannot "
            "boot; it is not restarted",
            ("reason",),
        ),
        Event(
            "finished",
            "NOTICE",
            ("trainer",),
            "the export is written: the trained model is in runs/<job>/export/",
            ("step", "export"),
        ),
        Event(
            "eta-past-grant",
            "WARNING",
            ("trainer",),
            "at the current rate the run ends after the grant's end (`grantEnds`)",
            ("eta", "grant_ends"),
        ),
    )
}


class EventError(ValueError):
    """An event not in EVENTS, a source it does not come from, or a field it does not have."""


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def log_name(project: str) -> str:
    return f"projects/{project}/logs/{LOG_ID}"


def entry(
    event: str,
    *,
    bucket: str,
    job: str,
    source: str,
    host: str,
    message: str,
    at: str | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """The jsonPayload of one event (checked against EVENTS)."""
    spec = EVENTS.get(event)
    if spec is None:
        raise EventError(f"unknown event {event!r}; events: {', '.join(EVENTS)}")
    if source not in spec.sources:
        raise EventError(f"event {event!r} comes from {'/'.join(spec.sources)}, not {source!r}")
    unknown = sorted(set(fields) - set(spec.fields))
    if unknown:
        raise EventError(
            f"event {event!r} has no field {unknown[0]!r}; its fields: {', '.join(spec.fields)}"
        )
    payload: dict[str, Any] = {
        "schema": SCHEMA,
        "event": event,
        "bucket": bucket,
        "job": job,
        "source": source,
        "host": host,
        "message": " ".join(str(message).split())[:500],
        "at": at or _now(),
    }
    payload.update({k: v for k, v in fields.items() if v is not None})
    return payload


def bucket_of(uri: str) -> str | None:
    """The bucket of a gs:// run root (None for a local path: nothing goes to Cloud Logging)."""
    if not uri.startswith("gs://"):
        return None
    return uri[len("gs://") :].split("/", 1)[0] or None


ENDPOINT = "https://logging.googleapis.com"
TIMEOUT_S = 10.0


def emit(
    event: str,
    *,
    run_root: str,
    job: str,
    message: str,
    source: str = "trainer",
    environ: Mapping[str, str] = os.environ,
    **fields: Any,
) -> dict[str, Any]:
    """Build, print and (for a gs:// run) send one event; returns its jsonPayload."""
    bucket = bucket_of(run_root)
    payload = entry(
        event,
        bucket=bucket or "",
        job=job,
        source=source,
        host=socket.gethostname(),
        message=message,
        **fields,
    )
    print(f"tpu-pretrain event: {json.dumps(payload, sort_keys=True)}", file=sys.stderr, flush=True)
    if bucket and environ.get("TPU_PRETRAIN_EVENTS", "on") != "off":
        try:
            _write(payload, EVENTS[event].severity, environ)
        except Exception as error:  # an event must never end the run
            print(
                f"tpu-pretrain event: not written to Cloud Logging ({type(error).__name__}: "
                f"{error}); the run goes on",
                file=sys.stderr,
                flush=True,
            )
    return payload


def _write(payload: dict[str, Any], severity: str, environ: Mapping[str, str]) -> None:
    import google.auth  # noqa: PLC0415
    from google.auth.credentials import AnonymousCredentials  # noqa: PLC0415
    from google.auth.transport.requests import AuthorizedSession  # noqa: PLC0415

    endpoint = environ.get("TPU_PRETRAIN_LOGGING_ENDPOINT", "")
    if endpoint:
        credentials: Any = AnonymousCredentials()
        project: str | None = environ.get("TPU_PRETRAIN_PROJECT", "")
    else:
        endpoint = ENDPOINT
        credentials, project = google.auth.default(
            scopes=["https://www.googleapis.com/auth/logging.write"]
        )
    if not project:
        raise RuntimeError("no project: the application default credentials name none")
    body: dict[str, Any] = {
        "logName": log_name(project),
        "resource": {"type": "global", "labels": {"project_id": project}},
        "entries": [{"severity": severity, "jsonPayload": payload}],
    }
    response = AuthorizedSession(credentials).post(
        f"{endpoint.rstrip('/')}/v2/entries:write", json=body, timeout=TIMEOUT_S
    )
    if response.status_code != 200:
        raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")

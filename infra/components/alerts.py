"""Alerts from the same `pulumi up`: an e-mail channel per address of tpu-pretrain:alertEmails and
one log-match alert policy per event of the run (docs/operating.md, Events and Alerts).

The events, their severities and the shape of an entry are the payload's (payload/core/events.py
EVENTS, SCHEMA, LOG_ID, MATCHED_FIELDS). infra never imports the payload, so the names below are
a copy that tests/infra/test_alerts.py keeps equal to the payload's table, and whose filters it
matches against the entries the payload's `emit` and the scripts' `emit_event` really write.

What Google requires of a log-match policy (Cloud Monitoring API, projects.alertPolicies:
AlertStrategy.notificationRateLimit "Required for alert policies with a LogMatch condition";
Cloud Logging's log-based incidents page: at most one notification every 5 minutes and 20 a day
per log-based policy) and what the pulumi-gcp SDK names it (10.2.0,
pulumi_gcp/monitoring/_inputs.py: AlertPolicyConditionConditionMatchedLogArgs `filter`,
`label_extractors`; AlertPolicyAlertStrategyArgs `notification_rate_limit` {`period`},
`auto_close`; AlertPolicyDocumentationArgs `content`, `mime_type`, `subject`)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

from infra.components.tpu import inherited_depends_on

# The payload's contract (payload/core/events.py; the test keeps these equal).
SCHEMA = "tpu-pretrain.event/1"
LOG_ID = "tpu-pretrain-events"
MATCHED_FIELDS = ("schema", "bucket", "event")

# Google's floor for a log-based policy: one notification per 5 minutes.
NOTIFICATION_PERIOD = "300s"
# An incident closes half an hour after its entry, so the next event of its kind opens a new
# one (and a new e-mail) instead of adding to an incident nobody closed.
AUTO_CLOSE = "1800s"
# A policy's severity: Cloud Monitoring has CRITICAL, ERROR and WARNING (AlertPolicy.severity);
# an entry's NOTICE (good news: recreated, finished) is its lowest, WARNING.
POLICY_SEVERITY = {"ERROR": "ERROR", "WARNING": "WARNING", "NOTICE": "WARNING"}
# What a notification shows of the entry (its labels; `${log.extracted_label.<key>}` in the
# documentation). Each distinct combination is its own incident: no timestamp among them.
LABEL_EXTRACTORS = {
    "job": "EXTRACT(jsonPayload.job)",
    "host": "EXTRACT(jsonPayload.host)",
    "message": "EXTRACT(jsonPayload.message)",
}
DOCS = "docs/operating.md (Events, Alerts) in the repository the stack was deployed from"


@dataclass(frozen=True)
class Alert:
    """One event of the run as an alert: its name, log severity and meaning (payload/core/
    events.py EVENTS: name, severity, when) and what the reader of the e-mail should do
    ("{bucket}": the stack's bucket)."""

    event: str
    severity: str
    means: str
    what_to_do: str


ALERTS: tuple[Alert, ...] = (
    Alert(
        "preempted",
        "WARNING",
        "the accelerator VM was preempted or found gone (a spot or preemptible VM taken back)",
        "Nothing, with auto-recovery on: the watchdog recreates the accelerator and training "
        "resumes from the last checkpoint (a `recreated` alert follows). With it off, replace "
        "the VM: the stack output tpuRecovery (or gpuRecovery) has the command.",
    ),
    Alert(
        "recreated",
        "NOTICE",
        "the watchdog asked for the accelerator again: a new TPU node (queued resource) or a "
        "stopped GPU VM started",
        "Nothing: the accelerator was asked for again and the run resumes from its last "
        "checkpoint. Many in a day cost progress: see the status page's timeline.",
    ),
    Alert(
        "capacity-wait",
        "WARNING",
        "a request for the accelerator has waited longer than the stack's "
        "`capacityWaitMinutes` (capacity or quota exhausted)",
        "The zone has no capacity or a quota is exhausted (the entry's `exhausted`). Wait, "
        "request quota (IAM & Admin > Quotas), or move the stack to another zone.",
    ),
    Alert(
        "unhealthy",
        "WARNING",
        "the TPU reported a health other than HEALTHY past its bound and was recreated, or "
        "waits out maintenance",
        "The TPU reported a bad health (the entry's `health` and `action`): maintenance is "
        "waited out, a node that stays unhealthy is recreated. Repeated: tell Google support "
        "the node's name and zone.",
    ),
    Alert(
        "hung",
        "ERROR",
        "the trainer made no progress within its bound (the stall watchdog) and exits 75 to "
        "be restarted",
        "The trainer made no progress and exits to be restarted from its last checkpoint. If it "
        "repeats, read the trainer's journal on the accelerator VM (docs/troubleshooting.md).",
    ),
    Alert(
        "stopped",
        "ERROR",
        "the run stopped for good: a user error, 5 failures in a row, or a VM that cannot "
        "boot; it is not restarted",
        "The run stopped for good and is not restarted (the entry's `reason`): fix the job or "
        "the VM, then `pulumi up` and re-run the startup script (stack output "
        "rerunStartupCommands).",
    ),
    Alert(
        "finished",
        "NOTICE",
        "the export is written: the trained model is in runs/<job>/export/",
        "The trained model is in gs://{bucket}/runs/<job>/export/. Copy it out; "
        "`pulumi destroy` when you are done (the bucket is kept unless destroyBucketWithStack).",
    ),
    Alert(
        "eta-past-grant",
        "WARNING",
        "at the current rate the run ends after the grant's end (`grantEnds`)",
        "At the current rate the run ends after the grant (the entry's `eta`, `grant_ends`): "
        "shorten train.steps, ask for more time, or accept a partial run.",
    ),
)


def log_name(project: str) -> str:
    return f"projects/{project}/logs/{LOG_ID}"


def _quoted(value: str) -> str:
    """A Logging query language string: double quotes, with `\\` and `"` escaped."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def event_filter(project: str, bucket: str, event: str) -> str:
    """The policy's filter: field equalities joined by AND (Logging query language), on the
    log's name and the entry's MATCHED_FIELDS."""
    equal = {
        "logName": log_name(project),
        **{
            f"jsonPayload.{field}": {"schema": SCHEMA, "bucket": bucket, "event": event}[field]
            for field in MATCHED_FIELDS
        },
    }
    return " AND ".join(f"{field}={_quoted(value)}" for field, value in equal.items())


def channel_name(name: str, address: str) -> str:
    """A channel's resource name, by its address (so reordering the list replaces nothing)."""
    digest = hashlib.sha256(address.lower().encode()).hexdigest()[:10]
    return f"{name}-email-{digest}"


@dataclass(frozen=True)
class RunAlertsArgs:
    project: str
    stack: str
    bucket: str  # the stack's bucket name: what an entry's `bucket` says
    emails: tuple[str, ...]
    labels: dict[str, str]


class RunAlerts(pulumi.ComponentResource):
    """The e-mail channels and one log-match alert policy per event of ALERTS; the program
    creates it only when tpu-pretrain:alertEmails lists an address."""

    def __init__(self, name: str, args: RunAlertsArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("tpu-pretrain:index:RunAlerts", name, None, opts)
        if not args.emails:
            raise ValueError("RunAlerts needs at least one address (tpu-pretrain:alertEmails)")
        # After the Monitoring API is on (the program's depends_on, which children do not inherit).
        child = pulumi.ResourceOptions(parent=self, depends_on=inherited_depends_on(opts))
        self.channels = [
            gcp.monitoring.NotificationChannel(
                channel_name(name, address),
                project=args.project,
                type="email",
                display_name=f"tpu-pretrain {args.stack}: {address}",
                labels={"email_address": address},
                user_labels=args.labels,
                opts=child,
            )
            for address in args.emails
        ]
        channel_names = [channel.name for channel in self.channels]
        self.policies = [
            gcp.monitoring.AlertPolicy(
                f"{name}-{alert.event}",
                project=args.project,
                display_name=f"tpu-pretrain {args.stack}: {alert.event}",
                combiner="OR",
                conditions=[
                    {
                        "display_name": f"a {alert.event} event of the run in {args.bucket}",
                        "condition_matched_log": {
                            "filter": event_filter(args.project, args.bucket, alert.event),
                            "label_extractors": LABEL_EXTRACTORS,
                        },
                    }
                ],
                alert_strategy={
                    "notification_rate_limit": {"period": NOTIFICATION_PERIOD},
                    "auto_close": AUTO_CLOSE,
                },
                notification_channels=channel_names,
                severity=POLICY_SEVERITY[alert.severity],
                documentation={
                    "mime_type": "text/markdown",
                    "subject": f"tpu-pretrain {args.stack}: {alert.event} "
                    "(${log.extracted_label.job})",
                    "content": _content(alert, args.bucket),
                },
                user_labels=args.labels,
                opts=child,
            )
            for alert in ALERTS
        ]
        self.register_outputs(
            {
                "channels": channel_names,
                "policies": [policy.name for policy in self.policies],
            }
        )


def _content(alert: Alert, bucket: str) -> str:
    """The e-mail's text: the entry (its extracted labels), what the event means, what to do."""
    return (
        f"**{alert.event}** in job ${{log.extracted_label.job}} on ${{log.extracted_label.host}}: "
        f"${{log.extracted_label.message}}\n\n"
        f"It means: {alert.means}.\n\n"
        f"What to do: {alert.what_to_do.format(bucket=bucket)}\n\n"
        f"The events, and how to read them: {DOCS}."
    )

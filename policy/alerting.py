"""The rule family of the run's alerts (tpu-pretrain:alertEmails, infra/components/alerts.py):
a notification channel sends mail, and only mail. Another type (a webhook, Pub/Sub, Slack)
would send the run's events to an endpoint outside the project and need a token in the
stack (its `sensitiveLabels`); an e-mail channel needs neither."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

try:  # inside the repository (tests): the package "policy"
    from .resources import NOTIFICATION_CHANNEL, Rule, get, resource_policy
except ImportError:  # the pack as the Pulumi CLI runs it: policy/ is the working directory
    from resources import (  # type: ignore[no-redef]
        NOTIFICATION_CHANNEL,
        Rule,
        get,
        resource_policy,
    )

MSG_EMAIL_ONLY = "notification channels must be e-mail channels with an address and no secret"


def _check_email_only(_t: str, props: Mapping[str, Any], report: Callable[[str], None]) -> None:
    kind = get(props, "type")
    labels = get(props, "labels")
    keys = sorted(labels) if isinstance(labels, Mapping) else []
    if kind != "email":
        report(f"{MSG_EMAIL_ONLY}: type {kind!r} (allowed: 'email')")
    elif keys != ["email_address"]:
        report(f"{MSG_EMAIL_ONLY}: labels {keys} (allowed: ['email_address'])")
    if get(props, "sensitiveLabels") is not None:
        report(f"{MSG_EMAIL_ONLY}: sensitiveLabels is set (a token or password)")


def rules() -> list[Rule]:
    """The alerting rules, in the pack's order."""
    return [
        Rule(
            resource_policy(
                "notification-channels-email-only",
                "Notification channels are e-mail channels: nothing leaves the project but mail, "
                "and no channel holds a token.",
                (NOTIFICATION_CHANNEL,),
                _check_email_only,
            ),
            MSG_EMAIL_ONLY,
        ),
    ]

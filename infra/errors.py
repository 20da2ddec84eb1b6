"""Errors a user can cause with stack configuration (pure: no Pulumi import)."""


class ConfigError(ValueError):
    """A stack setting is missing or invalid; the message is one line naming the key."""

"""Pulumi CrossGuard policy pack for tpu-pretrain (rules live in policy/rules.py)."""

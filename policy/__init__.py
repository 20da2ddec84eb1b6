"""Pulumi CrossGuard policy pack for tpu-pretrain: one module per rule family.

policy/rules.py assembles the families' rules (each family's module exports its list)."""

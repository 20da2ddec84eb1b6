"""Pulumi CrossGuard policy pack for tpu-pretrain (policy/rules.py assembles the rules, one
module per rule family)."""

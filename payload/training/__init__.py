"""What both trainers share: loop rules, evaluation, identity, export, model card."""

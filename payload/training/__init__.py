"""What both trainers share: loop rules, evaluation, identity, export and model card, goodput."""

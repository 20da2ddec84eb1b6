"""The encode stage: its door, the pure rules, outputs, local and Beam runners."""

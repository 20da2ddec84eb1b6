"""Stack configuration: the door (config.py) and the rooms beneath it."""

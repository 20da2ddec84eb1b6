"""One ComponentResource per concern; each takes a frozen dataclass of arguments."""

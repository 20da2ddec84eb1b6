"""Check gcloud command lines against the flags gcloud itself defines per release track
(tests/infra/data/gcloud_flags.yaml, recorded from gcloud's source; see its header)."""

from __future__ import annotations

import shlex
from functools import cache
from pathlib import Path

import yaml

DATA = Path(__file__).with_name("data") / "gcloud_flags.yaml"
TRACKS = {"alpha": "ALPHA", "beta": "BETA"}


@cache
def _recorded() -> tuple[frozenset[str], dict[str, dict[str, frozenset[str]]]]:
    data = yaml.safe_load(DATA.read_text(encoding="utf-8"))
    commands = {
        path: {track: frozenset(flags) for track, flags in tracks.items()}
        for path, tracks in data["commands"].items()
    }
    return frozenset(data["global"]), commands


def problems(command: str | list[str]) -> list[str]:
    """What is wrong with one gcloud invocation: an unrecorded command, a command that does
    not exist in its release track, or a flag the track does not define. [] when fine."""
    argv = shlex.split(command, comments=True) if isinstance(command, str) else list(command)
    if argv[:1] != ["gcloud"]:
        return [f"not a gcloud command: {command!r}"]
    argv = argv[1:]
    if "--" in argv:  # everything after `--` goes to ssh
        argv = argv[: argv.index("--")]
    track = TRACKS.get(argv[0], "GA") if argv else "GA"
    if track != "GA":
        argv = argv[1:]
    global_flags, commands = _recorded()
    words = [word for word in argv if not word.startswith("-")]
    path = next(
        (" ".join(words[:n]) for n in range(len(words), 0, -1) if " ".join(words[:n]) in commands),
        None,
    )
    if path is None:
        return [f"gcloud {' '.join(words[:4])}: not in {DATA.name}"]
    if track not in commands[path]:
        return [f"gcloud {path} has no {track} release track"]
    allowed = commands[path][track] | global_flags
    flags = [word.split("=", 1)[0] for word in argv if word.startswith("-")]
    return [
        f"gcloud {'' if track == 'GA' else track.lower() + ' '}{path}: {flag} is not a {track} flag"
        for flag in flags
        if flag not in allowed
    ]

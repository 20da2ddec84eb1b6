"""The run's status page, fetched from the stack's bucket and opened: `make status STACK=<stack>`.

    python -m infra.commands.status_page --stack v6e-euw4 [--out FILE] [--no-open]

The page is ``gs://<bucket>/runs/<job>/status.html``: the chief trainer writes it at its
logs, evaluations, checkpoints and the end (payload/training/page.py). The bucket and the job
are the stack's (stacks/Pulumi.<stack>.yaml and its job file, read as `pulumi up` reads them:
infra/commands/offline.py stack_config, infra/config parse_config); the object is copied
with ``gcloud storage cp`` (your gcloud credentials; the bucket is not public) to
build/status/<stack>/status.html (or --out) and opened with ``xdg-open`` (Linux, with a
display) or ``open`` (macOS); otherwise its path is printed. The console's authenticated URL
(https://storage.cloud.google.com/<bucket>/runs/<job>/status.html) opens the same page in a
browser signed in to Google. The page holds no script and fetches nothing (its
Content-Security-Policy forbids both). Exit 0 when the page is here, 2 with one line when it
cannot be fetched.

Every external command goes through `StatusPage.run` (gcloud, the opener); the offline test
puts stub executables first on PATH (tests/infra/test_status_page.py)."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml

from infra import jobspec
from infra.commands import offline
from infra.config.config import parse_config
from infra.config.project import cli_config
from infra.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]
OUT_DIR = REPO_ROOT / "build" / "status"
PAGE = "status.html"
CONSOLE = "https://storage.cloud.google.com"
TIMEOUT_S = 120
NAMESPACE = "tpu-pretrain:"


class StatusPageError(Exception):
    """The page cannot be fetched; the message is the one line the user reads."""


def page_uri(stack: str, stacks_dir: Path = offline.STACKS_DIR) -> tuple[str, str]:
    """(gs:// URI of the stack's status page, its console URL) from the stack file, read as
    `pulumi up` hands it to the program (infra/config/project.py cli_config)."""
    path = stacks_dir / f"Pulumi.{stack}.yaml"
    if not path.is_file():
        raise StatusPageError(
            f"STACK={stack!r}: no stacks/Pulumi.{stack}.yaml; stacks: "
            + ", ".join(offline.stack_names())
        )
    document = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    config = dict(document.get("config") or {})
    project = config.get("gcp:project")
    if not project:
        raise StatusPageError(
            f"gcp:project is not set for stack {stack}: run `pulumi config set gcp:project "
            f"<your-project-id> --stack {stack}` first"
        )
    try:
        given = cli_config(stack, config)
        values = {k.split(":", 1)[1]: v for k, v in given.items() if k.startswith(NAMESPACE)}
        cfg = parse_config(project=str(project), stack=stack, values=values)
    except ConfigError as exc:
        raise StatusPageError(str(exc)) from None
    prefix = jobspec.run_prefix(cfg.job_name)
    return (
        f"{jobspec.run_root(cfg.bucket.name, cfg.job_name)}/{PAGE}",
        f"{CONSOLE}/{cfg.bucket.name}/{prefix}/{PAGE}",
    )


def opener(environ: Mapping[str, str], platform: str = sys.platform) -> list[str] | None:
    """The command that opens a file in the desktop's browser, or None where there is none
    (no display on Linux, or no opener installed)."""
    if platform == "darwin":
        return ["open"] if shutil.which("open") else None
    if not (environ.get("DISPLAY") or environ.get("WAYLAND_DISPLAY")):
        return None
    return ["xdg-open"] if shutil.which("xdg-open") else None


class StatusPage:
    def __init__(
        self,
        stack: str,
        *,
        out: Path | None = None,
        open_it: bool = True,
        stacks_dir: Path = offline.STACKS_DIR,
    ) -> None:
        self.stack, self.stacks_dir = stack, stacks_dir
        self.out = out or OUT_DIR / stack / PAGE
        self.open_it = open_it

    def run(self, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(
                list(argv), capture_output=True, text=True, timeout=TIMEOUT_S, check=False
            )
        except FileNotFoundError:
            raise StatusPageError(f"{argv[0]} is not installed or not on PATH") from None
        except subprocess.TimeoutExpired:
            raise StatusPageError(f"`{' '.join(argv)}` did not finish in {TIMEOUT_S} s") from None

    def execute(self) -> int:
        uri, console = page_uri(self.stack, self.stacks_dir)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        copied = self.run(["gcloud", "storage", "cp", uri, str(self.out)])
        if copied.returncode != 0:
            said = " ".join((copied.stderr or copied.stdout or "").split())[:300]
            why = said or f"exit {copied.returncode}"
            raise StatusPageError(
                f"could not fetch {uri}: {why} (the trainer writes it once training runs)"
            )
        print(f"status page: {self.out}")
        print(f"in the console (signed in to Google): {console}")
        command = opener(os.environ) if self.open_it else None
        if command is not None:
            opened = self.run([*command, str(self.out)])
            if opened.returncode != 0:
                print(f"could not open it ({command[0]}): open {self.out} in a browser")
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m infra.commands.status_page", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--stack", required=True, help="one of: " + ", ".join(offline.stack_names())
    )
    parser.add_argument(
        "--out", type=Path, help=f"where to write it (default build/status/<stack>/{PAGE})"
    )
    parser.add_argument("--no-open", action="store_true", help="print its path; open nothing")
    args = parser.parse_args(argv)
    try:
        return StatusPage(args.stack, out=args.out, open_it=not args.no_open).execute()
    except StatusPageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""The first real run: `make smoke STACK=<stack> [KEEP=1]`.

    python -m infra.commands.smoke --stack v6e-euw4 [--keep] [--timeout-min 90]

For a user with a project, billing and quota: a preflight that checks what can be checked
before anything is created (credentials, project, billing, the accelerator type and runtime
version offered in the zone, GPU quotas, the recovery roles the stack binds), `pulumi up` of
the stack with the tiny job `stacks/jobs/smoke.yaml` under a name of its own for this run
(`smoke-<UTC time>`, so nothing a previous run left in the kept bucket is judged; through a
copy of the stack's settings: the stack file is never changed), the bundled corpus uploaded,
a bounded wait with progress on every status file of the run (the job's, each VM's, each
slice worker's, the watchdog's; the first failure stops it), a verdict table (each host fact
against the catalog, the devices the trainer saw, steps/s, the export loaded by transformers
with `from_pretrained` and one forward pass in the PyTorch environment .venv-pt) and `pulumi
destroy` unless --keep, after a failure too. The report (table and the log of every command)
is written to build/smoke/ for a bug report. Exit 0 when every verdict is ok, 1 when
something did not hold, 2 when the preflight or the settings stopped it before anything was
created.

Nothing from the bucket or the VMs is trusted (infra/commands/untrusted.py): the export is
downloaded only as the payload's exporter writes it, and what they wrote reaches the
terminal and the report without control characters.

Every external command goes through `Smoke.run` (gcloud, pulumi, the export loader); the
offline test puts stub executables first on PATH and injects the clock and the run's name, so
every branch runs without a cloud (tests/infra/test_smoke.py, test_untrusted.py)."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from infra import jobfit, jobspec
from infra.commands import smoke_rates
from infra.commands.offline import STACKS_DIR, stack_names
from infra.commands.smoke_job import SMOKE_JOB, run_name, write_run_job
from infra.commands.untrusted import (
    ExportError,
    boot_failures,
    clean_json,
    download_export,
    last_line,
    lines,
    one_line,
)
from infra.components.recovery import GPU_RECOVERY_ROLE_ID, RECOVERY_ROLE_ID
from infra.config.config import parse_config
from infra.config.job import plan_job
from infra.config.project import cli_config
from infra.config.types import GpuConfig, StackConfig, TpuConfig
from infra.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]
# Loads the export with transformers 5 + PyTorch (CPU) in .venv-pt (`make venv-pt`); a file
# of its own outside infra/, which never imports transformers (tests/test_boundaries.py).
LOAD_EXPORT = REPO_ROOT / "tools" / "load_export.py"
PT_PYTHON = REPO_ROOT / ".venv-pt" / "bin" / "python"
CORPUS_DIR = REPO_ROOT / "examples" / "corpus"
REPORT_DIR = REPO_ROOT / "build" / "smoke"
NAMESPACE = "tpu-pretrain"
OK, MISMATCH, FAILED, UNKNOWN = "ok", "MISMATCH", "FAILED", "unknown"
# The GitOps bootstrap's deploy account and the role it holds on each stack account
# (infra/bootstrap/gitops_bootstrap.py DEPLOY_ACCOUNT_ID, bootstrap_roles.py
# STACK_ACCOUNT_USER_ROLE_ID; the main program never imports the bootstrap).
DEPLOY_ACCOUNT_ID = "tpu-pretrain-deploy"
STACK_ACCOUNT_ROLE_ID = "tpuPretrainStackAccountUser"
SERVICE_ACCOUNT_USER = "roles/iam.serviceAccountUser"
# --refresh: the bootstrap's state may still list an account or grant that is gone (deleted by
# hand, or by a stack's destroy before stacks kept the bootstrap's accounts); a plain `up`
# believes its state and re-creates nothing.
BOOTSTRAP_FIX = "re-run the bootstrap's `pulumi up --refresh` (infra/bootstrap, docs/gitops.md)"
ADOPT_FIX = (
    "set tpu-pretrain:accountsFromBootstrap: true in stacks/Pulumi.{stack}.yaml: in a GitOps "
    "project the stack adopts the bootstrap's accounts and keeps them on destroy "
    "(docs/gitops.md)"
)
# What gcloud says when the API a command calls is off in the project (read as unknown: the
# preflight cannot tell, and `pulumi up` enables the program's APIs).
API_OFF = ("has not been used", "is disabled", "SERVICE_DISABLED")
# A watchdog's status (templates/tpu-watch.sh, gpu-watch.sh) that ends the wait: an action
# that failed, or a preempted TPU VM waiting for capacity in its queued resource (no bound
# on how long; the smoke run would only wait out its timeout).
WATCH_STOPS = ("queued", "waiting-capacity")
# The one-line fix printed beside a host fact that does not hold (templates/facts.sh): only a
# real VM shows which NVIDIA module loads and which NIC driver the image binds.
FACT_FIXES = {
    "nvidia_modules": "the driver of infra/catalogs/gpu.yaml did not load: read `journalctl -t "
    "tpu-pretrain` and `dkms status` on the GPU VM (the running kernel's headers and "
    "held kernel: gpu.sh install_driver), or boot the catalog's image",
    "nvidia_branch": "another NVIDIA branch loaded: `apt-mark showhold` and `dkms status` on "
    "the GPU VM; fix the image's or the catalog's driver_packages (infra/catalogs/gpu.yaml)",
    "nic_driver": "the NIC is not gVNIC: the image must support GVNIC (its guestOsFeatures) "
    "and the VM's network interface must be nic_type GVNIC (infra/catalogs/gpu.yaml families)",
}
GLOBAL_QUOTAS = frozenset({"GPUS_ALL_REGIONS"})  # in `project-info describe`, not per region


@dataclass
class Row:
    check: str
    expected: str
    seen: str
    verdict: str  # ok | MISMATCH | FAILED | unknown


@dataclass
class Report:
    stack: str
    rows: list[Row] = field(default_factory=list)
    log: list[str] = field(default_factory=list)

    def add(self, check: str, expected: str, seen: str, verdict: str) -> Row:
        # A cell may hold what a VM or the bucket wrote: one line, no control characters.
        row = Row(one_line(check), one_line(expected), one_line(seen), verdict)
        self.rows.append(row)
        return row

    def table(self) -> str:
        lines = ["| check | expected | seen | verdict |", "|---|---|---|---|"]
        for r in self.rows:
            cells = (r.check, r.expected, r.seen, r.verdict)
            lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
        return "\n".join(lines)

    @property
    def passed(self) -> bool:
        return all(r.verdict in (OK, UNKNOWN) for r in self.rows)


class SmokeStopError(Exception):
    """The run cannot go on; the message is the one line the user reads."""


class Smoke:
    def __init__(
        self,
        stack: str,
        *,
        keep: bool = False,
        timeout_s: float = 90 * 60,
        poll_s: float = 60,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        report_dir: Path = REPORT_DIR,
        pt_python: Path = PT_PYTHON,
        out: Any = sys.stderr,
        stacks_dir: Path = STACKS_DIR,
        name: str | None = None,
        compile_python: str | None = None,
    ) -> None:
        self.stacks_dir = stacks_dir
        # Opt-in (`make smoke ... COMPILE=1`): the preflight also compiles the job for the
        # stack's TPU type with this interpreter of the TPU environment (jobfit.compile_job).
        self.compile_python = compile_python
        self.stack, self.keep = stack, keep
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self.clock, self.sleep = clock, sleep
        self.report_dir, self.pt_python, self.out = report_dir, pt_python, out
        self.name = name or run_name(datetime.now(timezone.utc))
        self.report = Report(stack)
        self.backend = "tf"  # the stack's trainer backend and the job's plan: set by load()
        self.fit = jobfit.JobFit("")
        self.config_file = report_dir / f"Pulumi.{stack}.smoke.yaml"

    # --- commands -------------------------------------------------------------------------
    def say(self, line: str) -> None:
        line = lines(line)  # a table and its rows are ours; each value in them is one_line
        print(f"smoke[{self.stack}]: {line}", file=self.out, flush=True)
        self.report.log.append(line)

    def run(self, argv: Sequence[str], *, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        self.report.log.append("$ " + one_line(shlex.join(argv)))  # argv may name objects
        try:
            result = subprocess.run(
                list(argv), capture_output=True, text=True, timeout=timeout, check=False
            )
        except FileNotFoundError:
            raise SmokeStopError(f"{argv[0]} is not installed or not on PATH") from None
        except subprocess.TimeoutExpired:
            raise SmokeStopError(f"`{shlex.join(argv)}` did not finish in {timeout:.0f}s") from None
        output = (result.stdout + result.stderr).strip()
        if output:
            self.report.log.append(lines(output[-4000:]))
        return result

    def gcloud(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.run(["gcloud", *args])

    def pulumi(self, *args: str, timeout: float = 3600) -> subprocess.CompletedProcess[str]:
        return self.run(["pulumi", *args, "--stack", self.stack], timeout=timeout)

    def read_json(self, uri: str) -> dict[str, Any] | None:
        result = self.gcloud("storage", "cat", uri)
        if result.returncode != 0:
            return None
        try:
            doc = json.loads(result.stdout)
        except ValueError:
            return None
        return clean_json(doc) if isinstance(doc, dict) else None

    # --- the stack ------------------------------------------------------------------------
    def load(self) -> tuple[StackConfig, dict[str, Any]]:
        path = self.stacks_dir / f"Pulumi.{self.stack}.yaml"
        if not path.is_file():
            raise ConfigError(
                f"STACK={self.stack!r}: no stacks/Pulumi.{self.stack}.yaml; stacks: "
                + ", ".join(stack_names())
            )
        document = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        config = dict(document.get("config") or {})
        project = config.get("gcp:project")
        if not project:
            raise ConfigError(
                f"gcp:project is not set for stack {self.stack}: run `pulumi config set "
                f"gcp:project <your-project-id> --stack {self.stack}` first"
            )
        job = write_run_job(self.report_dir, self.name)
        config[f"{NAMESPACE}:job"] = (
            str(job.relative_to(REPO_ROOT)) if job.is_relative_to(REPO_ROOT) else str(job)
        )
        # What `pulumi up` hands the program: the stack file plus Pulumi.yaml's defaults.
        given = cli_config(self.stack, config)
        values = {k.split(":", 1)[1]: v for k, v in given.items() if k.startswith(f"{NAMESPACE}:")}
        cfg = parse_config(project=str(project), stack=self.stack, values=values)
        if cfg.backend == "jax":  # the same job with its profile window (nothing else changes)
            write_run_job(self.report_dir, self.name, profile=True)
        self.backend = cfg.backend
        # The plan parse_config made of the job (jobfit caches it): the rate it assumes.
        self.fit = plan_job(str(values["job"]), jobspec.load_template(cfg.job_file),
                            cfg.accelerator, cfg.bucket.name, cfg.backend)  # fmt: skip
        document["config"] = config
        return cfg, document

    # --- 1. preflight ---------------------------------------------------------------------
    def preflight(self, cfg: StackConfig) -> None:
        """Everything checkable before anything is created; a FAILED row stops the run."""
        project = cfg.project
        token = self.gcloud("auth", "application-default", "print-access-token")
        self._row_ok(
            "credentials (application default, as Pulumi uses them)",
            "a token",
            token.returncode == 0,
            "run `gcloud auth application-default login`",
        )
        state = self.gcloud(
            "projects", "describe", project, "--format=value(lifecycleState)"
        ).stdout.strip()
        self._row_ok(f"project {project}", "ACTIVE", state == "ACTIVE", state or "not readable")
        billing = self.gcloud(
            "billing", "projects", "describe", project, "--format=value(billingEnabled)"
        )
        if billing.returncode != 0 and any(m in last_line(billing) for m in API_OFF):
            # The Cloud Billing API is off in the project gcloud bills its calls to: that
            # says nothing about this project's billing (pulumi up does not need the API).
            self.report.add(
                "billing", "True", "not readable: the Cloud Billing API is not enabled", UNKNOWN
            )
        else:
            seen = billing.stdout.strip() or last_line(billing) or "not readable"
            self._row_ok("billing", "True", billing.stdout.strip() == "True", seen)
        accel = cfg.accelerator
        if isinstance(accel, TpuConfig):
            self._offered(
                f"accelerator type {accel.accelerator_type} in {accel.zone}",
                accel.accelerator_type,
                ["compute", "tpus", "tpu-vm", "accelerator-types", "list"],
                ["--zone", accel.zone, "--project", project, "--format=value(type)"],
            )
            self._offered(
                f"runtime version {accel.runtime_version} in {accel.zone}",
                accel.runtime_version,
                ["compute", "tpus", "tpu-vm", "versions", "list"],
                ["--zone", accel.zone, "--project", project, "--format=value(version)"],
            )
            self.report.add(
                "TPU quota",
                f"{accel.accelerator_type} ({accel.hosts} host(s))",
                "not readable with a GA gcloud command; a spot or on-demand TPU waits in its "
                "queued resource, the watchdog reports it",
                UNKNOWN,
            )
            if self.compile_python:
                self._compiles(cfg, accel.accelerator_type)
        else:
            self._gpu_preflight(cfg, accel)
        if accel.auto_recover:
            self._recovery_role(
                project, RECOVERY_ROLE_ID if isinstance(accel, TpuConfig) else GPU_RECOVERY_ROLE_ID
            )
        self._gitops_iam(cfg)
        failed = [r for r in self.report.rows if r.verdict == FAILED]
        if failed:
            raise SmokeStopError(f"preflight: {failed[0].check}: {failed[0].seen}")

    def _compiles(self, cfg: StackConfig, accelerator: str) -> None:
        """The job's programs compile for the TPU type (tpu-payload compile, minutes): the
        memory per chip and the kernels are the compiler's, before anything is rented."""
        check = f"the job compiles for {accelerator} (tpu-payload compile)"
        if cfg.backend != "jax":
            self.report.add(check, "compiled", f"the {cfg.backend} backend: not compiled", UNKNOWN)
            return
        self.say(f"compiling {cfg.job_name} for {accelerator} (tpu-payload compile; minutes)")
        spec = jobspec.render_job_spec(jobspec.load_template(cfg.job_file), cfg.bucket.name)
        code, line = jobfit.compile_job(
            jobspec.to_json(spec), accelerator, str(self.compile_python)
        )
        self._row_ok(check, "compiled", code == 0, line or f"exit status {code}")

    def _gitops_iam(self, cfg: StackConfig) -> None:
        """In a GitOps project (the bootstrap's deploy account holds roles there), what only
        IAM can tell: that it accepted the bootstrap's conditions (it refuses an undeclared
        function when the binding is written; an older bootstrap wrote matches(), which
        Google does not document for resource.name), that the deploy account holds actAs
        on each of this stack's accounts through a grant on that account's own policy, and
        that the controller holds the actAs its watchdog and Dataflow launches need (the
        bootstrap's grants too). And that the stack adopts those accounts: a stack that owns
        them would delete them, and the bootstrap's grants with them, on destroy."""
        project = cfg.project
        deploy = f"serviceAccount:{DEPLOY_ACCOUNT_ID}@{project}.iam.gserviceaccount.com"
        result = self.gcloud("projects", "get-iam-policy", project, "--format=json")
        try:
            bindings = list(json.loads(result.stdout or "{}").get("bindings", []))
        except (ValueError, AttributeError, TypeError):
            bindings = []
        check = "GitOps: the bootstrap's IAM conditions"
        if result.returncode != 0:
            self.report.add(check, "accepted by IAM", last_line(result) or "not readable", UNKNOWN)
            return
        mine = [b for b in bindings if deploy in b.get("members", [])]
        if not mine:
            self.report.add(check, "accepted by IAM", "no deploy account: not GitOps", UNKNOWN)
            return
        expressions = [str((b.get("condition") or {}).get("expression", "")) for b in mine]
        self._row_ok(
            check,
            "accepted by IAM, documented functions only",
            not any("matches(" in e for e in expressions),
            f"a condition uses matches(): {BOOTSTRAP_FIX}",
            seen_ok=f"{sum(map(bool, expressions))} conditional bindings",
        )
        self._row_ok(
            "GitOps: the stack adopts the bootstrap's accounts",
            "tpu-pretrain:accountsFromBootstrap: true",
            cfg.accounts_from_bootstrap,
            ADOPT_FIX.format(stack=cfg.stack),
        )
        controller = f"serviceAccount:{cfg.prefix}-controller@{project}.iam.gserviceaccount.com"
        # Whom the controller must act as: the TPU VM's account (its watchdog recreates the
        # VM) and the Dataflow workers' (it launches their jobs).
        acts_as = {
            "workload": isinstance(cfg.accelerator, TpuConfig) and cfg.accelerator.auto_recover,
            "dataflow": cfg.dataflow,
        }
        suffixes = ["workload", "controller", "vpn-hop", *(["dataflow"] if cfg.dataflow else [])]
        for suffix in suffixes:
            email = f"{cfg.prefix}-{suffix}@{project}.iam.gserviceaccount.com"
            policy = self.gcloud(
                "iam", "service-accounts", "get-iam-policy", email, "--project", project,
                "--format=json",
            )  # fmt: skip
            check = f"GitOps: deploy account's actAs on {cfg.prefix}-{suffix}"
            fix = f"missing: add stacks/Pulumi.{cfg.stack}.yaml, then {BOOTSTRAP_FIX}"
            if policy.returncode != 0:
                error = last_line(policy)
                missing = "NOT_FOUND" in error or "not found" in error.lower()
                self.report.add(
                    check, "granted", fix if missing else error, FAILED if missing else UNKNOWN
                )
                continue
            try:
                account_bindings = list(json.loads(policy.stdout or "{}").get("bindings", []))
            except (ValueError, AttributeError, TypeError):
                account_bindings = []
            granted = any(
                str(b.get("role", "")).endswith(f"/roles/{STACK_ACCOUNT_ROLE_ID}")
                and deploy in b.get("members", [])
                for b in account_bindings
            )
            self._row_ok(check, "granted", granted, fix)
            if acts_as.get(suffix):
                self._row_ok(
                    f"GitOps: controller's actAs on {cfg.prefix}-{suffix}",
                    "granted",
                    any(
                        b.get("role") == SERVICE_ACCOUNT_USER and controller in b.get("members", [])
                        for b in account_bindings
                    ),
                    f"missing: {BOOTSTRAP_FIX}",
                )

    def _gpu_preflight(self, cfg: StackConfig, gpu: GpuConfig) -> None:
        machine = self.gcloud(
            "compute", "machine-types", "describe", gpu.machine_type, "--zone", gpu.zone,
            "--project", cfg.project, "--format=value(name)",
        )  # fmt: skip
        self._row_ok(
            f"machine type {gpu.machine_type} in {gpu.zone}",
            gpu.machine_type,
            machine.stdout.strip() == gpu.machine_type,
            last_line(machine) or "not offered",
        )
        self._offered(
            f"GPU {gpu.gpu_type} in {gpu.zone}",
            gpu.gpu_type,
            ["compute", "accelerator-types", "list"],
            [f"--filter=zone:{gpu.zone}", "--project", cfg.project, "--format=value(name)"],
        )
        # GPUS_ALL_REGIONS is a project quota (`project-info describe`), the GPU's own quota
        # a regional one (`regions describe`); each read where Compute Engine lists it.
        scopes = {
            "the project": ("compute", "project-info", "describe"),
            gpu.region: ("compute", "regions", "describe", gpu.region),
        }
        for where, command in scopes.items():
            metrics = [
                m for m in gpu.quota_metrics if (m in GLOBAL_QUOTAS) == (where == "the project")
            ]
            if metrics:
                self._quotas(where, command, metrics, cfg.project, gpu.count)

    def _quotas(
        self, where: str, command: Sequence[str], metrics: list[str], project: str, count: int
    ) -> None:
        result = self.gcloud(*command, "--project", project, "--format=json(quotas)")
        try:
            rows = {q["metric"]: q for q in json.loads(result.stdout).get("quotas", [])}
        except (ValueError, AttributeError, TypeError, KeyError):
            rows = {}
        for metric in metrics:
            check = f"quota {metric} in {where}"
            if metric not in rows:
                seen = f"not listed for {where}" if result.returncode == 0 else last_line(result)
                self.report.add(check, f">= {count} free", seen, UNKNOWN)
                continue
            free = float(rows[metric].get("limit", 0)) - float(rows[metric].get("usage", 0))
            self._row_ok(
                check,
                f">= {count} free",
                free >= count,
                f"{free:g} free (request more: IAM & Admin > Quotas)",
                seen_ok=f"{free:g} free",
            )

    def _recovery_role(self, project: str, role_id: str) -> None:
        """The custom role the stack's watchdog grant binds: made once per project by the
        bootstrap, never by the program. Without it `pulumi up` fails after creating most of
        the stack."""
        result = self.gcloud(
            "iam", "roles", "describe", role_id, "--project", project,
            "--format=json(name,deleted)",
        )  # fmt: skip
        check = f"recovery role {role_id}"
        fix = (
            "missing: create it once per project (the bootstrap's `pulumi up` in infra/bootstrap, "
            "docs/gitops.md, or the gcloud command in docs/deploy-gcp.md), or set the stack's "
            "auto-recovery off"
        )
        if result.returncode != 0:
            error = last_line(result)
            if "NOT_FOUND" in error or "not found" in error.lower():
                self.report.add(check, "exists", fix, FAILED)
            else:
                self.report.add(check, "exists", error or "not readable", UNKNOWN)
            return
        try:
            doc = json.loads(result.stdout or "{}")
        except ValueError:
            doc = {}
        if doc.get("deleted"):
            self.report.add(
                check, "exists", "deleted (undelete it: gcloud iam roles undelete)", FAILED
            )
        else:
            self._row_ok(check, "exists", True, "")

    def _offered(self, check: str, wanted: str, command: list[str], flags: list[str]) -> None:
        result = self.gcloud(*command, *flags)
        if result.returncode != 0 and "Invalid choice" in (result.stderr or ""):
            # a gcloud older than the GA TPU VM lists: the same command on the alpha track
            result = self.gcloud("alpha", *command, *flags)
        offered = result.stdout.split()
        if result.returncode != 0:
            error = last_line(result)
            if any(m in error for m in API_OFF):
                self.report.add(
                    check, wanted, "API not enabled yet (pulumi up enables it)", UNKNOWN
                )
                return
            self.report.add(check, wanted, error or "not readable", FAILED)
            return
        self._row_ok(
            check, wanted, wanted in offered, "offered: " + (", ".join(offered) or "nothing")
        )

    def _row_ok(
        self, check: str, expected: str, ok: bool, seen: str, *, seen_ok: str = "yes"
    ) -> None:
        self.report.add(check, expected, seen_ok if ok else seen, OK if ok else FAILED)

    # --- 2.-5. deploy, wait, judge, destroy -----------------------------------------------
    def execute(self) -> int:
        self.report_dir.mkdir(parents=True, exist_ok=True)
        try:
            cfg, document = self.load()
        except ConfigError as error:
            self.say(f"error: {error}")
            return 2
        deployed = False
        try:
            self.preflight(cfg)
            self.say("preflight passed:\n" + self.report.table())
            self._ensure_empty_stack()
            self.config_file.write_text(yaml.safe_dump(document, sort_keys=False))
            deployed = True
            self.say(f"pulumi up (stack {self.stack}, job {self.name} from {SMOKE_JOB})")
            up = self.pulumi(
                "up", "--yes", "--skip-preview", "--config-file", str(self.config_file)
            )
            if up.returncode != 0:
                raise SmokeStopError(f"pulumi up failed: {last_line(up)}")
            outputs = self._outputs()
            bucket = outputs["bucketUrl"]
            self.say(f"uploading the bundled corpus to {bucket}/corpus/smoke/")
            files = sorted(str(p) for p in CORPUS_DIR.glob("*.txt"))
            copied = self.gcloud("storage", "cp", *files, f"{bucket}/corpus/smoke/")
            if copied.returncode != 0:
                raise SmokeStopError(f"corpus upload failed: {last_line(copied)}")
            run_root = jobspec.run_root(bucket.removeprefix("gs://"), self.name)
            try:
                status = self._wait(run_root, status_files(cfg))
            except SmokeStopError as stop:
                found = boot_failures(self.gcloud, cfg)
                failed = f"; boot failed on {'; '.join(found)}" if found else ""
                raise SmokeStopError(f"{stop}{failed}") from None
            self._judge(run_root, status, outputs)
        except SmokeStopError as stop:
            self.report.add("run", "complete", str(stop), FAILED)
            self.say(f"error: {stop}")
        finally:
            if deployed:
                self._destroy()
            self._write_report()
        if not deployed:
            return 2  # stopped before anything was created: the settings or the preflight
        return 0 if self.report.passed else 1

    def _ensure_empty_stack(self) -> None:
        """The smoke run ends with `pulumi destroy`: it must never destroy a stack someone uses."""
        self.pulumi("stack", "select", "--create")
        result = self.pulumi("stack", "output", "--json")
        try:
            outputs = json.loads(result.stdout or "{}")
        except ValueError:
            outputs = {}
        if outputs:
            raise SmokeStopError(
                f"stack {self.stack} is deployed ({len(outputs)} outputs); the smoke run "
                "destroys what it creates, so it runs only on a stack with nothing deployed: "
                "use another stack name, or `pulumi destroy` this one first"
            )

    def _outputs(self) -> dict[str, Any]:
        result = self.pulumi("stack", "output", "--json")
        try:
            outputs = json.loads(result.stdout)
        except ValueError:
            raise SmokeStopError(f"pulumi stack output is not JSON: {last_line(result)}") from None
        if "bucketUrl" not in outputs:
            raise SmokeStopError("pulumi stack output has no bucketUrl")
        return outputs

    def _wait(self, run_root: str, files: Sequence[str]) -> dict[str, Any]:
        """Poll status.json and every status file of this run (`files`: each VM's, each slice
        worker's, the watchdog's) until the export is complete, the first one reports a
        failure, or the time is up (bounded; one progress line per change)."""
        started = self.clock()
        previous = ""
        while True:
            status = self.read_json(f"{run_root}/status.json") or {}
            boots = {
                name: self.read_json(f"{run_root}/bootstrap/{name}.json") or {} for name in files
            }
            line = _progress(status, boots)
            if line != previous:
                self.say(f"{self.clock() - started:6.0f}s {line}")
                previous = line
            if (
                self.gcloud(
                    "storage", "ls", f"{run_root}/export/{jobspec.EXPORT_MARKER}"
                ).returncode
                == 0
            ):
                return status
            if status.get("state") == "failed":
                error = (status.get("last_error") or {}).get("error", "") or "status.json: failed"
                raise SmokeStopError(f"the job stopped: {error}")
            for name, doc in boots.items():  # in order: the first failure is the one reported
                stop = _failure(doc)
                if stop:
                    raise SmokeStopError(f"the job stopped: {name}: {stop}")
            if self.clock() - started >= self.timeout_s:
                raise SmokeStopError(
                    f"no complete export after {self.timeout_s / 60:.0f} min (last: {line})"
                )
            self.sleep(self.poll_s)

    def _judge(self, run_root: str, status: dict[str, Any], outputs: dict[str, Any]) -> None:
        listed = self.gcloud("storage", "ls", f"{run_root}/bootstrap/facts-*.json")
        names = sorted(u for u in listed.stdout.split() if u.endswith(".json"))
        if not names:
            self.report.add("host facts", "one file per VM", "none written", FAILED)
        for uri in names:
            doc = self.read_json(uri) or {}
            who = doc.get("name") or one_line(uri.rsplit("/", 1)[-1])
            facts, expected = doc.get("facts", {}), doc.get("expected", {})
            for key, want in sorted(expected.items()):
                if want in ("", None):
                    continue
                seen = str(facts.get(key, ""))
                want_text = {"true": "enabled", "false": "disabled"}.get(want, want)
                verdict = (
                    UNKNOWN if seen in ("", "unknown") else OK if seen == want_text else MISMATCH
                )
                shown = seen or "not readable"
                if verdict != OK and key in FACT_FIXES:
                    shown = f"{shown}; fix: {FACT_FIXES[key]}"
                self.report.add(f"{who}: {key}", want_text, shown, verdict)
            for extra in ("gcloud", "image", "tpu_runtime_unit", "install_seconds"):
                self.report.add(f"{who}: {extra}", "(recorded)", str(facts.get(extra, "")), OK)
        runtime = status.get("runtime") or {}
        want = "tpu" if "tpuName" in outputs else "gpu"
        self.report.add(
            "devices the trainer saw",
            want,
            f"{runtime.get('accelerator', '?')} x {runtime.get('replicas', '?')} replicas",
            OK if runtime.get("accelerator") == want else FAILED,
        )
        # Which backend trained (the stack's choice, docs/backends.md): a steps/s figure is
        # that backend's, to compare with the other backend's run on the same stack.
        self.report.add("training backend", "(recorded)", str(runtime.get("backend", "tf")), OK)
        metrics = (status.get("stages", {}).get("train", {}) or {}).get("metrics", {})
        speed = metrics.get("steps_per_second")
        self.report.add("steps/s", "(measured)", str(speed), OK if speed else UNKNOWN)
        self.report.add(*smoke_rates.against_plan(self.fit, float(speed or 0.0)))
        trace = (
            self.gcloud("storage", "ls", f"{run_root}/profile/**")
            if self.backend == "jax"
            else None
        )
        self.report.add(*smoke_rates.profile_row(self.backend, trace, run_root))
        self._load_export(run_root)

    def _load_export(self, run_root: str) -> None:
        """The export as a user takes it: downloaded (only the exporter's files, checked:
        infra/commands/untrusted.py), loaded with transformers' `from_pretrained` (its
        tokenizer too; no remote code, safetensors only, no download) and run once, on CPU
        (tools/load_export.py)."""
        check = "export loads (from_pretrained + one forward pass, PyTorch CPU)"
        if not self.pt_python.exists():
            self.report.add(
                check, "loads", f"no {self.pt_python}: `make venv-pt` builds it", FAILED
            )
            return
        try:
            local = download_export(
                self.gcloud, f"{run_root}/export", self.report_dir / f"export-{self.name}"
            )
        except ExportError as refused:
            self.report.add(check, "loads", f"refused: {refused}", FAILED)
            self.say(f"error: the export is refused: {refused}")
            return
        loaded = self.run([str(self.pt_python), str(LOAD_EXPORT), str(local)], timeout=900)
        try:
            doc = (
                json.loads(loaded.stdout.strip().splitlines()[-1]) if loaded.returncode == 0 else {}
            )
        except (ValueError, IndexError):
            doc = {}
        if loaded.returncode != 0 or not doc:
            self.report.add(check, "loads", last_line(loaded), FAILED)
            return
        self.report.add(
            check,
            "loads",
            f"{doc.get('class')}: logits {doc.get('logits_shape')} (transformers "
            f"{doc.get('transformers')})",
            OK,
        )

    def _destroy(self) -> None:
        if self.keep:
            self.say(f"KEEP=1: stack {self.stack} stays up; `pulumi destroy --stack {self.stack}`")
            return
        self.say("pulumi destroy")
        down = self.pulumi(
            "destroy", "--yes", "--skip-preview", "--config-file", str(self.config_file)
        )
        self.report.add(
            "pulumi destroy", "exit 0", "exit 0" if down.returncode == 0 else last_line(down),
            OK if down.returncode == 0 else FAILED,
        )  # fmt: skip

    def _write_report(self) -> Path:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        path = self.report_dir / f"smoke-{self.stack}-{stamp}.md"
        verdict = "PASSED" if self.report.passed else "FAILED"
        path.write_text(
            f"# tpu-pretrain smoke run: stack {self.stack}, {verdict}\n\n"
            + self.report.table()
            + "\n\n## Log\n```\n"
            + "\n".join(self.report.log)
            + "\n```\n"
        )
        self.say(f"{verdict}\n{self.report.table()}\nreport: {path}")
        return path


def status_files(cfg: StackConfig) -> list[str]:
    """The bootstrap status files of this stack's run (gs://…/runs/<job>/bootstrap/<name>.json,
    templates/common.sh write_status and the watchdogs' watch_status), in the order the wait
    reports a failure: the controller, the accelerator VM (a slice: worker 0 writes `tpu`,
    every other worker `tpu-worker-<i>`), the watchdog when the stack recovers its VM."""
    accel = cfg.accelerator
    if isinstance(accel, TpuConfig):
        names = ["controller", "tpu", *(f"tpu-worker-{i}" for i in range(1, accel.hosts))]
        watch = "tpu-watch"
    else:
        names, watch = ["controller", "gpu"], "gpu-watch"
    return [*names, watch] if accel.auto_recover else names


def _failure(doc: dict[str, Any]) -> str:
    """The line that ends the wait, or "": a VM's state failed or stopped, a watchdog action
    that failed or that waits for capacity without bound."""
    message = str(doc.get("message", ""))
    if doc.get("state") in ("failed", "stopped"):
        return message or str(doc["state"])
    action = str(doc.get("action", ""))
    if action.endswith("-failed") or action in WATCH_STOPS:
        return f"{action}: {message}"
    return ""


def _progress(status: dict[str, Any], boots: dict[str, dict[str, Any]]) -> str:
    parts = [
        f"{name} {doc.get('state') or doc.get('action')}"
        for name, doc in boots.items()
        if (doc.get("state") or doc.get("action")) is not None
    ]
    if status:
        progress = status.get("progress")
        share = f" {progress:.0%}" if isinstance(progress, (int, float)) else ""
        parts.append(f"job {status.get('stage')} {status.get('state')}{share}")
    return ", ".join(parts) or "waiting for the first status"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m infra.commands.smoke", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--stack", required=True)
    parser.add_argument("--keep", action="store_true", help="do not destroy the stack at the end")
    parser.add_argument("--timeout-min", type=float, default=90.0)
    parser.add_argument(
        "--compile",
        metavar="PYTHON",
        help="the preflight also compiles the job for the stack's TPU type with this "
        f"interpreter of the TPU environment (e.g. {jobfit.TPU_PYTHON}; minutes)",
    )
    args = parser.parse_args(argv)
    return Smoke(
        args.stack,
        keep=args.keep,
        timeout_s=args.timeout_min * 60,
        compile_python=args.compile,
    ).execute()


if __name__ == "__main__":
    sys.exit(main())

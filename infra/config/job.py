"""What the stack takes from its job template, checked before anything is deployed: the
global batch over the accelerator's replicas, the training backend the accelerator VM
installs, Dataflow, and the payload's plan of the job on the accelerator (infra/jobfit.py)."""

from __future__ import annotations

from collections.abc import Mapping

from infra import jobfit, jobspec
from infra.catalogs.dataflow_regions import dataflow_regions
from infra.catalogs.tpu import Catalog
from infra.config.keys import boolean, qualified
from infra.config.types import GpuConfig, TpuConfig
from infra.errors import ConfigError

# The payload's default train.global_batch_size (payload/schema/job.py TrainSpec); infra reads the
# template only as far as it must (the payload validates the whole spec when it starts).
DEFAULT_GLOBAL_BATCH = 32


def _check_replica_batch(
    job_file: str, template: Mapping[str, object], replicas: int, described: str
) -> None:
    """What a multi-replica accelerator (a TPU slice, several GPUs) needs from its job,
    checked before anything is deployed: the global batch splits evenly over every replica
    (the payload checks the same again against the replicas it finds: its backends'
    check_global_batch).
    The output is always gs://<bucket>/runs/<job> (jobspec.render_job_spec; a template with
    its own `output` is refused), which a slice needs: every host reads and worker 0 writes
    there."""
    train = template.get("train")
    train = train if isinstance(train, dict) else {}
    batch = train.get("global_batch_size", DEFAULT_GLOBAL_BATCH)
    if not isinstance(batch, int) or isinstance(batch, bool):
        return  # the payload refuses it with its own message
    if batch % replicas:
        lower = batch // replicas * replicas
        raise ConfigError(
            f"{qualified('job')}: {job_file!r}: train.global_batch_size {batch} must be a multiple "
            f"of the {replicas} replicas of {described}; e.g. {max(lower, replicas)} or "
            f"{lower + replicas}"
        )


def check_job_replicas(
    job_file: str,
    template: Mapping[str, object],
    accelerator: TpuConfig | GpuConfig,
    catalog: Catalog,
) -> None:
    if isinstance(accelerator, GpuConfig):
        if accelerator.count > 1:
            described = f"{accelerator.count} × {accelerator.gpu_name} (one replica per GPU)"
            _check_replica_batch(job_file, template, accelerator.count, described)
        return
    shape = catalog.slice_of(accelerator.accelerator_type)
    if shape is not None:
        described = (
            f"{accelerator.accelerator_type} ({shape.hosts} hosts x {shape.chips_per_host} chips)"
        )
        _check_replica_batch(job_file, template, shape.replicas, described)


# train.backend in a job template (the payload owns the key and validates it again).
BACKENDS = ("tf", "jax", "auto")


def resolve_backend(
    job_file: str,
    template: Mapping[str, object],
    accelerator: TpuConfig | GpuConfig,
    catalog: Catalog,
) -> str:
    """The backend whose environment the accelerator VM installs: the job's train.backend,
    or for auto (or none) jax for a family only the JAX backend trains (jobspec
    JAX_ONLY_FAMILIES, as the payload resolves auto), jax on a slice, jax on a single-host TPU
    VM whose image Google's TF CI does not cover (catalogs/tpu.yaml tf_ci: false, e.g. v6e) and tf
    everywhere else (a GPU VM included). A slice runs JAX only: Google's TF CI runs TensorFlow
    on slices only through its grpc_tpu_worker container, which is not built here
    (docs/pod-slices.md)."""
    train = template.get("train")
    value = train.get("backend", "auto") if isinstance(train, dict) else "auto"
    if value not in BACKENDS:
        raise ConfigError(
            f"{qualified('job')}: {job_file!r}: train.backend {value!r} is not one of: "
            + ", ".join(BACKENDS)
        )
    if value == "auto" and jobspec.model_family(template) in jobspec.JAX_ONLY_FAMILIES:
        value = "jax"
    if isinstance(accelerator, GpuConfig):
        return "jax" if value == "jax" else "tf"
    if accelerator.hosts > 1:
        if value == "tf":
            raise ConfigError(
                f"{qualified('job')}: {job_file!r}: train.backend: tf on a "
                f"{accelerator.accelerator_type} slice is not supported: Google's TF CI runs TF "
                "slices only through its grpc_tpu_worker container (not built here); use "
                "train.backend: jax"
            )
        return "jax"
    if value == "auto":
        return "tf" if catalog.images[accelerator.runtime_version].tf_ci else "jax"
    return str(value)


def dataflow_enabled(
    values: Mapping[str, object], job_file: str, template: Mapping[str, object], region: str
) -> bool:
    """tpu-pretrain:dataflow, off by default: Dataflow is billed outside a TPU grant and its
    grants (a launcher role on the controller) are a stack's explicit choice. A job that
    encodes on Dataflow needs it on; with it on, a job may still encode locally (the stack
    then only offers Dataflow, e.g. to a launch from your own machine: stack output
    dataflowOptions)."""
    enabled = boolean(values, "dataflow")
    if not enabled and jobspec.uses_dataflow(template):
        raise ConfigError(
            f"{qualified('dataflow')}: the job {job_file!r} encodes on Dataflow (data.beam.runner "
            f"{jobspec.DATAFLOW_RUNNER}); set {qualified('dataflow')} to true, or use a local Beam "
            "runner (docs/deploy-gcp.md#dataflow-encoding-at-scale)"
        )
    if enabled and region not in dataflow_regions():
        raise ConfigError(
            f"{qualified('dataflow')}: Dataflow has no regional endpoint in {region} (the stack's "
            "region; infra/catalogs/dataflow_regions.yaml, from Google's Dataflow locations page): "
            "use a stack in a Dataflow region, or encode with a local Beam runner"
        )
    return enabled


def check_job_fits(
    job_file: str,
    template: Mapping[str, object],
    accelerator: TpuConfig | GpuConfig,
    bucket: str,
    backend: str,
) -> str:
    """The payload's plan of the rendered job on the stack's accelerator (infra/jobfit.py):
    a job that cannot fit is refused here, before any resource exists."""
    return plan_job(job_file, template, accelerator, bucket, backend).summary


def plan_job(
    job_file: str,
    template: Mapping[str, object],
    accelerator: TpuConfig | GpuConfig,
    bucket: str,
    backend: str,
) -> jobfit.JobFit:
    """check_job_fits' plan with its figures (parameters, hours). The TF backend trains
    data-parallel only, so its jobs are planned with train.sharding: data."""
    # Where the corpus is encoded (data.runner, data.beam) does not change what training
    # holds in memory; the Dataflow options are rendered with the stack's resources later.
    raw_data = template.get("data")
    data = {
        k: v
        for k, v in (raw_data.items() if isinstance(raw_data, Mapping) else ())
        if k not in ("runner", "beam")
    }
    spec = jobspec.render_job_spec({**template, "data": data}, bucket)
    if backend == "tf" and isinstance(spec.get("train"), dict):
        spec["train"] = {**spec["train"], "sharding": "data"}
    if isinstance(accelerator, GpuConfig):
        name = jobfit.plan_accelerator("gpu", "", accelerator.gpu_type, accelerator.count)
    else:
        name = jobfit.plan_accelerator("tpu", accelerator.accelerator_type, "", 1)
    return jobfit.check_job_fits(f"{qualified('job')}: {job_file!r}", jobspec.to_json(spec), name)

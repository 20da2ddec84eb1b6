"""Dataflow for encoding at scale (tpu-pretrain:dataflow): off by default; when on, every
resource it adds, asserted on the inputs the engine receives, and the Beam options the job
spec carries for a job that encodes on Dataflow (infra/components/dataflow.py,
infra.jobspec.dataflow_options)."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
import yaml
from harness import config_error, of_type, one, run_offline

from infra import jobspec
from infra.render import render

ON = {"tpu-pretrain:dataflow": True}
PROJECT = "tpu-pretrain-test"  # infra.commands.offline.DEFAULT_TEST_PROJECT
SERVICE = "gcp:projects/service:Service"
ACCOUNT = "gcp:serviceaccount/account:Account"
PROJECT_MEMBER = "gcp:projects/iAMMember:IAMMember"
ACCOUNT_MEMBER = "gcp:serviceaccount/iAMMember:IAMMember"
BUCKET_MEMBER = "gcp:storage/bucketIAMMember:BucketIAMMember"
FIREWALL = "gcp:compute/firewall:Firewall"
SUBNET = "gcp:compute/subnetwork:Subnetwork"
JOB_OBJECT = "gcp:storage/bucketObject:BucketObject"
REPOSITORY = "gcp:artifactregistry/repository:Repository"
REPOSITORY_MEMBER = "gcp:artifactregistry/repositoryIamMember:RepositoryIamMember"
ROOT = Path(__file__).resolve().parents[2]


def _named(run, name: str):
    (found,) = [r for r in run.resources if r.name == name]
    return found


def _job_spec(run) -> dict:
    (job,) = [
        r
        for r in of_type(run.resources, JOB_OBJECT)
        if r.inputs.get("contentType") == "application/json"
        and r.inputs["name"] != render.POINTER_OBJECT  # the job pointer (StartupDelivery)
    ]
    return json.loads(job.inputs["content"])


def _template(tmp_path: Path, stack_job: str, data: dict) -> str:
    """The stack's job template with `data` keys added, written where the test owns it;
    returns its absolute path (tpu-pretrain:job takes it as it is)."""
    template = yaml.safe_load((ROOT / stack_job).read_text())
    template["data"] = {**template.get("data", {}), **data}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(template))
    return str(path)


DATAFLOW_DATA = {
    "runner": "beam",
    "beam": {"runner": "DataflowRunner", "options": {"max_num_workers": 8}},
}


@pytest.mark.parametrize("stack", ["v3-euw4", "t4-usc1"])
def test_dataflow_is_off_by_default(stack):
    run = run_offline(stack)
    services = {r.inputs["service"] for r in of_type(run.resources, SERVICE)}
    assert "dataflow.googleapis.com" not in services
    assert "artifactregistry.googleapis.com" not in services
    assert not of_type(run.resources, REPOSITORY) and not of_type(run.resources, REPOSITORY_MEMBER)
    assert not [r for r in run.resources if r.name.startswith("dataflow")]
    assert not [r for r in of_type(run.resources, ACCOUNT) if "dataflow" in r.inputs["accountId"]]
    roles = {r.inputs["role"] for r in of_type(run.resources, PROJECT_MEMBER)}
    assert not {r for r in roles if r.startswith("roles/dataflow.")}
    assert "dataflowOptions" not in run.exports
    assert "data" not in _job_spec(run) or "beam" not in _job_spec(run)["data"]


def test_dataflow_on_creates_exactly_what_the_workers_and_the_launcher_need():
    run = run_offline("v3-euw4", ON)
    prefix = "tp-v3-euw4"
    worker = f"{prefix}-dataflow@{PROJECT}.iam.gserviceaccount.com"
    launcher = f"serviceAccount:{prefix}-controller@{PROJECT}.iam.gserviceaccount.com"
    bucket = f"{PROJECT}-v3-euw4-tpu-pretrain"

    assert _named(run, "apis-dataflow").inputs == {
        "project": PROJECT,
        "service": "dataflow.googleapis.com",
        "disableOnDestroy": False,
        "disableDependentServices": False,
    }
    assert _named(run, "apis-artifactregistry").inputs == {
        "project": PROJECT,
        "service": "artifactregistry.googleapis.com",
        "disableOnDestroy": False,
        "disableDependentServices": False,
    }
    assert _named(run, "dataflow-worker-identity-sa").inputs == {
        "project": PROJECT,
        "accountId": f"{prefix}-dataflow",
        "displayName": "tpu-pretrain v3-euw4: dataflow",
        "createIgnoreAlreadyExists": True,
    }
    # The worker account: the bootstrap's worker role (roles/dataflow.worker without its
    # object create/get on every bucket) on the project and nothing else there (no log/metric
    # writer roles of its own), objects of the stack's bucket: read, and write outside what
    # another identity runs (tests/infra/test_executables.py evaluates the condition).
    worker_project_roles = [
        r for r in of_type(run.resources, PROJECT_MEMBER) if r.inputs["member"].endswith(worker)
    ]
    assert [r.inputs for r in worker_project_roles] == [
        {
            "project": PROJECT,
            "role": f"projects/{PROJECT}/roles/tpuPretrainDataflowWorker",
            "member": f"serviceAccount:{worker}",
        }
    ]
    # Pulumi registers resources whose inputs wait on outputs in no fixed order: compare
    # the set, then read each grant by its name.
    worker_bucket_roles = {
        (r.inputs["bucket"], r.inputs["role"])
        for r in of_type(run.resources, BUCKET_MEMBER)
        if r.inputs["member"].endswith(worker)
    }
    assert worker_bucket_roles == {
        (bucket, "roles/storage.objectViewer"),
        (bucket, "roles/storage.objectUser"),
    }
    read = _named(run, "dataflow-worker-objects-read").inputs
    write = _named(run, "dataflow-worker-objects-write").inputs
    assert (read["role"], "condition" in read) == ("roles/storage.objectViewer", False)
    assert write["role"] == "roles/storage.objectUser"
    assert write["condition"]["title"] == "dataflow-writes-no-executables"
    # The launcher (the controller's account): what Google's "minimal role for creating and
    # managing dataflow jobs" (Dataflow Admin) holds: Developer, plus the bootstrap's role with
    # Admin's two project-level reads (its object permissions: on the stack's bucket only,
    # which the controller reads and writes), and actAs on the worker account only.
    assert _named(run, "dataflow-launcher").inputs == {
        "project": PROJECT,
        "role": "roles/dataflow.developer",
        "member": launcher,
    }
    assert _named(run, "dataflow-launcher-reads").inputs == {
        "project": PROJECT,
        "role": f"projects/{PROJECT}/roles/tpuPretrainDataflowLauncher",
        "member": launcher,
    }
    assert _named(run, "dataflow-launcher-acts-as-worker").inputs == {
        "serviceAccountId": f"projects/{PROJECT}/serviceAccounts/{worker}",
        "role": "roles/iam.serviceAccountUser",
        "member": launcher,
    }
    assert _named(run, "dataflow-allow-workers").inputs == {
        "project": PROJECT,
        "name": f"{prefix}-vpc-allow-dataflow",
        "network": f"projects/{PROJECT}/global/networks/{prefix}-vpc",
        "direction": "INGRESS",
        "allows": [{"protocol": "tcp", "ports": ["12345-12346"]}],
        "sourceTags": ["dataflow"],
        "targetTags": ["dataflow"],
        "logConfig": {"metadata": "INCLUDE_ALL_METADATA"},
    }
    # No image repository and no grant on one: Artifact Registry names cannot be conditioned,
    # so the deploy account gets no power over repositories; the image's builder makes it.
    assert not of_type(run.resources, REPOSITORY) and not of_type(run.resources, REPOSITORY_MEMBER)
    assert not [
        r
        for r in of_type(run.resources, PROJECT_MEMBER)
        if r.inputs["role"].startswith("roles/artifactregistry.")
    ]
    # Nothing else: the component's children are exactly these (plus the account's settle).
    children = sorted(r.name for r in run.resources if r.name.startswith("dataflow"))
    assert children == [
        "dataflow",
        "dataflow-allow-workers",
        "dataflow-launcher",
        "dataflow-launcher-acts-as-worker",
        "dataflow-launcher-reads",
        "dataflow-worker",
        "dataflow-worker-identity",
        "dataflow-worker-identity-sa",
        "dataflow-worker-identity-settle",
        "dataflow-worker-objects-read",
        "dataflow-worker-objects-write",
    ]


def test_grants_naming_the_worker_account_wait_for_it_to_settle_and_the_controller_waits():
    run = run_offline("v3-euw4", ON)
    settle = _named(run, "dataflow-worker-identity-settle")
    for name in (
        "dataflow-worker",
        "dataflow-worker-objects-read",
        "dataflow-worker-objects-write",
        "dataflow-launcher-acts-as-worker",
    ):
        assert settle.urn in _named(run, name).options["dependencies"], name
    controller = one(
        [r for r in run.resources if r.name == "controller-vm"], "gcp:compute/instance:Instance"
    )
    # Depending on the component is depending on its children: the controller may launch a
    # Dataflow job on its first boot, once the grants exist.
    for name in (
        "dataflow-launcher",
        "dataflow-launcher-acts-as-worker",
        "dataflow-launcher-reads",
        "dataflow-worker",
    ):
        assert _named(run, name).urn in controller.options["dependencies"], name


def test_the_stack_exports_the_options_a_launch_from_your_machine_passes():
    run = run_offline("v3-euw4", ON)
    bucket = f"gs://{PROJECT}-v3-euw4-tpu-pretrain"
    assert run.exports["dataflowOptions"] == {
        "project": PROJECT,
        "region": "europe-west4",
        "service_account_email": f"tp-v3-euw4-dataflow@{PROJECT}.iam.gserviceaccount.com",
        "subnetwork": "regions/europe-west4/subnetworks/tp-v3-euw4-vpc-europe-west4",
        "temp_location": f"{bucket}/dataflow/tmp",
        "staging_location": f"{bucket}/dataflow/staging",
        "no_use_public_ips": True,
        "sdk_container_image": "europe-west4-docker.pkg.dev/tpu-pretrain-test/"
        f"tp-v3-euw4-dataflow/encode:{render.build_payload_archive().sha256[:16]}",
    }


def test_the_image_tag_is_the_digest_of_the_uploaded_payload_archive():
    """The job names exactly the image built from the archive the stack uploads: its tag is
    the digest in the archive's name, and the archive holds what the image is built from."""
    run = run_offline("v3-euw4", ON)
    image = run.exports["dataflowOptions"]["sdk_container_image"]
    payload_uri = run.exports["payloadUri"]
    digest = payload_uri.rsplit("tpu-pretrain-payload-", 1)[1].removesuffix(".tar.gz")
    assert image.endswith(f"/encode:{digest}")
    archive = render.build_payload_archive()
    assert payload_uri.endswith(f"/{archive.name}")
    with tarfile.open(fileobj=io.BytesIO(archive.data)) as tar:
        names = set(tar.getnames())
    assert {"requirements/beam.txt", "requirements/beam.Dockerfile", "pyproject.toml"} <= names
    # The Dockerfile the docs show is the file the image is built from.
    doc = (ROOT / "docs/encoding-at-scale.md").read_text()
    dockerfile = (ROOT / "requirements/beam.Dockerfile").read_text()
    body = "\n".join(line for line in dockerfile.splitlines() if not line.startswith("#"))
    assert f"```dockerfile\n{body.strip()}\n```" in doc.replace("\n  ", "\n")


@pytest.mark.parametrize(
    ("stack", "job"),
    [
        ("v3-euw4", "stacks/jobs/bert-small-mlm.yaml"),
        ("l4x2-use1", "stacks/jobs/bert-small-mlm-gpu.yaml"),
    ],
)
def test_a_job_on_dataflow_gets_the_stacks_resources_as_beam_options(tmp_path, stack, job):
    run = run_offline(stack, {**ON, "tpu-pretrain:job": _template(tmp_path, job, DATAFLOW_DATA)})
    beam = _job_spec(run)["data"]["beam"]
    options = beam["options"]
    assert beam["runner"] == "DataflowRunner"
    assert options["max_num_workers"] == 8  # the template's own options are kept
    assert {k: v for k, v in options.items() if k != "max_num_workers"} == run.exports[
        "dataflowOptions"
    ]
    # The options name what the program really creates: the worker account's email (as
    # the mocked IAM answers), the subnet of that region (Private Google Access on: workers
    # without public IPs reach Cloud Storage through it), the stack's bucket.
    (worker,) = [
        r for r in of_type(run.resources, ACCOUNT) if r.inputs["accountId"].endswith("-dataflow")
    ]
    assert options["service_account_email"] == worker.outputs["email"]
    subnets = {
        (r.inputs["region"], r.inputs["name"]): r.inputs for r in of_type(run.resources, SUBNET)
    }
    _, region, _, name = options["subnetwork"].split("/")
    assert region == options["region"]
    assert subnets[(region, name)]["privateIpGoogleAccess"] is True
    (bucket,) = of_type(run.resources, "gcp:storage/bucket:Bucket")
    assert options["temp_location"].startswith(f"gs://{bucket.inputs['name']}/")
    assert options["no_use_public_ips"] is True


def test_a_job_on_dataflow_in_a_stack_without_it_is_a_config_error(tmp_path):
    job = _template(tmp_path, "stacks/jobs/bert-small-mlm.yaml", DATAFLOW_DATA)
    message = config_error("v3-euw4", {"tpu-pretrain:job": job})
    assert message.startswith("tpu-pretrain:dataflow: the job ")
    assert "encodes on Dataflow (data.beam.runner DataflowRunner)" in message
    assert "set tpu-pretrain:dataflow to true" in message


@pytest.mark.parametrize("key", jobspec.DATAFLOW_OPTION_KEYS)
def test_a_template_may_not_set_the_options_infra_owns(tmp_path, key):
    data = {"runner": "beam", "beam": {"runner": "DataflowRunner", "options": {key: "x"}}}
    job = _template(tmp_path, "stacks/jobs/bert-small-mlm.yaml", data)
    message = config_error("v3-euw4", {**ON, "tpu-pretrain:job": job})
    assert f"data.beam.options.{key}: set by infra from the stack" in message


def test_a_local_beam_runner_needs_no_dataflow_and_gets_no_options(tmp_path):
    data = {"runner": "beam", "beam": {"runner": "DirectRunner"}}
    job = _template(tmp_path, "stacks/jobs/bert-small-mlm.yaml", data)
    run = run_offline("v3-euw4", {"tpu-pretrain:job": job})
    assert _job_spec(run)["data"]["beam"] == {"runner": "DirectRunner"}
    assert not [r for r in run.resources if r.name.startswith("dataflow")]


def test_dataflow_must_be_a_boolean():
    # The Pulumi CLI's own type check (Pulumi.yaml declares the key boolean), before the
    # program runs; the program's parse refuses the same (infra.config.keys.boolean).
    message = config_error("v3-euw4", {"tpu-pretrain:dataflow": "sometimes"})
    assert message == "Stack 'v3-euw4' with configuration key 'dataflow' must be of type 'boolean'"


def test_render_refuses_a_dataflow_job_without_a_target():
    """The pure renderer (what the contract test calls) refuses too, not only the config."""
    template = {
        "name": "j",
        "corpus": {"paths": ["a/"]},
        "data": {"runner": "beam", "beam": {"runner": "DataflowRunner"}},
    }
    with pytest.raises(jobspec.JobTemplateError, match=r"tpu-pretrain:dataflow true"):
        jobspec.render_job_spec(template, "b-tpu-pretrain")


def test_the_offline_plan_shows_the_dataflow_resources_and_options():
    from infra.commands import plan

    out = plan.format_plan(run_offline("v3-euw4", ON))
    lines = out.splitlines()

    def row(name: str) -> str:
        [line] = [line for line in lines if f"  {name}  " in line]
        return line

    assert 'service="dataflow.googleapis.com" disableOnDestroy=false' in row("apis-dataflow")
    assert 'accountId="tp-v3-euw4-dataflow"' in row("dataflow-worker-identity-sa")
    assert 'roles/tpuPretrainDataflowWorker"' in row("dataflow-worker")
    assert 'role="roles/storage.objectUser"' in row("dataflow-worker-objects-write")
    assert 'role="roles/dataflow.developer"' in row("dataflow-launcher")
    assert 'role="roles/iam.serviceAccountUser"' in row("dataflow-launcher-acts-as-worker")
    assert 'sourceTags=["dataflow"] targetTags=["dataflow"]' in row("dataflow-allow-workers")
    assert 'roles/tpuPretrainDataflowLauncher"' in row("dataflow-launcher-reads")
    [options] = [line for line in lines if line.startswith("  dataflowOptions: ")]
    shown = json.loads(options.removeprefix("  dataflowOptions: "))
    assert shown["subnetwork"] == "regions/europe-west4/subnetworks/tp-v3-euw4-vpc-europe-west4"
    assert shown == run_offline("v3-euw4", ON).exports["dataflowOptions"]


@pytest.mark.parametrize("stack", ["v4-usc2", "v4-32-usc2"])
def test_dataflow_in_a_region_without_a_dataflow_endpoint_is_refused(stack):
    """us-central2 (the TPU v4 stacks) is not on Google's Dataflow locations page."""
    message = config_error(stack, ON)
    assert message == (
        "tpu-pretrain:dataflow: Dataflow has no regional endpoint in us-central2 (the stack's "
        "region; infra/catalogs/dataflow_regions.yaml, from Google's Dataflow locations page): "
        "use a stack in a Dataflow region, or encode with a local Beam runner"
    )


def test_every_other_stack_region_has_dataflow():
    from infra.catalogs.dataflow_regions import dataflow_regions, dataflow_source

    assert dataflow_source() == "https://docs.cloud.google.com/dataflow/docs/resources/locations"
    for region in ("us-central1", "us-east1", "europe-west4"):
        assert region in dataflow_regions()
    assert "us-central2" not in dataflow_regions()
    for stack in ("v3-euw4", "t4-usc1", "l4x2-use1", "a100x4-usc1"):
        assert "dataflowOptions" in run_offline(stack, ON).exports, stack


def test_the_preview_says_in_one_line_that_the_stack_does_not_build_the_image():
    from infra.program import dataflow_image_note

    run = run_offline("v3-euw4", ON)
    image = run.exports["dataflowOptions"]["sdk_container_image"]
    note = dataflow_image_note("v3-euw4", image)
    assert "\n" not in note
    assert image in note and "docs/deploy-gcp.md" in note and "build and push" in note

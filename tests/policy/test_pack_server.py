"""The real pack, started the way the Pulumi CLI starts a Python policy pack
(`python -m pulumi.policy <engine> policy`), answers the analyzer gRPC protocol: it lists
every rule as mandatory and rejects an insecure resource through `Analyze`/`AnalyzeStack`,
with props serialized by protobuf exactly as the engine sends them."""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import empty_pb2, struct_pb2
from pulumi.runtime.proto import analyzer_pb2, analyzer_pb2_grpc

from policy import rules, storage, vms
from policy.resources import BUCKET, TPU_VM

ROOT = Path(__file__).resolve().parents[2]
START_GUARD_S = 300  # a hang guard only: the pack prints its port within seconds


@pytest.fixture(scope="module")
def analyzer() -> Iterator[analyzer_pb2_grpc.AnalyzerStub]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PULUMI_")}
    process = subprocess.Popen(
        [sys.executable, "-u", "-m", "pulumi.policy", "127.0.0.1:0", "policy"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        selector = selectors.DefaultSelector()
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout=START_GUARD_S):
            pytest.fail(f"policy pack did not print its port within {START_GUARD_S} s")
        line = process.stdout.readline().strip()
        if not line.isdigit():
            process.kill()
            pytest.fail(f"policy pack failed to start: {line!r} {process.stderr.read()}")
        with grpc.insecure_channel(f"127.0.0.1:{line}") as channel:
            yield analyzer_pb2_grpc.AnalyzerStub(channel)
    finally:
        process.terminate()  # the default SIGTERM action: it ends at once
        try:
            process.wait(timeout=START_GUARD_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _struct(props: dict) -> struct_pb2.Struct:
    message = struct_pb2.Struct()
    message.update(props)
    return message


def test_pack_lists_every_rule_as_mandatory(analyzer: analyzer_pb2_grpc.AnalyzerStub) -> None:
    info = analyzer.GetAnalyzerInfo(empty_pb2.Empty())
    assert info.name == rules.PACK_NAME
    names = {policy.name for policy in info.policies}
    assert names == set(rules.POLICY_MESSAGES)
    mandatory = analyzer_pb2.EnforcementLevel.Value("MANDATORY")
    assert {policy.enforcementLevel for policy in info.policies} == {mandatory}


def test_analyze_rejects_a_public_bucket(analyzer: analyzer_pb2_grpc.AnalyzerStub) -> None:
    request = analyzer_pb2.AnalyzeRequest(
        type=BUCKET,
        name="training",
        urn="urn:pulumi:dev::tpu-pretrain::gcp:storage/bucket:Bucket::training",
        properties=_struct(
            {"location": "EUROPE-WEST4", "uniformBucketLevelAccess": False, "versioning": {}}
        ),
    )
    response = analyzer.Analyze(request)
    by_policy = {d.policyName: d.message for d in response.diagnostics}
    assert set(by_policy) == {"bucket-uniform-access", "bucket-public-access-prevention"}
    assert storage.MSG_UNIFORM_ACCESS in by_policy["bucket-uniform-access"]


def test_analyze_accepts_a_secure_bucket(analyzer: analyzer_pb2_grpc.AnalyzerStub) -> None:
    request = analyzer_pb2.AnalyzeRequest(
        type=BUCKET,
        name="training",
        urn="urn:pulumi:dev::tpu-pretrain::gcp:storage/bucket:Bucket::training",
        properties=_struct(
            {
                "location": "EUROPE-WEST4",
                "uniformBucketLevelAccess": True,
                "publicAccessPrevention": "enforced",
            }
        ),
    )
    assert list(analyzer.Analyze(request).diagnostics) == []


def test_analyze_stack_rejects_a_bucket_far_from_the_tpu(
    analyzer: analyzer_pb2_grpc.AnalyzerStub,
) -> None:
    tpu_urn = "urn:pulumi:dev::tpu-pretrain::gcp:tpu/v2Vm:V2Vm::tpu"
    bucket_urn = "urn:pulumi:dev::tpu-pretrain::gcp:storage/bucket:Bucket::data"
    request = analyzer_pb2.AnalyzeStackRequest(
        resources=[
            analyzer_pb2.AnalyzerResource(
                type=TPU_VM,
                name="tpu",
                urn=tpu_urn,
                properties=_struct({"zone": "us-central2-b"}),
            ),
            analyzer_pb2.AnalyzerResource(
                type=BUCKET,
                name="data",
                urn=bucket_urn,
                properties=_struct({"location": "US"}),
            ),
        ]
    )
    [diagnostic] = analyzer.AnalyzeStack(request).diagnostics
    assert diagnostic.policyName == "accelerator-and-bucket-same-region"
    assert diagnostic.urn == bucket_urn
    assert vms.MSG_REGION in diagnostic.message

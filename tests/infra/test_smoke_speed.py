"""What `make smoke` prints of the run's speed (infra/commands/smoke_speed.py): steps/s and MFU
from the status.json the trainer writes, beside the payload's own plan of the smoke job on the
stack's accelerator, and the profile window it asks of a JAX stack. Offline: the plan runs
here (`python -m payload.plan`), the run's figures are a status.json's (smoke_world.py)."""

from __future__ import annotations

import yaml
from smoke_world import PROFILE_TIME, RUN

from infra.commands import smoke_speed


def test_mfu_and_steps_per_second_beside_the_plan(world):
    w = world()
    w.boot("controller")
    w.boot("tpu")
    w.finish_training(steps_per_second=12.5)
    code, runner = w.smoke()
    assert code == 0, w.out.getvalue()
    plan = smoke_speed.plan_of(runner.speed.spec_json, runner.speed.accelerator)
    assert plan is not None and plan["accelerator"]["name"] == "v6e-8"
    assert plan["steps"] == 300 and plan["global_batch_size"] == 64 and plan["seq_length"] == 64
    # Planned: 300 steps in plan["hours"]; measured MFU: 12.5 steps/s of the same FLOPs.
    planned = 300 / (plan["hours"] * 3600)
    flops = 12.5 * 64 * 64 * plan["flops_per_token"]
    mfu = flops / (plan["accelerator"]["chips"] * plan["accelerator"]["peak_flops"])
    rows = w.rows(runner)
    assert rows["steps/s"] == (
        f"{planned:.2f} (plan, at {plan['mfu']:.0%} MFU)",
        f"12.50 ({12.5 / planned:.0%} of plan)",
        "ok",
    )
    assert rows["MFU"] == (f"{plan['mfu']:.0%} (plan)", f"{mfu:.2%}", "ok")
    assert 0 < mfu < plan["mfu"]  # a tiny BERT: far below the plan's assumption
    # The trainer's profile window was asked for in the run's job, and its trace is listed.
    job = yaml.safe_load(w.job.read_text())
    assert job["train"]["profile"] == {"start_step": 151, "steps": 10}
    assert rows["profile"][1:] == ("1 host trace(s): t1v-n-0-w-0.xplane.pb", "ok")
    listed = smoke_speed.profile_files(f"gs://{w.bucket}/runs/{RUN}", runner.gcloud)
    assert listed == [f"gs://{w.bucket}/runs/{RUN}/profile/plugins/profile/{PROFILE_TIME}/"
                      "t1v-n-0-w-0.xplane.pb"]  # fmt: skip


def test_a_missing_trace_fails_and_no_figures_are_unknown(world):
    w = world()
    w.boot("controller")
    w.boot("tpu")
    w.finish_training(steps_per_second=0, profile=False)
    code, runner = w.smoke()
    assert code == 1, w.out.getvalue()
    rows = w.rows(runner)
    assert rows["profile"] == ("steps 151-160 in profile/", "no .xplane.pb written", "FAILED")
    assert rows["steps/s"][1:] == ("not recorded", "unknown")
    assert rows["MFU"][1:] == ("not recorded", "unknown")


def test_a_tf_stack_takes_no_profile(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"name": "smoke", "train": {"steps": 300}}))
    assert not smoke_speed.add_profile(job, "tf")
    assert "profile" not in yaml.safe_load(job.read_text())["train"]
    assert smoke_speed.profile_row("tf", []) == (
        "profile", "(JAX backend only)", "not taken: the stack trains on tf", "ok",
    )  # fmt: skip
    assert smoke_speed.add_profile(job, "jax")
    assert yaml.safe_load(job.read_text())["train"]["profile"] == smoke_speed.PROFILE_WINDOW

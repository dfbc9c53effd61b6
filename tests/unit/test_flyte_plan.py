"""`relax plan --flyte`: what a Flyte 1.16 cluster would refuse, clamp or kill, said before a run
is registered (relax_core/ops/flyte_plan.py). One test per check, and every shipped config
against the limits docs/cluster.md tells the operator to set."""

from __future__ import annotations

import argparse
import glob
import os

import pytest

from relax_core.config import load_config, replace
from relax_core.entrypoints import plan as plan_cli
from relax_core.ops import asks
from relax_core.ops.flyte_plan import RECOMMENDED, STOCK, flyte_plan, parse_limits, render_flyte

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ON_CLUSTER = {"storage": {"root": "s3://my-bucket/relax"}}
TRACKING = {"tracking_uri": "http://mlflow.example:5000"}
ONE_MACHINE = {"vllm-cpu"}
"""Configs that start an engine server the default image does not hold: one machine only."""


def _cfg(name: str, **sections):
    cfg = load_config(os.path.join(REPO, "configs", f"{name}.yaml"))
    return replace(cfg, **sections) if sections else cfg


def _on_cluster(name: str, **more):
    cfg = _cfg(name)
    return replace(cfg, **ON_CLUSTER, tracking={**TRACKING}, **more)


def _shipped() -> list[str]:
    return sorted(os.path.basename(p)[: -len(".yaml")] for p in glob.glob(f"{REPO}/configs/*.yaml"))


@pytest.mark.parametrize("name", _shipped())
def test_every_shipped_config_is_clean_on_a_cluster_set_as_the_docs_say(name):
    plan = flyte_plan(_on_cluster(name), RECOMMENDED)
    if name in ONE_MACHINE:
        (problem,) = plan.problems
        assert (
            "rollout.engine 'vllm'" in problem and "default image, which holds no vllm" in problem
        )
        return
    assert plan.problems == (), render_flyte(plan)
    # ... and against stock limits every one is refused, naming the setting to raise.
    stock = flyte_plan(_on_cluster(name), STOCK)
    text = "\n".join(stock.problems)
    assert "memory: " in text and "flyteadmin refuses to register" in text
    assert "configmap.task_resource_defaults.task_resources.limits.memory" in text
    assert "configuration.inline.task_resources.limits.memory" in text


def test_a_gpu_role_over_the_limits_is_named_as_clamped_not_refused():
    cfg = _on_cluster("qwen3-30b-a3b-moe-r3", services={"start_timeout_s": 4800})
    problems = flyte_plan(cfg, parse_limits("cpu=256,memory=2Ti,gpu=4")).problems
    (gpu,) = problems
    # The trainer's 8 GPUs: refused at registration (its registered task), and clamped to 4
    # when rl_run starts it with the run's own asks.
    assert gpu.startswith("gpu: ") and "trainer_service 8" in gpu
    assert "propeller silently clamps trainer_service to 4" in gpu
    assert "task_resources.limits.gpu" in gpu and "to at least 8" in gpu


def test_tasks_a_run_never_starts_are_registered_light():
    # The 8-GPU node run starts every role in one async_local pod: its role tasks register
    # light, so an unused 8-GPU trainer task does not stop the registration.
    cfg = _cfg("qwen3-4b-8xgpu")
    assert asks.registered_ask(cfg, "trainer_service").gpus == 0
    assert asks.registered_ask(cfg, "async_local").gpus == 8
    tasks_cfg = _cfg("qwen3-30b-a3b-moe-r3")
    assert asks.registered_ask(tasks_cfg, "async_local").gpus == 0
    assert asks.registered_ask(tasks_cfg, "trainer_service").gpus == 8


def test_roles_that_give_up_before_a_pending_trainer_starts_are_named():
    cfg = _on_cluster("qwen3-30b-a3b-moe-r3", services={"start_timeout_s": 300})
    (problem,) = flyte_plan(cfg, RECOMMENDED).problems
    assert problem.startswith("services.start_timeout_s: 300 s, shorter than cluster.pending_s")
    assert "no gang scheduling" in problem and "at least 3600" in problem


def test_the_plan_prints_each_task_s_timeout_and_the_2t_deadline():
    cfg = _on_cluster("cpu-default", train={"total_steps": 2000, "steps_per_node": 25})
    text = render_flyte(flyte_plan(cfg, RECOMMENDED))
    # 25 steps x 600 s + pending 1 h + start-up 20 min = 5.5 h, in whole hours
    assert "rl_steps                 default  cpu 2/4, memory 8/16Gi; T 6 h, retries 3" in text
    assert "rl_run T 480 h, killed at 2T = 960 h from first queueing, retries included" in text
    assert "loop: 80 rl_steps nodes of 25 steps in 9 rl_segment nodes of at most 9" in text


def test_a_loop_too_wide_for_one_dynamic_is_named():
    cfg = _on_cluster("cpu-default", train={"total_steps": 5_000_000, "steps_per_node": 1})
    (problem,) = flyte_plan(cfg, RECOMMENDED).problems
    assert problem.startswith("train.steps_per_node: 1 makes 5000000 nodes, 2237 in one @dynamic")


def test_state_and_tracking_on_a_pod_s_disk_and_a_local_model_are_named(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    cfg = replace(_cfg("qwen3-4b-8xgpu"), model={"source": str(tmp_path)})
    problems = flyte_plan(cfg, RECOMMENDED).problems
    named = {p.split(":", 1)[0] for p in problems}
    assert named == {"storage.root", "tracking.tracking_uri", "model.source"}
    model = next(p for p in problems if p.startswith("model.source"))
    assert "aws s3 sync" in model
    # A URL, a registry model and a packaged GGUF are all reachable from a pod.
    for source in ("s3://my-bucket/models/Qwen3-4B", "models:/policy/3"):
        ok = replace(cfg, model={"source": source}, storage=ON_CLUSTER["storage"])
        ok = replace(ok, tracking={**TRACKING})
        assert not flyte_plan(ok, RECOMMENDED).problems, source


def test_more_roles_than_the_max_parallelism_are_named():
    cfg = _on_cluster(
        "qwen3-30b-a3b-moe-r3",
        services={"rollout_workers": 30, "max_rollout_workers": 30, "start_timeout_s": 4800},
    )
    problems = flyte_plan(cfg, RECOMMENDED).problems
    (problem,) = (p for p in problems if p.startswith("services.rollout_workers"))
    assert "32 role tasks must all run at once, over the max parallelism 25" in problem
    assert "`--max-parallelism 32`" in problem and "flyteadmin.maxParallelism" in problem


def test_gpu_runs_are_told_the_node_label_driver_and_secret():
    notes = " ".join(flyte_plan(_on_cluster("qwen3-30b-a3b-moe-r3"), RECOMMENDED).notes)
    assert "k8s.amazonaws.com/accelerator=nvidia-h100" in notes
    assert "R580" in notes and "create secret generic relax-sglang" in notes
    assert not flyte_plan(_on_cluster("cpu-default"), RECOMMENDED).notes


def test_other_clouds_accelerator_names_are_accepted_and_planned():
    cfg = _on_cluster("qwen3-4b-8xgpu", services={"accelerator": "nvidia-h100-80gb"})
    assert "k8s.amazonaws.com/accelerator=nvidia-h100-80gb" in flyte_plan(cfg, RECOMMENDED).notes[0]
    from relax_core.plan.memory import plan_gpu

    assert plan_gpu(cfg).name == "NVIDIA H100 80GB"
    unknown = replace(cfg, services={"accelerator": "nvidia-b300", "gpu_memory_gib": 268})
    assert plan_gpu(unknown).gib == 268


def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    plan_cli.add_arguments(parser)
    return plan_cli.run(parser.parse_args(list(argv)))


def test_the_command_exits_1_on_problems_0_when_clean_and_2_on_bad_input(capsys):
    cfg = os.path.join(REPO, "configs", "cpu-default.yaml")
    assert _cli("--cfg", cfg, "--flyte") == 1  # stock limits, local storage
    out = capsys.readouterr().out
    assert "Flyte would refuse, clamp or kill:" in out and "storage.root: '.relax'" in out
    sets = ["--set", "storage.root=s3://b/relax", "--set", "tracking.tracking_uri=http://m:5000"]
    assert _cli("--cfg", cfg, "--flyte", "--limits", "recommended", *sets) == 0
    out = capsys.readouterr().out
    assert "Flyte: every task registers and runs within the cluster's limits" in out
    # places derived from storage.root follow a root given with --set
    assert "queue.root" not in out
    assert _cli("--cfg", cfg) == 0  # without --flyte: the memory plan only
    assert _cli("--cfg", cfg, "--flyte", "--limits", "cpu=4") == 2
    assert "missing gpu, memory" in capsys.readouterr().err
    assert _cli("--cfg", cfg, "--set", "train.nope=1") == 2
    assert "train.nope: unknown field" in capsys.readouterr().err

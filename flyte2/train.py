"""`train`: one RL run as Flyte 2 tasks, beside the flytekit workflow of workflows/train.py.

    flyte run --local flyte2/train.py train --cfg configs/cpu-default.yaml   # colocate
    flyte run --local flyte2/train.py train --cfg configs/cpu-async.yaml     # async, processes

The task bodies are tasks/bodies.py's, the ones the flytekit tasks call, so both entry points run
the same code and give the same run. `train` is the driver: it validates the config and
fingerprints the data (prepare_data, in its own light pod), picks the cached starting policy
(prepare_policy), starts the run (start_run: eval at step 0, checkpoint v0), runs the steps and
finishes (finish_run: final eval, registered model, the run report as this task's report). Each
call carries the run's own asks (relax_core/ops/asks.py through flyte2/asks.py) as `.override`:
- colocate: a plain `while` loop of rl_steps calls of `train.steps_per_node` steps each, every
  call a sibling under the driver, so a run of any length is one level deep;
- async, `services.launch: processes`: one async_local call that starts every role as an OS
  process (Flyte 2's local tasks are threads of one process, so roles cannot be tasks there);
- async, `services.launch: tasks` (a cluster): one task per role, gathered side by side; the
  trainer's final checkpoint is what finish_run waits for.

`--cfg` is a run config file (YAML, read by load_config exactly as `relax run` and pyflyte read
it) or a config as JSON text (what the nightly trigger carries), not a Flyte dataclass input:
Flyte 2 would decode `RunConfig` with its own rules (unknown fields dropped, no validation).
"""

from __future__ import annotations

import asyncio
import json
import os

import flyte

from flyte2.asks import call_overrides, image_kind, image_uri
from relax_core.config import RunConfig, config_to_dict, load_config
from relax_core.config.load import ConfigError
from relax_core.ops import asks
from relax_core.run.policy_code import policy_code_version
from tasks import bodies
from tasks.bodies import RunSummary
from tasks.resources import registration_config
from workflows.nightly import NIGHTLY_CRON, nightly_config

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

REGISTERED = registration_config()
"""The config the environments take their image and default resources from ($RELAX_CONFIG, else
the default: CPU only); every call then asks what the run's own config decides."""
MODEL_IMAGE = image_kind(REGISTERED, "rl_steps")

model_env = flyte.TaskEnvironment(
    name="relax-model",
    image=image_uri(MODEL_IMAGE),
    resources=flyte.Resources(cpu=2, memory="8Gi"),
    description="Tasks that hold the policy (the trainer image on GPUs).",
)
env = flyte.TaskEnvironment(
    name="relax",
    image=image_uri("default"),
    resources=flyte.Resources(cpu=(2, 4), memory=("8Gi", "16Gi")),
    depends_on=[model_env],
    description="The run's driver and its light tasks (default image).",
)


@env.task
def prepare_data(cfg_json: str) -> str:
    """Validate everything the run needs (its GPUs' memory plan included) before any work;
    returns the bodies' Prepared as JSON."""
    return json.dumps(bodies.prepare_data(RunConfig.from_json(cfg_json))._asdict())


@model_env.task(cache=flyte.Cache(behavior="auto", version_override=policy_code_version()))
def prepare_policy(spec_json: str, cache_dir: str, storage_json: str) -> str:
    """The starting policy, cached on exactly the settings that determine it."""
    return bodies.prepare_policy(spec_json, cache_dir, storage_json)


@model_env.task
def start_run(cfg_json: str, policy_dir: str) -> str:
    """New run: held-out eval at step 0 and checkpoint v0. Resume: the checkpoint to continue."""
    return bodies.start_run(cfg_json, policy_dir)


@model_env.task
def rl_steps(cfg_json: str, checkpoint: str) -> str:
    """Up to `train.steps_per_node` RL steps from `checkpoint`; returns the newest checkpoint."""
    return bodies.rl_steps(cfg_json, checkpoint)


@model_env.task
def async_local(cfg_json: str, checkpoint: str) -> str:
    """Async mode on one machine (or one big pod): every role a supervised OS process."""
    return bodies.async_local(cfg_json, checkpoint)


@model_env.task
def trainer_service(cfg_json: str, checkpoint: str) -> str:
    """Async mode on a cluster: the trainer role; returns the final checkpoint."""
    return bodies.trainer_service(cfg_json, checkpoint)


@model_env.task
def rollout_service(cfg_json: str, checkpoint: str, worker: int) -> None:
    """Async mode on a cluster: one rollout worker (engine + rewards)."""
    bodies.serve("rollout", cfg_json, checkpoint, worker)


@env.task
def sglang_rollout_service(cfg_json: str, checkpoint: str, worker: int) -> None:
    """Async mode on a cluster: one rollout worker driving its pod's SGLang sidecar."""
    bodies.serve("rollout", cfg_json, checkpoint, worker)


@model_env.task
def reference_service(cfg_json: str, checkpoint: str) -> None:
    """Async mode on a cluster: frozen reference / teacher log-probs."""
    bodies.serve("reference", cfg_json, checkpoint)


@model_env.task
def actor_fwd_service(cfg_json: str, checkpoint: str) -> None:
    """Async mode on a cluster: proximal log-probs under the newest trainer weights."""
    bodies.serve("actor_fwd", cfg_json, checkpoint)


@env.task
def advantages_service(cfg_json: str, checkpoint: str) -> None:
    """Async mode on a cluster: group-normalized advantages (CPU only)."""
    bodies.serve("advantages", cfg_json, checkpoint)


@model_env.task(report=True)
def finish_run(cfg_json: str, checkpoint: str) -> RunSummary:
    """Final held-out eval, close the MLflow run, register the policy; the run report (curves,
    staleness, time per role, MLflow link) is this task's report."""
    summary = bodies.finish_run(cfg_json, checkpoint)
    flyte.report.replace(bodies.run_report_page(cfg_json, summary.mlflow_run_id), do_flush=True)
    return summary


ROLE_TASKS = {
    "rollout_service": rollout_service,
    "sglang_rollout_service": sglang_rollout_service,
    "reference_service": reference_service,
    "actor_fwd_service": actor_fwd_service,
    "advantages_service": advantages_service,
    "trainer_service": trainer_service,
}


def read_config(cfg: str) -> RunConfig:
    """The run config `cfg` names: a YAML file (load_config), or a config as JSON text."""
    if os.path.isfile(cfg):
        return load_config(cfg)
    if cfg.lstrip().startswith("{"):
        return RunConfig.from_json(cfg)
    raise ConfigError(
        f"--cfg {cfg!r}: no such file (cwd {os.getcwd()}), nor a config as JSON text; pass a "
        "run config YAML such as configs/cpu-default.yaml"
    )


def _task(cfg: RunConfig, name: str, task, remaining: int | None = None, timeout_s: float = 0):
    """`task` with the run's own asks for this call; on a cluster, refused when the run needs
    another image than its environment was deployed with (Flyte 2 fixes images per env)."""
    if flyte.ctx().mode != "local" and task.parent_env_name == model_env.name:
        needed = image_kind(cfg, name)
        if needed != MODEL_IMAGE:
            raise ValueError(
                f"{name} of this run needs the {needed} image, but the {model_env.name} tasks "
                f"were deployed with the {MODEL_IMAGE} image: deploy with RELAX_CONFIG naming "
                "this run's config (its services.accelerator decides the image)"
            )
    return task.override(**call_overrides(cfg, name, remaining, timeout_s))


async def run_steps(cfg: RunConfig, cfg_json: str, checkpoint: str) -> str:
    """The steps of the run from `checkpoint` (a new run's version 0, or the one resumed)."""
    version = bodies.trained(cfg, checkpoint)
    left = asks.remaining_steps(cfg, version)
    execution = bodies.execution_of(cfg)
    if execution == "colocate":
        step = _task(cfg, "rl_steps", rl_steps)
        while version < cfg.train.total_steps:
            checkpoint = await step.aio(cfg_json, checkpoint)
            before, version = version, bodies.trained(cfg, checkpoint)
            if version <= before:  # a call that trains nothing would loop forever
                raise RuntimeError(f"rl_steps from {checkpoint} trained no step (v{version})")
        return checkpoint
    if execution == "async-processes":
        return await _task(cfg, "async_local", async_local, left).aio(cfg_json, checkpoint)
    if flyte.ctx().mode == "local":
        raise ValueError(
            "services.launch: tasks runs each role as a task of its own pod; Flyte 2 runs local "
            "tasks as threads of one process, so run this config locally with "
            "services.launch: processes"
        )
    *services, trainer = asks.role_tasks(cfg)
    calls, workers = [], {}
    for name in services:
        args = [cfg_json, checkpoint]
        if name.endswith("rollout_service"):
            workers[name] = workers.get(name, -1) + 1
            args.append(workers[name])
        calls.append(_task(cfg, name, ROLE_TASKS[name], left).aio(*args))
    final, *_ = await asyncio.gather(
        _task(cfg, trainer, ROLE_TASKS[trainer], left).aio(cfg_json, checkpoint), *calls
    )
    return final


async def train_config(cfg: RunConfig) -> RunSummary:
    """A whole run of `cfg` (the body of `train`, for callers holding a RunConfig)."""
    prepared = json.loads(
        await _task(cfg, "prepare_data", prepare_data).aio(
            json.dumps(config_to_dict(cfg), sort_keys=True)
        )
    )
    cfg_json = prepared["cfg_json"]
    spec = bodies.policy_spec(cfg_json, prepared["data_fingerprint"])
    policy_dir = await _task(cfg, "prepare_policy", prepare_policy).aio(
        spec, prepared["policy_cache"], prepared["storage_json"]
    )
    checkpoint = await _task(cfg, "start_run", start_run).aio(cfg_json, policy_dir)
    checkpoint = await run_steps(cfg, cfg_json, checkpoint)
    return await _task(cfg, "finish_run", finish_run).aio(cfg_json, checkpoint)


NIGHTLY = flyte.Trigger(
    name="nightly_grpo",
    automation=flyte.Cron(NIGHTLY_CRON),
    inputs={"cfg": json.dumps(config_to_dict(nightly_config()), sort_keys=True)},
    description="The nightly GRPO run from the newest registered policy (workflows/nightly.py).",
)
"""workflows/launch_plans.py's nightly plan for Flyte 2: the registration config with the nightly
recipe, baked in as JSON text at deployment, every night at 02:00 UTC."""


@env.task(entrypoint=True, triggers=NIGHTLY)
async def train(cfg: str) -> RunSummary:
    """One RL run of the config `cfg` (a YAML file, or the config as JSON text)."""
    return await train_config(read_config(cfg))


@model_env.task(entrypoint=True)
def evaluate(
    cfg: str, checkpoint: str = "", model: str = "", k: int = 8, samples: int = 8
) -> dict[str, float | int | str]:
    """Greedy pass@1, sampled pass@k and mean reward on cfg's eval split of a checkpoint
    directory or a registered model version (exactly one of the two), as its own MLflow run."""
    from relax_core.run.evaluate import evaluate_checkpoint

    result = evaluate_checkpoint(read_config(cfg), checkpoint, k=k, n_samples=samples, model=model)
    print(f"eval of {result['checkpoint']}: pass@1 {result['eval_accuracy']:.3f}", flush=True)
    return result

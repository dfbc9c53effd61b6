"""Every task that starts an engine's server on a cluster runs in an image that holds that engine,
checked offline: the engines of each image are read from its Dockerfile (what a build installs and
where the server's Python is found), and every task of every shipped config, with each rollout
engine it accepts, is matched against the image tasks/resources.py gives it. A CPU-only run whose
tasks would start a server (the default image holds none) is refused, naming the settings."""

from __future__ import annotations

import glob
import os
import re

import pytest

from relax_core.config import RunConfig, load_config, replace
from tasks import pods, resources

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENGINES = ("sglang", "vllm")


def _read(path: str) -> str:
    with open(os.path.join(REPO, path)) as f:
        return f.read()


def engines_installed(dockerfile: str) -> dict[str, str]:
    """engine -> version a server of it starts with in an image built from `dockerfile`: pip
    installed into the venv whose Python $RELAX_<ENGINE>_PYTHON names, or, in an image whose
    ENTRYPOINT starts the server with the Python on PATH (the SGLang sidecar), into that venv."""
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", dockerfile, re.M))
    text = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), dockerfile)
    out = {}
    for engine in ENGINES:
        python = re.search(rf"\bRELAX_{engine.upper()}_PYTHON=(\S+)/bin/python\b", text)
        if python:
            pip = re.escape(python.group(1)) + r"/bin/pip"
        elif "ENTRYPOINT" in text and re.search(r"\bPATH=(\S+)/bin:\$PATH", text):
            pip = r"(?<![/\w])pip"
        else:
            continue
        found = re.search(rf"{pip} install [^\n]*\b{engine}==([\d.]+)", text)
        if found:
            out[engine] = found.group(1)
    return out


def _variants() -> list[tuple[str, RunConfig]]:
    """Every shipped config with each rollout engine it accepts."""
    out = []
    for path in sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml"))):
        cfg = load_config(path)
        for engine in ("torch", *ENGINES):
            try:
                variant = replace(cfg, rollout={"engine": engine})
            except ValueError:  # refused at load: never reaches a cluster
                continue
            out.append((f"{os.path.basename(path)} engine {engine}", variant))
    return out


def misplaced(installed: dict[str | None, dict[str, str]]) -> list[str]:
    """Tasks of the shipped configs that would start a server their image lacks (`installed`:
    image -> engines, as the Dockerfiles give them)."""
    out = []
    for name, cfg in _variants():
        for task in resources.TASKS:
            served = resources.engine_served(cfg, task)
            try:
                ask = resources.task_ask(cfg, task)
            except ValueError as refused:
                assert served and not cfg.services.accelerator, (name, task, refused)
                assert "name services.accelerator" in str(refused)
                continue
            if task == "sglang_rollout_service":  # the engine is its sidecar's
                served, image = "sglang", pods.ROLLOUT_IMAGE
                assert ask.pod_template.pod_spec.containers[1].image == image
            else:
                image = ask.image
            if served and served not in installed[image]:
                out.append(f"{name}: {task} starts {served} in {pods.DOCKERFILES[image]}")
    return out


def test_every_task_that_starts_an_engine_server_runs_where_the_engine_is_installed():
    installed = {image: engines_installed(_read(path)) for image, path in pods.DOCKERFILES.items()}
    assert {image: tuple(sorted(e)) for image, e in installed.items()} == pods.IMAGE_ENGINES
    assert misplaced(installed) == []
    # The engines the session tasks start are the ones the rollout images serve.
    rollout = engines_installed(_read("containers/rollout/Dockerfile"))
    vllm = re.search(r"vllm==([\d.]+)", _read("containers/rollout/Dockerfile.vllm"))
    trainer = installed[pods.TRAINER_IMAGE]
    assert trainer == {"sglang": rollout["sglang"], "vllm": vllm.group(1)}
    # An image built without an engine is caught: the trainer without its SGLang venv.
    dockerfile = _read(pods.DOCKERFILES[pods.TRAINER_IMAGE])
    without = re.sub(r"ENV RELAX_SGLANG_PYTHON=\S+\n", "", dockerfile)
    stripped = {**installed, pods.TRAINER_IMAGE: engines_installed(without)}
    problems = misplaced(stripped)
    assert "qwen3-4b-8xgpu.yaml engine sglang: rl_steps starts sglang in " in "\n".join(problems)
    assert not any(" starts vllm " in p for p in problems)


def test_a_cpu_run_whose_tasks_start_a_server_is_refused_for_a_cluster():
    cfg = load_config(os.path.join(REPO, "configs", "vllm-cpu.yaml"))
    assert not cfg.services.accelerator
    with pytest.raises(ValueError, match=r"rollout.engine 'vllm': the rl_steps task starts"):
        resources.task_ask(cfg, "rl_steps")
    # Its light tasks still register; so does the same run with the torch engine.
    assert resources.task_ask(cfg, "prepare_data").image is None
    assert resources.task_ask(replace(cfg, rollout={"engine": "torch"}), "rl_steps").image is None

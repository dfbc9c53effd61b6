"""The role images and the SGLang sidecar's start script (containers/). No image is built here
(no registry access); these check what a build would silently get wrong: versions that drift
from pyproject.toml's pins, and a sidecar that starts serving a half-written policy."""

from __future__ import annotations

import os
import re
import subprocess
import time
import tomllib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVE = os.path.join(REPO, "containers", "rollout", "serve.sh")


def _read(*parts: str) -> str:
    with open(os.path.join(REPO, *parts)) as f:
        return f.read()


def _project() -> dict:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def test_trainer_image_is_cuda_with_the_megatron_extra_of_this_project():
    dockerfile = _read("containers", "trainer", "Dockerfile")
    assert re.search(r"^FROM nvidia/cuda:\S+-devel-ubuntu24\.04$", dockerfile, re.M)
    assert "pip install --no-cache-dir '.[megatron]'" in dockerfile
    megatron = _project()["optional-dependencies"]["megatron"]
    assert any(r.startswith("megatron-core==") for r in megatron), megatron
    # The image installs the project itself, so its torch is pyproject's pin (a CUDA build).
    assert "torch==2.13.0" in _project()["dependencies"]


def test_rollout_image_pins_sglang_and_starts_the_sidecar_script():
    dockerfile = _read("containers", "rollout", "Dockerfile")
    assert re.search(r"pip install --no-cache-dir sglang==\d+\.\d+\.\d+", dockerfile)
    assert "python3.11" in dockerfile  # the sglang wheel is built for CPython 3.11 only
    assert "COPY containers/rollout/serve.sh /opt/relax/serve.sh" in dockerfile
    assert os.access(SERVE, os.X_OK)


def test_sidecar_waits_for_the_complete_policy_then_serves_it_on_loopback(tmp_path):
    # A stand-in `python3` on PATH records how the server would be started.
    bin_dir, model = tmp_path / "bin", tmp_path / "models" / "policy"
    bin_dir.mkdir()
    model.mkdir(parents=True)
    record = tmp_path / "argv"
    fake = bin_dir / "python3"
    fake.write_text(f'#!/bin/sh\necho "$@" > {record}\n')
    fake.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "RELAX_MODEL_DIR": str(model),
        "SGLANG_TP": "2",
        "RELAX_POLL_S": "0.1",
    }
    proc = subprocess.Popen(["sh", SERVE], env=env)
    try:
        time.sleep(1.0)
        assert proc.poll() is None and not record.exists()  # no READY yet: still waiting
        (model / "VERSION").write_text("5")
        (model / "READY").write_text("")
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
    argv = record.read_text().split()
    assert argv[:2] == ["-m", "sglang.launch_server"]
    assert argv[argv.index("--model-path") + 1] == str(model)
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--port") + 1] == "30000"
    assert argv[argv.index("--tp-size") + 1] == "2"
    assert argv[argv.index("--weight-version") + 1] == "5"  # the published policy's VERSION
    assert "--skip-tokenizer-init" in argv  # token ids in and out, as the rollout client sends


def test_sidecar_refuses_to_start_without_a_model_directory():
    env = {k: v for k, v in os.environ.items() if k != "RELAX_MODEL_DIR"}
    out = subprocess.run(["sh", SERVE], env=env, capture_output=True, text=True, timeout=10)
    assert out.returncode != 0
    assert "RELAX_MODEL_DIR must name the shared policy directory" in out.stderr

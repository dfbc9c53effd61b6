"""The role images and the SGLang sidecar's start script (containers/). No image is built here
(no registry access); these check what a build would silently get wrong: versions that drift
from pyproject.toml's pins, a sidecar that starts serving a half-written policy, and one that
serves beyond loopback without an API key."""

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


def _fake_python(tmp_path):
    """A stand-in `python3` on PATH that records how the server would be started."""
    bin_dir, record = tmp_path / "bin", tmp_path / "argv"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text(f'#!/bin/sh\necho "$@" > {record}\n')
    fake.chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}", record


def _flags(argv: list[str]) -> dict[str, str]:
    return {a: b for a, b in zip(argv, argv[1:], strict=False) if a.startswith("--")}


def test_sidecar_waits_for_the_complete_policy_then_serves_it_on_the_pod_address(tmp_path):
    path, record = _fake_python(tmp_path)
    model = tmp_path / "models" / "policy"
    model.mkdir(parents=True)
    env = {
        **os.environ,
        "PATH": path,
        "RELAX_MODEL_DIR": str(model),
        "RELAX_SGLANG_API_KEY": "k3y",
        "RELAX_POLL_S": "0.1",
    }
    # The pod passes the launch flags its run's config decides as arguments.
    flags = ["--tp-size", "2", "--enable-return-routed-experts"]
    proc = subprocess.Popen(["sh", SERVE, *flags], env=env)
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
    got = _flags(argv)
    assert got["--model-path"] == str(model)
    # Every interface, so the trainer in another pod reaches it, and only with the run's key.
    assert got["--host"] == "0.0.0.0" and got["--api-key"] == "k3y"
    assert got["--port"] == "30000"
    assert got["--tp-size"] == "2" and "--enable-return-routed-experts" in argv
    assert got["--weight-version"] == "5"  # the published policy's VERSION
    assert "--skip-tokenizer-init" in argv  # token ids in and out, as the rollout client sends


def test_sidecar_refuses_to_serve_beyond_loopback_without_an_api_key(tmp_path):
    path, record = _fake_python(tmp_path)
    model = tmp_path / "policy"
    model.mkdir()
    (model / "READY").write_text("")
    env = {k: v for k, v in os.environ.items() if k != "RELAX_SGLANG_API_KEY"}
    env.update(PATH=path, RELAX_MODEL_DIR=str(model))
    out = subprocess.run(["sh", SERVE], env=env, capture_output=True, text=True, timeout=10)
    assert out.returncode == 2 and not record.exists()
    assert "RELAX_SGLANG_API_KEY is empty" in out.stderr
    # On loopback nobody outside the pod reaches it: no key needed, none passed.
    out = subprocess.run(
        ["sh", SERVE], env={**env, "SGLANG_HOST": "127.0.0.1"}, timeout=10, check=True
    )
    argv = record.read_text().split()
    assert _flags(argv)["--host"] == "127.0.0.1" and "--api-key" not in argv


def test_sidecar_refuses_to_start_without_a_model_directory():
    env = {k: v for k, v in os.environ.items() if k != "RELAX_MODEL_DIR"}
    out = subprocess.run(["sh", SERVE], env=env, capture_output=True, text=True, timeout=10)
    assert out.returncode != 0
    assert "RELAX_MODEL_DIR must name the shared policy directory" in out.stderr

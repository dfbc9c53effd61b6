"""The LoRA side of the stand-in SGLang server: adapters loaded by name and applied per request.

Rules copied from SGLang 0.5.23 (facts, not code):
- launch (srt/arg_groups/lora_hook.py, check_lora_server_args): `--enable-lora` with no
  `--lora-paths` needs both `--max-lora-rank` and `--lora-target-modules` (an assertion: the
  server does not start); module names are SGLang's (argparse choices); `--max-loras-per-batch`
  (default 8) adapters, the base included, run in one batch, the scheduler holding back the rest;
- the server's target modules and an adapter's are compared normalized (srt/lora/utils.py,
  get_normalized_target_modules): q/k/v_proj -> qkv_proj, gate/up_proj -> gate_up_proj;
- `/load_lora_adapter_from_tensors` and `/unload_lora_adapter`
  (srt/managers/tokenizer_control_mixin.py) answer {rid, http_worker_ipc, success,
  error_message, loaded_adapters}, HTTP 400 when not a success: without --enable-lora ("LoRA is
  not enabled..."); a name already loaded (LoRAManager.validate_new_adapter); a rank above
  --max-lora-rank or a module outside --lora-target-modules (LoRAMemoryPool.can_support); DoRA;
  a config without r, lora_alpha or target_modules (LoRAConfig: KeyError), or whose peft_type
  is not LORA (LoRAAdapter: an empty AssertionError); q_proj without v_proj (LoRAAdapter.
  normalize_qkv_proj: KeyError); unloading a name not loaded ("LoRA with name X does not
  exist"). A server with data-parallel replicas fails an assertion (HTTP 500 here);
- the tensors (TpModelWorker.load_lora_adapter_from_tensors): `serialized_named_tensors[tp_rank]`
  unpickled with the allow-list, a {name: tensor} dict (load_format None) or a flattened bucket;
  a missing rank payload, a blocked global, a payload that is not a dict, or a mismatch with
  `expected_checksums` fail in the scheduler (HTTP 500 here). Each tensor is filed by its
  `layers.N.` and the module name in it (LoRAAdapter._process_weight); names without a layer are
  dropped (embeddings aside, which the stand-in does not serve);
- unloading unregisters the name at once and answers once the requests running with it have
  finished (LoRARegistry.unregister, wait_for_unload);
- `/generate` `lora_path` (a name, or one per prompt; TokenizerManager._validate_and_resolve_lora):
  refused when LoRA is off; a name never loaded is refused; one loaded from tensors and unloaded
  since is "reloaded implicitly" from its path `__tensor__`, which fails;
- at the first batch with an adapter (LoRAMemoryPool.load_lora_weight_to_buffer) a tensor that
  matches no target module (k_proj or up_proj without its stack partner) or has the wrong shape
  fails in the scheduler (HTTP 500 here);
- the adapter runs unmerged: `base(x) + B(A(x) * lora_alpha / r)` (LoRAAdapter.scaling, the
  LoRA backends' sgemm_lora_a/b), in the model's dtype.

`GET /v1/models` lists the base (id: the model path) and each loaded adapter (id: its name,
root: its path, `__tensor__` for one loaded from tensors, parent: the base).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import re
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from tests.integration.fake_sglang_weights import (
    AllowListUnpickler,
    ServerError,
    named_tensors_of,
)

SUPPORTED = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "q_a_proj",
    "kv_a_proj_with_mqa",
    "q_b_proj",
    "kv_b_proj",
    "wq_b",
    "wk",
    "weights_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
    "embed_tokens",
    "lm_head",
    "qkvr",
    "wo_ud",
)
"""SUPPORTED_LORA_TARGET_MODULES (srt/utils/common.py), the choices of --lora-target-modules."""
NORMALIZED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"}
NORMALIZED |= {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
HF_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The dense projections of the stand-in's models, which it serves adapters on."""
TENSOR_PATH = "__tensor__"
_LAYER = re.compile(r"layers\.(\d+)\.")


def normalized(modules) -> set[str]:
    if isinstance(modules, str):
        if modules not in ("all", "all-linear"):
            raise ValueError(
                "Only 'all' or 'all-linear' can be used as the string for target module"
            )
        return {"all"}
    return {NORMALIZED.get(m.split(".")[-1], m.split(".")[-1]) for m in modules}


def check_launch(enabled: bool, max_rank: int | None, targets: list[str] | None) -> None:
    """check_lora_server_args, for a server started without --lora-paths."""
    if enabled and not (max_rank and targets):
        raise SystemExit(
            "AssertionError: When no initial --lora-paths is provided, you need to specify both "
            "--max-lora-rank and --lora-target-modules for LoRA initialization."
        )
    if targets and "all" in targets and len(targets) != 1:
        raise SystemExit("AssertionError: 'all' must be the only module in --lora-target-modules")


@dataclass
class Adapter:
    name: str
    path: str
    scaling: float
    weights: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]
    """HF module name -> (A [r, in], B [out, r]); None where the adapter has no such tensor."""
    lora_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    running: int = 0


class FakeLoRA:
    """Adapters of one stand-in server (`scheduler`: FakeSGLang)."""

    def __init__(
        self,
        scheduler: Any,
        enabled: bool = False,
        max_rank: int | None = None,
        targets: list[str] | None = None,
        max_per_batch: int = 8,
    ) -> None:
        check_launch(enabled, max_rank, targets)
        self.scheduler, self.model = scheduler, scheduler.model
        self.enabled, self.max_rank, self.max_per_batch = enabled, max_rank or 0, max_per_batch
        names = set(targets or ())
        self.targets = set(normalized(HF_MODULES)) if "all" in names else normalized(names)
        self.registry: OrderedDict[str, Adapter] = OrderedDict()
        self.ever_loaded: dict[str, str] = {}
        """TokenizerManager.lora_ref_cache: every name loaded, with its path."""
        self.update_lock = threading.Lock()
        """TokenizerManager.lora_update_lock: one load or unload at a time."""
        self.local = threading.local()
        self.modules = self._hook_modules() if enabled else {}

    # ------------------------------------------------------------------ endpoints
    def load_from_tensors(self, body: dict) -> dict:
        if not self.enabled:
            return _failed("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        if self.scheduler.dp_size != 1:
            raise ServerError("data-parallel replicas are not supported for dynamic lora loading")
        tensors = self._tensors(body)
        with self.update_lock:
            try:
                adapter = self._adapter(body["lora_name"], body["config_dict"], tensors)
            except (KeyError, ValueError, AssertionError) as err:
                return {**_failed(str(err)), "loaded_adapters": self._loaded()}
            with self.scheduler.cond:  # running requests keep theirs: no pause, no wait
                self.registry[adapter.name] = adapter
                self.ever_loaded[adapter.name] = TENSOR_PATH
        self.scheduler.event("lora_load", adapter.name, _digest(tensors))
        return {"rid": None, "http_worker_ipc": None, "success": True, "error_message": ""} | {
            "loaded_adapters": self._loaded()
        }

    def unload(self, body: dict) -> dict:
        if not self.enabled:
            return _failed("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        if self.scheduler.dp_size != 1:
            raise ServerError("data-parallel replicas are not supported for dynamic lora loading")
        name = body["lora_name"]
        with self.update_lock, self.scheduler.cond:
            adapter = self.registry.pop(name, None)
            if adapter is None:
                return _failed(
                    f"LoRA with name {name} does not exist. Loaded LoRAs: "
                    f"odict_keys({list(self.registry)})"
                )
            while adapter.running:  # the requests running with it finish first
                self.scheduler.cond.wait()
        self.scheduler.event("lora_unload", name)
        return {"rid": None, "http_worker_ipc": None, "success": True, "error_message": ""} | {
            "loaded_adapters": self._loaded()
        }

    def models(self, served: str) -> dict:
        cards = [{"id": served, "object": "model", "root": served, "parent": None}]
        if self.enabled:
            for a in list(self.registry.values()):
                cards.append({"id": a.name, "object": "model", "root": a.path, "parent": served})
        return {"object": "list", "data": cards}

    # ------------------------------------------------------------------ generation
    def acquire(self, lora_path: Any, count: int) -> list[Adapter | None]:
        """The adapter of each of `count` prompts, each counted as running until `release`;
        ValueError (HTTP 400) as SGLang refuses a request."""
        if not lora_path:
            return [None] * count
        if isinstance(lora_path, str):
            paths = [lora_path] * count
        elif isinstance(lora_path, list):
            if len(lora_path) != count:
                raise ValueError(
                    f"lora_path list length ({len(lora_path)}) must match batch size ({count})"
                )
            paths = lora_path
        else:
            raise ValueError("lora_path should be a list or a string.")
        if not self.enabled:
            first = next((p for p in paths if p), None)
            raise ValueError(
                f"LoRA adapter '{first}' was requested, but LoRA is not enabled. Please launch "
                "the server with --enable-lora flag and preload adapters using --lora-paths or "
                "/load_lora_adapter endpoint."
            )
        with self.scheduler.cond:
            for name in {p for p in paths if p} - set(self.registry):
                if name not in self.ever_loaded:
                    raise ValueError(
                        f"Got LoRA adapter that has never been loaded: {name}\n"
                        f"All loaded adapters: dict_keys({list(self.ever_loaded)})."
                    )
                raise ValueError(  # an implicit reload from its path, which is no directory
                    f"Failed to implicitly load LoRA adapter {name}: "
                    f"{self.ever_loaded[name]} is neither a local adapter directory nor a "
                    "Hugging Face repository"
                )
            adapters = [self.registry[p] if p else None for p in paths]
            for a in adapters:
                if a is not None:
                    a.running += 1
                    self.registry.move_to_end(a.name)
        return adapters

    def release(self, adapters: list[Adapter | None]) -> None:
        with self.scheduler.cond:
            for a in adapters:
                if a is not None:
                    a.running -= 1
            self.scheduler.cond.notify_all()

    @contextlib.contextmanager
    def applied(self, adapter: Adapter | None):
        """`adapter` on this thread's forwards (requests take turns on the model, so each
        thread's request sees its own)."""
        if adapter is not None:
            self._check_first_batch(adapter)
        self.local.adapter = adapter
        try:
            yield
        finally:
            self.local.adapter = None

    # ------------------------------------------------------------------ internals
    def _tensors(self, body: dict) -> dict[str, torch.Tensor]:
        payloads = body["serialized_named_tensors"]
        if not isinstance(payloads, list) or not all(isinstance(p, str) for p in payloads):
            raise TypeError("serialized_named_tensors must be a list of base64 strings")
        if len(payloads) < self.scheduler.tp_size:  # rank r reads entry r: an IndexError
            raise ServerError(f"{len(payloads)} payloads for {self.scheduler.tp_size} TP ranks")
        ranks = []
        for raw in payloads[: self.scheduler.tp_size]:  # each rank deserializes its own
            try:
                data = AllowListUnpickler(io.BytesIO(base64.b64decode(raw, validate=True))).load()
            except Exception as err:  # noqa: BLE001 - the scheduler fails on any of them
                raise ServerError(f"tp rank payload: {type(err).__name__}: {err}") from err
            if body.get("load_format") == "flattened_bucket":
                data = dict(named_tensors_of(data, "flattened_bucket"))
            if not isinstance(data, dict) or not all(
                isinstance(t, torch.Tensor) for t in data.values()
            ):
                raise ServerError(f"'{type(data).__name__}' object has no attribute 'items'")
            ranks.append(data)
        if any(_digest(r) != _digest(ranks[0]) for r in ranks):
            raise ServerError("TP ranks received different adapters")
        expected = body.get("expected_checksums")
        if expected is not None:
            got = {n: hashlib.sha256(_bytes(t)).hexdigest() for n, t in ranks[0].items()}
            if got != expected:
                raise ServerError("[LORA-CHECK] adapter sync MISMATCH")
        return ranks[0]

    def _adapter(self, name: str, config: dict, tensors: dict[str, torch.Tensor]) -> Adapter:
        """The adapter SGLang builds from `config` and `tensors`; its refusals as exceptions."""
        targets, r, alpha = config["target_modules"], config["r"], config["lora_alpha"]
        if config.get("use_dora", False):
            raise ValueError(
                f"Failed to load {name} because LoRA serving currently doesn't support DoRA "
                "adapters"
            )
        if name in self.registry:
            raise ValueError(f"Failed to load LoRA adapter {name} because it is already loaded")
        wanted = normalized(targets)
        if int(r) > self.max_rank or not ("all" in wanted or wanted <= self.targets):
            raise ValueError(
                f"LoRA adapter {name} with rank {r} is incompatible with the current LoRA memory "
                "pool configuration. Please ensure that the LoRA adapter's rank is within the "
                "configured `--max-lora-rank` and that the target modules are included in "
                "`--lora-target-modules`."
            )
        assert config["peft_type"].lower() == "lora"  # noqa: S101 - SGLang's own check
        weights: dict[str, list] = {}
        names = list(tensors)
        for key, tensor in tensors.items():
            layer = _LAYER.search(key)
            if layer is None:
                continue  # no layer: SGLang keeps embeddings only, which are not served here
            module = next((m for m in HF_MODULES if f".{m}." in key), None)
            if module is None:
                weights.setdefault(key, [None, None])  # matches no target: fails at use
                continue
            slot = weights.setdefault(f"{layer.group(1)}.{module}", [None, None])
            slot[0 if "lora_A" in key else 1] = tensor.to(self._dtype())
        for key in names:  # normalize_qkv_proj: a q_proj adapter is stacked with v_proj's
            if "q_proj" in key:
                v_key = key.replace("q_proj", "v_proj")
                if v_key not in tensors:
                    raise KeyError(v_key)
        return Adapter(name, TENSOR_PATH, float(alpha) / float(r), _tupled(weights))

    def _check_first_batch(self, adapter: Adapter) -> None:
        """LoRAMemoryPool.load_lora_weight_to_buffer's failures (in the scheduler)."""
        for key, (a, b) in adapter.weights.items():
            module = self.modules.get(key)
            stacked = key.split(".")[-1]
            if module is None or NORMALIZED.get(stacked, stacked) not in self.targets:
                raise ServerError(
                    f"Cannot find target module name for {key} in {sorted(self.targets)}"
                )
            if stacked in ("k_proj", "v_proj") and not _has(adapter, key, "q_proj"):
                raise ServerError(f"Cannot find target module name for {key} (no q_proj)")
            if stacked == "up_proj" and not _has(adapter, key, "gate_proj"):
                raise ServerError(f"Cannot find target module name for {key} (no gate_proj)")
            if a is None or b is None:
                continue  # the missing one's buffer is zeroed: no output
            rank = a.shape[0]
            for w, want in ((a, (rank, module.in_features)), (b, (module.out_features, rank))):
                if tuple(w.shape) != want or rank > self.max_rank:
                    raise ServerError(
                        f"LoRA buffer shape does not match weight shape {tuple(w.shape)} ({key})"
                    )

    def _hook_modules(self) -> dict[str, torch.nn.Linear]:
        """A forward hook on each dense projection SGLang would wrap (those of the targets)."""
        modules = {}
        for name, module in self.model.named_modules():
            layer, leaf = _LAYER.search(name), name.rsplit(".", 1)[-1]
            if layer is None or leaf not in HF_MODULES or not isinstance(module, torch.nn.Linear):
                continue
            if NORMALIZED.get(leaf, leaf) in self.targets:
                key = f"{layer.group(1)}.{leaf}"
                modules[key] = module
                module.register_forward_hook(self._hook(key))
        return modules

    def _hook(self, key: str):
        def add_adapter(module, inputs, output):
            adapter = getattr(self.local, "adapter", None)
            pair = adapter.weights.get(key) if adapter is not None else None
            if pair is None or pair[0] is None or pair[1] is None:
                return None
            a, b = pair
            return output + F.linear(F.linear(inputs[0], a) * adapter.scaling, b)

        return add_adapter

    def _dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def _loaded(self) -> dict[str, str]:
        return {a.name: a.path for a in self.registry.values()}


def _failed(message: str) -> dict:
    return {
        "rid": None,
        "http_worker_ipc": None,
        "success": False,
        "error_message": message,
        "loaded_adapters": None,
    }


def _has(adapter: Adapter, key: str, module: str) -> bool:
    return f"{key.split('.')[0]}.{module}" in adapter.weights


def _tupled(weights: dict[str, list]) -> dict[str, tuple]:
    return {k: (v[0], v[1]) for k, v in weights.items()}


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(_bytes(tensors[name]))
    return h.hexdigest()

"""The weight side of the stand-in SGLang server: groups, update sessions, and loading.

Rules copied from SGLang 0.5.23 (facts, not code):
- a server with data-parallel replicas refuses weight groups and tensor updates (an assertion
  in TokenizerManager.init_weights_update_group / update_weights_from_distributed /
  update_weights_from_tensor, srt/managers/tokenizer_control_mixin.py): HTTP 500 here;
- `update_weights_from_distributed` and `update_weights_from_tensor` load only inside a
  session opened by `/begin_weight_update` and closed by `/end_weight_update`
  (SchedulerWeightUpdaterManager, srt/managers/scheduler_components/weight_updater.py); a
  second begin while one is open fails; `update_weights_from_disk` needs none;
- every TP rank joins the group at rank_offset + tp_rank and receives every broadcast
  (fake_sglang_ranks.py);
- loading follows the model's `load_weights` (fake_sglang_models.py): names it skips are
  answered with success and recorded as ignored (`GET /relax_test/loaded`);
- a loaded update flushes the cache (fake_sglang_cache.py) only when the scheduler is idle,
  else the call fails (flush_cache_after_weight_update -> Scheduler.flush_cache ->
  is_fully_idle); with `flush_cache: false` the cache keeps the older weights' KV;
- `update_weights_from_tensor`: `serialized_named_tensors` holds one base64 payload per TP rank,
  each rank reads its own (TpModelWorker.deserialize_own_rank); a payload is
  MultiprocessingSerializer bytes that SGLang loads with an allow-list unpickler (SafeUnpickler,
  srt/utils/common.py): [(name, tensor)] for load_format None, {"flattened_tensor", "metadata"}
  for "flattened_bucket". CUDA tensors arrive as IPC handles whose device is a UUID
  (srt/utils/patch_torch.py).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import pickle
import threading
from typing import Any

import torch

from relax_core.sync.process_group import join_weight_group, leave_weight_group
from tests.integration.fake_sglang_models import hf_slot, load_target, sglang_params
from tests.integration.fake_sglang_ranks import OtherRanks, digest, receive


class ServerError(Exception):
    """What SGLang answers with HTTP 500 (an assertion in its tokenizer manager)."""


def _cuda_from_ipc(*args):
    """torch's rebuild_cuda_tensor, with the device given as a UUID mapped to this process's
    index (SGLang: patch_torch._rebuild_cuda_tensor_modified)."""
    from torch.multiprocessing import reductions

    args = list(args)
    if isinstance(args[6], str):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(count)]
        if args[6] not in uuids:
            raise ValueError(f"Invalid device_uuid={args[6]}")
        args[6] = uuids.index(args[6])
    return reductions.rebuild_cuda_tensor(*args)


def _storage_from_bytes(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)


class AllowListUnpickler(pickle.Unpickler):
    """Tensors, their storages, plain containers and dtypes; any other global is refused, as
    SGLang's SafeUnpickler refuses it."""

    MODULES = {
        "builtins": {"list", "tuple", "dict", "set", "str", "int", "float", "bool", "bytes"},
        "collections": {"OrderedDict"},
        "copyreg": {"__newobj__"},
        "types": {"SimpleNamespace"},
        "torch": {"Size", "device", "Tensor", "UntypedStorage"},
        "torch._utils": {"_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_parameter"},
        "torch.storage": {"UntypedStorage", "TypedStorage"},
        "torch.nn.parameter": {"Parameter"},
        "torch.multiprocessing.reductions": {
            "rebuild_tensor",
            "rebuild_storage_fd",
            "rebuild_storage_filename",
            "rebuild_storage_empty",
            "rebuild_typed_storage",
        },
        "multiprocessing.resource_sharer": {"DupFd"},
    }

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _storage_from_bytes
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return _cuda_from_ipc
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in self.MODULES.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"Blocked unsafe global ({module}.{name})")


def named_tensors_of(payload: Any, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    if load_format == "flattened_bucket":
        flat, metadata = payload["flattened_tensor"], payload["metadata"]
        return [
            (m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)) for m in metadata
        ]
    if load_format is not None:
        raise ValueError(f"Unknown load_format={load_format} (the stand-in loads None, flattened)")
    if not isinstance(payload, list) or not all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[1], torch.Tensor) for p in payload
    ):
        raise TypeError("the payload is not a list of (name, tensor)")
    return payload


class FakeWeights:
    """Weight groups, sessions and loads of one stand-in server (`scheduler`: FakeSGLang)."""

    def __init__(self, scheduler: Any, tp_size: int = 1, dp_size: int = 1) -> None:
        self.scheduler = scheduler
        self.model = scheduler.model
        self.tp_size, self.dp_size = tp_size, dp_size
        self.others = OtherRanks(tp_size)
        self.groups: dict[str, Any] = {}
        self.session_open = False
        self.sglang_names = sglang_params(self.model.config)
        self.outcome: dict[str, str] = {}
        """Each name ever sent: 'consumed' or 'ignored' (its latest load)."""
        self.lock = threading.Lock()

    def _single_replica(self, what: str) -> None:
        if self.dp_size != 1:
            raise ServerError(f"data-parallel replicas are not supported for {what}")

    # ------------------------------------------------------------------ groups
    def init_group(self, body: dict) -> dict:
        self._single_replica("update weights from distributed")
        name = body.get("group_name", "weight_update_group")
        if name in self.groups:
            return {"success": False, "message": f"group {name} already exists"}
        args = (
            body.get("backend", "nccl"),
            body["master_address"],
            int(body["master_port"]),
            int(body["world_size"]),
            int(body["rank_offset"]),
            name,
            120.0,
        )
        self.others.start("init", *args)
        try:
            group = join_weight_group(*args[:4], args[4], name, args[6])  # tp rank 0
            self.others.results()
        except Exception as err:  # noqa: BLE001 - SGLang answers it as a failure
            return {"success": False, "message": f"Failed to init process group: {err}."}
        self.groups[name] = group
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def destroy_group(self, body: dict) -> dict:
        self._single_replica("destroy parameter update group")
        name = body.get("group_name", "weight_update_group")
        group = self.groups.pop(name, None)
        if group is None:
            return {"success": False, "message": "The group to be destroyed does not exist."}
        self.others.start("destroy", name)
        leave_weight_group(group)
        self.others.results()
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    # ------------------------------------------------------------------ sessions
    def begin(self, body: dict) -> dict:
        if self.session_open:
            return {
                "success": False,
                "message": "a weight-update session is already open; "
                "call end_weight_update() first",
            }
        self.session_open = True
        return {"success": True, "message": "Success"}

    def end(self, body: dict) -> dict:
        if not self.session_open:
            return {
                "success": False,
                "message": "no weight-update session is open; call begin_weight_update() first",
            }
        self.session_open = False
        return {"success": True, "message": "Success"}

    def _no_session(self, path: str) -> dict | None:
        if self.session_open:
            return None
        return {
            "success": False,
            "message": f"{path} must run between begin_weight_update() and end_weight_update()",
        }

    # ------------------------------------------------------------------ updates
    def update_distributed(self, body: dict) -> dict:
        self._single_replica("update weights from distributed")
        refused = self._no_session("update_weights_from_distributed")
        if refused:
            return refused
        name = body.get("group_name", "weight_update_group")
        names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError("names, dtypes and shapes differ in length")
        if name not in self.groups:
            return {
                "success": False,
                "message": f"Failed to receive weights: Group {name} not in {list(self.groups)}",
            }
        flushable = self.scheduler.idle_for_flush()
        self.scheduler.event("update_begin", name)
        flat = body.get("load_format") == "flattened_bucket"
        self.others.start("receive", name, dtypes, shapes, flat)
        try:
            tensors = receive(self.groups[name], dtypes, shapes, flat)
            hashes = self.others.results()
        except Exception as err:  # noqa: BLE001
            return {"success": False, "message": f"Failed to receive weights: {err}"}
        if any(h != digest(tensors) for h in hashes):
            return {"success": False, "message": "TP ranks received different bytes"}
        return self._finish(list(zip(names, tensors, strict=True)), body, flushable)

    def update_tensor(self, body: dict) -> dict:
        self._single_replica("update weights from tensor")
        payloads = body["serialized_named_tensors"]
        if not isinstance(payloads, list) or not all(isinstance(p, str) for p in payloads):
            raise TypeError("serialized_named_tensors must be a list of base64 strings")
        try:
            raw = [base64.b64decode(p, validate=True) for p in payloads]
        except (binascii.Error, ValueError) as err:
            raise ValueError(f"serialized_named_tensors: not base64 ({err})") from err
        if len(raw) < self.tp_size:  # SGLang's rank r reads entry r: an IndexError there
            raise ServerError(f"{len(raw)} payloads for {self.tp_size} TP ranks")
        refused = self._no_session("update_weights_from_tensor")
        if refused:
            return refused
        flushable = self.scheduler.idle_for_flush()
        self.scheduler.event("update_begin", "tensor")
        try:
            payload = AllowListUnpickler(io.BytesIO(raw[0])).load()  # this server's tp rank 0
            named = named_tensors_of(payload, body.get("load_format"))
        except Exception as err:  # noqa: BLE001 - SGLang's scheduler fails the call
            return {"success": False, "message": f"Failed to update weights: {err}"}
        return self._finish(named, body, flushable)

    def update_disk(self, body: dict) -> dict:
        from safetensors.torch import load_file

        path = body["model_path"]
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            return {"success": False, "message": f"no *.safetensors in {path}"}
        self.scheduler.event("update_begin", "disk")
        named: list[tuple[str, torch.Tensor]] = []
        for f in files:
            named.extend(load_file(os.path.join(path, f)).items())
        answer = self._finish(named, body, flushable=self.scheduler.idle_for_flush())
        return {**answer, "num_paused_requests": 0}

    def _finish(self, named: list, body: dict, flushable: bool) -> dict:
        if "weights" in self.scheduler.released:
            return {"success": False, "message": "weights are released; resume them first"}
        with self.scheduler.model_held():
            error = self._load(named)
            if error:
                return {"success": False, "message": f"Failed to update parameter online: {error}"}
            if body.get("weight_version") is not None:
                self.scheduler.weight_version = str(body["weight_version"])
        self.scheduler.event("update_end", self.scheduler.weight_version)
        if body.get("flush_cache", True):
            if not flushable:
                return {
                    "success": False,
                    "message": "Weights were updated, but the cache was not flushed because "
                    "requests are still running or queued. Retract or finish them, then call "
                    "/flush_cache.",
                }
            self.scheduler.cache.reset()
        return {"success": True, "message": "Succeeded to update parameter online."}

    def _load(self, named: list[tuple[str, torch.Tensor]]) -> str:
        """Load as the model's load_weights does; '' or the error SGLang would report."""
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in named:
                try:
                    target = load_target(self.model.config, self.sglang_names, name)
                except KeyError as err:
                    return f"KeyError: {err}"
                if target is None:
                    self.outcome[name] = "ignored"
                    continue
                slot = hf_slot(params, name)
                if slot.shape != tensor.shape:  # SGLang's weight loaders assert the shape
                    return f"{name}: shape {tuple(tensor.shape)}, expected {tuple(slot.shape)}"
                slot.copy_(tensor.to(slot.device, slot.dtype))
                self.outcome[name] = "consumed"
        return ""

    def loaded(self) -> dict:
        return {
            "consumed": sorted(n for n, o in self.outcome.items() if o == "consumed"),
            "ignored": sorted(n for n, o in self.outcome.items() if o == "ignored"),
        }

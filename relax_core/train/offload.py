"""A trainer's state held in host memory while a colocated engine has the GPU.

`StateOffload` moves the trainable parameters and the optimizer's state between the trainer's
device and host memory, and drops the gradients (a step starts by zeroing them, so none outlives
its step). Each parameter keeps its identity (the optimizer's references stay valid) but holds an
empty placeholder on the device while its data is on the host, so a use of it while offloaded
fails loudly instead of computing on nothing. On a GPU the host copies are pinned buffers
allocated once and reused each step, and the allocator's cached blocks go back to the driver so
the engine's server can map them; on a CPU the host is the same memory and nothing is copied.
Frozen parameters (a LoRA run's base, which a torch engine may share) stay where they are.

`resident_bytes` is the CUDA-free proxy of what a trainer holds on its device in a phase: the
bytes of its parameters, gradients and optimizer state found there; `colocate_turn_bytes` reads
it in each phase of one colocate step (bench/offload_phases.py, tests/unit/test_offload.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

HOST = torch.device("cpu")


def on(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether `tensor` is on `device` ('cuda' without an index: any GPU of this process)."""
    return tensor.device.type == device.type and device.index in (None, tensor.device.index)


def _placeholder(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=tensor.dtype, device=device)


class StateOffload:
    """Host copies of one trainer's parameters and optimizer state (see the module doc)."""

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device
    ) -> None:
        self.model, self.optimizer = model, optimizer
        self.device = torch.device(device)
        """Where the state trains (a policy built in host memory is offloaded from the start)."""
        self.params: dict[torch.nn.Parameter, torch.Tensor] = {}
        """Trainable parameters whose data is on the host now, with that data."""
        self.states: dict[tuple[torch.nn.Parameter, str], torch.Tensor] = {}
        """Optimizer state tensors on the host now, by (parameter, key)."""
        self._pinned: dict[tuple[int, str], torch.Tensor] = {}
        """Page-locked buffers reused every step, by (parameter id, state key or '')."""

    def _trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _to_host(self, key: tuple[int, str], tensor: torch.Tensor) -> torch.Tensor:
        if on(tensor, HOST):
            return tensor
        buffer = self._pinned.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._pinned[key] = buffer
        return buffer.copy_(tensor, non_blocking=True)

    def offload(self, weights: bool = True) -> None:
        """Gradients dropped, optimizer state (and with `weights` the trainable parameters) to
        the host. Repeating it moves only what is still on the device."""
        params = self._trainable()
        for p in params:
            p.grad = None
        for p in params:
            for key, value in self.optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and (p, key) not in self.states:
                    self.states[(p, key)] = self._to_host((id(p), key), value)
                    self.optimizer.state[p][key] = _placeholder(value, value.device)
            if weights and p not in self.params:
                self.params[p] = self._to_host((id(p), ""), p.data)
                p.data = _placeholder(p.data, self.device)
        self._release()

    def reload(self) -> None:
        """Everything on the host back where it was, bit for bit."""
        for p, host in self.params.items():
            p.data = host.to(self.device, non_blocking=True)
        for (p, key), host in self.states.items():
            device = self.optimizer.state[p][key].device  # the placeholder's: where it was
            self.optimizer.state[p][key] = host.to(device, non_blocking=True)
        self.params.clear()
        self.states.clear()

    @property
    def offloaded(self) -> bool:
        return bool(self.params or self.states)

    @contextlib.contextmanager
    def on_host(self) -> Iterator[None]:
        """The offloaded parameters and optimizer state in place as their host copies while
        a checkpoint is saved or loaded (no trip through the device); state a load replaces
        is taken as the new host copy."""
        if self.states and not self.params:
            self.offload()  # all of it on the host, so a load's state lands there too
        params = list(self.params)
        for p, host in self.params.items():
            p.data = host
        for (p, key), host in self.states.items():
            self.optimizer.state[p][key] = host
        try:
            yield
        finally:
            self.states.clear()
            steps_on_device = self._steps_on_device()
            for p in params:
                self.params[p] = p.data
                p.data = _placeholder(p.data, self.device)
                for key, value in self.optimizer.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        self.states[(p, key)] = value
                        # torch keeps a step count on the CPU unless fused or capturable
                        where = self.device if key != "step" or id(p) in steps_on_device else HOST
                        self.optimizer.state[p][key] = _placeholder(value, where)

    def _steps_on_device(self) -> set[int]:
        """Ids of the parameters whose optimizer keeps its step count on their device."""
        groups = self.optimizer.param_groups
        on = [g for g in groups if g.get("fused") or g.get("capturable")]
        return {id(p) for g in on for p in g["params"]}

    def _release(self) -> None:
        """Wait for the copies, then give the allocator's cached blocks back to the driver."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()


def resident_bytes(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device
) -> dict[str, int]:
    """Bytes of the trainer's parameters, gradients and optimizer state on `device` (each
    storage once): what it holds there in the phase this is called in."""
    device = torch.device(device)
    seen: dict[int, torch.Tensor] = {}  # holding each tensor keeps its id unique meanwhile

    def on_device(tensors: Iterator[torch.Tensor | None]) -> int:
        total = 0
        for t in tensors:
            if t is None or not on(t, device):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr() or id(t)  # a meta tensor has no address
            if key not in seen and storage.nbytes():
                seen[key] = t
                total += storage.nbytes()
        return total

    params = list(model.parameters())
    states = (v for s in optimizer.state.values() for v in s.values())
    return {
        "params": on_device(p.data for p in params),
        "grads": on_device(p.grad for p in params),
        "optimizer": on_device(v for v in states if isinstance(v, torch.Tensor)),
    }


def colocate_turn_bytes(backend, train: Callable[[], object]) -> dict[str, dict[str, int]]:
    """One colocate step's turns on a torch `backend` that gives its device back: its state
    reloaded and `train()` run (the train phase), gradients and optimizer state out before the
    weight push (update), the weights out while the engine generates (generate). Returns
    `resident_bytes` of each phase on the backend's device; on a GPU, compare them with
    torch.cuda.memory_allocated() read at the same points."""

    def now() -> dict[str, int]:
        return resident_bytes(backend.model, backend.optimizer, backend.device)

    backend.reload()
    train()
    phases = {"train": now()}
    backend.offload(weights=False)
    phases["update"] = now()
    backend.offload()
    phases["generate"] = now()
    return phases

"""Where a RunSession puts the trainer's policy and optimizer, on a machine whose accelerator is
the meta device (what `models.policy.accelerator` would return on a GPU: the test sees which
tensors go there without a GPU). An async run's session and a run's finish only evaluate
through the engine: their float32 policy stays in host memory, no KL reference or optimizer
state is built for them. A colocate trainer that gives its device back (train.offload_between_steps)
loads its state into host memory and leaves nothing on the device after a step; with it off the
policy takes the accelerator."""

from __future__ import annotations

import pytest
import torch

from relax_core.config import load_config
from relax_core.data.dataset import fingerprint
from relax_core.models import policy as policy_module
from relax_core.run.colocate import ColocateController
from relax_core.run.prepare import PolicySpec, prepare_policy
from relax_core.run.session import RunSession
from relax_core.train.offload import resident_bytes
from relax_core.train.run_state import RunState

META = torch.device("meta")
NOTHING = {"params": 0, "grads": 0, "optimizer": 0}


@pytest.fixture
def prepared(small_config):
    def make(**sections):
        cfg = load_config(small_config(algorithm={"kl_coef": 0.01}, **sections))
        spec = PolicySpec.of(cfg, fingerprint(cfg.data.train_path))
        return cfg, prepare_policy(spec, cfg.checkpoint.policy_cache_dir)

    return make


@pytest.fixture
def on_accelerator(monkeypatch):
    """From here on, the session's process has an accelerator (the meta device)."""
    monkeypatch.setattr(policy_module, "accelerator", lambda: META)


def _devices(model) -> set[str]:
    return {p.device.type for p in model.parameters()}


def _on_meta(session) -> dict[str, int]:
    return resident_bytes(session.backend.model, session.backend.optimizer, META)


def test_an_async_session_evaluates_with_the_policy_off_the_accelerator(prepared, request):
    cfg, policy = prepared(mode="async", rollout={"max_staleness": 1})
    request.getfixturevalue("on_accelerator")
    session = RunSession(cfg, policy, RunState(run_id="async-start"), "start")
    try:
        assert session.engine.model.device == META  # the engine evaluates on the accelerator
        assert _devices(session.model) == {"cpu"} and _on_meta(session) == NOTHING
        assert session.ref_model is None and not session.gives_back
    finally:
        session.close()


def _checkpoint_with_optimizer_state(cfg, policy) -> str:
    trainer = RunSession(cfg, policy, RunState(run_id="colocate", policy_dir=policy))
    trainer.backend.reload()  # as a step does, when the state waits in host memory
    for p in trainer.backend.model.parameters():  # one AdamW step: the moments exist
        p.grad = torch.zeros_like(p)
    trainer.backend.optimizer.step()
    try:
        return trainer.save_checkpoint()
    finally:
        trainer.close()


def test_a_finish_reads_no_optimizer_state_and_keeps_the_policy_in_host_memory(prepared, request):
    cfg, policy = prepared()
    checkpoint = _checkpoint_with_optimizer_state(cfg, policy)
    request.getfixturevalue("on_accelerator")
    finish = RunSession.from_checkpoint(cfg, checkpoint, "evaluate")
    try:
        assert _devices(finish.model) == {"cpu"} and finish.ref_model is None
        assert finish.backend.optimizer.state == {}  # nothing read, nothing on the GPU
    finally:
        finish.close()


def test_a_colocate_step_leaves_nothing_of_the_trainer_on_its_device(prepared):
    cfg, policy = prepared(train={"offload_between_steps": "on"})
    checkpoint = _checkpoint_with_optimizer_state(cfg, policy)
    session = RunSession.from_checkpoint(cfg, checkpoint)
    cpu = torch.device("cpu")
    try:
        backend = session.backend
        assert session.gives_back and backend.offloading.states  # loaded into host memory
        assert resident_bytes(backend.model, backend.optimizer, cpu) == NOTHING
        metrics = ColocateController(session).step()
        assert session.state.policy_version == 1 and metrics["train/staleness_max"] == 0
        assert resident_bytes(backend.model, backend.optimizer, cpu) == NOTHING
        host = {n: backend.offloading.params[p] for n, p in backend.model.named_parameters()}
        for name, weight in session.engine.model.named_parameters():  # what the step pushed
            assert torch.equal(weight, host[name].to(weight.dtype)), name
    finally:
        session.close()


def test_a_colocate_trainer_without_offloading_takes_the_accelerator(prepared, request):
    cfg, policy = prepared(train={"offload_between_steps": "off"})
    request.getfixturevalue("on_accelerator")
    session = RunSession(cfg, policy, RunState(run_id="kept"))
    try:
        assert _devices(session.model) == {"meta"} and not session.gives_back
        params = sum(p.numel() * p.element_size() for p in session.model.parameters())
        assert _on_meta(session)["params"] == params
    finally:
        session.close()

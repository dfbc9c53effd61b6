"""Everything one colocate run holds while it trains: built from a config and a checkpoint.

A RunSession is the sum of its parts (queue, policy + engine + backend, reference model, prompt
sources, reward function, tracking) plus the resumable RunState. It knows how to load itself from a
checkpoint and save itself into one; the controller decides when. Only a colocate session that
trains (`purpose` "train") puts the trainer on the GPU and builds the reference and teacher: a
run's start (evaluate, write the first checkpoint), an evaluation (a run's finish, a checkpoint's
evaluation) and every session of an async run (whose trainer is its own service) keep the policy
in host memory, leaving the GPU to the engines, and an evaluation reads no optimizer state.
"""

from __future__ import annotations

import contextlib
import copy
import random
from typing import Literal

import torch

from relax_core.config import RunConfig
from relax_core.data.cursor import DatasetCursor
from relax_core.models import lora
from relax_core.models.policy import load_policy, load_teacher, on_accelerator
from relax_core.models.precision import computing_as_trainer
from relax_core.models.routing_replay import attach_routing_replay
from relax_core.queue import open_queue
from relax_core.queue.retry import set_outage_limit
from relax_core.rewards.registry import build_reward
from relax_core.roles.episodes import env_runner
from relax_core.roles.media import prompt_source, resolver_for
from relax_core.rollout.torch_engine import TorchEngine
from relax_core.run.prepare import local_policy
from relax_core.storage import join, local_cache, local_dir_for
from relax_core.sync.inprocess import InProcessSync
from relax_core.train import checkpoint as ckpt
from relax_core.train.determinism import use_deterministic_kernels
from relax_core.train.factory import has_training_state, make_backend, trainer_dtype
from relax_core.train.queue_retention import prune_queue
from relax_core.train.run_state import RunState, save_run_checkpoint

Purpose = Literal["train", "start", "evaluate"]
"""What a session is for: training steps, a run's start, or evaluation only (a finish)."""


class RunSession:
    def __init__(
        self, cfg: RunConfig, model_dir: str, state: RunState, purpose: Purpose = "train"
    ) -> None:
        self.cfg = cfg
        self.state = state
        self.trains = purpose == "train" and cfg.mode == "colocate"
        """Whether this session steps the optimizer (module doc)."""
        set_outage_limit(cfg.storage.outage_limit_s)
        if cfg.train.torch_threads:
            torch.set_num_threads(cfg.train.torch_threads)
        use_deterministic_kernels(cfg.train.deterministic)
        # Async mode trains in its own trainer service: this session evaluates and writes the
        # first checkpoint, whatever backend that service uses. A finish only evaluates.
        only_evaluates = cfg.mode == "async" or purpose == "evaluate"
        self.backend_name = "torch" if only_evaluates else cfg.train.backend
        # The trainer's parameters (float32 master weights); engine and reference hold copies
        # in model.dtype.
        self.model, self.tokenizer = load_policy(model_dir, trainer_dtype(cfg, self.backend_name))
        self.model = lora.for_run(self.model, cfg.train.lora, cfg.seed)
        self.pad_token_id = self.tokenizer.pad_token_id
        self.run_dir = join(cfg.checkpoint.dir, state.run_id)
        """Where the run's checkpoints and reports go (a local directory or a URL)."""
        self.engine = self._engine(cfg, model_dir, state.policy_version)
        self.backend = make_backend(self.model, cfg, self.backend_name, trains=self.trains)
        self.gives_back = getattr(self.backend, "offloading", None) is not None
        """Whether the trainer's state leaves the GPU while the engine generates
        (train.offload_between_steps; the backend starts offloaded)."""
        self.sync = InProcessSync([self.engine])
        self.ref_model = None
        """The KL anchor (the starting policy); a LoRA run's is the policy itself with its
        adapters off (`ref_logprobs` below), no second copy."""
        kl = cfg.algorithm.kl_coef > 0 and self.trains  # only training scores rows for a loss
        if kl and lora.is_lora(self.model):
            self.ref_model = self.model
        elif kl:
            self.ref_model = on_accelerator(self._inference_copy()).eval()
            self.ref_model.requires_grad_(False)
        self.teacher_model = None
        if cfg.algorithm.distill_coef > 0 and self.trains:
            self.teacher_model, _ = load_teacher(
                cfg.algorithm.teacher, self.tokenizer, cfg.model.dtype
            )
            self.teacher_model = on_accelerator(self.teacher_model)
        # A GenRM judge shares the prepared-policy cache, so a SmolLM2 policy and judge convert
        # the GGUF weights once.
        self.reward_fn = build_reward(
            cfg.reward,
            cache_dir=local_cache(cfg, "hf"),
            dtype=cfg.model.dtype,
            seed=cfg.seed,
        )
        # Colocate is the only writer of its queue; async roles write concurrently. Colocate
        # reads each entry back at once, and a resume skips what was written after its
        # checkpoint (fsynced): an fsync per entry would buy nothing there.
        colocate = cfg.mode == "colocate"
        self.queue = open_queue(
            cfg.queue, state.run_id, multi_writer=not colocate, durable=not colocate
        )
        self.media = resolver_for(cfg, self.model)
        """Rebuilds queue rows' encoder inputs (a multimodal policy); None for text."""
        self.teacher_media = resolver_for(cfg, self.teacher_model)
        """The same for the distillation teacher (its own encoders); None for text or none."""
        self.train_prompts = prompt_source(cfg, "train", self.model, self.tokenizer, self.queue)
        self.eval_prompts = prompt_source(cfg, "eval", self.model, self.tokenizer, self.queue)
        self.env = env_runner(cfg, self.model, self.tokenizer)
        """Plays multi-turn episodes (env.name or env.agent set); None for a single-turn run."""

    # ------------------------------------------------------------------ checkpoints
    @classmethod
    def from_checkpoint(
        cls, cfg: RunConfig, checkpoint: str, purpose: Purpose = "train"
    ) -> RunSession:
        """The session `checkpoint` (a local directory or a URL) left, loaded from a local copy."""
        options, scratch = cfg.storage.options(), cfg.storage.scratch_dir
        path = ckpt.local_checkpoint(checkpoint, options, scratch)
        state = RunState.from_dict(ckpt.read_state(path))
        session = cls(cfg, path, state, purpose)
        if session.trains and has_training_state(path, session.backend_name):
            session.backend.load(path)
        ref = session.ref_model
        if ref is not None and ref is not session.model and state.policy_dir:
            # The KL anchor is the starting policy, not the checkpoint being resumed.
            start = local_policy(state.policy_dir, options, scratch)
            ref, _ = load_policy(start, cfg.model.dtype)
            ref = on_accelerator(session._for_inference(ref))
            session.ref_model = ref.eval().requires_grad_(False)
        session._restore_rng()
        return session

    def _engine(self, cfg: RunConfig, model_dir: str, version: int):
        if cfg.rollout.engine == "vllm":  # the server takes the trainer's weights between steps
            from relax_core.pool.weights import checkpoint_specs
            from relax_core.sync.buckets import specs_of
            from relax_core.sync.vllm_colocate import start_colocated as start_vllm

            local_run = local_dir_for(self.run_dir, cfg.storage.scratch_dir)
            specs = checkpoint_specs(specs_of(lora.synced_weights(self.model), cfg.model.dtype))
            return start_vllm(
                cfg, model_dir, version, local_run, specs, lambda: lora.synced_weights(self.model)
            )
        if cfg.rollout.engine == "sglang":  # the server takes turns with the trainer
            from relax_core.rollout.sglang_colocate import start_colocated

            local_run = local_dir_for(self.run_dir, cfg.storage.scratch_dir)
            engine = start_colocated(cfg, model_dir, version, local_run)
            if lora.is_lora(self.model):  # the server holds the base; the adapter goes by name
                try:
                    engine.update_weights(lora.synced_weights(self.model), version)
                except BaseException:
                    engine.close()
                    raise
            return engine
        engine_model = on_accelerator(self._engine_copy())
        if cfg.train.routing_replay:  # the engine records the experts the trainer replays
            attach_routing_replay(engine_model)
        engine = TorchEngine(
            engine_model, self.tokenizer.eos_token_id, self.pad_token_id, seed=cfg.seed
        )
        engine.version = version
        return engine

    def _engine_copy(self) -> torch.nn.Module:
        """The torch engine's policy. A LoRA policy on the torch backend shares the trainer's
        frozen base tensors (already in model.dtype, and never written) and holds its own
        adapters, which weight sync updates: no second copy of the base. Otherwise a copy in
        model.dtype (the FSDP2 backend shards the trainer's tensors after this)."""
        if not (lora.is_lora(self.model) and self.backend_name == "torch"):
            return self._inference_copy()
        frozen = {id(p): p for p in self.model.parameters() if not p.requires_grad}
        return copy.deepcopy(self.model, memo=frozen)

    def _inference_copy(self) -> torch.nn.Module:
        """A copy of the policy in model.dtype (the trainer's may be float32 master weights;
        LoRA adapters stay float32, as the trainer's) that computes as the trainer does."""
        copied = copy.deepcopy(self.model).to(getattr(torch, self.cfg.model.dtype))
        return self._for_inference(lora.adapters_in_float32(copied))

    def _for_inference(self, model: torch.nn.Module) -> torch.nn.Module:
        """`model` (an engine's or the KL reference's) with its linear layers in
        model.matmul_dtype when that is set, as the trainer computes them under autocast."""
        return computing_as_trainer(model, self.cfg.model.matmul_dtype)

    def ref_logprobs_context(self, model: torch.nn.Module):
        """What scoring `model` as the KL anchor runs under: the policy's adapters off when
        the anchor is the LoRA policy itself."""
        if model is self.model and lora.is_lora(model):
            return lora.adapters_disabled(model)
        return contextlib.nullcontext()

    def ref_scorer(self, model: torch.nn.Module):
        """How to score `model` as the KL anchor: through the train backend when the anchor
        is the LoRA policy itself (a sharded FSDP2 policy gathers its weights only through
        the backend), else directly."""
        if model is self.model and lora.is_lora(model):
            return lambda mb: self.backend.logprobs([mb])[0]
        return None

    def _engine_rng(self) -> dict[str, str]:
        """The torch engine's sampling RNG (an SGLang server keeps its own)."""
        if not hasattr(self.engine, "generator"):
            return {}
        return {"engine": ckpt.encode_rng(self.engine.generator.get_state())}

    def close(self) -> None:
        """Stop what the session started (an SGLang server)."""
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

    def save_checkpoint(self) -> str:
        self.state.rng = {
            "torch": ckpt.encode_rng(torch.get_rng_state()),
            **self._engine_rng(),
            "python": random.getstate()[1][:625],
        }

        path = save_run_checkpoint(self.run_dir, self.state, self.cfg, self.backend, self.tokenizer)
        if self.cfg.mode == "colocate":  # async: the trainer service prunes its run's queue
            prune_queue(self.queue, self.cfg, self.run_dir)
        return path

    def _restore_rng(self) -> None:
        rng = self.state.rng
        if "torch" in rng:
            torch.set_rng_state(ckpt.decode_rng(rng["torch"]))
            if "engine" in rng and hasattr(self.engine, "generator"):
                self.engine.generator.set_state(ckpt.decode_rng(rng["engine"]))
            random.setstate((3, tuple(rng["python"]), None))

    @property
    def dataset_cursor(self) -> DatasetCursor:
        return DatasetCursor.from_dict(self.state.dataset_cursor)

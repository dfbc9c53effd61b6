"""The async trainer service: step batches from `ready`, optimizer steps, weight pushes, MLflow.

Per step with policy version v:
  read new `ready` entries -> pool of untrained groups (with their behaviour versions)
  -> `select_step_groups`: the G oldest, none newer than a group still being generated
  -> train_on_table (staleness measured from v) -> v + 1 -> push weights to every engine
     (on one CPU trainer in a thread of its own, overlapping the next step's batching,
     forward and backward; the next optimizer step waits for it: roles/publisher.py)
  -> metrics (staleness histogram, where the time went, the rollout's own metrics from the
     entries' meta) to the run's MLflow run -> checkpoint every N steps.
The checkpoint records which `ready` entries (and which groups of a partly trained one) were
trained, so a resumed trainer neither repeats nor skips a group.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import torch

from relax_core.queue import (
    split_over_stale,
    staleness_histogram,
)
from relax_core.queue.audit import record_trained
from relax_core.roles.episodes import response_budget
from relax_core.roles.evaluation import accuracy_by_modality
from relax_core.roles.publisher import WeightPublisher, overlaps
from relax_core.roles.ready_pool import ReadyPool
from relax_core.roles.service import RoleContext, mark_progress, set_threads
from relax_core.roles.trainer import train_on_table
from relax_core.storage import join, local_cache, write_json
from relax_core.train import checkpoint as ckpt
from relax_core.train import preemption
from relax_core.train.agent_failures import count_failed_step, failed_step_error
from relax_core.train.checkpoint import FINAL_CHECKPOINT
from relax_core.train.run_state import RunState

log = logging.getLogger(__name__)

_JOIN_CHECK_S = 0.5
"""How often a trainer waiting for data looks for engines waiting to join weight sync."""

# Rollout metrics that add up over the entries a step consumed (the others are averaged).
_SUMMED = (
    "perf/generate_s",
    "perf/reward_s",
    "perf/generated_tokens",
    "perf/rollout_wait_s",
    "rollout/filtered_groups",
    "rollout/sampling_rounds",
)


def _batch_metrics(batch: pa.Table) -> dict[str, float]:
    """Reward, accuracy, length and truncation means of the trained rows, from their columns
    (what `rollout.rollout_metrics` reports for rows as dicts)."""
    n = max(1, batch.num_rows)
    infos = batch.column("reward_info").to_pylist()  # JSON text per row
    oks = [bool(i) and bool(json.loads(i).get("correct")) for i in infos]
    kinds = [
        {"meta": {"modality": m[0]["kind"] if m else None}}
        for m in batch.column("media").to_pylist()
    ]
    lengths = pc.list_value_length(batch.column("response_ids"))
    return {
        **accuracy_by_modality("train", kinds, oks),
        "train/reward_mean": float(pc.sum(batch.column("reward")).as_py() or 0.0) / n,
        "train/accuracy": sum(oks) / n,
        "train/response_length": float(pc.sum(lengths).as_py() or 0) / n,
        "train/truncated_frac": float(
            pc.sum(pc.equal(batch.column("finish_reason"), "length")).as_py() or 0
        )
        / n,
    }


def _entry_metrics(metas: list[dict[str, Any]]) -> dict[str, float]:
    """Rollout time and token totals of the entries read since the last step, and the mean
    over those entries of their `rollout/` metrics (an agentic run's turns, tool calls...)."""
    out = dict.fromkeys(_SUMMED, 0.0)
    means: dict[str, list[float]] = {}
    for meta in metas:
        for key, value in (meta.get("metrics") or {}).items():
            if key in out:
                out[key] += float(value)
            elif key.startswith("rollout/"):
                means.setdefault(key, []).append(float(value))
    out.update({key: sum(v) / len(v) for key, v in means.items()})
    return out


class AsyncTrainer:
    def __init__(self, ctx: RoleContext) -> None:
        from relax_core.models.lora import is_lora, synced_weights
        from relax_core.pool.weights import make_sender
        from relax_core.roles.cores import CoreShare, check_cores_per_layer
        from relax_core.roles.media import resolver_for
        from relax_core.sync.buckets import specs_of
        from relax_core.train.factory import has_training_state, make_backend, trainer_policy

        self.ctx = ctx
        cfg = self.cfg = ctx.cfg
        s = cfg.services
        set_threads(s.trainer_threads)
        self.state = RunState.from_dict(ckpt.read_state(ctx.checkpoint))
        if self.state.run_id != ctx.run_id:
            raise ValueError(
                f"checkpoint {ctx.checkpoint} belongs to run {self.state.run_id!r}, "
                f"not {ctx.run_id!r}"
            )
        self.model, self.tokenizer = trainer_policy(cfg, ctx.checkpoint)
        self.backend = make_backend(self.model, cfg, source=ctx.checkpoint)
        if has_training_state(ctx.checkpoint, cfg.train.backend):
            self.backend.load(ctx.checkpoint)
        if cfg.services.trainer_gpus > 1:  # the other ranks do what this one does (ranks.py)
            from relax_core.train.ranks import Channel, LeaderBackend

            self.backend = LeaderBackend(self.backend, Channel())
        self.cores = CoreShare.from_env(ctx.name) if s.trainer_threads == 0 else None
        if self.cores is not None and cfg.train.deterministic:
            # CPU kernels sum in an order that depends on the thread count: a fixed one, all
            # the cores (what an elastic trainer takes while no other role computes).
            torch.set_num_threads(self.cores.cores)
            self.cores = None
        self.threads_used: list[int] = []
        if self.cores is not None:
            self.backend.before_micro_batch = self._take_free_cores
            check_cores_per_layer(self.model, self._take_free_cores)
        self.pool = ReadyPool(ctx, self.state.ready_cursor)
        self.media = resolver_for(cfg, self.model)
        # The layout engines hold: every weight in model.dtype, or a LoRA policy's adapter.
        published = None if is_lora(self.model) else cfg.model.dtype
        sender = make_sender(cfg, ctx.queue, specs_of(synced_weights(self.model), published))
        self.publisher = WeightPublisher(sender, self._named_weights, overlaps(cfg, self.backend))
        self.run_dir = join(cfg.checkpoint.dir, self.state.run_id)
        self._eval = None
        self._eval_copy = None
        if self.publisher.overlap:  # weights stay put until a push in flight has read them
            self.backend.before_update = self.publisher.finish

    # ---- pieces ------------------------------------------------------------------------
    def _take_free_cores(self) -> None:
        assert self.cores is not None
        threads = self.cores.free()
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        self.threads_used.append(threads)

    def save_checkpoint(self) -> str:
        from relax_core.train.queue_retention import prune_queue
        from relax_core.train.run_state import save_run_checkpoint

        self.publisher.finish()

        self.state.ready_cursor = self.pool.state()
        self.state.rng = {}
        path = save_run_checkpoint(self.run_dir, self.state, self.cfg, self.backend, self.tokenizer)
        # Entries every kept checkpoint has trained go now (queue.retention).
        prune_queue(self.ctx.queue, self.cfg, self.run_dir)
        return path

    def evaluate(self) -> dict[str, float]:
        """Held-out greedy eval with the trainer's own weights (no copy, no sync); under
        `model.matmul_dtype` in the trainer's autocast, which computes as the engines do."""
        from relax_core.models.precision import trainer_autocast
        from relax_core.rewards.registry import build_reward
        from relax_core.roles.episodes import env_runner
        from relax_core.roles.evaluation import evaluate
        from relax_core.roles.media import prompt_source
        from relax_core.rollout.torch_engine import TorchEngine

        cfg, tok = self.cfg, self.tokenizer
        if self._eval is None:
            source = prompt_source(cfg, "eval", self.model, tok, self.ctx.queue)
            reward = build_reward(
                cfg.reward,
                cache_dir=local_cache(cfg, "hf"),
                dtype=cfg.model.dtype,
                seed=cfg.seed,
            )
            self._eval = (source, reward, env_runner(cfg, self.model, tok))
        source, reward, env = self._eval
        model = self._eval_model()
        engine = TorchEngine(model, tok.eos_token_id, tok.pad_token_id, seed=cfg.seed)
        engine.version = self.state.policy_version
        device = next(model.parameters()).device
        try:
            with trainer_autocast(device, cfg.model.matmul_dtype):
                if env is not None:
                    return env.evaluate(
                        engine, source, cfg.rollout.max_new_tokens, cfg.data.eval_size
                    )
                return evaluate(
                    engine, tok, source, reward, cfg.rollout.max_new_tokens, cfg.data.eval_size
                )
        finally:
            model.train()

    def _eval_model(self):
        """The policy to evaluate: the trainer's own model with the torch backend without
        master weights; otherwise a copy in model.dtype on this rank, filled tensor by tensor
        from the backend's current weights (FSDP2 shards the model across ranks, Megatron
        keeps weights of its own, float32 master weights are not what the engines hold)."""
        if self.cfg.train.backend == "torch" and self.model.dtype == getattr(
            torch, self.cfg.model.dtype
        ):
            return self.model
        from relax_core.models.lora import synced_weights
        from relax_core.models.policy import load_policy

        if self._eval_copy is None:
            self._eval_copy, _ = load_policy(self.ctx.checkpoint, self.cfg.model.dtype)
        # What the backend publishes: every weight, or a LoRA policy's adapter (the copy's
        # frozen base is the trainer's).
        params = dict(synced_weights(self._eval_copy))
        tied = set(self._eval_copy.state_dict()) - set(params)  # e.g. a tied lm_head.weight
        unexpected = []
        with torch.no_grad():
            for name, tensor in self._named_weights():
                if name in params:
                    params.pop(name).copy_(tensor)
                elif name not in tied:
                    unexpected.append(name)
        if unexpected or params:
            raise RuntimeError(
                f"the {self.cfg.train.backend} backend's weights do not fit the policy to "
                f"evaluate: missing {sorted(params)[:5]}, unexpected {sorted(unexpected)[:5]}"
            )
        return self._eval_copy

    def _named_weights(self):
        """The backend's weights in the layout of transformers' models (what torch engines,
        actor_fwd and evaluation hold; Megatron converts its experts to the fused tensors),
        streamed one tensor at a time."""
        if self.cfg.train.backend == "megatron":
            return self.backend.named_weights(fused_experts=True)
        return self.backend.named_weights()

    def next_batch(self) -> tuple[pa.Table, float]:
        """Block until a step batch can be formed; returns it and the seconds waited."""
        r, ctx = self.cfg.rollout, self.ctx
        t0 = time.perf_counter()
        blocked_since: float | None = None
        next_join_check = t0 + _JOIN_CHECK_S
        while True:
            self.publisher.check()  # a push that failed fails the step now, not at its end
            if time.perf_counter() >= next_join_check and not self.publisher.in_flight:
                # An engine that restarted waits for weights before it may admit the groups
                # this step needs: serve it now, not after the step.
                next_join_check = time.perf_counter() + _JOIN_CHECK_S
                if self.publisher.needs_reform():
                    self.publisher.publish(self.state.policy_version)
            self.pool.refresh()
            enough = len(self.pool.groups) >= r.groups_per_step
            # A group lost upstream (a quarantined rollout entry) never arrives; after a lease
            # TTL of waiting with a full batch on hand, stop waiting for it.
            stuck = (
                blocked_since is not None
                and time.perf_counter() - blocked_since > self.cfg.queue.lease_ttl_s
            )
            chosen = self.pool.select(r.groups_per_step, ignore_in_flight=stuck) if enough else None
            if chosen is not None:
                if stuck:
                    log.warning(
                        "step %d: in-flight groups never arrived; trained without them",
                        self.state.policy_version,
                    )
                return self.pool.take(chosen), time.perf_counter() - t0
            if enough and blocked_since is None:
                blocked_since = time.perf_counter()
            if preemption.requested():  # nothing taken yet: a step boundary
                raise preemption.Interrupted
            if ctx.stopped():
                raise RuntimeError("control/stop appeared before the run finished")
            ctx.status["state"] = f"waiting for ready groups ({len(self.pool.groups)} on hand)"
            ctx.sleep()

    def step(self) -> dict[str, float]:
        mark_progress()  # a busy trainer takes its batch without a poll round
        cfg, state = self.cfg, self.state
        a, r = cfg.algorithm, cfg.rollout
        v = state.policy_version
        t0 = time.perf_counter()
        batch, waited = self.next_batch()
        # A batch whose every agent episode failed trains nothing; enough in a row stop the run.
        state.failed_agent_steps = count_failed_step(
            state.failed_agent_steps,
            failed_step_error(batch.column("reward_info").to_pylist()),
            cfg.env.max_failed_agent_steps,
        )
        dropped = 0
        if cfg.services.drop_over_stale:
            batch, dropped = split_over_stale(batch, v, r.max_staleness)
        self.ctx.status["state"] = f"training step {v}"
        # The layer hooks take cores in an eval's generation too: the metric is the step's own.
        self.threads_used.clear()
        t1 = time.perf_counter()
        metrics = train_on_table(
            self.backend,
            batch,
            a,
            self.tokenizer.pad_token_id,
            cfg.train.micro_batch_tokens,
            cfg.train.minibatches_per_step,
            train_version=v,
            max_new_tokens=response_budget(cfg),
            resolver=self.media,
            routing_replay=cfg.train.routing_replay,
            skip_inert=cfg.train.skip_inert_groups,
        )
        t2 = time.perf_counter()
        if self.threads_used:
            metrics["perf/trainer_threads"] = sum(self.threads_used) / len(self.threads_used)
            self.threads_used.clear()
        state.policy_version = v + 1
        sync_wait = self.publisher.take_waited()
        self.publisher.publish(v + 1, wait=False)
        self.ctx.status["policy_version"] = v + 1
        t3 = time.perf_counter()
        metrics.update(_batch_metrics(batch))
        metrics.update(_entry_metrics(self.pool.pop_meta()))
        groups = batch.group_by("group_id").aggregate([("behaviour_version_min", "min")])
        record_trained(self.ctx.queue, v + 1, groups.column("group_id").to_pylist())
        versions = groups.column("behaviour_version_min_min").to_pylist()
        hist = staleness_histogram(v, versions)
        staleness = [v - b for b in versions]
        step_s = t3 - t0
        metrics.update(
            {
                "train/staleness_mean": sum(staleness) / max(1, len(staleness)),
                "train/staleness_max": float(max(staleness, default=0)),
                **{f"train/staleness_hist_{k}": float(n) for k, n in hist.items()},
                "perf/step_s": step_s,
                "perf/trainer_wait_s": waited,
                "perf/train_s": t2 - t1,
                # Overlapped, the push of this step's weights runs on during the next step;
                # what it held the previous step up by (the optimizer step waiting) counts here.
                "perf/sync_s": t3 - t2 + sync_wait,
                "perf/tokens_per_s": metrics["train/response_length"] * batch.num_rows / step_s,
                "queue/ready_groups_on_hand": float(len(self.pool.groups)),
                "queue/ready_through": float(self.pool.cursor.through),
                "queue/dropped_stale_groups": float(dropped),
                "queue/quarantined_entries": float(self.pool.quarantined),
                "sync/reforms": float(self.publisher.reforms),
            }
        )
        state.train_seconds += step_s
        return metrics

    # ---- the loop ----------------------------------------------------------------------
    def run(self) -> str:
        from relax_core.train.loop import train_until

        self.ctx.status["state"] = "waiting for the engines to join weight sync"
        self.publisher.init()
        # Engines may hold other weights than this checkpoint's (this trainer restarted and
        # they hold the dead trainer's newer ones, or an engine restarted): everyone starts
        # from the trainer's current version. Over the object store this also removes the
        # dead trainer's versions above it.
        self.publisher.publish(self.state.policy_version)
        final = train_until(
            self.cfg,
            self.state,
            self.cfg.train.total_steps,
            self.step,
            self.evaluate,
            self.save_checkpoint,
            self.ctx.checkpoint_url,
        )
        self.publisher.finish()
        return final

    def close(self) -> None:
        try:
            self.publisher.close()
        finally:
            if hasattr(self.backend, "stop"):
                self.backend.stop()


def serve(ctx: RoleContext) -> None:
    """Train to `train.total_steps`, then end the run: engines get STOP through weight sync,
    every service through `control/stop`."""
    trainer = AsyncTrainer(ctx)
    # A failure does not end the run: the supervisor (Flyte's retries on a cluster) restarts
    # the trainer from its newest checkpoint, and the other roles wait for it meanwhile.
    final = trainer.run()
    options = ctx.cfg.storage.options()
    write_json(join(trainer.run_dir, FINAL_CHECKPOINT), {"checkpoint": final}, options)
    try:
        trainer.close()
    finally:
        ctx.queue.stop()
    log.info("run finished at version %d; weight sync closed", trainer.state.policy_version)

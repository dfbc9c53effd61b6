"""Colocate controller: strict on-policy RL (max_staleness 0), every role in one process.

Per step, with policy version v:
  PromptSource --prompts--> rollout_groups (TorchEngine, reward fn) --rows--> queue `rollout`
  (an agentic run: EnvRunner.rollout plays multi-turn episodes instead, env rewards)
  (dynamic sampling: groups with equal rewards dropped, more prompts sampled, DAPO)
  `rollout` --> add_ref_logprobs (frozen reference when kl_coef > 0; teacher when distilling)
            --> queue `ref`
  `rollout`|`ref` --> add_advantages (group-normalized, + distillation term) --> queue `ready`
  `ready` --> train_on_table (TorchBackend) --> version v+1 --InProcessSync--> TorchEngine
Rows travel through the same TransferQueue as in async mode, so both modes share one data path
(each entry committed, then passed on in memory rather than read back).
On a GPU trainer and engine take turns (train.offload_between_steps): the trainer's state waits
in host memory while the engine generates; the engine sleeps and the state comes back for the
reference pass and training; gradients and optimizer state leave before the weights go to the
engine, and the weights after.
The controller only sequences the roles and times them; a RunSession holds the parts and the
resumable state, and checkpoints every `checkpoint_every` steps.
"""

from __future__ import annotations

import logging
import time

import pyarrow as pa

from relax_core.queue import ROW_SCHEMA, rows_to_table
from relax_core.roles.advantages import advantages_of
from relax_core.roles.episodes import response_budget
from relax_core.roles.evaluation import evaluate
from relax_core.roles.reference import add_ref_logprobs
from relax_core.roles.rollout import informative_groups, rollout_groups, rollout_metrics
from relax_core.roles.trainer import train_on_table
from relax_core.rollout.engine import SamplingParams
from relax_core.run.session import RunSession
from relax_core.train.agent_failures import count_failed_step, first_failure

log = logging.getLogger(__name__)


def _n_groups(rows: list[dict]) -> int:
    return len({row["group_id"] for row in rows})


class ColocateController:
    def __init__(self, session: RunSession) -> None:
        self.s = session
        r = session.cfg.rollout
        self.params = SamplingParams(r.max_new_tokens, r.temperature, r.top_p)

    def _consume(self, stage: str) -> pa.Table:
        """Read the next committed entry of `stage` and advance this consumer's cursor."""
        found = self.s.queue.next(stage, self.s.state.queue_cursors[stage])
        if found is None:
            raise RuntimeError(f"queue stage {stage!r} has no entry after the cursor")
        seq, table = found
        self.s.state.queue_cursors[stage] = seq
        return table

    def _pass(self, stage: str, table: pa.Table, version: int) -> pa.Table:
        """Commit `table` to `stage` and take it as the stage's next entry.

        When the commit lands right after the cursor (always, in a run with one writer), the
        entry is the table just written: the cursor moves to it and the table goes on without
        being read back and decoded (~0.5 ms a stage on the CPU default). An entry found between
        (another writer's) is read in order, as a consumer reads it.
        """
        seq = self.s.queue.put(stage, table, {"policy_version": version})
        # A table whose columns are in another order or lack the schema's metadata is read
        # back, as the reader normalizes it.
        in_order = table.schema.equals(ROW_SCHEMA, check_metadata=True)
        if seq != self.s.state.queue_cursors[stage] + 1 or not in_order:
            return self._consume(stage)
        self.s.state.queue_cursors[stage] = seq
        return table

    def _generate(self, n_groups: int) -> tuple[list[dict], dict[str, float]]:
        s, cfg = self.s, self.s.cfg
        items, cursor = s.train_prompts.take(s.dataset_cursor, n_groups)
        if s.env is not None:
            rows, metrics = s.env.rollout(
                s.engine, items, self.params, cfg.rollout.n_samples_per_prompt
            )
        else:
            rows, metrics = rollout_groups(
                s.engine,
                s.tokenizer,
                items,
                self.params,
                cfg.rollout.n_samples_per_prompt,
                s.reward_fn,
                cfg.reward.overlong_buffer,
                cfg.reward.overlong_penalty,
            )
        s.state.dataset_cursor = cursor.to_dict()
        return rows, metrics

    def _sample_step_batch(self) -> tuple[list[dict], dict[str, float]]:
        """The step batch's rows; with dynamic sampling only groups whose rewards differ, topping
        up with fresh prompts for at most `max_sampling_rounds` rounds (DAPO)."""
        r = self.s.cfg.rollout
        rows, metrics = self._generate(r.groups_per_step)
        if not r.dynamic_sampling:
            self._count_agent_failures(rows)
            return rows, metrics
        kept, rounds, generated = informative_groups(rows), 1, list(rows)
        while _n_groups(kept) < r.groups_per_step and rounds < r.max_sampling_rounds:
            more, more_metrics = self._generate(r.groups_per_step - _n_groups(kept))
            kept, rounds = kept + informative_groups(more), rounds + 1
            generated += more
            for key in (
                "perf/generate_s",
                "perf/reward_s",
                "perf/generated_tokens",
                "train/reward_errors",
            ):
                metrics[key] += more_metrics[key]  # totals over every round of the step
        dropped = _n_groups(generated) - _n_groups(kept)
        metrics.update(rollout_metrics(generated))
        metrics.update(
            {
                "rollout/sampling_rounds": float(rounds),
                "rollout/filtered_groups": float(dropped),
                "rollout/unfilled_groups": float(max(0, r.groups_per_step - _n_groups(kept))),
            }
        )
        self._count_agent_failures(generated)
        if not kept:
            raise RuntimeError(
                f"dynamic sampling found no group with differing rewards in {rounds} rounds of "
                f"{r.groups_per_step} prompts; raise rollout.max_sampling_rounds or check the "
                "reward (every sample scored the same)"
            )
        return kept, metrics

    def _count_agent_failures(self, rows: list[dict]) -> None:
        """A step whose every agent episode failed counts; env.max_failed_agent_steps of them in
        a row stop the run (AgentsFailed)."""
        s = self.s
        s.state.failed_agent_steps = count_failed_step(
            s.state.failed_agent_steps,
            first_failure(row["reward_info"] for row in rows),
            s.cfg.env.max_failed_agent_steps,
        )

    def step(self) -> dict[str, float]:
        """One RL step: version v -> v+1. Returns the step's metrics."""
        s, cfg = self.s, self.s.cfg
        v = s.state.policy_version
        t0 = time.perf_counter()
        self._engine_turn()
        rows, metrics = self._sample_step_batch()
        t1 = time.perf_counter()
        table = self._pass("rollout", rows_to_table(rows), v)
        self._trainer_turn()
        t2 = time.perf_counter()
        frozen = [
            (s.ref_model, "ref_logprobs", s.media),  # a copy of the policy: the same media
            (s.teacher_model, "teacher_logprobs", s.teacher_media),
        ]
        frozen = [(model, column, media) for model, column, media in frozen if model is not None]
        for model, column, media in frozen:
            with s.ref_logprobs_context(model):
                table = add_ref_logprobs(
                    model,
                    table,
                    s.pad_token_id,
                    cfg.train.micro_batch_tokens,
                    cfg.rollout.temperature,
                    column,
                    media,
                    scorer=s.ref_scorer(model),
                )
        if frozen:
            table = self._pass("ref", table, v)
        t3 = time.perf_counter()
        a = cfg.algorithm
        table = self._pass("ready", advantages_of(table, a), v)
        t4 = time.perf_counter()
        metrics.update(
            train_on_table(
                s.backend,
                table,
                a,
                s.pad_token_id,
                cfg.train.micro_batch_tokens,
                cfg.train.minibatches_per_step,
                train_version=v,
                max_new_tokens=response_budget(cfg),
                resolver=s.media,
                routing_replay=cfg.train.routing_replay,
                skip_inert=cfg.train.skip_inert_groups,
            )
        )
        t5 = time.perf_counter()
        s.state.policy_version = v + 1
        if s.gives_back:  # the weights stay for the push; the rest is not needed until then
            s.backend.offload(weights=False)
        s.sync.push(s.backend.named_weights(), v + 1)
        self._engine_turn()
        t6 = time.perf_counter()
        staleness = [v - b for b in table.column("behaviour_version_min").to_pylist()]
        step_s = t6 - t0
        metrics.update(
            {
                "train/staleness_mean": sum(staleness) / len(staleness),
                "train/staleness_max": float(max(staleness)),
                "perf/step_s": step_s,
                "perf/rollout_s": t1 - t0,
                "perf/ref_s": t3 - t2,
                "perf/train_s": t5 - t4,
                "perf/sync_s": t6 - t5,
                "perf/queue_s": (t2 - t1) + (t4 - t3),
                "perf/tokens_per_s": metrics["perf/generated_tokens"] / step_s,
                "queue/orphaned_groups": float(s.state.orphaned_groups),
                "queue/ready_seq": float(s.state.queue_cursors["ready"]),
                **(s.reward_fn.metrics() if hasattr(s.reward_fn, "metrics") else {}),
            }
        )
        s.state.train_seconds += step_s
        return metrics

    def _engine_turn(self) -> None:
        """The GPU to the engine: the trainer's state to host memory, when it gives it back
        (already there: nothing moves)."""
        if self.s.gives_back:
            self.s.backend.offload()

    def _trainer_turn(self) -> None:
        """The GPU to the trainer: an SGLang or vLLM server releases its memory, and the
        trainer's state comes back."""
        if hasattr(self.s.engine, "sleep"):
            self.s.engine.sleep()
        if self.s.gives_back:
            self.s.backend.reload()

    def evaluate(self) -> dict[str, float]:
        s = self.s
        self._engine_turn()
        if s.env is not None:
            return s.env.evaluate(
                s.engine, s.eval_prompts, s.cfg.rollout.max_new_tokens, s.cfg.data.eval_size
            )
        return evaluate(
            s.engine,
            s.tokenizer,
            s.eval_prompts,
            s.reward_fn,
            s.cfg.rollout.max_new_tokens,
            s.cfg.data.eval_size,
        )

    def skip_orphans(self) -> None:
        """Entries written after the checkpoint came from weights that were lost with the crash.

        Their prompts are regenerated from the restored dataset cursor, so no prompt is skipped
        or trained twice; the generated rows themselves are passed over and counted.
        """
        s = self.s
        for stage, cursor in s.state.queue_cursors.items():
            later = s.queue.committed(stage, cursor)
            if later:
                groups = sum(s.queue.record(stage, seq)["groups"] for seq in later)
                if stage == "rollout":
                    s.state.orphaned_groups += groups
                log.warning(
                    "resume at version %d: skipping %d %r entries (%d groups) written after the "
                    "checkpoint",
                    s.state.policy_version,
                    len(later),
                    stage,
                    groups,
                )
                s.state.queue_cursors[stage] = later[-1]

"""What a run's checkpoint holds besides weights and optimizer, so a run continues exactly (the
policy version, dataset and queue cursors, the MLflow run, RNG states), and the one function both
modes write a checkpoint with."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from relax_core.config import RunConfig
from relax_core.data.cursor import DatasetCursor
from relax_core.queue import STAGES
from relax_core.train import checkpoint as ckpt


@dataclass
class RunState:
    """What a checkpoint needs besides weights and optimizer to continue exactly."""

    run_id: str
    policy_dir: str = ""
    started_at: float = 0.0
    policy_version: int = 0
    dataset_cursor: dict[str, int] = field(default_factory=lambda: DatasetCursor().to_dict())
    queue_cursors: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STAGES, -1))
    tracking_run_id: str = ""
    eval_before: dict[str, float] = field(default_factory=dict)
    train_seconds: float = 0.0
    orphaned_groups: int = 0
    ready_cursor: dict[str, Any] = field(default_factory=lambda: {"through": -1, "beyond": []})
    """Async trainer: `ready` entries fully trained (StageCursor) plus, under "partial", the
    group ids already trained of entries a step batch split."""
    rng: dict[str, Any] = field(default_factory=dict)
    failed_agent_steps: int = 0
    """Steps in a row whose every agent episode failed (train/agent_failures.py)."""

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RunState:
        """From a checkpoint's state.json (fields it lacks, from older versions, default)."""
        return cls(**{f.name: raw[f.name] for f in dataclasses.fields(cls) if f.name in raw})


def save_run_checkpoint(run_dir: str, state: RunState, cfg: RunConfig, backend, tokenizer) -> str:
    """Checkpoint `state.policy_version`: model + optimizer (backend), tokenizer, state + config."""

    def write_model(directory: str) -> None:
        backend.save(directory)
        tokenizer.save_pretrained(directory)

    return ckpt.save_checkpoint(
        run_dir,
        state.policy_version,
        write_model,
        {**dataclasses.asdict(state), "config": dataclasses.asdict(cfg)},
        cfg.train.keep_checkpoints,
        cfg.storage.options(),
        cfg.storage.scratch_dir,
    )

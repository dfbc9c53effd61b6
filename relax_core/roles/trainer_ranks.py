"""Trainer ranks 1.. of a trainer over several GPUs (torchrun): the same policy and backend as
rank 0, then the operations rank 0 announces (train/ranks.py) until the run stops. No heartbeat,
queue or MLflow of their own: rank 0 is the trainer service (trainer_service.py)."""

from __future__ import annotations

from relax_core.config import RunConfig
from relax_core.roles.service import set_threads
from relax_core.roles.stacks import dump_stacks_on_signal
from relax_core.roles.trainer import train_on_table


def follow_rank0(cfg: RunConfig, checkpoint: str) -> None:
    """A trainer rank other than 0 under torchrun: train what rank 0 announces until it stops."""
    from relax_core.roles.media import resolver_for
    from relax_core.train.factory import has_training_state, make_backend, trainer_policy
    from relax_core.train.ranks import Channel, follow

    dump_stacks_on_signal()
    set_threads(cfg.services.trainer_threads or 1)
    model, _ = trainer_policy(cfg, checkpoint)
    backend = make_backend(model, cfg, source=checkpoint)
    if has_training_state(checkpoint, cfg.train.backend):
        backend.load(checkpoint)
    resolver = resolver_for(cfg, model)

    def train(backend, table, step: dict) -> None:
        train_on_table(
            backend,
            table,
            cfg.algorithm,
            step["pad_token_id"],
            step["token_budget"],
            step["minibatches"],
            train_version=step["train_version"],
            max_new_tokens=step["max_new_tokens"],
            resolver=resolver,
            routing_replay=step["routing_replay"],
            skip_inert=cfg.train.skip_inert_groups,
        )

    follow(backend, Channel(), train)

"""Trainer ranks 1.. of a trainer over several GPUs (torchrun): the same policy and backend as
rank 0, then the operations rank 0 announces (train/ranks.py) until the run stops. No heartbeat,
queue or MLflow of their own: rank 0 is the trainer service (async_trainer.py)."""

from __future__ import annotations

import argparse
import logging

from relax_core.services.role import set_threads
from relax_core.services.trainer import train_on_table


def main(argv: list[str] | None = None) -> int:
    """`python -m relax_core.services.trainer` under torchrun, on a rank other than 0."""
    from relax_core.models.policy import load_policy
    from relax_core.services.media import resolver_for
    from relax_core.services.role import load_run_config
    from relax_core.train.factory import has_training_state, make_backend
    from relax_core.train.ranks import Channel, follow

    parser = argparse.ArgumentParser(prog="python -m relax_core.services.trainer (rank > 0)")
    for flag in ("--cfg", "--run-id", "--checkpoint"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--worker", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer-rank %(message)s")
    cfg = load_run_config(args.cfg)
    set_threads(cfg.services.trainer_threads or 1)
    model, _ = load_policy(args.checkpoint, cfg.model.dtype)
    backend = make_backend(model, cfg)
    if has_training_state(args.checkpoint, cfg.train.backend):
        backend.load(args.checkpoint)
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
        )

    follow(backend, Channel(), train)
    return 0

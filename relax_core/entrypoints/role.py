"""`python -m relax_core.entrypoints.role ROLE --cfg CFG --run-id RUN_ID --checkpoint DIR
[--worker N]`: one service of an async run in this process (what the local supervisor starts).

CFG is a YAML run config or the canonical JSON the Flyte tasks pass around; RUN_ID names the
queue prefix; DIR is the checkpoint the run continues from. Under torchrun (a trainer over several
GPUs) rank 0 is the trainer service and the other ranks follow it (train/ranks.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from relax_core.roles.torchrun import die_with_torchrun

# First, before the imports below take seconds: a trainer rank whose torchrun is killed meanwhile
# (a start that timed out) must not live on without it.
die_with_torchrun()

from relax_core.config import ConfigError  # noqa: E402
from relax_core.queue import StorageUnavailable  # noqa: E402
from relax_core.roles.service import ROLES, load_run_config, run_role  # noqa: E402
from relax_core.roles.trainer_ranks import follow_rank0  # noqa: E402
from relax_core.run.role_services import serve_fn  # noqa: E402
from relax_core.storage import is_committed  # noqa: E402
from relax_core.train import preemption  # noqa: E402
from relax_core.train.agent_failures import AgentsFailed  # noqa: E402
from relax_core.train.checkpoint import STATE_FILE, local_checkpoint  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m relax_core.entrypoints.role",
        description="Run one service of an async RL run.",
    )
    parser.add_argument("role", choices=ROLES, help="the role this process serves")
    parser.add_argument("--cfg", required=True, help="run config: YAML or JSON file, or JSON")
    # --run-id: torchrun (a trainer over several GPUs) reads '--run' as an abbreviation of its
    # own --run-path.
    parser.add_argument(
        "--run-id", "--run", dest="run", required=True, help="run id (the queue prefix)"
    )
    parser.add_argument("--checkpoint", required=True, help="checkpoint the run continues from")
    parser.add_argument("--worker", type=int, default=0, help="index among workers of this role")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    name = f"{args.role}-{args.worker}" if rank == 0 else f"{args.role}-rank{rank}"
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(message)s")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    try:
        cfg = load_run_config(args.cfg)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not is_committed(args.checkpoint, STATE_FILE, cfg.storage.options()):
        print(f"error: --checkpoint {args.checkpoint} is not a checkpoint", file=sys.stderr)
        return 2
    try:
        if args.role == "trainer" and rank > 0:
            options, scratch = cfg.storage.options(), cfg.storage.scratch_dir
            follow_rank0(cfg, local_checkpoint(args.checkpoint, options, scratch))
        else:
            run_role(args.role, serve_fn(args.role), cfg, args.run, args.checkpoint, args.worker)
    except preemption.Preempted as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return preemption.EXIT_CODE
    except StorageUnavailable as exc:
        print(f"error: {name}: {exc}", file=sys.stderr)
        return StorageUnavailable.exit_code
    except AgentsFailed as exc:
        # stdout is the role's log, where the supervisor reads the reason the run stopped.
        for stream in (sys.stdout, sys.stderr):
            print(f"error: {name}: {exc}", file=stream, flush=True)
        return AgentsFailed.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())

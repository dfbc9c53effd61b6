"""`python -m relax_core.entrypoints.run --cfg CFG`: a whole RL run (colocate or async) in this
process, without Flyte: what the `train` workflow does node by node."""

from __future__ import annotations

import argparse
import logging
import sys

from relax_core.config import ConfigError, load_config
from relax_core.queue import StorageUnavailable
from relax_core.roles.stacks import dump_stacks_on_signal
from relax_core.run.lifecycle import run
from relax_core.train import preemption
from relax_core.train.agent_failures import AgentsFailed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run RL (colocate or async) without Flyte.")
    parser.add_argument("--cfg", required=True, help="YAML run config")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    dump_stacks_on_signal()  # kill -USR1: where the supervisor waits
    try:
        cfg = load_config(args.cfg)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        run(cfg)
    except preemption.Preempted as exc:
        print(str(exc), file=sys.stderr)
        return preemption.EXIT_CODE
    except StorageUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return StorageUnavailable.exit_code
    except AgentsFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return AgentsFailed.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())

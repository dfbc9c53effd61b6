"""`relax`: the command line for people operating runs (`relax queue ...`)."""

from __future__ import annotations

import argparse
import sys

from relax_core.queue import __main__ as queue_cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="relax")
    commands = parser.add_subparsers(dest="command", required=True)
    queue_cli.add_arguments(
        commands.add_parser("queue", help="stages, backlog, leases, staleness and quarantine")
    )
    args = parser.parse_args(argv)
    return queue_cli.run(args)


if __name__ == "__main__":
    sys.exit(main())

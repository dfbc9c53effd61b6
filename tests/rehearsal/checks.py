"""Checks the rehearsal runs in a pod of their own after a run, as an operator's job would:
only the config and the final checkpoint's URL, and storage."""

from __future__ import annotations

from typing import Any


def queue_audit(cfg_json: str, checkpoint: str) -> dict[str, Any]:
    """The exactly-once audit of an async run (relax_core/queue/audit.py) from storage."""
    from relax_core.config import RunConfig
    from relax_core.queue import open_queue
    from relax_core.queue.audit import audit_run
    from relax_core.train.checkpoint import read_state

    cfg = RunConfig.from_json(cfg_json)
    state = read_state(checkpoint, cfg.storage.options())
    return audit_run(open_queue(cfg.queue, state["run_id"]), state)


def preflight(cfgs: dict[str, dict[str, Any]]) -> dict[str, str]:
    """prepare_data's preflight (relax_core.run.lifecycle.preflight) on each config, in this pod:
    '' where it passes, else its refusal."""
    from relax_core.config import ConfigError, config_from_dict
    from relax_core.run.lifecycle import preflight as check

    refusals = {}
    for name, data in cfgs.items():
        try:
            check(config_from_dict(data))
            refusals[name] = ""
        except ConfigError as exc:
            refusals[name] = str(exc)
    return refusals

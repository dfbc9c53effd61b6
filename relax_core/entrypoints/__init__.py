"""Command lines; nothing imports them. `python -m relax_core.entrypoints.role ROLE ...` (one
async-mode service), `python -m relax_core.entrypoints.run --cfg CFG` (a whole run without
Flyte), and `relax` (cli.py: `relax queue` (queue.py), `relax compare`, `relax scale`,
`relax send-metrics` (send_metrics.py)).

May import: every room.
"""

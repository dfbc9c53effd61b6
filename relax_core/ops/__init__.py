"""Operating a local async run: supervisor.py starts every role as a process (processes.py),
watches heartbeats and restarts what fails; elastic.py grows and shrinks the rollout engine pool
behind an HTTP API (scale_api.py, scale_requests.py) that `relax scale` talks to (scale_client.py);
notify.py tells people about restarts and the end of a run.

May import: config, plan, pool, queue, roles, rollout, storage, sync, train.
"""

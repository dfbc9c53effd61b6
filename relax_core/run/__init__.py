"""A run's lifecycle: preflight, the starting policy (prepare.py), start (eval at step 0), the
steps (colocate.py's controller in this process, or the async roles), finish (register, report).
session.py holds what a colocate run needs while it trains; evaluate.py evaluates a checkpoint;
role_services.py names each async role's service. The Flyte tasks call these functions.

May import: algorithms, config, data, envs, models, multimodal, ops, pool, queue, rewards, roles,
rollout, storage, sync, tracking, train.
"""

"""The RL roles, one module each with its step function (what the colocate controller calls) and,
for the async mode, its service loop: rollout.py + rollout_service.py (episodes.py for agentic
multi-turn rollout), reference.py, actor_fwd.py, advantages.py, trainer.py (one optimizer step
on a step batch) + trainer_service.py (the async trainer: ready_pool.py chooses its step
batches) + trainer_ranks.py (ranks 1.. of a trainer over several GPUs).
Shared by the roles: service.py (context, heartbeats, stop, the stage-serving loop), media.py
(media per policy kind), evaluation.py (held-out eval), cores.py (CPU cores between local roles).

May import: agents, algorithms, config, data, envs, models, multimodal, pool, queue, rewards, rollout,
storage, sync, tracking, train.
"""

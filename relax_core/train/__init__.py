"""Training: the TrainBackend protocol (backend.py) and its torch, FSDP2 and Megatron-core
backends (factory.py picks one), micro-batches from queue tables (batch.py, batching.py),
checkpoints written whole (checkpoint.py) with the run's resumable state (run_state.py), the step
loop both modes share (loop.py: log, evaluate, checkpoint), trainer ranks over several GPUs
(ranks.py), the supervised warm start (warm_start.py), and the stop of a run whose agents all
fail (agent_failures.py).

May import: algorithms, config, data, models, multimodal, plan, queue, rollout, storage, sync, tracking.
"""

"""The rollout engine pool of an async run, as every process sees it on the run's storage
(engines.py: members, states, drains, SGLang servers), and how the trainer's weights reach each
engine (weights.py: sender and receivers per config; engine_weights.py: the one interface a
rollout process's engine takes weights through).

May import: config, queue, rollout, sync.
"""

"""The memory plan: what each GPU of a run holds, part by part, computed from the config alone
before anything starts (docs/gpus.md, "Memory plan").

devices.py names the cards and their memory; shapes.py gives a policy's shape (the tiny models
from the config, a local HF directory from its config.json, known Hugging Face ids from a small
table); parts.py is the arithmetic of each part (trainer state and its sharding, activations with
and without checkpointing, logits, engines' weights and KV cache); memory.py puts one run's
processes on their GPUs, sums the parts and refuses what does not fit, naming the parts and the
setting to change. Beside it, ops/placement.py says which GPUs each process gets.

No torch, no I/O beyond reading a local model's config.json: a plan is made anywhere, in
milliseconds.

May import: config.
"""

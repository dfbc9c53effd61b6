"""Rollout engines: the RolloutEngine protocol and sampling (engine.py, sampling.py), the torch
engine (batched sampling with a KV cache), the SGLang client, server launcher, colocated
server and LoRA adapters loaded by name (sglang_lora.py), and multi-turn episodes against an env (multiturn.py, observations.py, demonstrations.py).

May import: config, data, envs, models, multimodal.
"""

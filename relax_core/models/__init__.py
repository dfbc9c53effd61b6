"""Policies: the tiny character-level Qwen3 (tiny.py), the tiny omni policy (omni.py),
pretrained models from GGUF or HF (pretrained.py), loading any of them from a directory
(policy.py), routing replay for MoE routers (routing_replay.py), and float32 attention inside
a bfloat16 policy (attention.py).

May import: config, data, multimodal.
"""

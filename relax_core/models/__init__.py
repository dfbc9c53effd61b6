"""Policies: the tiny character-level Qwen3 (tiny.py), the tiny omni policy (omni.py),
pretrained models from GGUF or HF (pretrained.py), loading any of them from a directory
(policy.py), routing replay for MoE routers (routing_replay.py), and bf16 linear layers in a
float32 policy (precision.py, with float32 attention: attention.py).

May import: config, data, multimodal.
"""

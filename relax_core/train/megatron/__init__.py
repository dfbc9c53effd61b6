"""Megatron-core training backend: HF <-> Megatron conversion (pure torch), parallel settings, and
the backend itself (megatron.core is imported only when a backend is built)."""

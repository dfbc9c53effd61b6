"""Prompt datasets (JSONL/Parquet), the resumable dataset cursor, prompt rendering, and the
PromptSource that hands the rollout tokenized prompts in dataset order (prompts.py).

May import: config, multimodal.
"""

from relax_core.data.cursor import DatasetCursor, PromptSampler
from relax_core.data.dataset import (
    SUPPORTED_EXTENSIONS,
    DatasetError,
    check_dataset_path,
    load_prompts,
)
from relax_core.data.templates import TEMPLATES, render_prompt

__all__ = [
    "SUPPORTED_EXTENSIONS",
    "TEMPLATES",
    "DatasetCursor",
    "DatasetError",
    "PromptSampler",
    "check_dataset_path",
    "load_prompts",
    "render_prompt",
]

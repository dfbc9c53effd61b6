"""Loading a policy (or a distillation teacher) from a prepared policy or checkpoint directory:
a tiny or pretrained causal LM, the tiny omni policy, or a Qwen VL/Omni policy
(run/prepare.py builds the starting policy these directories begin as)."""

from __future__ import annotations

import json
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from relax_core.models.lora import has_adapter, load_adapter
from relax_core.models.omni import SPEC_FILE as OMNI_SPEC_FILE
from relax_core.models.omni import load_omni

PREPARED_MARKER = "PREPARED.json"
"""Written last into a prepared starting policy's directory (run/prepare.py): it is whole."""


def load_policy(directory: str, dtype: str = "float32", video_fps: float = 2.0):
    """(model, tokenizer) from a prepared policy or checkpoint directory; `video_fps` is the
    frame rate a Qwen multimodal policy's videos are sampled at (model.video_fps)."""
    hf_logging.disable_progress_bar()  # a weight-loading bar per node drowns the run's own bar
    if _is_qwen_multimodal(directory):
        from relax_core.multimodal.qwen import load_qwen_policy

        model, tokenizer = load_qwen_policy(directory, dtype, video_fps)
    else:
        if os.path.isfile(os.path.join(directory, OMNI_SPEC_FILE)):
            model = load_omni(directory, getattr(torch, dtype))
        else:
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype))
        tokenizer = AutoTokenizer.from_pretrained(directory)
    if has_adapter(directory):  # a LoRA policy: base weights here, the adapter beside them
        load_adapter(model, directory)
    return model, for_generation(tokenizer)


def load_tokenizer(directory: str):
    """The tokenizer of a text policy directory, set up as `load_policy` sets it up."""
    return for_generation(AutoTokenizer.from_pretrained(directory))


def for_generation(tokenizer):
    """Left padding, and EOS as padding when the tokenizer has no pad token."""
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def accelerator() -> torch.device | None:
    """This process's GPU when it has one (the placement plan's CUDA_VISIBLE_DEVICES says
    which; every process sees its own as cuda:0), else None."""
    if not torch.cuda.is_available():
        return None
    return torch.device("cuda", torch.cuda.current_device())


def on_accelerator(model):
    """`model` moved to this process's GPU (`accelerator`) when it has one, else as it is."""
    device = accelerator()
    return model if device is None else model.to(device)


def _is_qwen_multimodal(directory: str) -> bool:
    from relax_core.multimodal.qwen.families import family_for_model_type

    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        return family_for_model_type(json.load(f).get("model_type", "")) is not None


def load_teacher(directory: str, student_tokenizer, dtype: str = "float32"):
    """A frozen teacher for on-policy distillation; it must share the student's vocabulary, since
    it scores the student's token ids."""
    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise FileNotFoundError(
            f"algorithm.teacher: {directory} is not a model directory (no config.json); give a "
            "checkpoint directory such as .relax/checkpoints/<run id>/step_000200"
        )
    model, tokenizer = load_policy(directory, dtype)
    if tokenizer.get_vocab() != student_tokenizer.get_vocab():
        raise ValueError(
            f"algorithm.teacher: {directory} has a different tokenizer than the student; "
            "distillation scores the student's token ids, so both need the same vocabulary"
        )
    return model.eval().requires_grad_(False), tokenizer

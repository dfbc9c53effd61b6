"""model.source as a URL of a Hugging Face model directory (run/sources.py, storage/trees.py):

- copied into scratch once per content (file:// and memory://): a second resolve reuses the copy
  untouched, a changed upload gets a copy and a policy key of its own, and a run keyed on the old
  upload refuses the new one rather than prepare it under the old key;
- a download that fails midway, or a leftover of a killed one, leaves nothing that looks complete;
- a URL without config.json, a store that cannot be listed, a scheme fsspec does not know and a
  URL with no path are refused, naming model.source and what is wrong;
- the prepared policy holds the same weights as the directory loaded locally;
- the memory plan takes a URL source's shape from KNOWN by its name, else from its config.json,
  without the weights.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import ClassVar

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from relax_core.config import ConfigError, ModelConfig, config_from_dict
from relax_core.models.policy import load_policy
from relax_core.models.tiny import build_char_tokenizer, build_tiny_qwen3
from relax_core.plan.shapes import KNOWN, model_shape, shape_from_hf
from relax_core.run.lifecycle import policy_spec_for
from relax_core.run.prepare import PolicySpec, prepare_policy
from relax_core.run.sources import local_source, source_problems
from relax_core.storage import list_tree, tree_copy, tree_key
from tests.s3servers import free_ports


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory) -> str:
    """A Hugging Face model directory (config.json, safetensors, tokenizer) of the tiny Qwen3."""
    path = tmp_path_factory.mktemp("tiny-hf") / "Tiny-Qwen3"
    tokenizer = build_char_tokenizer()
    build_tiny_qwen3(ModelConfig(), len(tokenizer), seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


class CountingMemoryFileSystem(MemoryFileSystem):
    """memory:// under a scheme of its own that records each file opened for reading (what a
    download reads), plugged in through fsspec's registry like any other filesystem."""

    protocol = "countmem"
    reads: ClassVar[list[str]] = []

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(str(path).removeprefix("countmem://"))

    def _open(self, path, mode="rb", **kwargs):
        if "r" in mode:
            self.reads.append(path)
        return super()._open(path, mode, **kwargs)


fsspec.register_implementation("countmem", CountingMemoryFileSystem, clobber=True)


def _upload_to_memory(local_dir: str, scheme: str = "memory") -> str:
    """`local_dir`'s files under a fresh memory:// prefix (as `aws s3 sync` would upload them)."""
    url = f"{scheme}://models-{uuid.uuid4().hex[:8]}/Tiny-Qwen3"
    fs = fsspec.filesystem(scheme)
    for name in os.listdir(local_dir):
        fs.put_file(os.path.join(local_dir, name), f"{url}/{name}")
    return url


def _files_in(directory: str) -> dict[str, tuple[int, int]]:
    """relative path -> (inode, mtime in ns) of every file: what a rewrite would change."""
    out = {}
    for base, _, names in os.walk(directory):
        for name in names:
            st = os.stat(os.path.join(base, name))
            out[os.path.relpath(os.path.join(base, name), directory)] = (st.st_ino, st.st_mtime_ns)
    return out


def _cfg(source: str, scratch: str, **storage) -> object:
    return config_from_dict(
        {
            "model": {"kind": "pretrained", "source": source},
            "warm_start": {"steps": 0},
            "storage": {"scratch_dir": scratch, **storage},
        }
    )


def test_a_file_url_is_copied_once_and_a_changed_upload_gets_a_new_copy(tiny_hf_dir, tmp_path):
    upload = tmp_path / "bucket" / "Tiny-Qwen3"
    shutil.copytree(tiny_hf_dir, upload)
    url, scratch = f"file://{upload}", str(tmp_path / "scratch")
    first = local_source(url, "", None, scratch)
    assert first.startswith(scratch) and os.path.basename(first).startswith("Tiny-Qwen3-")
    assert sorted(os.listdir(first)) == sorted(os.listdir(tiny_hf_dir))
    copied = _files_in(first)
    assert local_source(url, "", None, scratch) == first
    assert _files_in(first) == copied  # the second resolve wrote nothing
    assert os.listdir(os.path.dirname(first)) == [os.path.basename(first)]  # no staging left

    key = policy_spec_for(_cfg(url, scratch), "").key()
    config = json.loads((upload / "config.json").read_text())
    config["architectures"] = config["architectures"] * 2  # a new upload of other bytes
    (upload / "config.json").write_text(json.dumps(config))
    second = local_source(url, "", None, scratch)
    assert second != first and os.path.isdir(first)
    assert json.loads((Path(second) / "config.json").read_text()) == config
    assert policy_spec_for(_cfg(url, scratch), "").key() != key


def test_memory_url_copy_is_read_once_and_keyed_by_content(tiny_hf_dir, tmp_path):
    url, scratch = _upload_to_memory(tiny_hf_dir, "countmem"), str(tmp_path / "scratch")
    files = list_tree(url)
    assert set(files) == set(os.listdir(tiny_hf_dir))
    assert files["config.json"]["size"] == os.path.getsize(f"{tiny_hf_dir}/config.json")
    reads = CountingMemoryFileSystem.reads
    reads.clear()
    first = local_source(url, tree_key(files), None, scratch)
    assert sorted(os.path.basename(r) for r in reads) == sorted(files)  # each file read once
    assert local_source(url, tree_key(files), None, scratch) == first
    assert len(reads) == len(files)  # the second resolve only listed
    assert list_tree(url) == files  # listing again: the same key

    fs = fsspec.filesystem("countmem")
    same_size = fs.cat_file(f"{url}/config.json").replace(b'"', b"'", 1)
    fs.pipe_file(f"{url}/config.json", same_size)  # other bytes, same size: a new version
    assert tree_key(list_tree(url)) != tree_key(files)
    # A run whose policy was keyed on the first upload refuses the second one.
    with pytest.raises(ValueError, match=r"model.source: the files at countmem://.* changed since"):
        local_source(url, tree_key(files), None, scratch)


def test_a_failed_or_killed_download_leaves_nothing_that_looks_complete(tiny_hf_dir, tmp_path):
    url, scratch = _upload_to_memory(tiny_hf_dir), str(tmp_path / "scratch")
    files = list_tree(url)
    # The upload changes while it is copied: config.json (first in order) arrives, then a file
    # the listing named is gone.
    fsspec.filesystem("memory").rm_file(f"{url}/model.safetensors")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        tree_copy(url, files, None, scratch)
    assert os.listdir(os.path.join(scratch, "trees")) == []

    # What a killed download leaves (a staging directory, config.json in it) is not taken for a
    # copy: the next resolve downloads a whole one beside it.
    url = _upload_to_memory(tiny_hf_dir)
    target = os.path.join(scratch, "trees", f"Tiny-Qwen3-{tree_key(list_tree(url))}")
    os.makedirs(f"{target}.tmp-killed")
    shutil.copy(f"{tiny_hf_dir}/config.json", f"{target}.tmp-killed/config.json")
    assert local_source(url, "", None, scratch) == target
    assert sorted(os.listdir(target)) == sorted(os.listdir(tiny_hf_dir))


def test_a_url_without_config_json_or_out_of_reach_is_refused_naming_model_source(
    tiny_hf_dir, tmp_path
):
    url = _upload_to_memory(tiny_hf_dir)
    fsspec.filesystem("memory").rm_file(f"{url}/config.json")
    problems = source_problems(_cfg(url, str(tmp_path)))
    assert len(problems) == 1
    assert problems[0].startswith(f"model.source: {url} is not a Hugging Face model directory")
    assert "no config.json there" in problems[0] and "model.safetensors" in problems[0]
    empty = f"file://{tmp_path}/nothing-here"
    assert "(found nothing)" in source_problems(_cfg(empty, str(tmp_path)))[0]

    # A store where nothing listens (an unreachable S3 endpoint: tests/integration's
    # test_model_url_s3.py): the refusal names model.source, the URL and why.
    url = f"ftp://127.0.0.1:{free_ports(1)[0]}/models/Tiny-Qwen3"
    (problem,) = source_problems(_cfg(url, str(tmp_path)))
    assert problem.startswith(f"model.source: cannot list {url} (ConnectionRefusedError")
    assert "check that the store is reachable" in problem


@pytest.mark.parametrize(
    ("source", "error"),
    [
        ("nosuchfs://bucket/Qwen3-4B", "has the scheme 'nosuchfs', which fsspec does not know"),
        ("s3://", "names no directory"),
        ("memory:///", "names no directory"),
        ("models:/policy", "is not a registry reference"),
    ],
)
def test_config_checks_refuse_a_url_without_a_known_scheme_or_a_path(source, error):
    with pytest.raises(ConfigError, match=f"model.source: '{source}' {error}"):
        config_from_dict({"model": {"kind": "pretrained", "source": source}})


def test_config_checks_accept_urls():
    for source in ("s3://b/models/Qwen3-4B", "gs://b/m", "file:///m", "simplecache::s3://b/m"):
        assert config_from_dict({"model": {"kind": "qwen3-vl", "source": source}})


def test_the_policy_prepared_from_a_url_holds_the_directory_s_weights(tiny_hf_dir, tmp_path):
    url, scratch = _upload_to_memory(tiny_hf_dir), str(tmp_path / "scratch")
    spec = policy_spec_for(_cfg(url, scratch), "")
    assert spec.source_key == tree_key(list_tree(url))
    assert PolicySpec.from_json(spec.to_json()) == spec  # what the Flyte task hands on
    policy = prepare_policy(spec, str(tmp_path / "policies"), None, scratch)
    model, _ = load_policy(policy)
    local, _ = load_policy(tiny_hf_dir)
    want = local.state_dict()
    assert model.state_dict().keys() == want.keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, want[name]), name


def test_the_memory_plan_needs_no_weights_of_a_url_source(tmp_path):
    # The shipped configs' placeholder bucket cannot be read: KNOWN by the directory's name.
    unreachable = ModelConfig(kind="pretrained", source="s3://my-bucket/models/Qwen3-4B/")
    assert model_shape(unreachable) == KNOWN["Qwen/Qwen3-4B"]
    # A name KNOWN lacks: the shape in the config.json at the URL (no weights there at all).
    config = {
        "hidden_size": 1536,
        "intermediate_size": 4096,
        "num_hidden_layers": 20,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 32000,
        "tie_word_embeddings": True,
    }
    url = f"memory://plan-{uuid.uuid4().hex[:8]}/My-Finetune-2B"
    fsspec.filesystem("memory").pipe_file(f"{url}/config.json", json.dumps(config).encode())
    assert model_shape(ModelConfig(kind="pretrained", source=url)) == shape_from_hf(config)
    nowhere = ModelConfig(kind="pretrained", source=f"file://{tmp_path}/Unknown-9B")
    assert model_shape(nowhere) is None

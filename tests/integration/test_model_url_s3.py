"""model.source as an s3:// URL on a real S3 server (SeaweedFS, shared by the session), read with
the run's storage.endpoint_url and credentials as a cluster's pods read it: checked before the
run, keyed by its listing (S3's ETags), prepared into the same weights as the directory it was
uploaded from and copied once per content; an endpoint that does not answer is refused naming
model.source."""

from __future__ import annotations

import os
import uuid

import pytest
import torch

from relax_core.config import config_from_dict
from relax_core.models.policy import load_policy
from relax_core.models.tiny import build_char_tokenizer, build_tiny_qwen3
from relax_core.run.lifecycle import policy_spec_for
from relax_core.run.prepare import prepare_policy
from relax_core.run.sources import local_source, source_problems
from relax_core.storage import list_tree
from tests.s3servers import free_ports

pytestmark = [pytest.mark.integration]


def _cfg(source: str, root: str, endpoint: str, scratch: str):
    return config_from_dict(
        {
            "model": {"kind": "pretrained", "source": source},
            "warm_start": {"steps": 0},
            "storage": {"root": root, "endpoint_url": endpoint, "scratch_dir": scratch},
        }
    )


def test_an_s3_source_is_prepared_from_the_run_s_storage(seaweed_s3, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweed_s3.key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweed_s3.secret)
    local = tmp_path / "Tiny-Qwen3"
    tokenizer = build_char_tokenizer()
    build_tiny_qwen3(config_from_dict({}).model, len(tokenizer), seed=0).save_pretrained(local)
    tokenizer.save_pretrained(local)
    prefix = f"s3://{seaweed_s3.bucket}/model-url-{uuid.uuid4().hex[:8]}"
    source = f"{prefix}/models/Tiny-Qwen3"
    seaweed_s3.filesystem().put(f"{local}/", f"{source}/", recursive=True)  # `aws s3 sync`
    scratch = str(tmp_path / "scratch")
    cfg = _cfg(source, f"{prefix}/runs", seaweed_s3.endpoint_url, scratch)

    assert source_problems(cfg) == []
    files = list_tree(source, cfg.storage.options())
    assert set(files) == set(os.listdir(local))
    assert all(f["version"].strip('"') for f in files.values())  # S3's ETags, not times
    spec = policy_spec_for(cfg, "")
    policy = prepare_policy(spec, str(tmp_path / "policies"), cfg.storage.options(), scratch)
    model, _ = load_policy(policy)
    want = load_policy(str(local))[0].state_dict()
    assert all(torch.equal(t, want[name]) for name, t in model.state_dict().items())
    (copy,) = os.listdir(os.path.join(scratch, "trees"))
    again = local_source(source, spec.source_key, cfg.storage.options(), scratch)
    assert again == os.path.join(scratch, "trees", copy)

    # The same source behind an endpoint where nothing listens.
    down = f"http://127.0.0.1:{free_ports(1)[0]}"
    (problem,) = source_problems(_cfg(source, f"{prefix}/runs", down, scratch))
    assert problem.startswith(f"model.source: cannot list {source} (EndpointConnectionError")

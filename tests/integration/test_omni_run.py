"""An omni-modal run end to end, colocate (full weights) and async with LoRA (every role an OS
process, the reference role included; the reference role and the rollout engine rebuild media from
the rows): media prompts from a generated dataset with one corrupt clip and one missing video. The
bad rows are quarantined with their reason and the run goes on; queue rows carry media by
reference; MLflow has accuracy per modality at step 0 and at the end, held-out and on training
rollouts. The async run (the module's `lora_async` fixture) trains adapters on the LM's projections
and on two encoder layers: the base (LM and encoders) stays frozen, the checkpoint is an omni base
+ adapter that loads back, and its engines, updated through the object store at max_staleness 1,
sample with the adapter version they report.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path

import mlflow
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch
from safetensors.torch import load_file

from relax_core.config import load_config
from relax_core.data.dataset import write_prompts
from relax_core.models import lora
from relax_core.models.lora import ADAPTER_DIR
from relax_core.models.omni import WEIGHTS_FILE as OMNI_WEIGHTS
from relax_core.models.policy import load_policy
from relax_core.queue import TransferQueue
from relax_core.roles.media import resolver_for
from relax_core.roles.reference import add_ref_logprobs
from relax_core.train.checkpoint import find_resume_checkpoint, list_checkpoints, read_state
from tests.conftest import workdir_for
from tests.integration.test_async_run import ASYNC
from tests.runs import run_small, run_to_end

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # whole runs, each over 5 s

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("omni", os.path.join(REPO, "datasets", "omni.py"))
omni = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(omni)

OMNI = {
    "model": {"kind": "tiny-omni", "image_size": 16, "patch_size": 8, "video_frames": 4},
    "warm_start": {"steps": 2, "batch_size": 8},
    "data": {"train_path": "omni/train.jsonl", "eval_path": "omni/eval.jsonl", "eval_size": 0},
    "rollout": {"n_samples_per_prompt": 2, "groups_per_step": 3, "max_new_tokens": 2},
    "reward": {"name": "multiple_choice"},
    # A KL term brings in the reference role, which rebuilds media from the rows too.
    "algorithm": {"kl_coef": 0.1},
    "train": {"total_steps": 3, "checkpoint_every": 3, "steps_per_node": 3, "encoder_lr_scale": 10},
}
KINDS = ("audio", "image", "video")


def _dataset(workdir):
    out = workdir / "omni"
    train, eval_ = omni.generate(str(out), seed=1, per_modality=6, eval_per_modality=2)
    (out / train[7]["media"][0]["uri"]).write_bytes(b"RIFF but not a clip")  # audio
    os.remove(out / train[13]["media"][0]["uri"])  # video
    write_prompts(train, str(out / "train.jsonl"))
    write_prompts(eval_, str(out / "eval.jsonl"))


def _history(workdir, run_id: str, key: str) -> list[tuple[int, float]]:
    mlflow.set_tracking_uri(f"sqlite:///{workdir}/mlflow.db")
    client = mlflow.tracking.MlflowClient()
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def _check_quarantine_and_modalities(workdir, state: dict, steps: int) -> None:
    """The bad rows were quarantined with their reason, queue rows hold media by reference,
    the reference role scored every row, and MLflow has accuracy per modality."""
    assert state["policy_version"] == steps
    queue = TransferQueue(str(Path(workdir) / ".relax" / "queue"), state["run_id"])
    record = json.loads(queue.store.read_bytes("quarantine/prompts/train.json"))
    assert [q["index"] for q in record["quarantined"]] == [7, 13]
    assert "unreadable audio" in record["quarantined"][0]["reason"]
    assert "not found" in record["quarantined"][1]["reason"]
    # Rows hold references (kind + the file's path), never decoded media or inline bytes.
    seq = queue.committed("rollout")[0]
    table = queue.read("rollout", seq)
    media = table.column("media").to_pylist()
    assert all(len(m) == 1 and m[0]["bytes"] is None for m in media)
    assert all(os.path.isfile(m[0]["uri"]) for m in media)
    ref = queue.read("ref", queue.committed("ref")[0])
    assert ref.column("ref_logprobs").null_count == 0
    run_id = state["tracking_run_id"]
    for kind in KINDS:
        evals = [s for s, _ in _history(workdir, run_id, f"eval/accuracy/{kind}")]
        assert evals[0] == 0 and evals[-1] == steps, (kind, evals)
    trained = {k for k in KINDS if _history(workdir, run_id, f"train/accuracy/{k}")}
    assert trained, "no train/accuracy/<modality> was logged"


def test_a_colocate_omni_run_quarantines_bad_media_and_reports_each_modality(small_config, workdir):
    _dataset(workdir)
    out = run_to_end(small_config("o.yaml", run_name="o", **OMNI), timeout_s=270)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-6000:]
    state = read_state(find_resume_checkpoint(".relax/checkpoints", "o"))
    _check_quarantine_and_modalities(workdir, state, OMNI["train"]["total_steps"])


LORA_STEPS = 6


@pytest.fixture(scope="module")
def lora_async(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """(its directory, its final checkpoint): an async omni LoRA run, adapters on the LM's
    projections and on the encoders' output layers, at max_staleness 1 over LORA_STEPS
    versions, each checkpointed, the adapters through the object store to the rollout engine
    and to actor_fwd (the broadcast group is the other async LoRA runs')."""
    for workdir in workdir_for(tmp_path_factory, "omni-lora"):
        _dataset(workdir)
        targets = "q_proj,v_proj,gate_proj,audio_out,video_out"
        lora = {"rank": 4, "target_modules": targets}
        # A large learning rate: each version's adapter scores the samples measurably apart.
        train = {**OMNI["train"], "total_steps": LORA_STEPS, "checkpoint_every": 1}
        train.update(lr=3e-2, lora=lora)
        # The entropy bonus gives every step a gradient, whatever the rewards.
        algorithm = {**OMNI["algorithm"], "entropy_coef": 0.01}
        rollout = {**OMNI["rollout"], "max_staleness": 1}
        services = {**ASYNC["services"], "weight_sync": "object_store", "actor_fwd": True}
        sections = {**OMNI, "train": train, "algorithm": algorithm, "rollout": rollout}
        run_small(
            workdir,
            "o.yaml",
            run_name="o",
            mode="async",
            queue={"keep_versions": 100},
            services=services,
            **sections,
        )
        yield workdir, find_resume_checkpoint(str(workdir / ".relax" / "checkpoints"), "o")


def test_an_async_omni_run_quarantines_bad_media_and_reports_each_modality(lora_async):
    workdir, final = lora_async
    _check_quarantine_and_modalities(workdir, read_state(final), LORA_STEPS)


def test_the_tiny_omni_policy_trains_lora_adapters_on_its_lm_and_encoders(lora_async):
    _, final = lora_async
    start = min(list_checkpoints(os.path.dirname(final)))
    for name in ("model.safetensors", OMNI_WEIGHTS):
        before, after = load_file(os.path.join(start, name)), load_file(os.path.join(final, name))
        assert before.keys() == after.keys() and all(
            torch.equal(after[k], t) for k, t in before.items()
        ), name
    adapter = load_file(os.path.join(final, ADAPTER_DIR, "adapter_model.safetensors"))
    trained = {n for n, t in adapter.items() if "lora_B" in n and t.abs().sum() > 0}
    assert any(".lm." in n for n in trained) and any("audio_out" in n for n in trained), trained
    policy, _ = load_policy(final)
    assert lora.is_lora(policy) and type(policy).__name__ == "TinyOmni"
    state = {k: v for k, v in policy.state_dict().items() if ".lora_" in k}
    assert len(state) == len(adapter)


def test_async_engines_sample_with_the_adapter_version_they_report(lora_async):
    """Every rollout row must have been sampled with the adapter of the version it is stamped
    with (its log-probs, media encoders included, are that checkpoint's, not the starting
    adapter's nor the one before), and no row trains more than one version late."""
    workdir, final = lora_async
    state = read_state(final)
    run_dir = os.path.dirname(final)
    checkpoints = {read_state(c)["policy_version"]: c for c in list_checkpoints(run_dir)}
    assert sorted(checkpoints) == list(range(LORA_STEPS + 1))
    staleness = [v for _, v in _history(workdir, state["tracking_run_id"], "train/staleness_max")]
    assert len(staleness) == LORA_STEPS and max(staleness) <= 1

    cfg = load_config(str(workdir / "o.yaml"))
    queue = TransferQueue(str(workdir / ".relax" / "queue"), state["run_id"])
    tables = [queue.read("rollout", seq) for seq in queue.committed("rollout")]
    by_version: dict[int, list] = {}
    for table in tables:
        for v in set(table.column("behaviour_version_min").to_pylist()):
            rows = pc.equal(table.column("behaviour_version_min"), v)
            by_version.setdefault(v, []).append(table.filter(rows))
    assert len(by_version) >= 4, sorted(by_version)  # several adapter versions sampled
    gaps_own, gaps_before = [], []
    for v, parts in sorted(by_version.items()):
        table = pa.concat_tables(parts)
        assert table.column("behaviour_version_max").to_pylist() == [v] * table.num_rows
        sampled = [torch.tensor(r) for r in table.column("rollout_logprobs").to_pylist()]
        for at, gaps in ((v, gaps_own), (v - 1, gaps_before)):
            if at < 0:
                continue
            model, tok = load_policy(checkpoints[at])
            resolver = resolver_for(cfg, model)  # the media, as the engine encoded them
            temperature = cfg.rollout.temperature
            scored = add_ref_logprobs(
                model, table, tok.pad_token_id, 4096, temperature, resolver=resolver
            )
            rescored = [torch.tensor(r) for r in scored.column("ref_logprobs").to_pylist()]
            gaps.append(
                max(float((a - b).abs().max()) for a, b in zip(sampled, rescored, strict=True))
            )
    # The engine's log-probs are the trainer's at the stamped version, and the version before
    # (what an engine whose update never landed would hold) is far off.
    assert max(gaps_own) < 1e-4, gaps_own
    assert min(gaps_before) > 1e-2, gaps_before

"""Weight sync between real processes: a gloo broadcast group on loopback and the object store.

The sender runs in the test process; receivers are subprocesses (tests/integration/
weight_sync_actors.py) that report what they received through files under tmp_path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from relax_core.queue.store import ObjectStore
from relax_core.sync import (
    BroadcastReceiver,
    BroadcastSender,
    LayoutMismatch,
    ObjectStoreReceiver,
    ObjectStoreSender,
    specs_of,
)
from relax_core.sync.object_store import STOP_PATH, WEIGHTS
from tests.integration.weight_sync_actors import layout_tensors, tiny_policy

pytestmark = [pytest.mark.integration]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUCKET = 1024  # bytes: the test layout spans a dozen buckets, one tensor larger than a bucket


_SPAWNED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _stop_receivers():
    """Kill (by PID) any receiver a failed test left running."""
    yield
    while _SPAWNED:
        proc = _SPAWNED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _spawn(tmp_path, mode: str, transport: str, rank: int = 1, **flags) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tests.integration.weight_sync_actors", mode]
    cmd += ["--transport", transport, "--root", str(tmp_path / "q"), "--out", str(tmp_path)]
    cmd += ["--rank", str(rank)]
    for key, value in flags.items():
        flag = "--" + key.replace("_", "-")
        cmd += [flag] if value is True else [flag, str(value)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    _SPAWNED.append(proc)
    return proc


def _wait_for(path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60.0
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"receiver {proc.pid} wrote no {path.name}: {proc.communicate()[1]}")
        time.sleep(0.05)


def _wait_ready(tmp_path, proc: subprocess.Popen, rank: int = 1) -> None:
    _wait_for(tmp_path / f"ready-r{rank}", proc)


def _finish(proc: subprocess.Popen, timeout: float = 60.0) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"receiver {proc.pid} hung; stderr:\n{err}")
    return proc.returncode, err


@pytest.fixture
def sender_cleanup():
    """Leave no default process group behind in the test process, whatever a test does."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _assert_is_version(path, version: int) -> None:
    got = load_file(str(path))
    sent = dict(layout_tensors(version))
    assert list(got) == list(sent) or set(got) == set(sent)
    for name, tensor in sent.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape
        assert torch.equal(_bits(got[name]), _bits(tensor)), f"{name} of v{version}"


# ---------------------------------------------------------------------- broadcast group
def test_broadcast_delivers_every_version_bit_for_bit_and_stop_ends_receivers(
    tmp_path, sender_cleanup
):
    eager = _spawn(tmp_path, "collect", "broadcast", rank=1)
    lazy = _spawn(tmp_path, "collect", "broadcast", rank=2, lazy=True)
    store = ObjectStore(str(tmp_path / "q"), durable=False)
    specs = specs_of(layout_tensors(0))
    sender = BroadcastSender(
        store, "rollout", ["r1", "r2"], specs, bucket_bytes=BUCKET, timeout_s=60.0
    )
    assert len(sender.buckets) >= 8 and {b.dtype for b in sender.buckets} >= {"float32", "int64"}
    sender.init()
    assert store.exists("control/rendezvous/rollout")
    for version in range(1, 6):
        sender.push(layout_tensors(version), version)
        _wait_for(tmp_path / f"r1-v{version}.safetensors", eager)  # rank 1 took it
    sender.destroy()
    assert not store.exists("control/rendezvous/rollout")
    for proc in (eager, lazy):
        code, err = _finish(proc)
        assert code == 0, err

    assert json.loads((tmp_path / "r1.json").read_text()) == {
        "taken": [1, 2, 3, 4, 5],
        "stopped": True,
    }
    for version in range(1, 6):
        _assert_is_version(tmp_path / f"r1-v{version}.safetensors", version)
    # Took nothing until STOP: each newer update replaced the pending one, so only v5 is left.
    assert json.loads((tmp_path / "r2.json").read_text()) == {"taken": [5], "stopped": True}
    _assert_is_version(tmp_path / "r2-v5.safetensors", 5)


def test_broadcast_group_forms_again_when_a_receiver_dies_and_restarts(tmp_path, sender_cleanup):
    survivor = _spawn(tmp_path, "collect", "broadcast", rank=1)
    victim = _spawn(tmp_path, "collect", "broadcast", rank=2)
    store = ObjectStore(str(tmp_path / "q"), durable=False)
    specs = specs_of(layout_tensors(0))
    sender = BroadcastSender(
        store, "rollout", ["r1", "r2"], specs, bucket_bytes=BUCKET, timeout_s=60.0
    )
    sender.init()
    assert sender.push_or_reform(layout_tensors(1), 1) is False  # a healthy group: no reform
    _wait_for(tmp_path / "r1-v1.safetensors", survivor)
    _wait_for(tmp_path / "r2-v1.safetensors", victim)
    victim.kill()
    victim.communicate()
    restarted = _spawn(tmp_path, "collect", "broadcast", rank=2)
    # The dead member broke the group; the next update goes to a new generation that the
    # survivor rejoins and the restarted receiver joins, and reaches both whole.
    assert sender.push_or_reform(layout_tensors(2), 2) is True
    assert sender.generation == 1
    # Both take v2 before v3 goes out (a newer update replaces one not taken yet).
    _wait_for(tmp_path / "r1-v2.safetensors", survivor)
    _wait_for(tmp_path / "r2-v2.safetensors", restarted)
    sender.push_or_reform(layout_tensors(3), 3)
    _wait_for(tmp_path / "r1-v3.safetensors", survivor)
    _wait_for(tmp_path / "r2-v3.safetensors", restarted)
    sender.destroy()
    for proc in (survivor, restarted):
        code, err = _finish(proc)
        assert code == 0, err
    assert json.loads((tmp_path / "r1.json").read_text())["taken"] == [1, 2, 3]
    assert json.loads((tmp_path / "r2.json").read_text())["taken"] == [2, 3]
    for version in (2, 3):
        _assert_is_version(tmp_path / f"r1-v{version}.safetensors", version)
        _assert_is_version(tmp_path / f"r2-v{version}.safetensors", version)


def test_broadcast_group_follows_the_wanted_members(tmp_path, sender_cleanup):
    """An elastic pool: a member added later joins the next generation once it waits (the
    others need not wait for it to start), and a member no longer wanted is left out."""
    wanted = ["r1"]
    first = _spawn(tmp_path, "collect", "broadcast", rank=1)
    store = ObjectStore(str(tmp_path / "q"), durable=False)
    specs = specs_of(layout_tensors(0))
    sender = BroadcastSender(
        store, "rollout", lambda: list(wanted), specs, bucket_bytes=BUCKET, timeout_s=60.0
    )
    sender.init()
    sender.push_or_reform(layout_tensors(1), 1)
    _wait_for(tmp_path / "r1-v1.safetensors", first)

    wanted.append("r2")
    assert not sender.needs_reform()  # wanted, but not started: no reason to wait for it
    added = _spawn(tmp_path, "collect", "broadcast", rank=2)
    deadline = time.monotonic() + 60
    while not sender.needs_reform():  # it waits to join once it has started
        assert time.monotonic() < deadline and added.poll() is None, "r2 never waited to join"
        time.sleep(0.05)
    assert sender.push_or_reform(layout_tensors(2), 2) is True
    assert sender.members == ["r1", "r2"] and sender.world_size == 3
    _wait_for(tmp_path / "r1-v2.safetensors", first)
    _wait_for(tmp_path / "r2-v2.safetensors", added)

    wanted.remove("r1")  # drained: its process still runs, but gets nothing more
    assert sender.needs_reform()
    left_out = time.time()  # the clock of the receivers' waiting markers
    assert sender.push_or_reform(layout_tensors(3), 3) is True
    assert sender.members == ["r2"]
    _wait_for(tmp_path / "r2-v3.safetensors", added)
    deadline = time.monotonic() + 60
    while sender.waiting(["r1"]).get("r1", 0.0) <= left_out:
        assert time.monotonic() < deadline and first.poll() is None, "r1 never waited again"
        time.sleep(0.05)
    assert not sender.needs_reform()  # r1 now waits to join, but nobody wants it
    sender.destroy()
    code, err = _finish(added)
    assert code == 0, err
    assert json.loads((tmp_path / "r2.json").read_text())["taken"] == [2, 3]
    assert first.poll() is None and not (tmp_path / "r1-v3.safetensors").exists()
    for version in (2, 3):
        _assert_is_version(tmp_path / f"r2-v{version}.safetensors", version)


def test_broadcast_refuses_a_misfit_tensor_before_sending_anything(tmp_path, sender_cleanup):
    receiver = _spawn(tmp_path, "collect", "broadcast", rank=1)
    store = ObjectStore(str(tmp_path / "q"), durable=False)
    sender = BroadcastSender(
        store, "rollout", ["r1"], specs_of(layout_tensors(0)), bucket_bytes=BUCKET
    )
    sender.init()
    wrong = [(n, t[:-1] if n == "lm_head.weight" else t) for n, t in layout_tensors(1)]
    with pytest.raises(ValueError, match=r"'lm_head.weight' is \[96, 16\] float32"):
        sender.push(wrong, 1)
    with pytest.raises(ValueError, match="'embed.weight' of the weight layout is missing"):
        sender.push(layout_tensors(1)[1:], 1)
    # The verbs one by one: a refused send leaves the update open for a good one.
    sender.pause(2)
    with pytest.raises(RuntimeError, match=r"resume\(\) after pause\(2\) without send"):
        sender.resume()
    with pytest.raises(ValueError, match="'lm_head.weight'"):
        sender.send(wrong, 2)
    sender.send(layout_tensors(2), 2)
    sender.resume()
    _wait_for(tmp_path / "r1-v2.safetensors", receiver)
    sender.pause()  # the WeightSync protocol's pause(): the version goes out with send
    sender.send(layout_tensors(3), 3)
    sender.resume()
    sender.destroy()
    code, err = _finish(receiver)
    assert code == 0, err
    assert json.loads((tmp_path / "r1.json").read_text())["taken"] == [2, 3]
    _assert_is_version(tmp_path / "r1-v2.safetensors", 2)
    _assert_is_version(tmp_path / "r1-v3.safetensors", 3)


def test_broadcast_layout_mismatch_fails_init_on_both_sides(tmp_path, sender_cleanup):
    other_bucket = _spawn(tmp_path, "collect", "broadcast", rank=1, bucket_bytes=2048)
    other_layout = _spawn(tmp_path, "collect", "broadcast", rank=2, layout="other")
    store = ObjectStore(str(tmp_path / "q"), durable=False)
    sender = BroadcastSender(
        store,
        "rollout",
        ["r1", "r2"],
        specs_of(layout_tensors(0)),
        bucket_bytes=BUCKET,
        timeout_s=60.0,
    )
    with pytest.raises(LayoutMismatch, match=r"group 'rollout': receiver\(s\) \['r1', 'r2'\]"):
        sender.init()
    assert not dist.is_initialized()
    code, err = _finish(other_bucket)
    assert code == 3 and "bucket_bytes here 2048, sender 1024" in err, err
    code, err = _finish(other_layout)
    assert code == 3, err
    assert (
        "weight layout differs at tensor #6: here layers.1.mlp.up.weight [41, 16] bfloat16, "
        "there layers.1.mlp.up.weight [40, 16] bfloat16" in err
    ), err


def test_receiver_without_a_sender_times_out_naming_the_rendezvous_path(tmp_path):
    store = ObjectStore(str(tmp_path / "q"), durable=False)
    receiver = BroadcastReceiver(store, "rollout", "r1", specs_of(layout_tensors(0)), timeout_s=0.5)
    with pytest.raises(
        TimeoutError,
        match=r"no rendezvous record of a forming group with member 'r1' at "
        r".*q/control/rendezvous/rollout",
    ):
        receiver.init()


# ---------------------------------------------------------------------- engines
def _push_alternating(sender, versions: int, generated) -> None:
    """Versions 1..n: even versions carry weights A (seed 0), odd ones B (seed 1). After every
    seventh (4 of 30, of both weights) the sender waits until the engine generated under it
    (`generated`), however slowly it runs; the versions between follow each other at once."""
    weights = {0: list(tiny_policy(0)[0].named_parameters())}
    weights[1] = list(tiny_policy(1)[0].named_parameters())
    for version in range(1, versions + 1):
        sender.push(weights[version % 2], version)
        if version % 7 == 0:
            generated(version)


def _generated(tmp_path, proc: subprocess.Popen):
    """A wait until the engine process generated under `version` or a newer one."""
    path = tmp_path / "engine-r1-generated"

    def wait(version: int) -> None:
        deadline = time.monotonic() + 60.0
        while not (path.exists() and int(path.read_text()) >= version):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    f"engine {proc.pid} generated under no version >= {version}: "
                    f"{proc.communicate()[1] if proc.poll() is not None else 'still running'}"
                )
            time.sleep(0.02)

    return wait


def _assert_no_mixed_weights(result: dict, versions: int) -> None:
    refs = {0: result["refs"]["A"], 1: result["refs"]["B"]}
    assert refs[0] != refs[1]  # A and B are told apart by their outputs
    seen = set()
    for batch in result["batches"]:
        version = batch[0][0]
        assert {c[0] for c in batch} == {version}  # one version per generate call
        assert [c[1:] for c in batch] == refs[version % 2], f"version {version}"
        seen.add(version)
    assert result["final_version"] == versions
    assert len(seen) >= 4 and {v % 2 for v in seen} == {0, 1}, sorted(seen)


@pytest.mark.slow
def test_engine_never_generates_with_half_updated_weights_broadcast(tmp_path, sender_cleanup):
    proc = _spawn(tmp_path, "engine", "broadcast", bucket_bytes=BUCKET)
    model, _ = tiny_policy(0)
    store = ObjectStore(str(tmp_path / "q"), durable=False)
    specs = specs_of(model.named_parameters())
    sender = BroadcastSender(store, "rollout", ["r1"], specs, bucket_bytes=BUCKET, timeout_s=60.0)
    assert len(sender.buckets) >= 15  # about one bucket per tensor
    sender.init()
    _push_alternating(sender, 30, _generated(tmp_path, proc))
    sender.destroy()
    code, err = _finish(proc)
    assert code == 0, err
    _assert_no_mixed_weights(json.loads((tmp_path / "engine-r1.json").read_text()), 30)


@pytest.mark.slow
def test_engine_never_generates_with_half_updated_weights_object_store(tmp_path):
    proc = _spawn(tmp_path, "engine", "store")
    model, _ = tiny_policy(0)
    store = ObjectStore(str(tmp_path / "q"), durable=False)
    sender = ObjectStoreSender(store, specs_of(model.named_parameters()), BUCKET, keep=1)
    sender.init()
    _wait_ready(tmp_path, proc)
    _push_alternating(sender, 30, _generated(tmp_path, proc))
    store.write_replace(STOP_PATH, b"done")
    code, err = _finish(proc)
    assert code == 0, err
    _assert_no_mixed_weights(json.loads((tmp_path / "engine-r1.json").read_text()), 30)


# ---------------------------------------------------------------------- object store
def test_object_store_delivers_newest_versions_bit_for_bit_and_keeps_few(tmp_path):
    store = ObjectStore(str(tmp_path / "q"), durable=False)
    sender = ObjectStoreSender(store, specs_of(layout_tensors(0)), BUCKET, keep=2)
    sender.init()
    sender.push(layout_tensors(1), 1)
    sender.push(layout_tensors(2), 2)
    proc = _spawn(tmp_path, "collect", "store", rank=1)  # joins late: starts at the newest
    _wait_for(tmp_path / "r1-v2.safetensors", proc)
    for version in range(3, 7):
        sender.push(layout_tensors(version), version)
        _wait_for(tmp_path / f"r1-v{version}.safetensors", proc)
    store.write_replace(STOP_PATH, b"done")
    code, err = _finish(proc)
    assert code == 0, err
    assert json.loads((tmp_path / "r1.json").read_text()) == {
        "taken": [2, 3, 4, 5, 6],
        "stopped": True,
    }
    for version in range(2, 7):
        _assert_is_version(tmp_path / f"r1-v{version}.safetensors", version)
    assert store.list_dir(WEIGHTS) == ["v0000000005", "v0000000006"]
    assert store.list_dir("weights/v0000000006") == [
        "COMMITTED",
        *[f"bucket-{i:05d}.safetensors" for i in range(len(sender.buckets))],
    ]


def test_a_restarted_sender_replaces_the_dead_lineage_in_engines(tmp_path):
    """A trainer restarted from its step-3 checkpoint publishes its weights as v3 at start: the
    engine, holding v5 of the dead trainer, takes them, not waiting for a v6 to outrank v5."""
    store = ObjectStore(str(tmp_path / "q"), durable=False)
    specs = specs_of(layout_tensors(0))
    dead = ObjectStoreSender(store, specs, BUCKET, keep=2)
    dead.init()
    for version in range(1, 6):
        dead.push(layout_tensors(version), version)
    receiver = ObjectStoreReceiver(store, specs)
    assert receiver.poll_once() and receiver.take()[0] == 5
    restarted = ObjectStoreSender(store, specs, BUCKET, keep=2)
    restarted.init()
    restarted.push(layout_tensors(7), 3)  # other weights under the checkpoint's version
    assert receiver.poll_once()
    version, tensors = receiver.take()
    assert version == 3
    for (name, got), (_, sent) in zip(tensors, layout_tensors(7), strict=True):
        assert torch.equal(_bits(got), _bits(sent)), name
    assert store.list_dir(WEIGHTS) == ["v0000000003"]  # v4, v5 of the dead lineage are gone


class _PushOnFirstBucketRead(ObjectStore):
    """A store on which the sender publishes (and prunes) while the receiver reads a bucket."""

    sender: ObjectStoreSender | None = None

    def read_bytes(self, path: str) -> bytes:
        data = super().read_bytes(path)
        if self.sender is not None and path.endswith("bucket-00001.safetensors"):
            sender, self.sender = self.sender, None
            sender.push(layout_tensors(3), 3)  # keep=1: v2, which is being read, goes away
        return data


def test_object_store_skips_a_version_deleted_while_it_is_read(tmp_path):
    root = str(tmp_path / "q")
    sender = ObjectStoreSender(
        ObjectStore(root, durable=False), specs_of(layout_tensors(0)), BUCKET, keep=1
    )
    sender.init()
    sender.push(layout_tensors(2), 2)
    store = _PushOnFirstBucketRead(root, durable=False)
    receiver = ObjectStoreReceiver(store, specs_of(layout_tensors(0)))
    store.sender = sender
    assert receiver.poll_once()
    version, tensors = receiver.take()
    assert version == 3 and receiver.skipped == 1
    for (name, got), (_, sent) in zip(tensors, layout_tensors(3), strict=True):
        assert torch.equal(_bits(got), _bits(sent)), name
    assert not receiver.poll_once() and receiver.take() is None


def test_object_store_layout_mismatch_is_a_clear_error(tmp_path):
    store = ObjectStore(str(tmp_path / "q"), durable=False)
    sender = ObjectStoreSender(store, specs_of(layout_tensors(0)), BUCKET)
    sender.init()
    sender.push(layout_tensors(1), 1)
    receiver = ObjectStoreReceiver(store, specs_of(layout_tensors(0, "other")))
    with pytest.raises(LayoutMismatch, match=r"tensor #6: here layers.1.mlp.up.weight \[41, 16\]"):
        receiver.init()
    receiver.start()  # the thread meets the same version and reports the same error
    with pytest.raises(LayoutMismatch, match="weights/v0000000001 have another layout"):
        receiver.wait(60.0)
    receiver.destroy()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank")
def test_nccl_broadcast_delivers_bit_for_bit(tmp_path, sender_cleanup):
    proc = subprocess.Popen(
        [sys.executable, "-c", _NCCL_RECEIVER, str(tmp_path / "q"), str(tmp_path)],
        cwd=REPO,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES="1", PYTHONPATH=REPO),
        stderr=subprocess.PIPE,
        text=True,
    )
    torch.cuda.set_device(0)
    store = ObjectStore(str(tmp_path / "q"), durable=False)
    specs = specs_of(layout_tensors(0))
    sender = BroadcastSender(
        store, "rollout", ["r1"], specs, BUCKET, backend="nccl", timeout_s=60.0
    )
    sender.init()
    for version in (1, 2):
        sender.push([(n, t.cuda()) for n, t in layout_tensors(version)], version)
    sender.destroy()
    code, err = _finish(proc)
    assert code == 0, err
    _assert_is_version(tmp_path / "r1-v2.safetensors", 2)


_NCCL_RECEIVER = """
import sys, torch
from safetensors.torch import save_file
from relax_core.queue.store import ObjectStore
from relax_core.sync import BroadcastReceiver, specs_of
from tests.integration.weight_sync_actors import layout_tensors
torch.cuda.set_device(0)
r = BroadcastReceiver(ObjectStore(sys.argv[1]), "rollout", "r1", specs_of(layout_tensors(0)), 1024)
r.init(); r.start()
while not r.stopped:
    r.wait(1.0)
version, tensors = r.take()
save_file({n: t.cpu() for n, t in tensors}, f"{sys.argv[2]}/r1-v{version}.safetensors")
r.destroy()
"""

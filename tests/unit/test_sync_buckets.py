"""Weight sync parts without a process group: bucket planning, flat buffers, layout checks, and
the hand-off of updates from a receiver thread to the engine (slot, staging pool, apply)."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from relax_core.sync.apply import StagingPool, UpdateSlot, UpdateTensors, apply_update
from relax_core.sync.buckets import (
    TensorSpec,
    check_tensors,
    copy_tensor,
    flat_view,
    flatten_into,
    layout_difference,
    layout_fingerprint,
    plan_buckets,
    specs_of,
    unflatten,
)

DTYPES = ["float32", "bfloat16", "float16", "int64"]


def _random_specs(rng: random.Random, n: int) -> list[TensorSpec]:
    specs = []
    for i in range(n):
        shape = tuple(rng.randint(1, 9) for _ in range(rng.randint(0, 3)))
        specs.append(TensorSpec(f"layer.{i}.w", shape, rng.choice(DTYPES)))
    return specs


@pytest.mark.parametrize("seed", range(20))
def test_plan_buckets_places_every_tensor_once_in_order_within_the_bound(seed):
    rng = random.Random(seed)
    specs = _random_specs(rng, rng.randint(1, 60))
    bucket_bytes = rng.choice([1, 8, 64, 300, 4096])
    buckets = plan_buckets(specs, bucket_bytes)

    placed = [s for b in buckets for s in b.specs]
    assert sorted(placed, key=specs.index) == specs and len(placed) == len(specs)
    for dtype in DTYPES:  # parameter order kept within a dtype
        assert [s for s in placed if s.dtype == dtype] == [s for s in specs if s.dtype == dtype]
    for b in buckets:
        assert {s.dtype for s in b.specs} == {b.dtype}
        assert b.numel == sum(s.numel for s in b.specs)
        assert b.nbytes == sum(s.nbytes for s in b.specs)
        assert b.nbytes <= bucket_bytes or len(b.specs) == 1


def test_plan_buckets_packs_greedily_and_isolates_oversized_tensors():
    f32 = [TensorSpec(f"t{i}", (n,), "float32") for i, n in enumerate([10, 10, 30, 5, 5])]
    # 4 bytes per element, 80-byte buckets: [10,10] (80), [30] alone (120 > 80), [5,5] (40).
    buckets = plan_buckets(f32, 80)
    assert [[s.name for s in b.specs] for b in buckets] == [["t0", "t1"], ["t2"], ["t3", "t4"]]
    assert [b.nbytes for b in buckets] == [80, 120, 40]


def test_flatten_unflatten_round_trips_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    named = [
        ("a", torch.randn(3, 4, generator=gen)),
        ("b", torch.randn(5, generator=gen).to(torch.bfloat16)),
        ("c", torch.randn(2, 2, 2, generator=gen)),
        ("d", torch.randn(7, 3, generator=gen).t()),  # non-contiguous source
        ("e", torch.tensor(1.5)),  # 0-d
    ]
    specs = specs_of(named)
    tensors = dict(named)
    buckets = plan_buckets(specs, 64)
    buffer = torch.empty(max(b.nbytes for b in buckets), dtype=torch.uint8)
    for bucket in buckets:
        flat = flat_view(buffer, bucket)
        flatten_into(bucket, tensors, flat)
        for name, view in unflatten(bucket, flat):
            assert view.dtype == tensors[name].dtype and view.shape == tensors[name].shape
            assert torch.equal(view, tensors[name])


@pytest.mark.parametrize(
    "dtype",
    [torch.bool, torch.int8, torch.bfloat16, torch.float32, torch.float64, torch.complex128],
)
def test_copy_tensor_is_bit_exact_for_any_dtype_and_layout(dtype):
    src = (torch.randn(5, 3, dtype=torch.float64) * 3).to(dtype).t()  # non-contiguous
    dst = torch.empty(3, 5, dtype=dtype)
    copy_tensor(dst, src)
    assert torch.equal(dst, src)
    grad = torch.randn(4, requires_grad=True)  # a trainer parameter
    out = torch.empty(4)
    copy_tensor(out, grad)
    assert torch.equal(out, grad.detach())


def test_fingerprint_changes_with_any_name_shape_or_dtype():
    base = [TensorSpec("w", (4, 4), "float32"), TensorSpec("b", (4,), "float32")]
    variants = [
        [TensorSpec("w2", (4, 4), "float32"), base[1]],
        [TensorSpec("w", (4, 5), "float32"), base[1]],
        [TensorSpec("w", (4, 4), "bfloat16"), base[1]],
        [base[1], base[0]],
        base[:1],
    ]
    fp = layout_fingerprint(base)
    assert fp == layout_fingerprint(list(base))
    assert all(layout_fingerprint(v) != fp for v in variants)


def test_layout_difference_names_the_first_differing_tensor():
    here = [TensorSpec("w", (4, 4), "float32"), TensorSpec("b", (4,), "float32")]
    there = [TensorSpec("w", (4, 4), "float32"), TensorSpec("b", (8,), "float32")]
    assert layout_difference(here, here) == ""
    assert layout_difference(here, there) == "tensor #1: here b [4] float32, there b [8] float32"
    assert "2 tensors here, 1 there" in layout_difference(here, there[:1])
    assert "#1 b [4] float32" in layout_difference(here, there[:1])


def test_check_tensors_names_missing_misshapen_and_unknown_tensors():
    specs = [TensorSpec("w", (2, 2), "float32"), TensorSpec("b", (2,), "float32")]
    w, b = torch.zeros(2, 2), torch.zeros(2)
    assert set(check_tensors(specs, [("b", b), ("w", w)])) == {"w", "b"}
    with pytest.raises(ValueError, match="'b' of the weight layout is missing"):
        check_tensors(specs, [("w", w)])
    with pytest.raises(
        ValueError, match=r"'w' is \[2, 3\] float32; the weight layout says \[2, 2\]"
    ):
        check_tensors(specs, [("w", torch.zeros(2, 3)), ("b", b)])
    with pytest.raises(ValueError, match="'w' is .* bfloat16"):
        check_tensors(specs, [("w", w.bfloat16()), ("b", b)])
    with pytest.raises(ValueError, match="'extra' is not in the weight layout"):
        check_tensors(specs, [("w", w), ("b", b), ("extra", b)])


def test_update_slot_keeps_only_the_newest_untaken_update_and_surfaces_errors():
    slot = UpdateSlot()
    assert slot.take() is None and slot.wait(0.01) is False
    assert slot.put((1, [])) is None
    assert slot.put((2, [])) == (1, [])  # handed back: the receiver may reuse its staging
    assert slot.wait(0.01) is True
    assert slot.take() == (2, []) and slot.take() is None
    slot.fail(RuntimeError("connection closed"))
    with pytest.raises(RuntimeError, match="connection closed"):
        slot.take()


class _Engine:
    """Records the order of calls an engine sees; fails update_weights on request."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[str] = []
        self.fail = fail

    def pause(self) -> None:
        self.calls.append("pause")

    def update_weights(self, named_tensors, version: int) -> None:
        self.calls.append(f"update {version}")
        if self.fail:
            raise KeyError("no parameter 'x'")

    def resume(self) -> None:
        self.calls.append("resume")


def test_apply_update_pauses_around_the_load_and_stays_paused_if_it_fails():
    engine = _Engine()
    assert apply_update(engine, (7, [])) == 7
    assert engine.calls == ["pause", "update 7", "resume"]
    broken = _Engine(fail=True)
    with pytest.raises(KeyError):
        apply_update(broken, (8, []))
    assert broken.calls == ["pause", "update 8"]  # not resumed: it must not serve a mix


def test_staging_pool_reuses_only_buffers_given_back():
    pool = StagingPool(keep=1)
    made = []

    def make():
        made.append([torch.zeros(4)])
        return made[-1]

    first = pool.acquire(make)
    taken = UpdateTensors([("w", first[0].view(2, 2))])
    pool.lease(taken, first)
    assert pool.acquire(make) is not first  # still leased: a fresh set
    pool.release([("w", first[0].view(2, 2))])  # an equal list that is not the leased one
    assert pool.acquire(make) is not first
    pool.release(taken)
    assert pool.acquire(make) is first
    assert len(made) == 3 and pool.leased == 0

    dropped = UpdateTensors([("w", made[1][0])])
    pool.lease(dropped, made[1])
    del dropped
    gc.collect()
    assert pool.leased == 0  # dropped without release: forgotten, never reused


def test_apply_update_gives_the_update_back_after_the_engine_copied_it():
    engine, released = _Engine(), []
    update = (3, [])
    apply_update(engine, update, released.append)
    assert released == [update] and engine.calls == ["pause", "update 3", "resume"]


def _counted_stream(specs: list[TensorSpec], alive: list[int], peak: list[int]):
    """Fresh tensors for `specs` in order (as a gathering backend yields them), counting how
    many are alive at once."""
    import weakref

    def gone():
        alive[0] -= 1

    for spec in specs:
        tensor = torch.full(spec.shape, 1.0, dtype=spec.torch_dtype)
        alive[0] += 1
        peak[0] = max(peak[0], alive[0])
        weakref.finalize(tensor, gone)
        yield spec.name, tensor
        del tensor


@pytest.mark.slow
def test_a_stream_is_sent_holding_about_one_bucket_not_the_model():
    from relax_core.sync.buckets import stream_buckets

    specs = [TensorSpec(f"w{i}", (256,), "float32") for i in range(40)]  # 1 KiB each
    buckets = plan_buckets(specs, 4 << 10)  # 4 tensors per bucket, 10 buckets
    alive, peak = [0], [0]
    sent = []
    for i, bucket, tensors in stream_buckets(specs, buckets, _counted_stream(specs, alive, peak)):
        sent.append((i, [s.name for s in bucket.specs], sorted(tensors)))
        del tensors
        gc.collect()
    assert [i for i, _, _ in sent] == list(range(10))
    assert all(sorted(names) == got for _, names, got in sent)
    assert peak[0] <= 5  # one bucket and the tensor that opens the next, never the 40
    # A list keeps its own tensors alive; it is checked whole before anything is yielded.
    with pytest.raises(ValueError, match="'w39' of the weight layout is missing"):
        stream_buckets(specs, buckets, [(s.name, torch.ones(256)) for s in specs[:-1]])


def test_a_stream_that_misfits_is_stopped_at_the_misfit_and_read_to_its_end():
    from relax_core.sync.buckets import stream_buckets

    specs = [TensorSpec(f"w{i}", (4,), "float32") for i in range(6)]
    buckets = plan_buckets(specs, 32)  # 2 tensors per bucket
    read = []

    def stream(extra: bool):
        for spec in specs:
            read.append(spec.name)
            yield spec.name, torch.ones(4)
        if extra:
            yield "stray", torch.ones(4)
            read.append("after-stray")
            yield "w7", torch.ones(4)
            read.append("end")

    assert len(list(stream_buckets(specs, buckets, stream(False)))) == 3
    read.clear()
    with pytest.raises(ValueError, match="'stray' is not in the weight layout"):
        list(stream_buckets(specs, buckets, stream(True)))
    assert read[-1] == "end"  # the other ranks of a gathering backend finish their pass too
    bad = iter([("w0", torch.ones(4)), ("w1", torch.ones(5))])
    with pytest.raises(ValueError, match=r"'w1' is \[5\] float32; the weight layout says \[4\]"):
        list(stream_buckets(specs, buckets, bad))

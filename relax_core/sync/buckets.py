"""Weight layout and buckets: the part of weight sync that both ends compute alike.

Sender and receivers hold the same architecture, so each derives the same `TensorSpec` list from
its own model and the same `Bucket` plan from it; only flat bucket payloads travel. A bucket holds
tensors of one dtype, in parameter order, and at most `bucket_bytes` (a single larger tensor gets a
bucket of its own), which bounds the staging memory of a transfer. `layout_fingerprint` lets the
two ends refuse a mismatched layout at init instead of loading garbage.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch

NamedTensors = Iterable[tuple[str, torch.Tensor]]
WeightSource = Callable[[], NamedTensors] | NamedTensors
"""What a sender pushes: named tensors, or a function that streams them anew (a backend's
`named_weights`), so an update that must go again after a group re-forms can be read again
without keeping a copy of the model."""


def replayable(weights: WeightSource) -> Callable[[], NamedTensors]:
    """`weights` as a function giving the tensors each call: itself when it is one, else the
    tensors read once into a list."""
    if callable(weights):
        return weights
    kept = list(weights)
    return lambda: kept


class LayoutMismatch(ValueError):
    """Two ends of a weight sync disagree on the weight layout or the bucket size."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    """Parameter name, as `named_parameters()` gives it."""
    shape: tuple[int, ...]
    """Tensor shape."""
    dtype: str
    """torch dtype without the `torch.` prefix, e.g. 'float32', 'bfloat16'."""

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_of(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize

    def describe(self) -> str:
        return f"{self.name} {list(self.shape)} {self.dtype}"


@dataclass(frozen=True)
class Bucket:
    dtype: str
    """The one dtype of every tensor in the bucket."""
    specs: tuple[TensorSpec, ...]
    """Tensors in the bucket, in parameter order; they lie back to back in the flat buffer."""
    numel: int
    """Elements of the flat buffer."""
    nbytes: int
    """Bytes of the flat buffer."""


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r} (expected e.g. 'float32', 'bfloat16')")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def specs_of(named_tensors: NamedTensors, dtype: str | None = None) -> list[TensorSpec]:
    """The layout of (name, tensor) pairs, in their order; `dtype` (a torch dtype name) is the
    one they are sent in when it is not their own (float32 master weights sent as bfloat16)."""
    return [TensorSpec(n, tuple(t.shape), dtype or dtype_name(t.dtype)) for n, t in named_tensors]


def plan_buckets(specs: list[TensorSpec], bucket_bytes: int) -> list[Bucket]:
    """Pack `specs` into dtype-homogeneous buckets of at most `bucket_bytes`.

    Dtypes come in the order of their first tensor; within a dtype, tensors keep parameter
    order and fill a bucket until the next one would overflow it.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    by_dtype: dict[str, list[TensorSpec]] = {}
    for spec in specs:
        by_dtype.setdefault(spec.dtype, []).append(spec)
    buckets: list[Bucket] = []
    for dtype, group in by_dtype.items():
        current: list[TensorSpec] = []
        size = 0
        for spec in group:
            if current and size + spec.nbytes > bucket_bytes:
                buckets.append(_bucket(dtype, current))
                current, size = [], 0
            current.append(spec)
            size += spec.nbytes
        if current:
            buckets.append(_bucket(dtype, current))
    return buckets


def _bucket(dtype: str, specs: list[TensorSpec]) -> Bucket:
    numel = sum(s.numel for s in specs)
    return Bucket(dtype, tuple(specs), numel, numel * dtype_of(dtype).itemsize)


def layout_fingerprint(specs: list[TensorSpec]) -> str:
    """sha256 over every tensor's name, shape and dtype, in order."""
    text = json.dumps([[s.name, list(s.shape), s.dtype] for s in specs], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def layout_to_json(specs: list[TensorSpec]) -> list[list]:
    return [[s.name, list(s.shape), s.dtype] for s in specs]


def layout_from_json(items: list[list]) -> list[TensorSpec]:
    return [TensorSpec(str(n), tuple(int(d) for d in shape), str(dt)) for n, shape, dt in items]


def layout_difference(ours: list[TensorSpec], theirs: list[TensorSpec]) -> str:
    """One line naming the first tensor where two layouts differ ('' when they are equal)."""
    for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            return f"tensor #{i}: here {a.describe()}, there {b.describe()}"
    if len(ours) != len(theirs):
        n = min(len(ours), len(theirs))
        extra = ours[n] if len(ours) > n else theirs[n]
        side = "here" if len(ours) > n else "there"
        return (
            f"{len(ours)} tensors here, {len(theirs)} there; the first extra one ({side}) is "
            f"#{n} {extra.describe()}"
        )
    return ""


def check_tensors(specs: list[TensorSpec], named_tensors: NamedTensors) -> dict[str, torch.Tensor]:
    """name -> tensor for exactly the tensors of `specs`; ValueError naming the first misfit."""
    by_name = {s.name: s for s in specs}
    seen: set[str] = set()
    got: dict[str, torch.Tensor] = {}
    for name, tensor in named_tensors:
        _check_one(by_name, seen, name, tensor)
        got[name] = tensor
    for spec in specs:
        if spec.name not in got:
            raise ValueError(f"tensor {spec.name!r} of the weight layout is missing")
    return got


def stream_buckets(
    specs: list[TensorSpec], buckets: list[Bucket], named_tensors: NamedTensors
) -> Iterator[tuple[int, Bucket, dict[str, torch.Tensor]]]:
    """(index, bucket, name -> tensor) for each bucket of the plan in order, as soon as
    `named_tensors` has delivered its tensors.

    A stream (an iterator, such as a backend's `named_weights()`, whose tensors may be gathered
    or cast copies) is read as the buckets go: in layout order only about one bucket of its
    tensors is held at a time, never the whole model. Each tensor is checked as it arrives; a
    misfit, an unknown or repeated name, or a tensor missing at the end is a ValueError after
    the buckets before it went out. A list or dict is checked whole first: a misfit sends
    nothing. Either way the stream is read to its end (a collective `named_weights` needs
    every rank to finish it).
    """
    if not isinstance(named_tensors, Iterator):
        checked = check_tensors(specs, named_tensors)
        return ((i, b, {s.name: checked[s.name] for s in b.specs}) for i, b in enumerate(buckets))
    return _stream(specs, buckets, named_tensors)


def _stream(
    specs: list[TensorSpec], buckets: list[Bucket], stream: Iterator[tuple[str, torch.Tensor]]
) -> Iterator[tuple[int, Bucket, dict[str, torch.Tensor]]]:
    by_name = {s.name: s for s in specs}
    seen: set[str] = set()
    pending: dict[str, torch.Tensor] = {}
    try:
        for i, bucket in enumerate(buckets):
            for spec in bucket.specs:
                while spec.name not in pending:
                    item = next(stream, None)
                    if item is None:
                        raise ValueError(f"tensor {spec.name!r} of the weight layout is missing")
                    name, tensor = item
                    _check_one(by_name, seen, name, tensor)
                    pending[name] = tensor
            yield i, bucket, {s.name: pending.pop(s.name) for s in bucket.specs}
        extra = next(stream, None)
        if extra is not None:
            raise ValueError(f"tensor {extra[0]!r} is not in the weight layout")
    finally:
        pending.clear()
        finish(stream)


def finish(stream: Iterator) -> None:
    """Read what is left of `stream`, whatever it raises: a backend's `named_weights` is a
    collective that every rank must run to its end, also when this rank's send failed."""
    with contextlib.suppress(Exception):
        for _ in stream:
            pass


def _check_one(
    by_name: dict[str, TensorSpec], seen: set[str], name: str, tensor: torch.Tensor
) -> None:
    spec = by_name.get(name)
    if spec is None:
        raise ValueError(f"tensor {name!r} is not in the weight layout")
    if name in seen:
        raise ValueError(f"tensor {name!r} is given twice")
    seen.add(name)
    if tuple(tensor.shape) != spec.shape or dtype_name(tensor.dtype) != spec.dtype:
        raise ValueError(
            f"tensor {name!r} is {list(tensor.shape)} {dtype_name(tensor.dtype)}; "
            f"the weight layout says {list(spec.shape)} {spec.dtype}"
        )


def flatten_into(bucket: Bucket, tensors: Mapping[str, torch.Tensor], out: torch.Tensor) -> None:
    """Copy the bucket's tensors back to back into the 1-d `out` (`bucket.numel` elements)."""
    offset = 0
    for spec in bucket.specs:
        n = spec.numel
        copy_tensor(out[offset : offset + n].view(spec.shape), tensors[spec.name])
        offset += n


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def copy_tensor(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src, bit for bit; `dst` contiguous and of src's shape and dtype.

    Between CPU tensors this is one single-threaded memcpy (numpy): torch's copy_ splits a large
    copy over its intra-op threads, which then spin against the gloo threads sending the
    previous bucket (on 2 cores: 0.5-1.7 GiB/s instead of ~6).
    """
    as_int = _SAME_SIZE_INT.get(src.dtype.itemsize)
    if dst.device.type == "cpu" and src.device.type == "cpu" and as_int is not None:
        np.copyto(dst.view(as_int).numpy(), src.detach().view(as_int).numpy())
    else:
        dst.copy_(src)


def unflatten(bucket: Bucket, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(name, view into `flat`) for each tensor of the bucket; no copy."""
    out = []
    offset = 0
    for spec in bucket.specs:
        n = spec.numel
        out.append((spec.name, flat[offset : offset + n].view(spec.shape)))
        offset += n
    return out


def flat_view(buffer: torch.Tensor, bucket: Bucket) -> torch.Tensor:
    """The first `bucket.nbytes` of a uint8 `buffer`, seen as the bucket's 1-d flat tensor."""
    return buffer[: bucket.nbytes].view(dtype_of(bucket.dtype))

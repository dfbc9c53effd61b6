"""Weight layout and buckets: the part of weight sync that both ends compute alike.

Sender and receivers hold the same architecture, so each derives the same `TensorSpec` list from
its own model and the same `Bucket` plan from it; only flat bucket payloads travel. A bucket holds
tensors of one dtype, in parameter order, and at most `bucket_bytes` (a single larger tensor gets a
bucket of its own), which bounds the staging memory of a transfer. `layout_fingerprint` lets the
two ends refuse a mismatched layout at init instead of loading garbage.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

NamedTensors = Iterable[tuple[str, torch.Tensor]]


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
    got: dict[str, torch.Tensor] = {}
    for name, tensor in named_tensors:
        if name in got:
            raise ValueError(f"tensor {name!r} is given twice")
        got[name] = tensor
    expected = {s.name for s in specs}
    for spec in specs:
        tensor = got.get(spec.name)
        if tensor is None:
            raise ValueError(f"tensor {spec.name!r} of the weight layout is missing")
        if tuple(tensor.shape) != spec.shape or dtype_name(tensor.dtype) != spec.dtype:
            raise ValueError(
                f"tensor {spec.name!r} is {list(tensor.shape)} {dtype_name(tensor.dtype)}; "
                f"the weight layout says {list(spec.shape)} {spec.dtype}"
            )
    unknown = [n for n in got if n not in expected]
    if unknown:
        raise ValueError(f"tensor {unknown[0]!r} is not in the weight layout ({len(unknown)} such)")
    return got


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

"""Weight sync through the run's object store: each version is a set of immutable safetensors files.

    weights/v{N:010d}/bucket-{i:05d}.safetensors   one bucket's tensors, by name
    weights/v{N:010d}/COMMITTED                    JSON (fingerprint, layout, n_buckets, nonce), last

Parts:
- `ObjectStoreSender` writes the buckets of version N (`send`), then COMMITTED (`resume`), then
  deletes versions older than the newest `keep` committed ones. Its first push also removes
  versions >= N left by an earlier trainer process (a restart from a checkpoint).
- `ObjectStoreReceiver` polls in a thread for the newest committed version it has not loaded,
  reads it into fresh tensors and hands it to the engine loop through an `UpdateSlot`. It never
  reads a version without COMMITTED; a version deleted while it reads is skipped for the newest
  one then. `control/stop` in the store ends its loop.

Slower than a broadcast group but needs no network path between trainer and engines, survives
either side restarting, and serves engines that join late.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from relax_core.queue.store import ObjectStore
from relax_core.sync.apply import Update, UpdateSlot
from relax_core.sync.buckets import (
    LayoutMismatch,
    NamedTensors,
    TensorSpec,
    check_tensors,
    layout_difference,
    layout_fingerprint,
    layout_from_json,
    layout_to_json,
    plan_buckets,
    stream_buckets,
)

WEIGHTS = "weights"
STOP_PATH = "control/stop"
_COMMITTED = "COMMITTED"


def version_dir(version: int) -> str:
    return f"{WEIGHTS}/v{version:010d}"


def bucket_path(version: int, index: int) -> str:
    return f"{version_dir(version)}/bucket-{index:05d}.safetensors"


def committed_path(version: int) -> str:
    return f"{version_dir(version)}/{_COMMITTED}"


def _versions(store: ObjectStore) -> list[int]:
    """Version numbers under weights/, ascending (committed or not)."""
    out = []
    for name in store.list_dir(WEIGHTS):
        if name.startswith("v") and name[1:].isdigit():
            out.append(int(name[1:]))
    return sorted(out)


def _delete_version(store: ObjectStore, version: int) -> None:
    # COMMITTED first: from then on no reader starts on this version.
    store.delete(committed_path(version))
    for name in store.list_dir(version_dir(version)):
        store.delete(f"{version_dir(version)}/{name}")
    if store.is_local:  # object stores have no directories to leave behind
        with contextlib.suppress(OSError):
            store.fs.rmdir(store.full_path(version_dir(version)))


class ObjectStoreSender:
    """Publishes each version as bucket files plus a COMMITTED marker; keeps the newest `keep`."""

    def __init__(
        self,
        store: ObjectStore,
        specs: list[TensorSpec],
        bucket_bytes: int = 64 << 20,
        keep: int = 2,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep (committed weight versions kept) must be >= 1, got {keep}")
        self.store = store
        self.specs = list(specs)
        self.buckets = plan_buckets(self.specs, bucket_bytes)
        self.fingerprint = layout_fingerprint(self.specs)
        self.keep = keep
        self._state = "new"
        self._version: int | None = None
        self._pushed = False

    def init(self) -> None:
        self._state = "idle"

    def destroy(self) -> None:
        """Stop publishing; what was published stays (receivers stop on `control/stop`)."""
        self._state = "destroyed"

    def pause(self, version: int | None = None) -> None:
        self._expect("idle", "pause()")
        self._version = version
        self._state = "paused"

    def send(self, named_tensors: NamedTensors, version: int) -> None:
        """Write every bucket of `version` as its tensors arrive (buckets.stream_buckets); a
        misfit leaves the version uncommitted, which receivers never read (a list with a misfit
        writes nothing)."""
        self._expect("paused", "send()")
        stream = stream_buckets(self.specs, self.buckets, named_tensors)
        if self._version is not None and version != self._version:
            raise ValueError(f"send(version={version}) after pause(version={self._version})")
        self._version = version
        if not self._pushed:
            for stale in _versions(self.store):
                if stale >= version:
                    _delete_version(self.store, stale)
        with contextlib.closing(stream):  # a failed write still reads the rest of the stream
            for i, bucket, tensors in stream:
                named = {
                    s.name: tensors[s.name].detach().to("cpu").contiguous() for s in bucket.specs
                }
                meta = {"version": str(version), "bucket": str(i)}
                self.store.write_immutable(bucket_path(version, i), save_safetensors(named, meta))
        self._state = "sent"

    def resume(self) -> None:
        """Commit the version (receivers may read it from now on) and drop old versions."""
        if self._state == "paused":
            self._state = "idle"  # nothing was written
            return
        self._expect("sent", "resume()")
        assert self._version is not None
        record = {
            "version": self._version,
            "fingerprint": self.fingerprint,
            "n_buckets": len(self.buckets),
            "layout": layout_to_json(self.specs),
            "nonce": uuid.uuid4().hex,
            "time": time.time(),
        }
        self.store.write_immutable(committed_path(self._version), json.dumps(record).encode())
        self._pushed = True
        self._state = "idle"
        self._prune()

    def push(self, named_tensors: NamedTensors, version: int) -> None:
        """pause -> send -> resume: one complete, committed version."""
        self.pause(version)
        self.send(named_tensors, version)
        self.resume()

    def _prune(self) -> None:
        versions = _versions(self.store)
        committed = [v for v in versions if self.store.exists(committed_path(v))]
        if len(committed) <= self.keep:
            return
        oldest_kept = committed[-self.keep]
        for version in versions:
            if version < oldest_kept:
                _delete_version(self.store, version)

    def _expect(self, state: str, what: str) -> None:
        if self._state != state:
            raise RuntimeError(
                f"object-store weight sync at {self.store.url(WEIGHTS)}: {what} needs state "
                f"{state!r}, it is {self._state!r} (order: init, pause/send/resume, destroy)"
            )


class ObjectStoreReceiver:
    """Loads each newly committed version in a thread; `take()` hands it to the engine loop."""

    def __init__(self, store: ObjectStore, specs: list[TensorSpec], poll_s: float = 0.5) -> None:
        self.store = store
        self.specs = list(specs)
        self.fingerprint = layout_fingerprint(self.specs)
        self.poll_s = poll_s
        self._slot = UpdateSlot()
        self._loaded: tuple[int, str] | None = None  # (version, nonce) last loaded
        self.skipped = 0
        """Versions deleted by the sender while this receiver read them."""
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None

    def init(self) -> None:
        """Fail early if the newest published version has another layout."""
        newest = self._newest_committed()
        if newest is not None:
            self._check_layout(*newest)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="weight-sync-store", daemon=True)
            self._thread.start()

    def destroy(self, timeout: float = 30.0) -> None:
        self._closing.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def take(self) -> Update | None:
        """The newest complete update not yet taken (version, named tensors), or None."""
        return self._slot.take()

    def release(self, update: Update) -> None:
        """No-op: every load reads into new tensors (kept for the receivers' common shape)."""

    def wait(self, timeout: float) -> bool:
        """Block until an update is pending, the run stopped or the thread failed."""
        return self._slot.wait(timeout)

    @property
    def stopped(self) -> bool:
        return self._slot.stopped

    # ------------------------------------------------------------------ internals
    def _run(self) -> None:
        try:
            while not self._closing.is_set():
                if not self.poll_once() and self.store.exists(STOP_PATH):
                    self._slot.stop()
                    return
                self._closing.wait(self.poll_s)
        except BaseException as err:  # surfaced to the engine loop by take()/wait()
            self._slot.fail(err)

    def poll_once(self) -> bool:
        """Load the newest committed version if it is not the one loaded last; True if loaded."""
        while True:
            newest = self._newest_committed()
            if newest is None:
                return False
            version, record = newest
            if (version, record.get("nonce", "")) == self._loaded:
                return False
            self._check_layout(version, record)
            try:
                tensors = self._load(version, int(record["n_buckets"]))
            except FileNotFoundError:
                if self._nonce_of(version) == record.get("nonce"):
                    raise  # still committed yet incomplete: the store lost an object
                self.skipped += 1  # deleted under us: a newer version is committed by now
                continue
            self._loaded = (version, record.get("nonce", ""))
            self._slot.put((version, tensors))
            return True

    def _newest_committed(self) -> tuple[int, dict] | None:
        for version in reversed(_versions(self.store)):
            try:
                return version, json.loads(self.store.read_bytes(committed_path(version)))
            except FileNotFoundError:
                continue  # being written, or being deleted
        return None

    def _nonce_of(self, version: int) -> str | None:
        try:
            return json.loads(self.store.read_bytes(committed_path(version))).get("nonce")
        except FileNotFoundError:
            return None

    def _check_layout(self, version: int, record: dict) -> None:
        if record.get("fingerprint") == self.fingerprint:
            return
        diff = layout_difference(self.specs, layout_from_json(record.get("layout", [])))
        raise LayoutMismatch(
            f"weights at {self.store.url(version_dir(version))} have another layout than this "
            f"engine's model ({diff or 'fingerprints differ'}; 'here' is the engine, 'there' "
            "the published weights); build the trainer's architecture"
        )

    def _load(self, version: int, n_buckets: int) -> list[tuple[str, torch.Tensor]]:
        got: dict[str, torch.Tensor] = {}
        for i in range(n_buckets):
            got.update(load_safetensors(self.store.read_bytes(bucket_path(version, i))))
        try:
            check_tensors(self.specs, got.items())
        except ValueError as err:
            raise LayoutMismatch(
                f"weights at {self.store.url(version_dir(version))} do not fit this engine's "
                f"model: {err}"
            ) from err
        return [(s.name, got[s.name]) for s in self.specs]

"""Weight sync from the trainer to SGLang servers, over a process group that SGLang joins itself.

SGLang's documented update path (0.5.23), driven from the trainer (rank 0):
1. form: ask each server for its `tp_size` and `dp_size` (`/server_info`); a server with
   data-parallel replicas is refused here, as SGLang refuses it (an assertion in
   TokenizerManager.init_weights_update_group: run one server per replica instead). Give each
   server `rank_offset` = 1 + the tp sizes before it, and call `/init_weights_update_group
   {master_address, master_port, rank_offset, world_size, group_name, backend}` on every server
   at once while this process joins as rank 0 (process_group.py); each of a server's TP ranks
   joins at rank_offset + tp_rank, so world_size = 1 + the sum of the tp sizes. The calls
   return once the group is formed.
2. update version v: `/pause_generation {"mode": "retract"}` (sglang.pause_mode; retract:
   running requests go back to the waiting queue, keeping their tokens, and their KV cache is
   recomputed by the new weights), `/begin_weight_update` (SGLang loads distributed updates only
   inside such a session: SchedulerWeightUpdaterManager), then per bucket
   `/update_weights_from_distributed {names, dtypes, shapes, group_name, load_format:
   "flattened_bucket"}` on every server while rank 0 broadcasts the bucket as one flat uint8
   tensor (tensors back to back, SGLang's FlattenedTensorBucket layout); the last bucket carries
   `weight_version: "v"` and `flush_cache` (not with pause mode in_place, whose paused requests
   keep running: SGLang refuses to flush then and fails the update); then `/end_weight_update`
   and `/continue_generation`. In place, the radix cache still holds KV (and an MoE policy's
   routing) of the older weights, which new requests would reuse: `/flush_cache` runs at once
   when nothing ran, else it is left pending (`?timeout=`, SGLang runs it as soon as the
   requests that kept running have finished) before generation continues.
   Before it pauses anything, the update reads each member's `weight_version` (`/model_info`):
   one that no longer serves what this sender last sent restarted at its URL (a sidecar its
   kubelet restarted) and holds no weight group, so the group is formed again first.
Every member's call of a step is in flight at once (each blocks inside the broadcast until all
ranks take part), so the sender's HTTP threads number at least its servers.
3. the engine set changes (an engine registered or drained): `/destroy_weights_update_group` on
   the servers that stay, and a new group under a new name, formed at the next update.

Group names are `{base}-{incarnation}-{generation}`, the incarnation a nonce of this sender: a
trainer restarted from a checkpoint finds servers that still hold the dead trainer's group, and
torch refuses a second group of the same name. The new trainer first destroys the group the dead
one recorded (`previous`, from control/rendezvous/sglang) on the servers that were in it. A
session the dead trainer left open is closed before a new one begins.

SGLang loads the names it knows and skips the rest with success (each model's `load_weights`):
the names sent must be its checkpoint names (per-expert MoE names, not transformers 5's fused
ones). Buckets are the same plan as the broadcast transport (buckets.py): one dtype each, at most
`bucket_bytes`, so the staging a server needs is bounded. NCCL on GPUs, gloo on CPU.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from relax_core.net import free_port
from relax_core.rollout.sglang_engine import SGLangClient, SGLangEngine, SGLangError
from relax_core.sync.buckets import (
    Bucket,
    NamedTensors,
    TensorSpec,
    flatten_into,
    plan_buckets,
    stream_buckets,
)
from relax_core.sync.process_group import join_weight_group, leave_weight_group
from relax_core.sync.sglang_fresh import PendingFlushes, flush_idle, restarted

log = logging.getLogger(__name__)

Engines = Sequence[tuple[str, str]] | Callable[[], Sequence[tuple[str, str]]]
"""(name, URL) of the SGLang servers to keep in sync: fixed, or a function giving them now."""


def engines_source(engines: Engines) -> Callable[[], Sequence[tuple[str, str]]]:
    """`engines` as a function giving the servers now."""
    return engines if callable(engines) else (lambda fixed=tuple(engines): fixed)


def wanted_engines(source: Callable[[], Sequence[tuple[str, str]]]) -> list[tuple[str, str]]:
    """The servers `source` gives now, as (name, URL) strings; ValueError when names repeat."""
    engines = [(str(n), str(u)) for n, u in source()]
    names = [n for n, _ in engines]
    if len(set(names)) != len(names):
        raise ValueError(f"SGLang engine names repeat: {names}")
    return engines


class SGLangSender:
    """Rank 0 of a weight group whose other ranks are SGLang servers' tensor-parallel ranks."""

    what = "SGLang"
    client_class: type = SGLangClient

    def __init__(
        self,
        engines: Engines,
        specs: list[TensorSpec],
        bucket_bytes: int = 512 << 20,
        backend: str = "gloo",
        host: str = "127.0.0.1",
        group_name: str = "relax-weights",
        timeout_s: float = 600.0,
        pause_mode: str = "retract",
        previous: dict[str, Any] | None = None,
    ) -> None:
        self._engines = engines_source(engines)
        self.specs = list(specs)
        self.buckets = plan_buckets(self.specs, bucket_bytes)
        self.backend = backend
        self.host = host
        self.base_name = group_name
        self.timeout_s = timeout_s
        self.pause_mode = pause_mode
        """How servers pause for an update (sglang.pause_mode): 'retract', 'in_place', 'abort'."""
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else (torch.device("cpu"))
        )
        self.members: list[tuple[str, str]] = []
        """(name, URL) of the servers in the current group."""
        self.generation = -1
        self.incarnation = secrets.token_hex(3)
        """Names this sender's groups apart from an earlier trainer's (see the module doc)."""
        self.previous = previous
        """The rendezvous record of the group a dead trainer left on the servers, if any."""
        self.group: Any = None
        self.group_name = ""
        self.clients: dict[str, SGLangClient] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0
        self._flushes = PendingFlushes()
        self.sent: str | None = None
        """The version the members were last sent (None: none since the group formed)."""
        self.rendezvous: dict[str, Any] = {}
        self._buffer: torch.Tensor | None = None

    def wanted(self) -> list[tuple[str, str]]:
        return wanted_engines(self._engines)

    def needs_reform(self) -> bool:
        return self.wanted() != self.members

    # ------------------------------------------------------------------ lifecycle
    def init(self) -> None:
        """Form the group with the servers wanted now (nothing to do without any)."""
        self._form(self.wanted())

    def push(self, named_tensors: NamedTensors, version: int) -> bool:
        """Send every weight to every wanted server as `version`, forming the group again
        first when the set of servers changed. True if it formed a new group."""
        # A list is checked whole here, before anything is sent; a stream (a backend's
        # named_weights) is read bucket by bucket as the buckets go out, and not at all when
        # no server is there to take it.
        stream = stream_buckets(self.specs, self.buckets, named_tensors)
        wanted = self.wanted()
        if not wanted and not self.members:
            return False
        reformed = wanted != self.members or self.group is None
        if reformed:
            self._form(wanted)
        if not self.members:
            return reformed
        return bool(self._update(stream, version)) or reformed

    def _update(self, stream, version: int) -> bool:
        """Send the buckets of `stream` to the members as `version` (the group is formed),
        forming it again first when a member restarted. True if it did."""
        clients = {n: self._client(n, u) for n, u in self.members}
        lost = self.sent is not None and restarted(self._executor(), clients, self.sent)
        if lost:
            log.warning("%s engines %s restarted: forming the weight group again", self.what, lost)
            self._form(list(self.members))
        self._flushes.check()
        busy: list[str] = []
        self._each("/pause_generation", {"mode": self.pause_mode})
        try:
            with self._session(), torch.no_grad(), contextlib.closing(stream):
                for i, bucket, tensors in stream:
                    last = i == len(self.buckets) - 1
                    self._send_bucket(bucket, tensors, version if last else None)
            if self.pause_mode == "in_place":  # the others flushed with the last bucket
                busy = flush_idle(self._executor(), clients)
        finally:
            self._each("/continue_generation", {})
        self._flushes.start({n: clients[n] for n in busy}, self.timeout_s)
        self.sent = str(version)
        return bool(lost)

    def destroy(self) -> None:
        self._leave()
        self._flushes.shutdown()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    # ------------------------------------------------------------------ internals
    def _client(self, name: str, url: str) -> SGLangClient:
        client = self.clients.get(name)
        if client is None or client.url != url.rstrip("/"):
            client = self.clients[name] = self.client_class(url, timeout_s=self.timeout_s)
        return client

    def _executor(self, servers: int = 0) -> ThreadPoolExecutor:
        """Threads for a call to every server at once (`servers`, else the members): each call
        of a step blocks inside the broadcast until every server has joined it, so fewer
        threads than servers would wait on each other for ever."""
        need = max(servers, len(self.members), 4)
        if self._pool is None or self._pool_size < need:
            if self._pool is not None:
                self._pool.shutdown(wait=False)  # its running calls finish
            self._pool = ThreadPoolExecutor(max_workers=need, thread_name_prefix="sglang-sync")
            self._pool_size = need
        return self._pool

    def _each(self, path: str, body: dict[str, Any]) -> list[Any]:
        """POST `body` to every member at once; SGLangError naming the first that failed."""
        futures = [
            (name, self._executor().submit(self._client(name, url).post_ok, path, body))
            for name, url in self.members
        ]
        return [self._result(name, f) for name, f in futures]

    def _result(self, name: str, future) -> Any:
        try:
            return future.result()
        except SGLangError as err:
            raise type(err)(f"{self.what} engine {name}: {err}") from err

    @contextlib.contextmanager
    def _session(self):
        """SGLang's weight-update session around the buckets, closed however they end."""
        futures = [(n, self._executor().submit(self._begin, n, u)) for n, u in self.members]
        for n, future in futures:
            self._result(n, future)
        try:
            yield
        except BaseException:
            with contextlib.suppress(SGLangError):
                self._each("/end_weight_update", {})
            raise
        self._each("/end_weight_update", {})

    def _begin(self, name: str, url: str) -> None:
        """Open a session; one left open (a trainer that died mid-update) is closed first."""
        client = self._client(name, url)
        try:
            client.post_ok("/begin_weight_update", {})
        except SGLangError as err:
            if "already open" not in str(err):
                raise
            log.warning("SGLang engine %s had a weight-update session open; closing it", name)
            client.post_ok("/end_weight_update", {})
            client.post_ok("/begin_weight_update", {})

    def _ranks(self, name: str, url: str) -> int:
        """The server's TP size (its ranks in the group); SGLangError for one with DP replicas."""
        tp, dp = SGLangEngine(self._client(name, url)).parallel_shape()
        if dp != 1:
            raise SGLangError(
                f"SGLang engine {name} ({url}) runs {dp} data-parallel replicas: SGLang 0.5.23 "
                "refuses weight updates from distributed with --dp-size > 1; run one server "
                "per replica (sglang.extra_args) instead"
            )
        return tp

    def _form(self, wanted: list[tuple[str, str]]) -> None:
        self._leave()
        self.generation += 1
        self.members = []
        if not wanted:
            return
        sizes = [self._ranks(n, u) for n, u in wanted]
        world = 1 + sum(sizes)
        port = free_port(self.host)
        name = f"{self.base_name}-{self.incarnation}-{self.generation}"
        self._destroy_previous(wanted)
        offsets = [1 + sum(sizes[:i]) for i in range(len(wanted))]
        pool = self._executor(len(wanted))
        pending = [
            (n, pool.submit(self._join_request, n, u, offset, world, port, name))
            for (n, u), offset in zip(wanted, offsets, strict=True)
        ]
        try:
            group = self._join(port, world, name)
        except Exception as err:
            failures = []
            for n, future in pending:
                with contextlib.suppress(Exception):
                    self._result(n, future)
                    continue
                failures.append(n)
            raise SGLangError(
                f"{self.what} weight group {name!r} did not form with {[n for n, _ in wanted]} "
                f"(world size {world}, rendezvous {self.host}:{port}; engines that failed to "
                f"join: {failures or 'none reported'}): {err}"
            ) from err
        for n, future in pending:
            self._result(n, future)
        self.group, self.group_name, self.members = group, name, list(wanted)
        self.sent = None
        self.rendezvous = {
            "group_name": name,
            "master_address": self.host,
            "master_port": port,
            "world_size": world,
            "backend": self.backend,
            "rank_offsets": {n: off for (n, _), off in zip(wanted, offsets, strict=True)},
            "tp_sizes": {n: size for (n, _), size in zip(wanted, sizes, strict=True)},
        }
        """How the group formed (for control/rendezvous/; the servers got it over HTTP)."""
        log.info("%s weight group %s formed: %s (world size %d)", self.what, name, wanted, world)

    def _join_request(
        self, name: str, url: str, offset: int, world: int, port: int, group: str
    ) -> Any:
        """Ask server `name` to join the group (its ranks from `offset`); returns once formed."""
        body = {
            "master_address": self.host,
            "master_port": port,
            "rank_offset": offset,
            "world_size": world,
            "group_name": group,
            "backend": self.backend,
        }
        return self._client(name, url).post_ok("/init_weights_update_group", body)

    def _join(self, port: int, world: int, group: str) -> Any:
        """This process's end of the group: rank 0, hosting the rendezvous."""
        return join_weight_group(self.backend, self.host, port, world, 0, group, self.timeout_s)

    def _destroy_previous(self, wanted: list[tuple[str, str]]) -> None:
        """Destroy the dead trainer's group on the servers that held it (best effort: a server
        that restarted since holds none)."""
        if not self.previous:
            return
        old = self.previous.get("group_name", "")
        held = set(self.previous.get("rank_offsets", {}))
        for name, url in wanted:
            if name in held and old:
                with contextlib.suppress(SGLangError):
                    self._client(name, url).post(
                        "/destroy_weights_update_group", {"group_name": old}, 30.0
                    )
        self.previous = None

    def _leave(self) -> None:
        if self.group is None:
            return
        for name, url in self.members:
            with contextlib.suppress(SGLangError):
                self._client(name, url).post(
                    "/destroy_weights_update_group", {"group_name": self.group_name}, 30.0
                )
        leave_weight_group(self.group)
        self.group = None

    def _send_bucket(
        self, bucket: Bucket, tensors: dict[str, torch.Tensor], version: int | None
    ) -> None:
        body: dict[str, Any] = {
            "names": [s.name for s in bucket.specs],
            "dtypes": [s.dtype for s in bucket.specs],
            "shapes": [list(s.shape) for s in bucket.specs],
            "group_name": self.group_name,
            "load_format": "flattened_bucket",
            # SGLang flushes only an idle scheduler: after a retract or abort pause nothing runs,
            # but in_place keeps its requests running, and a flush would fail the update.
            "flush_cache": version is not None and self.pause_mode != "in_place",
        }
        if version is not None:
            body["weight_version"] = str(version)
        futures = [
            (
                n,
                self._executor().submit(
                    self._client(n, u).post_ok, "/update_weights_from_distributed", body
                ),
            )
            for n, u in self.members
        ]
        dist.broadcast(self._flat_bytes(bucket, tensors), src=0, group=self.group)
        for n, future in futures:
            self._result(n, future)

    def _flat_bytes(self, bucket: Bucket, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The bucket's tensors back to back, as one uint8 tensor."""
        if len(bucket.specs) == 1:
            tensor = tensors[bucket.specs[0].name].detach()
            if tensor.is_contiguous() and tensor.device == self.device:
                return tensor.reshape(-1).view(torch.uint8)
        if self._buffer is None or self._buffer.numel() < bucket.nbytes:
            self._buffer = torch.empty(
                max(b.nbytes for b in self.buckets), dtype=torch.uint8, device=self.device
            )
        flat = self._buffer[: bucket.nbytes]
        flatten_into(bucket, tensors, flat.view(bucket.specs[0].torch_dtype))
        return flat

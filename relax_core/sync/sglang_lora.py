"""Weight sync of a LoRA policy to SGLang servers: each version's adapter, loaded by name.

The frozen base is on every server from its launch; an update is the adapter alone, loaded as
`policy-v{N}` on every wanted server at once through SGLang's LoRA API (rollout/sglang_lora.py:
the PEFT config, one self-contained payload per TP rank), after which versions older than the
newest `keep` are unloaded. No weight group and no pause: running requests keep the adapter they
named, new ones name the newest (SGLangEngine reads it from GET /v1/models). SGLang unregisters
an unloaded name at once but answers the unload only once the requests running with it have
finished, so unloads run on threads of their own: the trainer's push does not wait for them,
and one that failed is logged at the next push.

`push` has SGLangSender's shape for TrainerSync (pool/weights.py): `members` are the servers
that hold the trainer's adapter, `generation` counts the changes of that set.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from relax_core.rollout.sglang_engine import SGLangClient, SGLangError, adapter_name
from relax_core.rollout.sglang_lora import (
    peft_config,
    peft_name,
    peft_tensors,
    publish_adapter,
    server_shape,
    unload_adapter,
)
from relax_core.sync.buckets import NamedTensors, TensorSpec
from relax_core.sync.sglang import Engines, engines_source, wanted_engines

log = logging.getLogger(__name__)


class SGLangLoRASender:
    """The trainer's adapter versions to SGLang servers started with --enable-lora."""

    what = "SGLang"

    def __init__(
        self,
        engines: Engines,
        specs: list[TensorSpec],
        alpha: float,
        keep: int,
        timeout_s: float = 600.0,
    ) -> None:
        self._engines = engines_source(engines)
        self.specs = {s.name: tuple(s.shape) for s in specs}
        self.config = peft_config(self.specs, alpha)
        """The PEFT adapter_config.json every version is loaded with."""
        self.keep = keep
        self.timeout_s = timeout_s
        self.members: list[tuple[str, str]] = []
        """(name, URL) of the servers holding the trainer's adapter."""
        self.generation = -1
        self.rendezvous: dict[str, Any] = {}
        """What the servers hold, for control/rendezvous/sglang (`relax queue`, debugging)."""
        self._tp: dict[str, int] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._unloader: ThreadPoolExecutor | None = None
        self._unloads: list[tuple[str, str, Future]] = []
        """(server URL, adapter, its unload) still to report on."""

    def wanted(self) -> list[tuple[str, str]]:
        return wanted_engines(self._engines)

    def needs_reform(self) -> bool:
        return self.wanted() != self.members

    def init(self) -> None:
        pass  # nothing to form: a server is reached over HTTP at its first update

    def push(self, named_tensors: NamedTensors, version: int) -> bool:
        """Load the adapter as `version` on every wanted server (one that holds it already is
        left as it is). True when the set of servers changed."""
        wanted = self.wanted()
        reformed = wanted != self.members
        if reformed:
            self.generation += 1
        if not wanted:
            self.members = []
            return reformed
        self._report_unloads()
        tensors = self._checked(peft_tensors(named_tensors))
        clients = {n: SGLangClient(u, timeout_s=self.timeout_s) for n, u in wanted}
        futures = [
            (n, self._executor().submit(self._publish, n, clients[n], version, tensors))
            for n, _ in wanted
        ]
        for n, future in futures:
            try:
                future.result()
            except SGLangError as err:
                raise type(err)(f"{self.what} engine {n}: {err}") from err
        self.members = wanted
        self.rendezvous = {
            "lora_adapter": adapter_name(version),
            "keep": self.keep,
            "tp_sizes": {n: self._tp[n] for n, _ in wanted},
        }
        return reformed

    def destroy(self) -> None:
        for pool in (self._pool, self._unloader):
            if pool is not None:
                pool.shutdown(wait=False)
        self._pool = self._unloader = None

    def _publish(self, name: str, client: SGLangClient, version: int, tensors) -> None:
        if name not in self._tp or name not in dict(self.members):
            self._tp[name] = server_shape(client)
        publish_adapter(
            client, version, tensors, self.config, self._tp[name], self.keep, self._unload_later
        )

    def _unload_later(self, client: SGLangClient, adapter: str) -> None:
        if any((u, a) == (client.url, adapter) and not f.done() for u, a, f in self._unloads):
            return  # still listed until SGLang unregisters it: one unload is enough
        if self._unloader is None:
            self._unloader = ThreadPoolExecutor(max_workers=4, thread_name_prefix="sglang-unload")
        future = self._unloader.submit(unload_adapter, client, adapter)
        self._unloads.append((client.url, adapter, future))

    def _report_unloads(self) -> None:
        for url, adapter, future in [u for u in self._unloads if u[2].done()]:
            self._unloads.remove((url, adapter, future))
            if future.exception() is not None:
                log.warning("%s: unloading %s failed: %s", url, adapter, future.exception())

    def _checked(self, tensors: dict) -> dict:
        """`tensors` (PEFT names) when they are the adapter of `specs`; ValueError otherwise."""
        expected = {peft_name(n): shape for n, shape in self.specs.items()}
        got = {n: tuple(t.shape) for n, t in tensors.items()}
        if got != expected:
            missing = sorted(expected.keys() - got.keys())[:3]
            unexpected = sorted(got.keys() - expected.keys())[:3]
            wrong = sorted(n for n in got.keys() & expected.keys() if got[n] != expected[n])[:3]
            raise ValueError(
                f"the adapter sent does not fit its layout: missing {missing}, unexpected "
                f"{unexpected}, shapes differ for {wrong}"
            )
        return tensors

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="sglang-lora")
        return self._pool

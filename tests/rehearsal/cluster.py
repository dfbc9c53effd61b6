"""The rehearsal's cluster: network, storage host, pod launcher and the driver's storage view.

    with open_cluster(tmp_path) as cluster:
        root = cluster.storage_root("run-a")              # s3://rehearsal/run-a
        result = cluster.rehearsal(faults=[...]).run(train, {"cfg": cfg})
        cluster.on_ctl(lambda: MlflowClient(cluster.tracking_uri).get_run(...))

Hosts: "storage" (SeaweedFS + mlflow server), "ctl" (where the driver's own S3 and MLflow calls
come from: a thread of this process joined to its namespace) and one host per pod. On teardown
every pod still running is killed, then the servers are stopped, then the namespaces removed.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from tests.rehearsal.driver import Rehearsal, StorageWatch
from tests.rehearsal.netns import Host, LoopbackNetwork, Network, open_network
from tests.rehearsal.pods import PodLauncher
from tests.rehearsal.servers import StorageHost

T = TypeVar("T")
REPO = str(Path(__file__).resolve().parents[2])


@dataclass
class Cluster:
    network: Network | LoopbackNetwork
    storage: StorageHost
    ctl: Host
    launcher: PodLauncher
    watch: StorageWatch

    @property
    def isolated(self) -> bool:
        return self.network.isolated

    @property
    def tracking_uri(self) -> str:
        return self.storage.tracking_uri

    @property
    def endpoint_url(self) -> str:
        assert self.storage.s3 is not None
        return self.storage.s3.endpoint_url

    @property
    def bucket(self) -> str:
        assert self.storage.s3 is not None
        return self.storage.s3.bucket

    def storage_root(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix.strip('/')}"

    def on_ctl(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) with the ctl host's network (MLflow client calls, urllib)."""
        return self.network.runner(self.ctl).call(fn, *args)

    def rehearsal(self, storage_root: str, **kwargs: Any) -> Rehearsal:
        return Rehearsal(self.launcher, storage_root, self.watch, **kwargs)


@contextlib.contextmanager
def open_cluster(workdir: str | os.PathLike, prefix: str = "rh") -> Iterator[Cluster]:
    import s3fs

    workdir = Path(workdir)
    with open_network(prefix) as net:
        storage_host = net.add_host("storage")
        ctl = net.add_host("ctl")
        with StorageHost(net, storage_host, workdir / "storage") as storage:
            assert storage.s3 is not None
            fs = s3fs.S3FileSystem(
                loop=net.runner(ctl).loop,
                skip_instance_cache=True,
                key=storage.s3.key,
                secret=storage.s3.secret,
                client_kwargs={"endpoint_url": storage.s3.endpoint_url},
            )
            launcher = PodLauncher(
                net, REPO, workdir / "pod-logs", storage.pod_env(), workdir / "pod-disks"
            )
            try:
                yield Cluster(net, storage, ctl, launcher, StorageWatch(fs))
            finally:
                launcher.kill_all()
                if fs._s3 is not None:  # close its connections while the loop still runs
                    s3fs.S3FileSystem.close_session(fs.loop, fs._s3)

"""The rehearsal's storage host: SeaweedFS (S3) and an `mlflow server`, the only things pods share.

    with StorageHost(net, host, workdir) as storage:
        storage.s3.endpoint_url, storage.tracking_uri, storage.pod_env()

The MLflow server keeps its runs in SQLite on the host's disk and proxies artifacts (registered
models) to `s3://<bucket>/mlflow`, so a pod needs nothing but the tracking URI. Both servers run
under the storage host's namespace prefix in their own sessions and are stopped by PID.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests import s3servers
from tests.rehearsal.netns import Host, LoopbackNetwork, Network

BUCKET = "rehearsal"
START_TIMEOUT_S = 90.0


class StorageHost:
    def __init__(
        self, network: Network | LoopbackNetwork, host: Host, workdir: str | os.PathLike
    ) -> None:
        self.network, self.host = network, host
        self.workdir = Path(workdir)
        self.s3: s3servers.S3Server | None = None
        self.mlflow: subprocess.Popen | None = None
        self.tracking_uri = ""
        self.mlflow_log = self.workdir / "mlflow-server.log"

    def __enter__(self) -> StorageHost:
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self.s3 = s3servers.start_seaweedfs(
                str(self.workdir),
                BUCKET,
                host=self.host.ip,
                command_prefix=self.network.exec_prefix(self.host),
            )
            self._start_mlflow()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def credentials_env(self) -> dict[str, str]:
        assert self.s3 is not None
        return {"AWS_ACCESS_KEY_ID": self.s3.key, "AWS_SECRET_ACCESS_KEY": self.s3.secret}

    def pod_env(self) -> dict[str, str]:
        """What every pod is given: S3 credentials and the tracking server."""
        return {**self.credentials_env(), "MLFLOW_TRACKING_URI": self.tracking_uri}

    def _start_mlflow(self) -> None:
        assert self.s3 is not None
        (port,) = s3servers.free_ports(1)
        self.tracking_uri = f"http://{self.host.ip}:{port}"
        command = [
            *self.network.exec_prefix(self.host),
            sys.executable, "-m", "mlflow", "server",
            "--host", self.host.ip,
            "--port", str(port),
            "--backend-store-uri", f"sqlite:///{self.workdir / 'mlflow.db'}",
            "--artifacts-destination", f"s3://{self.s3.bucket}/mlflow",
            "--workers", "1",
        ]  # fmt: skip
        env = {
            **os.environ,
            **self.credentials_env(),
            "MLFLOW_S3_ENDPOINT_URL": self.s3.endpoint_url,
            "MLFLOW_DISABLE_TELEMETRY": "true",
            # The server's job runner (four huey consumer processes, each importing mlflow)
            # serves nothing the pods use; on 2 cores it costs the pods seconds of CPU.
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        }
        with open(self.mlflow_log, "wb") as log:
            self.mlflow = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        runner = self.network.runner(self.host)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not runner.call(s3servers.http_ok, f"{self.tracking_uri}/health"):
            if self.mlflow.poll() is not None:
                raise RuntimeError(
                    f"mlflow server exited {self.mlflow.returncode}; log {self.mlflow_log}:\n"
                    + self.mlflow_log.read_text(errors="replace")[-3000:]
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"mlflow server at {self.tracking_uri} did not answer /health within "
                    f"{START_TIMEOUT_S:.0f} s; log {self.mlflow_log}:\n"
                    + self.mlflow_log.read_text(errors="replace")[-3000:]
                )
            time.sleep(0.25)

    def stop(self) -> None:
        if self.mlflow is not None:
            s3servers.stop_group(self.mlflow)
            self.mlflow = None
        if self.s3 is not None:
            self.s3.stop()
            self.s3 = None

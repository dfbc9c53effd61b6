"""Run configuration, where the run's parts run: the queue's storage, the async services and
their weight sync, the SGLang servers. Sections of the run config (sections.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QueueConfig:
    root: str = ".relax/queue"
    """TransferQueue root: a local path or an fsspec URL (s3://bucket/prefix)."""
    endpoint_url: str = ""
    """S3 endpoint for s3:// roots (MinIO, SeaweedFS...); empty = AWS. Credentials come from the
    usual AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY environment."""
    lease_ttl_s: float = 60.0
    """How long a worker's claim on an entry of a multi-consumer stage lasts unless renewed."""
    retry_attempts: int = 4
    """Tries per storage operation on transient faults (the first included)."""

    def storage_options(self) -> dict:
        """fsspec options for `root`."""
        if self.endpoint_url:
            return {"client_kwargs": {"endpoint_url": self.endpoint_url}}
        return {}


@dataclass(frozen=True)
class ServicesConfig:
    """Async mode: how the roles run as separate services and exchange weights."""

    launch: str = "processes"
    """'processes': one Flyte task (or `relax run`) starts every role as a local OS process and
    supervises it; 'tasks': each role is its own Flyte task, run in parallel on a cluster."""
    rollout_workers: int = 1
    """Rollout services sharing the admission ledger (each its own engine)."""
    rollout_batch_groups: int = 0
    """Groups one rollout generate call (and queue entry) holds; 0 = rollout.groups_per_step."""
    actor_fwd: bool = False
    """Run the actor_fwd role: old log-probs under the newest trainer weights it has received
    (otherwise the trainer interpolates the proximal policy, algorithms/decoupled.py)."""
    weight_sync: str = "broadcast"
    """'broadcast': a torch.distributed group from the trainer to the engines (gloo on CPU, NCCL
    on GPU); 'object_store': weights/v{N}/ safetensors under the queue prefix, polled."""
    sync_backend: str = "auto"
    """Broadcast backend: auto (nccl when CUDA is available, else gloo), gloo or nccl."""
    sync_host: str = "127.0.0.1"
    """Address the trainer publishes for the broadcast group (its pod IP on a cluster)."""
    bucket_mb: int = 64
    """Weights move in buckets of at most this many MiB."""
    rollout_threads: int = 1
    """torch threads of each rollout (and reference, actor_fwd) process."""
    trainer_threads: int = 0
    """torch threads of the trainer; 0 = elastic: the cores the other local roles leave idle
    (a rollout waiting at the staleness bound lends its core to the trainer)."""
    drop_over_stale: bool = False
    """Backstop: drop whole groups older than max_staleness at the trainer (counted in
    queue/dropped_stale_groups). Admission control already bounds staleness; this only matters
    for rows left from before a resume."""
    poll_s: float = 0.005
    """How often an idle service looks for new queue entries."""
    heartbeat_s: float = 5.0
    """Seconds between heartbeats under control/heartbeats/."""
    start_timeout_s: float = 300.0
    """How long a service waits for the trainer's weight-sync rendezvous."""
    heartbeat_timeout_s: float = 120.0
    """Local supervisor: a service whose newest heartbeat is older than this is silent (hung or
    stopped); it is killed and handled as a failure."""
    max_role_restarts: int = 3
    """Local supervisor: restarts in place of one failed or silent service (the trainer resumes
    from its newest checkpoint) before the whole run is restarted from that checkpoint."""
    max_global_restarts: int = 2
    """Local supervisor: whole-run restarts before the run gives up with a report."""
    restart_window_s: float = 1800.0
    """Local supervisor: max_role_restarts counts a role's failures within this many seconds,
    so a long run is not given up over failures spread across days."""
    notify: str = ""
    """Apprise URLs (comma-separated) told about restarts, giving up and the run's end;
    empty = none."""
    scale_api: bool = True
    """Local launcher: serve the elastic rollout API (/engines, /scale_out, /scale_in); its URL
    and bearer token go to {run_dir}/scale_api.json (token: $RELAX_SCALE_TOKEN, else random)."""
    scale_api_host: str = "127.0.0.1"
    """Address the scaling API binds; anything but loopback exposes it (token still required)."""
    scale_api_port: int = 0
    """Port of the scaling API; 0 = a free one."""
    max_rollout_workers: int = 8
    """Most rollout engines the pool may scale out to."""
    trainer_gpus: int = 1
    """GPUs of the trainer on a cluster (FSDP2 shards the policy across them)."""
    rollout_gpus: int = 1
    """GPUs of each rollout worker's engine on a cluster (tensor parallel across them); a run
    takes trainer_gpus + rollout_workers x rollout_gpus."""


@dataclass(frozen=True)
class SGLangConfig:
    """rollout.engine 'sglang': the SGLang server each rollout worker drives over HTTP."""

    url: str = ""
    """A running server to drive instead of starting one (the rollout pod's sidecar on a
    cluster); '{worker}' in it is replaced by the rollout worker's number. Empty = each worker
    starts `python -m sglang.launch_server` on the policy and stops it when it exits."""
    python: str = ""
    """Interpreter of SGLang's own venv or image (SGLang pins its own torch); empty =
    $RELAX_SGLANG_PYTHON, else the Python running the rollout worker."""
    mem_fraction_static: float = 0.8
    """Share of GPU memory SGLang takes for weights and KV cache."""
    pause_mode: str = "retract"
    """How a weight update pauses generation: 'retract' (running requests go back to the queue
    and their KV cache is recomputed under the new weights), 'in_place' (kept, finished under
    the new weights: a partial rollout) or 'abort'."""
    release_memory: bool = True
    """Colocate on one GPU: the server frees its weights and KV cache while the trainer runs
    (--enable-memory-saver, /release_memory_occupation) and takes them back after."""
    handoff_dir: str = "/dev/shm/relax-weights"
    """Colocate: where the trainer writes each version (safetensors) for
    /update_weights_from_disk; node-local memory on a cluster."""
    extra_args: str = ""
    """More `sglang.launch_server` arguments, as on a command line (e.g. '--dp-size 2')."""
    start_timeout_s: float = 900.0
    """How long a started server may take to load the policy and answer /health."""

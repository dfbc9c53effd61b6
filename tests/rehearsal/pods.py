"""One task in one "pod": a fresh process tree with its own network, disk, HOME and TMPDIR.

    launcher = PodLauncher(net, repo, logs_dir, env)
    pod = launcher.pod("rl-steps", ["task", "tasks.rl.rl_steps", inputs_json]).start()
    outputs = pod.wait(timeout=300)        # the task's outputs, or PodError with the log tail
    pod.kill()                             # SIGKILL to the whole tree, as a lost node

Isolated (root, namespaces available) a pod is
`ip netns exec <its ns> unshare --mount --uts --pid --fork --kill-child --mount-proc` running
POD_SCRIPT, which inside the new mount namespace only:
- mounts a private tmpfs on /tmp (the pod's disk: TMPDIR, HOME=/tmp/home, XDG_CACHE_HOME) and on
  /dev/shm and /var/tmp, and makes the rest of the root filesystem read-only for the pod, so a
  task can write nowhere another pod (or a retry of itself) could read;
- mounts the repo checkout as an overlayfs at its own path: lower = the checkout (the image:
  code, configs/, datasets/), upper and work dirs on the pod's tmpfs (the container's writable
  layer). Run state a developer's checkout holds (.relax/, mlflow.db, ...: git-ignored entries,
  see image_masks) is whited out, since an image would not have it. Where overlayfs cannot be
  mounted the tracked and unignored files are copied onto the tmpfs instead;
- sets the hostname to the pod name and an /etc/hosts naming it with the pod's IP, as Kubernetes
  does, then execs the command with the repo as cwd and PYTHONPATH.
Everything the pod wrote disappears with its mount namespace. The pod's stdout and stderr go to a
log file on the host, one per attempt.

Not isolated (the loopback fallback) a pod is a plain process in its own session with HOME,
TMPDIR and a copy of the repo in a host directory that is deleted when the pod ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tests.rehearsal.netns import Host, LoopbackNetwork, Network
from tests.rehearsal.pod_main import MARKER
from tests.s3servers import log_tail

DISK_SIZE = "4g"
"""tmpfs size limit of a pod's disk (pages are only used as written)."""
_LOG_TAIL_BYTES = 6000
# Ignored entries that belong in an image: the environment, build metadata, generated media.
_IMAGE_IGNORED = re.compile(r"^(\.venv|.*\.egg-info|__pycache__|datasets/omni|\.whl|\.gl)/?$")

POD_SCRIPT = r"""
set -eu
repo=$1; pod=$2; ip=$3; masks=$4; size=$5; shift 5
# The pod's own disk and scratch; the host's /tmp, /dev/shm and /var/tmp are out of sight.
mount -t tmpfs -o size=1g,mode=1777 pod-shm /dev/shm
mkdir /dev/shm/.image
mount --bind "$repo" /dev/shm/.image
mount -o remount,bind,ro /dev/shm/.image
mount -t tmpfs -o "size=$size,mode=1777" pod-disk /tmp
mount -t tmpfs -o size=256m,mode=1777 pod-var-tmp /var/tmp
mkdir -p /tmp/.layer/upper /tmp/.layer/work /tmp/home /tmp/cache
for m in $masks; do mknod "/tmp/.layer/upper/$m" c 0 0; done
workdir=$repo
mkdir -p "$repo"
if ! mount -t overlay pod-image \
    -o "lowerdir=/dev/shm/.image,upperdir=/tmp/.layer/upper,workdir=/tmp/.layer/work" "$repo" \
    2>/tmp/.layer/overlay.err; then
  echo "rehearsal pod: overlayfs failed ($(cat /tmp/.layer/overlay.err)); copying the image" >&2
  workdir=/tmp/image
  mkdir -p "$workdir"
  (cd /dev/shm/.image && git -c safe.directory='*' ls-files -co --exclude-standard -z \
    | tar --null -T - -cf -) | tar -xf - -C "$workdir"
fi
umount -l /dev/shm/.image
rmdir /dev/shm/.image
printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n%s\t%s\n' "$ip" "$pod" \
  > /tmp/.layer/hosts
mount --bind -o ro /tmp/.layer/hosts /etc/hosts
hostname "$pod"
# Read-only for the pod (this mount namespace's view only; the host's / stays as it is).
mount -o remount,bind,ro /
cd "$workdir"
export PYTHONPATH="$workdir"
exec "$@"
"""


class PodError(RuntimeError):
    """A pod failed, timed out or printed no output; the message ends with its log's tail."""


def image_masks(repo: str) -> list[str]:
    """Top-level git-ignored entries of the checkout that an image would not have (run state:
    .relax/, mlflow.db, mlartifacts/, caches)."""
    done = subprocess.run(
        ["git", "-C", repo, "status", "--porcelain", "--ignored", "--untracked-files=normal"],
        capture_output=True,
        text=True,
        check=True,
    )
    masks = set()
    for line in done.stdout.splitlines():
        if not line.startswith("!! "):
            continue
        path = line[3:].strip().strip('"')
        top = path.rstrip("/").split("/")[0]
        if _IMAGE_IGNORED.match(path) or "/" in path.rstrip("/"):
            continue  # nested ignored files (__pycache__ in packages) are the image's own
        if re.fullmatch(r"[\w.+-]+", top):
            masks.add(top)
    return sorted(masks)


def image_files(repo: str) -> list[str]:
    """The files an image of the checkout holds: tracked or untracked, never ignored."""
    done = subprocess.run(
        ["git", "-C", repo, "ls-files", "-co", "--exclude-standard", "-z"],
        capture_output=True,
        check=True,
    )
    return [p for p in done.stdout.decode().split("\0") if p]


def read_outputs(log_path: str | os.PathLike) -> dict[str, Any] | None:
    """The JSON after the last MARKER line of a pod's log, or None."""
    found = None
    with open(log_path, errors="replace") as f:
        for line in f:
            if line.startswith(MARKER):
                found = line[len(MARKER) :]
    return json.loads(found) if found is not None else None


class Pod:
    """One attempt of one task; see the module docstring."""

    def __init__(
        self,
        name: str,
        command: list[str],
        env: dict[str, str],
        log_path: Path,
        host: Host,
        disk: Path | None,
        launcher: PodLauncher | None = None,
    ) -> None:
        self.name, self.command, self.env = name, command, env
        self.log_path, self.host, self.disk = log_path, host, disk
        self.launcher = launcher
        self.process: subprocess.Popen | None = None
        self.killed = False
        self.started_at = self.ended_at = 0.0

    def __repr__(self) -> str:
        return f"Pod({self.name}, {self.host.ip}, log={self.log_path})"

    def start(self) -> Pod:
        def popen() -> None:
            with open(self.log_path, "wb") as log:
                self.process = subprocess.Popen(
                    self.command,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    cwd=self.disk / "image" if self.disk else "/",
                    start_new_session=True,
                )
            self.started_at = time.monotonic()

        if self.launcher is not None:
            self.launcher._started(self, popen)
        else:
            popen()
        return self

    def poll(self) -> int | None:
        assert self.process is not None, "start() the pod first"
        code = self.process.poll()
        if code is not None:
            self._ended()
        return code

    def wait(self, timeout: float) -> dict[str, Any]:
        """The task's outputs once the pod exits 0; PodError (after killing it) otherwise."""
        assert self.process is not None, "start() the pod first"
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise PodError(f"pod {self.name} ran past {timeout:.0f} s{self._log_note()}") from None
        self._ended()
        if code != 0:
            how = "was killed" if self.killed else f"exited with code {code}"
            raise PodError(f"pod {self.name} {how}{self._log_note()}")
        outputs = read_outputs(self.log_path)
        if outputs is None:
            raise PodError(f"pod {self.name} printed no {MARKER.strip()} line{self._log_note()}")
        return outputs

    def kill(self) -> None:
        """SIGKILL the pod's whole process tree (its session; in a PID namespace, its init)."""
        if self.process is None:
            return
        self.killed = True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(30)
        self._ended()

    def _ended(self) -> None:
        if not self.ended_at:
            self.ended_at = time.monotonic()
            if self.disk is not None:  # the fallback's pod disk goes with the pod
                shutil.rmtree(self.disk, ignore_errors=True)

    @property
    def wall_s(self) -> float:
        return (self.ended_at or time.monotonic()) - self.started_at

    def log_tail(self) -> str:
        return log_tail(self.log_path, _LOG_TAIL_BYTES)

    def _log_note(self) -> str:
        return f"; log {self.log_path} ends with:\n{self.log_tail()}"


POD_PRIVATE_DIRS = ("/tmp", "/dev/shm", "/var/tmp")
"""Where an isolated pod mounts tmpfs of its own (POD_SCRIPT): the host's files there are out of
its sight."""


def check_interpreter_visible(python: str = sys.executable, prefix: str = sys.prefix) -> None:
    """Refuse, naming the path, an interpreter or virtualenv that isolated pods cannot see: each
    pod would otherwise fail at its first line (`exec: .../python3: not found` in every pod's
    log)."""
    for path in (python, os.path.realpath(python), prefix, os.path.realpath(prefix)):
        for private in POD_PRIVATE_DIRS:
            if path == private or path.startswith(private + "/"):
                raise RuntimeError(
                    f"the pod rehearsal cannot start pods from {path}: each pod mounts a disk of "
                    f"its own on {private}, so the Python that runs the tests must live outside "
                    f"{', '.join(POD_PRIVATE_DIRS)} (make the virtualenv elsewhere)"
                )


class PodLauncher:
    """Makes pods on one network, with one log directory and the env every pod shares."""

    def __init__(
        self,
        network: Network | LoopbackNetwork,
        repo: str,
        logs_dir: str | os.PathLike,
        env: dict[str, str],
        scratch_dir: str | os.PathLike | None = None,
    ) -> None:
        if network.isolated:
            check_interpreter_visible()
        self.network, self.repo = network, os.path.abspath(repo)
        self.logs_dir = Path(logs_dir)
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self.scratch_dir = Path(scratch_dir or self.logs_dir.parent / "pod-disks")
        self.env = dict(env)
        self.masks = image_masks(self.repo)
        self.count = 0
        self.pods: list[Pod] = []
        self._lock = threading.Lock()
        self._closed = False

    @property
    def isolated(self) -> bool:
        return self.network.isolated

    def pod(self, label: str, args: Sequence[str], env: dict[str, str] | None = None) -> Pod:
        """A new pod (not started) running `python -m tests.rehearsal.pod_main *args`, with
        `env` added to what every pod gets."""
        with self._lock:
            self.count += 1
            count = self.count
        name = f"{re.sub(r'[^a-z0-9]+', '-', label.lower()).strip('-')[:40]}-{count}"
        host = self.network.add_host(name)
        log_path = self.logs_dir / f"{count:02d}-{name}.log"
        python = [sys.executable, "-m", "tests.rehearsal.pod_main", *args]
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
            "PYTHONDONTWRITEBYTECODE": "1",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "MLFLOW_DISABLE_TELEMETRY": "true",
            "AWS_EC2_METADATA_DISABLED": "true",
            **self.env,
            **(env or {}),
            "RELAX_POD_IP": host.ip,
            "RELAX_POD_NAME": name,
        }
        if self.isolated:
            env.update(HOME="/tmp/home", TMPDIR="/tmp", XDG_CACHE_HOME="/tmp/cache")
            command = [*self.network.exec_prefix(host), "unshare", "--mount", "--uts", "--pid"]
            command += ["--fork", "--kill-child", "--mount-proc", "--propagation", "private"]
            command += ["--", "/bin/sh", "-c", POD_SCRIPT, "pod-init", self.repo, name, host.ip]
            command += [" ".join(self.masks), DISK_SIZE, *python]
            disk = None
        else:
            disk = self.scratch_dir / name
            self._copy_image(disk / "image")
            for sub in ("home", "tmp", "cache"):
                (disk / sub).mkdir(parents=True)
            env.update(
                HOME=str(disk / "home"),
                TMPDIR=str(disk / "tmp"),
                XDG_CACHE_HOME=str(disk / "cache"),
                PYTHONPATH=str(disk / "image"),
            )
            command = python
        return Pod(name, command, env, log_path, host, disk, self)

    def _copy_image(self, target: Path) -> None:
        target.mkdir(parents=True)
        for rel in image_files(self.repo):
            src = os.path.join(self.repo, rel)
            if not os.path.isfile(src):
                continue  # deleted in the work tree but still tracked
            dst = target / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)

    def _started(self, pod: Pod, start: Callable[[], None]) -> None:
        """Start `pod` unless kill_all has begun: a pod never escapes it."""
        with self._lock:
            if self._closed:
                raise PodError(f"pod {pod.name} not started: the launcher's pods were killed")
            start()
            self.pods.append(pod)

    def kill_all(self) -> None:
        """Kill every running pod; until reopen() no pod starts."""
        with self._lock:
            self._closed = True
            pods = list(self.pods)
        for pod in pods:
            if pod.process is not None and pod.process.poll() is None:
                pod.kill()

    def reopen(self) -> None:
        with self._lock:
            self._closed = False

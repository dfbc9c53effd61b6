"""Drive a workflow pod by pod, as a Flyte cluster would, with fault injection.

    result = Rehearsal(launcher, storage_root, watch, faults=[kill_after("rl_steps",
                       newer_checkpoint())]).run(workflows.train.train, {"cfg": cfg_dict})

graph.py walks the workflow's compiled nodes; for each one this module starts a pod:
- a task: one pod running it; its outputs are checked (outputs.py: no local path may leave a
  pod) and handed to the nodes that bind them;
- a @dynamic: a pod runs the dynamic's body, which reads storage and returns the graph it built
  (pod_main.record_plan); its calls then run as pods, each as soon as the calls it binds have
  finished, so calls without edges (async_roles' services) run side by side. The dynamic is done
  when the call it returns has finished and every other call has ended on its own within
  `grace_s` (services watch control/stop); one that hangs fails the rehearsal.
A fault (`kill_after(task, when)`) SIGKILLs the matching pod once `when(pod, inputs, watch)`
holds and reruns the task with the same inputs in a fresh pod, as Flyte's retry does. A pod that
fails by itself fails the rehearsal at once, with its log's tail, and every pod still running is
killed.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tests.rehearsal import graph
from tests.rehearsal.outputs import check_outputs
from tests.rehearsal.pods import Pod, PodError, PodLauncher, image_files

Condition = Callable[[Pod, dict[str, Any], "StorageWatch | None"], bool]
POLL_S = 0.5
log = logging.getLogger(__name__)


class RehearsalError(RuntimeError):
    """The workflow did not complete as a cluster would run it; the message says where."""


class StorageWatch:
    """The driver's view of the object store (an s3fs filesystem whose sockets open in the
    rehearsal network, `NamespaceRunner.loop`)."""

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    def ls(self, url: str) -> list[str]:
        self.fs.invalidate_cache()
        try:
            return [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(url, detail=False)]
        except FileNotFoundError:
            return []

    def exists(self, url: str) -> bool:
        self.fs.invalidate_cache()
        return self.fs.exists(url)


@dataclass
class Fault:
    task: str
    """Short task name (`rl_steps`, `trainer_service`)."""
    when: Condition
    occurrence: int = 1
    """The first pod of that task the fault watches (1 = the first started); it stays armed for
    later pods until `when` has held once, so a pod that finishes too soon does not waste it."""
    fired: bool = False


def kill_after(task: str, when: Condition, occurrence: int = 1) -> Fault:
    return Fault(task, when, occurrence)


def after_seconds(seconds: float) -> Condition:
    return lambda pod, inputs, watch: time.monotonic() - pod.started_at >= seconds


def newer_checkpoint(input_name: str = "checkpoint") -> Condition:
    """Holds once the run directory of the pod's input checkpoint (in storage) holds a later
    `step_NNNNNN` with its state.json: the task has committed progress of its own."""

    def holds(pod: Pod, inputs: dict[str, Any], watch: StorageWatch | None) -> bool:
        start = str(inputs[input_name])
        if watch is None or "://" not in start:
            raise RehearsalError(
                f"cannot watch {start!r} for a newer checkpoint: not a URL in the object store"
            )
        run_dir, _, name = start.rstrip("/").rpartition("/")
        version = int(re.fullmatch(r"step_(\d+)", name)[1])
        later = [
            n for n in watch.ls(run_dir) if re.fullmatch(r"step_\d+", n) and int(n[5:]) > version
        ]
        return any(watch.exists(f"{run_dir}/{n}/state.json") for n in later)

    return holds


@dataclass
class PodRecord:
    pod: str
    task: str
    outputs: dict[str, Any] | None
    killed: bool
    log: str
    wall_s: float


@dataclass
class RehearsalResult:
    outputs: dict[str, Any]
    pods: list[PodRecord]
    logs_dir: str
    plans: list[dict[str, Any]] = field(default_factory=list)

    def pods_of(self, task: str) -> list[PodRecord]:
        return [r for r in self.pods if r.task == task]


class Rehearsal:
    def __init__(
        self,
        launcher: PodLauncher,
        storage_root: str,
        watch: StorageWatch | None = None,
        faults: list[Fault] = (),
        pod_timeout_s: float = 900.0,
        grace_s: float = 60.0,
        check_outputs: bool = True,
    ) -> None:
        self.launcher, self.storage_root, self.watch = launcher, storage_root, watch
        self.faults = list(faults)
        self.pod_timeout_s, self.grace_s = pod_timeout_s, grace_s
        self.check_outputs = check_outputs
        self.image = set(image_files(launcher.repo))
        self.config_texts: set[str] = set()
        self.records: list[PodRecord] = []
        self.plans: list[dict[str, Any]] = []
        self._started: dict[str, int] = {}
        self._lock = threading.Lock()
        self.execution_id = f"rh{secrets.token_hex(4)}"
        self.flyte_env: dict[str, str] = {}

    def run(self, workflow: Any, inputs: dict[str, Any]) -> RehearsalResult:
        # What Kubernetes and Flyte set in every task pod of a cluster execution (the tasks tell
        # a cluster run from a local one by KUBERNETES_SERVICE_HOST).
        self.flyte_env = {
            "KUBERNETES_SERVICE_HOST": "10.96.0.1",
            "KUBERNETES_SERVICE_PORT": "443",
            "FLYTE_INTERNAL_EXECUTION_ID": self.execution_id,
            "FLYTE_INTERNAL_EXECUTION_PROJECT": "rehearsal",
            "FLYTE_INTERNAL_EXECUTION_DOMAIN": "development",
            "FLYTE_INTERNAL_EXECUTION_WORKFLOW": workflow.name,
            "FLYTE_INTERNAL_TASK_VERSION": "rehearsal",
        }
        try:
            outputs = graph.walk_workflow(workflow, inputs, self.run_entity)
        finally:
            self.launcher.kill_all()  # nothing of this run outlives it, on failure above all
            self.launcher.reopen()
        return RehearsalResult(outputs, self.records, str(self.launcher.logs_dir), self.plans)

    def call(self, function: str, inputs: dict[str, Any], label: str = "") -> Any:
        """`module:function(**inputs)` of the test suite in a fresh pod (an operator's job such
        as the queue audit); returns its result."""
        label = label or function.rsplit(":", 1)[-1]
        pod = self.launcher.pod(label, ["call", function, json.dumps(inputs)], self.flyte_env)
        pod.start()
        self.records.append(PodRecord(pod.name, label, None, False, str(pod.log_path), 0.0))
        outputs = pod.wait(self.pod_timeout_s)
        self.records[-1].outputs, self.records[-1].wall_s = outputs, pod.wall_s
        return outputs["o0"]

    # ----------------------------------------------------------------------- one node

    def run_entity(self, entity: Any, inputs: dict[str, Any]) -> dict[str, Any]:
        outputs = self.run_pod(entity.name, inputs)
        if "plan" not in outputs:
            return outputs
        plan = outputs["plan"]
        self.plans.append({"dynamic": entity.name, **plan})
        return self.run_plan(entity, plan)

    def run_pod(self, name: str, inputs: dict[str, Any]) -> dict[str, Any]:
        """Run task `name` in a pod until an attempt finishes; a faulted attempt is retried."""
        short = name.rsplit(".", 1)[-1]
        while True:
            with self._lock:
                self._started[short] = self._started.get(short, 0) + 1
                occurrence = self._started[short]
                fault = next(
                    (f for f in self.faults if f.task == short and not f.fired
                     and occurrence >= f.occurrence),
                    None,
                )  # fmt: skip
            args = ["task", name, json.dumps(inputs)]
            pod = self.launcher.pod(short, args, self.flyte_env).start()
            record = PodRecord(pod.name, short, None, False, str(pod.log_path), 0.0)
            self.records.append(record)
            try:
                outputs = self._watch(pod, inputs, fault)
            finally:
                record.killed, record.wall_s = pod.killed, pod.wall_s
            if outputs is None:  # killed by the fault: a fresh pod, the same inputs
                continue
            record.outputs = outputs
            if "plan" not in outputs and self.check_outputs:
                self.config_texts.update(
                    v for k, v in outputs.items() if k == "cfg_json" and isinstance(v, str)
                )
                check_outputs(
                    f"{short} (pod {pod.name}, log {pod.log_path})",
                    outputs,
                    self.storage_root,
                    self.image,
                    self.config_texts,
                )
            return outputs

    def _watch(self, pod: Pod, inputs: dict[str, Any], fault: Fault | None) -> dict | None:
        deadline = pod.started_at + self.pod_timeout_s
        while pod.poll() is None:
            if fault is not None and not fault.fired and self._holds(fault, pod, inputs):
                fault.fired = True
                pod.kill()
                return None
            if time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
        return pod.wait(max(0.0, deadline - time.monotonic()))

    def _holds(self, fault: Fault, pod: Pod, inputs: dict[str, Any]) -> bool:
        try:
            return fault.when(pod, inputs, self.watch)
        except RehearsalError:
            raise
        except Exception as exc:  # a storage hiccup while watching: look again next poll
            log.warning("fault condition for %s failed: %r", pod.name, exc)
            return False

    # ----------------------------------------------------------------------- a dynamic's graph

    def run_plan(self, entity: Any, plan: dict[str, Any]) -> dict[str, Any]:
        calls, output = plan["calls"], plan["output"]
        target = output["$ref"][0] if "$ref" in output else None
        results: list[dict[str, Any] | None] = [None] * len(calls)
        futures: dict[int, concurrent.futures.Future] = {}
        pool = concurrent.futures.ThreadPoolExecutor(max(1, len(calls)), "plan")
        target_done_at: float | None = None
        try:
            while True:
                for i, call in enumerate(calls):
                    waits = graph.plan_refs(call["inputs"])
                    if i not in futures and all(results[j] is not None for j in waits):
                        inputs = {
                            k: graph.plan_value(v, results) for k, v in call["inputs"].items()
                        }
                        futures[i] = pool.submit(self.run_entity_by_name, call["task"], inputs)
                for i, f in futures.items():
                    if results[i] is None and f.done():
                        results[i] = f.result()  # a failed call raises here
                pending = [f for i, f in futures.items() if results[i] is None]
                if not pending and len(futures) == len(calls):
                    break
                if not pending:
                    continue  # what they waited for has finished: start them
                if target is not None and target_done_at is None and results[target] is not None:
                    target_done_at = time.monotonic()
                if target_done_at and time.monotonic() - target_done_at > self.grace_s:
                    hung = [calls[i]["task"] for i, f in futures.items() if not f.done()]
                    raise RehearsalError(
                        f"{entity.name}: {hung} did not end within {self.grace_s:.0f} s after "
                        f"{calls[target]['task']} finished (they should stop on control/stop)"
                    )
                concurrent.futures.wait(
                    pending, timeout=POLL_S, return_when=concurrent.futures.FIRST_COMPLETED
                )
        except BaseException:
            self.launcher.kill_all()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        names = list(entity.python_interface.outputs)
        return {names[0]: graph.plan_value(output, results)} if names else {}

    def run_entity_by_name(self, name: str, inputs: dict[str, Any]) -> dict[str, Any]:
        from tests.rehearsal.pod_main import resolve

        return self.run_entity(resolve(name), inputs)


__all__ = [
    "Fault",
    "PodError",
    "Rehearsal",
    "RehearsalError",
    "RehearsalResult",
    "StorageWatch",
    "after_seconds",
    "kill_after",
    "newer_checkpoint",
]

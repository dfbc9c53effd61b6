"""Drive a workflow pod by pod, as a Flyte cluster would, with fault injection.

    result = Rehearsal(launcher, storage_root, watch, faults=[kill_after("rl_steps",
                       newer_checkpoint())], registration=package).run(train, {"cfg": cfg})

graph.py walks the workflow's compiled nodes; for each one this module starts a pod:
- a task: one pod running it; its outputs are checked (outputs.py: no local path may leave a
  pod) and handed to the nodes that bind them;
- a @dynamic: a pod compiles the dynamic as a cluster's would (pod_main.record_plan) and returns
  the DynamicJobSpec; a node in it whose resources propeller would clamp to the cluster's limits
  fails the rehearsal (flyte_rules.clamp_problems); its nodes then run as pods, each as soon as
  the nodes it binds have finished, so nodes without edges (async_roles' services) run side by
  side. The dynamic is done when the node it returns has finished and every other node has
  ended on its own within `grace_s` (services watch control/stop); one that hangs fails the
  rehearsal.
Before the first pod, a `registration` (registration.register: the workflows serialized as
`pyflyte package` does) is checked against the cluster's `limits` as flyteadmin would, and the
workflow's nodes take their timeouts and retries from it.

Each node's timeout T is enforced as propeller does (flyte_rules.Deadlines): an attempt still
running at T from its start is killed and, while the node's retries last, run again in a fresh
pod; at 2T from the node's first start the node fails whatever retries are left ("Timeout in
node"), and so does the rehearsal. A @dynamic's deadlines cover the nodes it started too. No timeout, no deadline.
A fault (`kill_after(task, when)`) SIGKILLs the matching pod once `when(pod, inputs, watch)`
holds and reruns the task with the same inputs in a fresh pod, as Flyte's retry of a lost pod
does (a system failure: it spends none of the node's retries). A pod that fails by itself fails
the rehearsal at once, with its log's tail, and every pod still running is killed.
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

from relax_core.ops.flyte_plan import RECOMMENDED, Limits
from tests.rehearsal import graph
from tests.rehearsal.flyte_rules import Deadlines, SilentClamp, clamp_problems
from tests.rehearsal.outputs import check_outputs
from tests.rehearsal.pod_main import resolve
from tests.rehearsal.pods import Pod, PodError, PodLauncher, image_files
from tests.rehearsal.registration import Package

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
    timed_out: bool = False
    """Killed at the node's timeout (an execution deadline), not by a fault."""


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
        registration: Package | None = None,
        limits: Limits = RECOMMENDED,
    ) -> None:
        self.launcher, self.storage_root, self.watch = launcher, storage_root, watch
        self.faults = list(faults)
        self.pod_timeout_s, self.grace_s = pod_timeout_s, grace_s
        self.check_outputs = check_outputs
        self.registration, self.limits = registration, limits
        self._registered: dict[int, Any] = {}
        self.image = set(image_files(launcher.repo))
        self.config_texts: set[str] = set()
        self.records: list[PodRecord] = []
        self.plans: list[dict[str, Any]] = []
        self._started: dict[str, int] = {}
        self._lock = threading.Lock()
        self.execution_id = f"rh{secrets.token_hex(4)}"
        # What Kubernetes and Flyte set in every task pod of a cluster execution (the tasks tell
        # a cluster run from a local one by KUBERNETES_SERVICE_HOST); run() adds the workflow.
        self.flyte_env: dict[str, str] = {
            "KUBERNETES_SERVICE_HOST": "10.96.0.1",
            "KUBERNETES_SERVICE_PORT": "443",
            "FLYTE_INTERNAL_EXECUTION_ID": self.execution_id,
            "FLYTE_INTERNAL_EXECUTION_PROJECT": "rehearsal",
            "FLYTE_INTERNAL_EXECUTION_DOMAIN": "development",
            "FLYTE_INTERNAL_TASK_VERSION": "rehearsal",
        }

    def run(self, workflow: Any, inputs: dict[str, Any]) -> RehearsalResult:
        self.flyte_env["FLYTE_INTERNAL_EXECUTION_WORKFLOW"] = workflow.name
        if self.registration is not None:
            self.registration.check(self.limits)
            registered = self.registration.node_metadata(workflow.name)
            self._registered = {
                id(n): registered[n.id] for n in workflow.nodes if n.id in registered
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

    def run_entity(self, entity: Any, inputs: dict[str, Any], node: Any = None) -> dict[str, Any]:
        """Run one node of `entity`; `node` (a compiled or serialized Node) carries its timeout
        and retries, the registered workflow's where there is one."""
        metadata = self._registered.get(id(node), getattr(node, "metadata", None))
        if metadata is None:
            metadata = entity.construct_node_metadata()
        deadlines = Deadlines.of(entity.name.rsplit(".", 1)[-1], metadata)
        outputs = self.run_pod(entity.name, inputs, deadlines)
        if "plan" not in outputs:
            return outputs
        job, message, literal_outputs = graph.decode_plan(outputs["plan"])
        if job is None:
            return literal_outputs
        short = entity.name.rsplit(".", 1)[-1]
        self.plans.append({"dynamic": short, "job": job})
        problems = clamp_problems(short, message, self.limits)
        if problems:
            raise SilentClamp(
                f"{short} starts nodes whose resources propeller would lower to the cluster's "
                f"limits without failing them:\n  - " + "\n  - ".join(problems)
            )
        return self.run_plan(entity, job, deadlines)

    def run_pod(
        self, name: str, inputs: dict[str, Any], deadlines: Deadlines | None = None
    ) -> dict[str, Any]:
        """Run task `name` in a pod until an attempt finishes. An attempt killed by a fault is
        run again; one killed at its timeout too, while the node's retries last."""
        short = name.rsplit(".", 1)[-1]
        deadlines = deadlines or Deadlines(short)
        attempt = failures = 0
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
            env = {**self.flyte_env, "FLYTE_ATTEMPT_NUMBER": str(attempt)}
            pod = self.launcher.pod(short, args, env).start()
            deadlines.started(pod.started_at)
            attempt += 1
            record = PodRecord(pod.name, short, None, False, str(pod.log_path), 0.0)
            self.records.append(record)
            try:
                outputs = self._watch(pod, inputs, fault, deadlines)
            finally:
                record.killed, record.wall_s = pod.killed, pod.wall_s
            if outputs is _FAULTED:  # a lost pod: a fresh pod, the same inputs
                continue
            if outputs is _TIMED_OUT:
                record.timed_out = True
                failures += 1
                if failures > deadlines.retries:
                    raise RehearsalError(
                        f"{short}: RetriesExhausted|TimeoutExpired: attempt {attempt} ran past "
                        f"its timeout T = {deadlines.timeout_s:g} s and its "
                        f"{deadlines.retries} retries are spent (pod {pod.name}, log "
                        f"{pod.log_path})"
                    )
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

    def _watch(
        self, pod: Pod, inputs: dict[str, Any], fault: Fault | None, deadlines: Deadlines
    ) -> Any:
        """The pod's outputs, _FAULTED or _TIMED_OUT (the pod killed); RehearsalError at the
        node's active deadline."""
        deadline = pod.started_at + self.pod_timeout_s
        while pod.poll() is None:
            now = time.monotonic()
            if deadlines.active_expired(now):  # checked first: terminal, whatever else holds
                pod.kill()
                raise RehearsalError(
                    deadlines.active_expiry(f" (pod {pod.name}, log {pod.log_path})")
                )
            if deadlines.execution_expired(now):
                pod.kill()
                return _TIMED_OUT
            if fault is not None and not fault.fired and self._holds(fault, pod, inputs):
                fault.fired = True
                pod.kill()
                return _FAULTED
            if now > deadline:
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

    def run_plan(self, entity: Any, job: Any, deadlines: Deadlines) -> dict[str, Any]:
        """Run a DynamicJobSpec's nodes, each once the nodes it binds have finished, within the
        dynamic's own deadlines."""
        nodes = {n.id: n for n in job.nodes}
        tasks = {t.id.name: t for t in job.tasks}
        targets = {b.binding.promise.node_id for b in job.outputs if b.binding.promise}
        results: dict[str, dict[str, Any]] = {}
        futures: dict[str, concurrent.futures.Future] = {}
        pool = concurrent.futures.ThreadPoolExecutor(max(1, len(nodes)), "plan")
        targets_done_at: float | None = None
        try:
            while True:
                for node_id, node in nodes.items():
                    if node_id not in futures and graph.upstream(node) <= set(results):
                        task = node.task_node.reference_id.name
                        if task not in tasks:
                            raise graph.GraphError(f"{entity.name}: no template for {task}")
                        inputs = graph.bindings(node, results)
                        futures[node_id] = pool.submit(self._run_node, task, inputs, node)
                for node_id, f in futures.items():
                    if node_id not in results and f.done():
                        results[node_id] = f.result()  # a failed node raises here
                pending = [f for i, f in futures.items() if i not in results]
                if not pending and len(futures) == len(nodes):
                    break
                if not pending:
                    continue  # what they waited for has finished: start them
                now = time.monotonic()
                if deadlines.active_expired(now):
                    raise RehearsalError(deadlines.active_expiry(" while the nodes it started ran"))
                if deadlines.execution_expired(now):
                    # Propeller would fail this attempt and rerun the dynamic, its nodes anew;
                    # the rehearsal stops here: a timeout that fires is a defect of its own.
                    raise RehearsalError(
                        f"{deadlines.node}: the nodes it started ran past its timeout T = "
                        f"{deadlines.timeout_s:g} s (a dynamic's deadlines cover its nodes)"
                    )
                if targets and targets_done_at is None and targets <= set(results):
                    targets_done_at = now
                if targets_done_at and now - targets_done_at > self.grace_s:
                    hung = [
                        nodes[i].task_node.reference_id.name for i, f in futures.items()
                        if not f.done()
                    ]  # fmt: skip
                    raise RehearsalError(
                        f"{entity.name}: {hung} did not end within {self.grace_s:.0f} s after "
                        f"{sorted(targets)} finished (they should stop on control/stop)"
                    )
                concurrent.futures.wait(
                    pending, timeout=POLL_S, return_when=concurrent.futures.FIRST_COMPLETED
                )
        except BaseException:
            self.launcher.kill_all()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        return graph.outputs_of_plan(job, results)

    def _run_node(self, task: str, inputs: dict[str, Any], node: Any) -> dict[str, Any]:
        return self.run_entity(resolve(task), inputs, node)


_FAULTED, _TIMED_OUT = object(), object()


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

"""The rollout service of an async run: admit groups under the staleness bound, generate, score,
append to the `rollout` stage (the step itself is rollout.py, or episodes.py for an agentic run).

Parts: the AdmissionLedger (tickets: ticket i is prompt i of the stream), the engine this worker
drives (a torch engine in this process, or an SGLang or vLLM server it started, found in its pod
or was given by URL: rollout_servers.py; `pool/engine_weights.py` keeps its weights current) and
the pool's drain requests.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from relax_core.queue.pruning import summaries
from relax_core.roles.rollout import informative_groups, rollout_groups
from relax_core.roles.rollout_servers import own_server, served_engine
from relax_core.rollout.engine import SamplingParams
from relax_core.storage import local_cache
from relax_core.train.agent_failures import first_failure

log = logging.getLogger(__name__)


def serve(ctx) -> None:
    """The rollout service: admit groups under the staleness bound, generate, score, append.

    Groups are numbered by admission tickets (`AdmissionLedger`), and ticket i is prompt i of the
    dataset stream, so several workers and a restarted worker hand out every prompt once. New
    weights arrive in the background; they are applied between generate calls, or between
    decode steps with `rollout.partial_rollout`.

    Elastic pool (`engines.py`): an engine added by scaling out (a worker number past the
    config's `rollout_workers`) takes no work before it holds the trainer's weights. An engine
    asked to drain admits nothing more, commits what it admitted (and what a dead process of it
    had admitted), and exits 0.

    Dynamic sampling (`rollout.dynamic_sampling`, DAPO): only groups whose rewards differ are
    committed; the others are recorded as dropped (`AdmissionLedger.record_dropped`), which frees
    their admission slots for fresh prompts and tells the trainer not to wait for them. See
    `DynamicSampling` for the metrics and the bound on redraws.
    """
    import contextlib

    from relax_core.pool.engines import drain_requested, pool_entry, withdraw_server
    from relax_core.queue import AdmissionLedger, rows_to_table
    from relax_core.rewards.registry import build_reward
    from relax_core.roles.cores import CoreShare
    from relax_core.roles.episodes import env_runner
    from relax_core.roles.media import prompt_source
    from relax_core.roles.service import set_threads
    from relax_core.train.checkpoint import read_state

    cfg, s, r = ctx.cfg, ctx.cfg.services, ctx.cfg.rollout
    set_threads(s.rollout_threads)
    entry = pool_entry(cfg, ctx.queue, ctx.name) if ctx.worker >= s.rollout_workers else None
    url = (entry or {}).get("url")
    server = None
    if url:
        engine, weights, tokenizer = served_engine(ctx, url)
    elif r.engine in ("sglang", "vllm"):
        url, server = own_server(ctx, read_state(ctx.checkpoint))
        engine, weights, tokenizer = served_engine(ctx, url)
    else:
        engine, weights, tokenizer = _local_engine(ctx, read_state(ctx.checkpoint))
    # Joining waits for the trainer (still importing, opening its MLflow run); generation under
    # the checkpoint's weights need not wait for it.
    weights.start()
    apply_pending = weights.apply_pending
    if r.partial_rollout:
        engine.weight_poll = apply_pending
    reward_fn = build_reward(
        cfg.reward,
        cache_dir=local_cache(cfg, "hf"),
        dtype=cfg.model.dtype,
        seed=cfg.seed,
    )
    prompts = prompt_source(cfg, "train", engine.model if not url else None, tokenizer, ctx.queue)
    env = env_runner(cfg, engine.model if not url else None, tokenizer)
    ledger = AdmissionLedger(ctx.queue)
    # Blocks an earlier process of this worker admitted but never committed (it died): void
    # them and generate their prompts again, so the trainer neither waits for them nor loses them.
    committed = committed_blocks(ctx.queue)
    redo = ledger.reclaim(ctx.name, set(committed))
    _record_missing_drops(ledger, ctx.name, committed)
    sampler = (
        DynamicSampling(r.groups_per_step, r.max_sampling_rounds) if r.dynamic_sampling else None
    )
    if redo:
        log.warning(
            "%s: generating %d groups again that a dead process had admitted",
            ctx.name,
            sum(n for _, n in redo),
        )
    params = SamplingParams(r.max_new_tokens, r.temperature, r.top_p)
    chunk = s.rollout_batch_groups or r.groups_per_step
    cores = CoreShare.from_env(ctx.name)
    drain = _Throttled(lambda: drain_requested(ctx.queue, ctx.name), _DRAIN_CHECK_S)
    if ctx.worker >= s.rollout_workers:
        # Added by scaling out: its checkpoint's weights may be many versions old.
        ctx.status["state"] = "waiting for the trainer's weights"
        ctx.beat()
        while not ctx.stopped() and not drain() and not weights.holds_trainer_weights():
            weights.wait(0.05)
    ctx.status["taking_work"] = True
    ctx.beat()  # the supervisor marks a new engine active on this beat
    waited, wait_start = 0.0, None
    drained = False
    try:
        while not ctx.stopped():
            if not redo and drain():
                drained = True
                break
            apply_pending()
            stream_first = redo[0][0] if redo else None
            version = engine.version  # the block's admission version
            first, count = ledger.try_admit(
                min(chunk, redo[0][1]) if redo else chunk,
                version,
                r.max_staleness,
                r.groups_per_step,
                worker=ctx.name,
                stream_first=stream_first,
            )
            if count == 0:
                if wait_start is None:
                    wait_start = time.perf_counter()
                    ctx.status["state"] = f"at the staleness bound ({first} groups started)"
                    ctx.beat()  # waiting is news: `relax queue` shows it now, not a beat later
                weights.wait(0.05)
                continue
            if wait_start is not None:
                waited += time.perf_counter() - wait_start
                wait_start = None
            stream = ledger.stream_first
            if redo:
                redo[0] = (redo[0][0] + count, redo[0][1] - count)
                if redo[0][1] == 0:
                    redo.pop(0)
            ctx.status["state"] = f"generating groups {first}..{first + count - 1}"
            busy = cores.busy(s.rollout_threads) if cores else contextlib.nullcontext()
            with busy:
                items = prompts.at(stream, count)
                if env is not None:
                    rows, metrics = env.rollout(engine, items, params, r.n_samples_per_prompt)
                else:
                    rows, metrics = rollout_groups(
                        engine,
                        tokenizer,
                        items,
                        params,
                        r.n_samples_per_prompt,
                        reward_fn,
                        cfg.reward.overlong_buffer,
                        cfg.reward.overlong_penalty,
                    )
            metrics["perf/rollout_wait_s"] = waited
            waited = 0.0
            dropped: list[str] = []
            if sampler is not None:
                rows, dropped, metrics = sampler.split(rows, metrics)
            if rows:
                ctx.queue.put(
                    "rollout",
                    rows_to_table(rows),
                    {
                        "policy_version": engine.version,
                        "admitted_version": version,  # its tickets' (ready_pool.py counts by it)
                        "tickets": [first, count],
                        "stream": [stream, count],
                        "worker": ctx.name,
                        "metrics": metrics,
                        **({"dropped": dropped} if dropped else {}),
                    },
                )
            # After the commit: a block that reached the stage is never voided by `reclaim`.
            ledger.record_dropped(first, dropped, version, ctx.name)
            if sampler is not None:
                sampler.check()
    finally:
        weights.close(drained, s.start_timeout_s)
        if server is not None:
            withdraw_server(ctx.queue, ctx.name)
            server.stop()
    if drained:
        log.info("%s drained: every group it admitted is committed", ctx.name)
        ctx.status["state"] = "drained"
        ctx.status["taking_work"] = False


_DRAIN_CHECK_S = 0.5


def _local_engine(ctx, state: dict[str, Any]):
    """A torch engine on the checkpoint's policy, fed by the trainer's weight transport."""
    from relax_core.models.lora import synced_weights
    from relax_core.models.policy import load_policy, on_accelerator
    from relax_core.models.precision import computing_as_trainer
    from relax_core.pool.engine_weights import LocalWeights
    from relax_core.pool.weights import make_receiver
    from relax_core.rollout.torch_engine import TorchEngine
    from relax_core.sync.buckets import specs_of

    cfg = ctx.cfg
    model, tokenizer = load_policy(ctx.checkpoint, cfg.model.dtype)
    specs = specs_of(synced_weights(model))  # what the trainer publishes (float32 weights)
    model = on_accelerator(computing_as_trainer(model, cfg.model.matmul_dtype))
    if cfg.train.routing_replay:  # the engine records the experts the trainer replays
        from relax_core.models.routing_replay import attach_routing_replay

        attach_routing_replay(model)
    version = int(state["policy_version"])
    # Distinct sampling streams per worker and per (re)start version.
    engine = TorchEngine(
        model,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        seed=cfg.seed * 1_000_003 + ctx.worker * 7919 + version,
    )
    engine.version = version
    receiver = make_receiver(cfg, ctx.queue, specs, "rollout", ctx.worker)
    return engine, LocalWeights(engine, receiver, ctx.status), tokenizer


class _Throttled:
    """A check that asks storage at most every `every_s` seconds; True stays True."""

    def __init__(self, check, every_s: float) -> None:
        self.check, self.every_s = check, every_s
        self.last, self.value = float("-inf"), False

    def __call__(self) -> bool:
        now = time.monotonic()
        if not self.value and now - self.last >= self.every_s:
            self.last = now
            self.value = bool(self.check())
        return self.value


def committed_blocks(queue) -> dict[int, dict]:
    """The blocks committed to the rollout stage: first ticket -> the entry's meta, or for an
    entry retention deleted, what its summary kept (worker, dropped groups)."""
    blocks = {}
    for seq in queue.committed("rollout"):
        try:
            meta = queue.record("rollout", seq).get("meta") or {}
        except Exception:  # noqa: BLE001 - an unreadable record is quarantined by its reader
            continue
        if meta.get("tickets"):
            blocks[int(meta["tickets"][0])] = meta
    # Read after the records: an entry deleted since the listing is in a summary by now.
    for summary in summaries(queue.store, "rollout"):
        for first, block in (summary.get("blocks") or {}).items():
            blocks.setdefault(int(first), block)
    return blocks


def _record_missing_drops(ledger, worker: str, committed: dict[int, dict]) -> None:
    """Record the dropped groups of this worker's committed blocks that a dead process of it
    committed but died before recording as dropped (else the trainer waits for them)."""
    from relax_core.queue.admission import VOID

    missing = {
        first: meta["dropped"]
        for first, meta in committed.items()
        if meta.get("dropped") and meta.get("worker") == worker
    }
    if not missing:
        return
    recorded = {int(n) for n in ledger.queue.store.list_dir(VOID) if n.isdigit()}
    blocks = None
    for first, group_ids in sorted(missing.items()):
        if first not in recorded:
            blocks = blocks if blocks is not None else ledger.blocks()
            ledger.record_dropped(first, group_ids, int(blocks[first]["policy_version"]), worker)


class DynamicSampling:
    """DAPO dynamic sampling for one rollout worker of an async run: keep the groups whose
    rewards differ, drop the others (their prompts are consumed, as in colocate), and count.

    Metrics, with colocate's names, ride on the next entry this worker commits (a draw that
    kept nothing commits no entry, so its counts and times carry over):
    `rollout/filtered_groups` (groups drawn and dropped) and `rollout/sampling_rounds` (draws,
    i.e. generate calls, the entry stands for); groups kept are the entry's groups.

    Redraws are bounded like colocate's (a step of `max_sampling_rounds` rounds of at most
    `groups_per_step` prompts that keeps nothing fails the run): `check` raises once
    `max_sampling_rounds * groups_per_step` groups in a row were dropped, so a task where every
    group scores the same fails naming the setting instead of drawing forever.
    """

    CARRIED = (
        "perf/generate_s",
        "perf/reward_s",
        "perf/generated_tokens",
        "perf/rollout_wait_s",
        "train/reward_errors",
    )
    """Totals a draw that kept nothing adds to the next committed entry's metrics."""

    def __init__(self, groups_per_step: int, max_sampling_rounds: int) -> None:
        self.groups_per_step, self.max_sampling_rounds = groups_per_step, max_sampling_rounds
        self.in_a_row = 0  # groups dropped since the last group kept
        self.agent_error: str | None = None
        """The first agent error of the latest draw whose every episode failed (agent runs)."""
        self._reset()

    def _reset(self) -> None:
        self.rounds, self.filtered = 0, 0
        self.carried: dict[str, float] = {}

    def split(
        self, rows: list[dict[str, Any]], metrics: dict[str, float]
    ) -> tuple[list[dict[str, Any]], list[str], dict[str, float]]:
        """(rows of the groups kept, ids of the groups dropped, metrics for the kept rows'
        entry); no rows kept means nothing to commit: the metrics carry over to the next."""
        kept = informative_groups(rows)
        kept_ids = {row["group_id"] for row in kept}
        dropped = list(dict.fromkeys(r["group_id"] for r in rows if r["group_id"] not in kept_ids))
        self.rounds += 1
        self.filtered += len(dropped)
        for key in self.CARRIED:
            if key in metrics:
                self.carried[key] = self.carried.get(key, 0.0) + float(metrics[key])
        if not kept:
            self.in_a_row += len(dropped)
            self.agent_error = first_failure(row.get("reward_info") for row in rows)
            return [], dropped, metrics
        self.in_a_row, self.agent_error = 0, None
        out = {
            **metrics,
            **self.carried,
            "rollout/sampling_rounds": float(self.rounds),
            "rollout/filtered_groups": float(self.filtered),
        }
        self._reset()
        return kept, dropped, out

    def check(self) -> None:
        """Raise once too many groups in a row were dropped (see the class docstring)."""
        limit = self.max_sampling_rounds * self.groups_per_step
        if self.in_a_row >= limit:
            raise RuntimeError(
                f"dynamic sampling dropped {self.in_a_row} groups in a row, none with differing "
                f"rewards (limit: rollout.max_sampling_rounds {self.max_sampling_rounds} x "
                f"rollout.groups_per_step {self.groups_per_step}); raise "
                "rollout.max_sampling_rounds or check the reward (every sample scored the same)"
                + (
                    f"; every agent episode of the last draw failed, first: {self.agent_error}"
                    if self.agent_error
                    else ""
                )
            )

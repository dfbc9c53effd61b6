"""The server a rollout worker drives (rollout.engine 'sglang' or 'vllm', or an engine registered
by URL): its own, started here or found in its pod and published for the trainer, or one it was
given; and the engine and weight view the worker drives it through."""

from __future__ import annotations

import logging
import os
from typing import Any

from relax_core.storage import join, local_dir_for

log = logging.getLogger(__name__)


def served_engine(ctx, url: str):
    """An SGLang or vLLM server, driven over HTTP; only the tokenizer is loaded here."""
    from transformers import AutoTokenizer

    from relax_core.pool.engine_weights import ServedWeights
    from relax_core.pool.engines import sglang_synced
    from relax_core.rollout.sglang_engine import SGLangClient, SGLangEngine

    tokenizer = AutoTokenizer.from_pretrained(ctx.checkpoint)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    lora = ctx.cfg.train.lora.rank > 0
    vllm = ctx.cfg.rollout.engine == "vllm"
    if vllm:
        from relax_core.rollout.vllm_engine import served_engine
        from relax_core.rollout.vllm_lora import load_checkpoint_adapter

        engine = served_engine(url, ctx.cfg)
    else:
        from relax_core.rollout.sglang_lora import load_checkpoint_adapter
        from relax_core.rollout.sglang_server import served_context

        engine = SGLangEngine(
            SGLangClient(url, timeout_s=ctx.cfg.services.start_timeout_s),
            ctx.cfg.sglang.pause_mode,
            routed_experts=ctx.cfg.train.routing_replay,
            lora=lora,
            context_len=served_context(ctx.checkpoint, ctx.cfg.sglang.extra_args),
        )
    if lora:  # the server has the base; the policy is the checkpoint's adapter until updated
        from relax_core.train.checkpoint import read_state

        version = int(read_state(ctx.checkpoint)["policy_version"])
        load_checkpoint_adapter(engine.client, ctx.checkpoint, version)
    weights = ServedWeights(engine, lambda: sglang_synced(ctx.queue, ctx.name), ctx.status)
    log.info("%s drives the %s server at %s", ctx.name, "vLLM" if vllm else "SGLang", url)
    return engine, weights, tokenizer


def own_server(ctx, state: dict[str, Any]):
    """rollout.engine 'sglang' (or 'vllm'): this worker's own server (started here, or its pod's
    sidecar), published under control/sglang_servers/ so the trainer adds it to its SGLang
    weight group at its next update. Returns (URL, the server to stop or None)."""
    from relax_core.pool.engines import publish_server
    from relax_core.rollout.sglang_lora import lora_flags, versions_kept
    from relax_core.rollout.sglang_server import attach_or_start

    cfg = ctx.cfg
    ctx.status["state"] = f"starting its {cfg.rollout.engine} server"
    ctx.beat()
    run_dir = local_dir_for(join(cfg.checkpoint.dir, ctx.run_id), cfg.storage.scratch_dir)
    log_path = os.path.join(run_dir, "logs", f"{cfg.rollout.engine}-{ctx.name}.log")
    version = int(state["policy_version"])
    if cfg.rollout.engine == "vllm":
        from relax_core.rollout.vllm_server import attach_or_start as vllm_server
        from relax_core.rollout.vllm_server import launch_flags

        client, server = vllm_server(
            cfg.vllm, ctx.worker, ctx.checkpoint, version, log_path, launch_flags(cfg)
        )
    else:
        replay = bool(getattr(cfg.train, "routing_replay", False))
        lora = lora_flags(cfg.train.lora, versions_kept(cfg))
        client, server = attach_or_start(
            cfg.sglang, ctx.worker, ctx.checkpoint, version, cfg.services.rollout_gpus, log_path,
            routed_experts=replay, lora=lora,
        )  # fmt: skip
    publish_server(ctx.queue, ctx.name, client.url)
    return client.url, server

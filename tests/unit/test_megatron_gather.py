"""Loading shards and streaming full tensors back, with real megatron-core process groups: two
CPU processes over gloo, a tiny GPTModel built on the CPU (its forward needs CUDA, its weights do
not). Each rank reads only the HF tensors its shards are made of; rank 0 alone receives the full
tensors, one parameter alive at a time, in the order `weight_layout` announces.
"""

from __future__ import annotations

import json
import os
import time
import weakref
from pathlib import Path

import pytest
import torch

from tests import needs

needs.module("megatron.core", "pip install -e '.[dev]' (megatron-core 0.16.1 on Python 3.11)")

from relax_core.net import free_port  # noqa: E402
from relax_core.train.megatron.config import MegatronParallel  # noqa: E402
from relax_core.train.megatron.convert import hf_to_megatron, megatron_to_hf_named  # noqa: E402
from tests.unit.test_megatron_convert import dense, moe  # noqa: E402

SPAWN_TIMEOUT_S = 240.0  # all three cases take ~25 s on a loaded 2-core box
CASES = {
    "dense-tp2": (dict(tp=2), "dense"),
    "moe-ep2": (dict(ep=2), "moe"),
    "moe-tp2": (dict(tp=2), "moe"),
}


def _model(kind: str):
    return dense(tied=False) if kind == "dense" else moe(mlp_only_layers=[1])


def _settled_alive(refs: list[weakref.ref]) -> int:
    """How many of the tensors rank 0 was given are still alive. gloo's gather work can hold its
    output tensors a moment after it returns, so a count above one is given 0.5 s to settle."""
    for _ in range(50):
        alive = sum(r() is not None for r in refs)
        if alive <= 1:
            return alive
        time.sleep(0.01)
    return alive


def _worker(rank: int, port: int, checkpoints: dict[str, str], out: str) -> None:
    """Every case in turn in this one process group (a spawn costs seconds of imports apiece)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    for case in sorted(CASES):
        _stream_case(rank, case, checkpoints[CASES[case][1]], out)
    dist.destroy_process_group()


def _stream_case(rank: int, case: str, checkpoint: str, out: str) -> None:
    from megatron.core import parallel_state

    from relax_core.train.megatron import model as model_module
    from relax_core.train.megatron.checkpoint import SafetensorsCheckpoint
    from relax_core.train.megatron.weights import full_param_layout, load_into, stream_full_params

    sizes, kind = CASES[case]
    parallel = MegatronParallel(**sizes)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=1 if parallel.ep > 1 else parallel.tp,
    )
    config, _ = _model(kind)
    # The all-to-all dispatcher makes a CUDA stream when built; the all-gather one has the same
    # parameters and builds on a CPU.
    kwargs = model_module.transformer_config_kwargs
    model_module.transformer_config_kwargs = lambda *a, **k: {
        **kwargs(*a, **k),
        **({"moe_token_dispatcher_type": "allgather"} if kind == "moe" else {}),
    }
    try:
        model, _ = model_module.build_gpt(config, parallel, "float32", "local", 64, cpu_init=True)
    finally:
        model_module.transformer_config_kwargs = kwargs
    reader = SafetensorsCheckpoint(checkpoint)
    asked: list[str] = []
    load_into(model, lambda name: asked.append(name) or reader(name), config, "local")

    layout = [(n, list(t.shape), str(t.dtype)) for n, t in full_param_layout(model, config)]
    got, refs, most_alive = {}, [], 0
    for name, tensor in stream_full_params(model, config):
        got[name] = tensor.clone()
        refs.append(weakref.ref(tensor))
        del tensor
        most_alive = max(most_alive, _settled_alive(refs))
    path = os.path.join(out, f"{case}-rank{rank}")
    torch.save(got, path + ".pt")
    with open(path + ".json", "w") as f:
        json.dump({"asked": asked, "layout": layout, "most_alive": most_alive}, f)
    parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each model kind saved with transformers' save_pretrained (per-expert names on disk)."""
    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

    out = {}
    for kind, cls in (("dense", Qwen3ForCausalLM), ("moe", Qwen3MoeForCausalLM)):
        config, state = _model(kind)
        model = cls(config)
        model.load_state_dict(state)
        out[kind] = str(tmp_path_factory.mktemp(kind))
        model.save_pretrained(out[kind])
    return out


@pytest.fixture(scope="module")
def streamed(checkpoints, tmp_path_factory) -> str:
    """Two ranks that load and stream back every case; the directory of what each rank got."""
    out = tmp_path_factory.mktemp("streamed")
    ranks = torch.multiprocessing.spawn(
        _worker, (free_port("127.0.0.1"), checkpoints, str(out)), nprocs=2, join=False
    )
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not ranks.join(timeout=1.0):  # raises when a rank failed, with its traceback
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail(f"the two ranks did not end within {SPAWN_TIMEOUT_S:.0f} s")
    return str(out)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_shards_load_and_stream_back_to_rank_0(case, streamed):
    _, kind = CASES[case]
    config, hf_state = _model(kind)
    full = {n: t.float() for n, t in hf_to_megatron(hf_state, config, spec="local").items()}
    where = Path(streamed, case)
    ranks = [json.loads(Path(f"{where}-rank{r}.json").read_text()) for r in (0, 1)]
    got = [torch.load(f"{where}-rank{r}.pt", weights_only=True) for r in (0, 1)]

    # Rank 0 gets every full tensor, bit for bit, in the announced order; rank 1 gets none.
    assert list(got[0]) == [n for n, _, _ in ranks[0]["layout"]]
    assert got[0].keys() == full.keys()
    for name, tensor in full.items():
        assert torch.equal(got[0][name], tensor), name
    assert got[1] == {}
    assert [[n, list(t.shape), str(t.dtype)] for n, t in got[0].items()] == ranks[0]["layout"]
    # One full tensor alive at a time on rank 0 (the consumer dropped each one it was given).
    assert ranks[0]["most_alive"] == 1

    # Under expert parallel each rank reads its own experts and no other.
    if CASES[case][0].get("ep", 1) == 2:
        for rank, record in enumerate(ranks):
            experts = {int(n.split(".")[5]) for n in record["asked"] if ".experts." in n}
            assert experts == {2 * rank, 2 * rank + 1}, (rank, experts)


@pytest.mark.parametrize("fused", [False, True])
def test_announced_hf_layout_matches_what_is_streamed(fused):
    # The HF-named layout a weight sync plans with is the same conversion run on meta tensors.
    config, hf_state = moe(mlp_only_layers=[1])
    full = hf_to_megatron(hf_state, config, spec="local")
    meta = ((n, torch.empty(t.shape, dtype=t.dtype, device="meta")) for n, t in full.items())
    announced = [(n, t.shape, t.dtype) for n, t in megatron_to_hf_named(meta, config, fused)]
    streamed = [(n, t.shape, t.dtype) for n, t in megatron_to_hf_named(full.items(), config, fused)]
    assert announced == streamed
    names = {n for n, _, _ in announced}
    assert ("model.layers.0.mlp.experts.gate_up_proj" in names) is fused
    assert ("model.layers.0.mlp.experts.3.down_proj.weight" in names) is not fused

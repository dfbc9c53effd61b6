"""MegatronBackend over two data-parallel ranks (two GPUs, tp=1): each rank runs its share of a
step's micro-batches (rank 1 pads one), yet the step's loss and gradient norm are those of one
rank running all of them, and every rank returns every micro-batch's log-probs."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("megatron.core")

from relax_core.net import free_port  # noqa: E402
from relax_core.train.batch import make_micro_batch  # noqa: E402
from tests.unit.test_megatron_convert import dense  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]


def micro_batches():
    torch.manual_seed(1)
    out = []
    for lengths in ((5, 3), (7, 2), (4, 6)):  # 3 micro-batches over 2 ranks: rank 1 pads one
        prompts = [torch.randint(0, 256, (n,)).tolist() for n in lengths]
        responses = [torch.randint(0, 256, (n + 1,)).tolist() for n in lengths]
        masks = [[1] * len(r) for r in responses]
        out.append(make_micro_batch(prompts, responses, masks, pad_token_id=0))
    return out


def step_nll(mbs):
    """Token-mean NLL over the whole step: each micro-batch's loss is its share of it."""
    total = sum(float(mb.loss_mask.sum()) for mb in mbs)

    def loss_fn(logprobs, entropy, mb):
        loss = -(logprobs * mb.loss_mask.to(logprobs.device)).sum() / total
        return loss, {"loss": loss.detach()}

    return loss_fn


def _run(rank: int, world: int, port: int, out: str) -> None:
    from relax_core.train.megatron.backend import MegatronBackend
    from relax_core.train.megatron.config import MegatronParallel

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
    )  # fmt: skip
    config, hf_state = dense(tied=False)
    backend = MegatronBackend(
        config, hf_state, MegatronParallel(), lr=1e-3, dtype="float32", max_sequence_length=64
    )
    mbs = micro_batches()
    before = backend.logprobs(mbs)
    metrics = backend.train_step(mbs, step_nll(mbs))
    after = backend.logprobs(mbs)
    torch.save({"before": before, "after": after, "metrics": metrics}, f"{out}/{world}-{rank}.pt")


def test_two_data_parallel_ranks_step_as_one_rank_with_every_micro_batch(tmp_path):
    for world in (1, 2):
        torch.multiprocessing.spawn(
            _run, (world, free_port("127.0.0.1"), str(tmp_path)), nprocs=world
        )
    one = torch.load(tmp_path / "1-0.pt", weights_only=True)
    ranks = [torch.load(tmp_path / f"2-{r}.pt", weights_only=True) for r in (0, 1)]
    for got in ranks:
        for a, b in zip(got["before"], one["before"], strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        for key in ("loss", "grad_norm"):
            assert got["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-4), key
    for a, b in zip(ranks[0]["after"], ranks[1]["after"], strict=True):
        assert torch.equal(a, b)  # both ranks return the same log-probs, every micro-batch

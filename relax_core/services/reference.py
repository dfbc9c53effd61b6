"""Reference and teacher roles: log-probs of the responses under a frozen model (the reference
for the KL term, the teacher for on-policy distillation), into their own column."""

from __future__ import annotations

import pyarrow as pa
import torch
from transformers import PreTrainedModel

from relax_core.queue import with_columns
from relax_core.services.batching import table_micro_batches
from relax_core.train.torch_backend import response_logprobs


@torch.no_grad()
def add_ref_logprobs(
    model: PreTrainedModel,
    table: pa.Table,
    pad_token_id: int,
    token_budget: int,
    temperature: float,
    column: str = "ref_logprobs",
) -> pa.Table:
    out: list[list[float]] = [[] for _ in range(table.num_rows)]
    lengths = [len(r) for r in table.column("response_ids").to_pylist()]
    for rows, mb in table_micro_batches(table, pad_token_id, token_budget):
        logprobs, _ = response_logprobs(model, mb, temperature)
        for j, i in enumerate(rows):
            out[i] = logprobs[j, : lengths[i]].tolist()
    return with_columns(table, **{column: out})

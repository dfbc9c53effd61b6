"""`evaluate`: held-out pass@1 / pass@k and mean reward of a checkpoint or a registered model,
as its own MLflow run.

    pyflyte run workflows/evaluate.py evaluate --cfg configs/cpu-default.yaml \\
        --checkpoint .relax/checkpoints/<run id>/step_000200 [--k 8 --samples 8]
    pyflyte run workflows/evaluate.py evaluate --cfg configs/cpu-default.yaml \\
        --model models:/relax-cpu-default/latest

The greedy pass@1 is the same evaluation the training run logs at its end; the MLflow run is
nested under the training run that produced the checkpoint.
"""

from __future__ import annotations

from flytekit import workflow

from relax_core.config import RunConfig
from tasks.evaluate import EvalSummary, evaluate_checkpoint


@workflow
def evaluate(
    cfg: RunConfig, checkpoint: str = "", model: str = "", k: int = 8, samples: int = 8
) -> EvalSummary:
    return evaluate_checkpoint(cfg=cfg, checkpoint=checkpoint, model=model, k=k, samples=samples)

"""The trained policy as an MLflow pyfunc model ("models from code": MLflow stores this file
with the model and runs it on load, so loading a registered policy unpickles nothing).

    model = mlflow.pyfunc.load_model("models:/relax-cpu-default/latest")
    model.predict(["What is 12 + 30?"])            # -> ["42"]

Input: a list of prompt strings or a DataFrame with a `prompt` column. Each prompt is rendered
with the run's template (plain or the tokenizer's chat template, with its system prompt), answered
greedily by the torch engine with the run's generation budget (override with
`params={"max_new_tokens": N}`), and decoded. The weights are the `policy` artifact: the final
checkpoint's Hugging Face directory (safetensors + tokenizer + state.json). A run with
`model.matmul_dtype` computes its linear layers in it here too (models/precision.py), so the
model answers as the run's held-out eval did.
"""

from __future__ import annotations

from typing import Any

import mlflow
from mlflow.pyfunc import PythonModel


class RelaxPolicy(PythonModel):
    def load_context(self, context) -> None:
        from relax_core.models.policy import load_policy
        from relax_core.rollout.torch_engine import TorchEngine

        config = context.model_config or {}
        self.template = config.get("template", "plain")
        self.system_prompt = config.get("system_prompt") or None
        self.max_new_tokens = int(config.get("max_new_tokens", 64))
        self.model, self.tokenizer = load_policy(context.artifacts["policy"])
        if config.get("matmul_dtype"):  # 'auto' is decided by the machine serving it
            from relax_core.models.precision import computing_as_trainer

            self.model = computing_as_trainer(self.model, str(config["matmul_dtype"]))
        self.engine = TorchEngine(
            self.model.eval(), self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        )

    def predict(self, context, model_input, params=None):  # no hints: the signature is logged
        from relax_core.data.templates import render_prompt
        from relax_core.rollout.engine import SamplingParams

        prompts = _prompts(model_input)
        budget = int((params or {}).get("max_new_tokens", self.max_new_tokens))
        ids = [
            self.tokenizer(
                render_prompt(p, self.template, self.tokenizer, self.system_prompt),
                add_special_tokens=False,
            )["input_ids"]
            for p in prompts
        ]
        completions = self.engine.generate(ids, SamplingParams(max_new_tokens=budget, greedy=True))
        return self.tokenizer.batch_decode(
            [c.response_ids for c in completions], skip_special_tokens=True
        )


def _prompts(model_input: Any) -> list[str]:
    if hasattr(model_input, "columns"):  # a pandas DataFrame
        columns = list(model_input.columns)
        if "prompt" not in columns and len(columns) != 1:
            raise ValueError(
                f"RelaxPolicy.predict: the DataFrame needs a 'prompt' column, got {columns}"
            )
        model_input = model_input["prompt" if "prompt" in columns else columns[0]].tolist()
    if isinstance(model_input, str):
        model_input = [model_input]
    prompts = list(model_input)
    bad = [type(p).__name__ for p in prompts if not isinstance(p, str) or not p]
    if bad:
        raise ValueError(f"RelaxPolicy.predict: every prompt must be a non-empty string, got {bad}")
    return prompts


mlflow.models.set_model(RelaxPolicy())

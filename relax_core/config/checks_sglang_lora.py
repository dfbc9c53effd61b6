"""What SGLang 0.5.23 can serve of a LoRA run (`train.lora.rank > 0` with `rollout.engine:
sglang`): the adapter goes to each server by name through its LoRA API, so the run's adapter
must be one SGLang's LoRA layers load. Facts from the pinned source:

- dynamic adapter loading asserts one data-parallel replica (TokenizerControlMixin.
  load_lora_adapter_from_tensors: `dp_size == 1`);
- `--lora-target-modules` takes only SGLang's module names (argparse choices,
  SUPPORTED_LORA_TARGET_MODULES in srt/utils/common.py);
- q/k/v adapters are stacked into one qkv_proj adapter (LoRAAdapter.normalize_qkv_proj):
  without q_proj the k/v weights match no target at the first batch, and with q_proj but no
  v_proj the load fails; an up_proj adapter without gate_proj matches no target either
  (normalize_gate_up_proj keeps it as an orphan).
"""

from __future__ import annotations

from relax_core.config.checks_gpu import data_parallel

SGLANG_LORA_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
)
"""The dense-model projections of SGLang's SUPPORTED_LORA_TARGET_MODULES (the rest are MLA,
embedding and other architectures' names, which peft adapters of a Qwen/Llama policy do not
use)."""


def check_sglang_lora(e: list[str], cfg) -> None:
    """Append to `e` what an SGLang server cannot serve of `cfg.train.lora`."""
    modules = {m.strip() for m in cfg.train.lora.target_modules.split(",") if m.strip()}
    unknown = sorted(modules - set(SGLANG_LORA_MODULES))
    if unknown:
        e.append(
            f"train.lora.target_modules: {', '.join(unknown)} with rollout.engine 'sglang': "
            f"SGLang 0.5.23 serves adapters on {', '.join(SGLANG_LORA_MODULES)} only"
        )
    if modules & {"q_proj", "k_proj", "v_proj"} and not {"q_proj", "v_proj"} <= modules:
        e.append(
            "train.lora.target_modules: with rollout.engine 'sglang' an attention adapter "
            "needs q_proj and v_proj (k_proj optional): SGLang 0.5.23 stacks them into one "
            "qkv_proj adapter and cannot load one without both"
        )
    if "up_proj" in modules and "gate_proj" not in modules:
        e.append(
            "train.lora.target_modules: with rollout.engine 'sglang' up_proj needs gate_proj: "
            "SGLang 0.5.23 stacks them into one gate_up_proj adapter"
        )
    try:
        replicas = data_parallel(cfg.sglang.extra_args)
    except ValueError:
        return  # named by the SGLang checks
    if replicas > 1:
        e.append(
            f"sglang.extra_args: --dp-size {replicas} with train.lora: SGLang 0.5.23 loads "
            "adapters only on a server with one data-parallel replica; run "
            f"{replicas} rollout workers (services.rollout_workers), one server each, instead"
        )

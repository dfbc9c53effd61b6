"""`python -m sglang.launch_server ...` for tests: SGLang's arguments, fake_sglang's server.

Arguments a real server takes and this one cannot honour are refused, so the launcher's command
line is checked as well: unknown flags are an error, as with SGLang's own argument parser.
`--tp-size N` gives the server N ranks in the weight group (fake_sglang_ranks.py); `--dp-size`
makes it refuse weight groups, as SGLang 0.5.23 does with data-parallel replicas; the LoRA flags
(`--enable-lora`, `--max-lora-rank`, `--lora-target-modules` with SGLang's choices,
`--max-loras-per-batch`) go to its LoRA side (fake_sglang_lora.py); `--context-length` bounds
prompt plus max_new_tokens. Test knobs come
from the environment: RELAX_TEST_SGLANG_DELAY_S (per request), RELAX_TEST_SGLANG_STEP_DELAY_S
(per decode step), RELAX_TEST_SGLANG_WARMUP_S (how long /health answers 503 after start).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from tests.integration.fake_sglang_lora import SUPPORTED


def main() -> None:
    p = argparse.ArgumentParser(prog="sglang.launch_server")
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--skip-tokenizer-init", action="store_true")
    p.add_argument("--enable-memory-saver", action="store_true")
    p.add_argument("--enable-return-routed-experts", action="store_true")
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--max-lora-rank", type=int)
    p.add_argument("--lora-target-modules", nargs="*", choices=[*SUPPORTED, "all"])
    p.add_argument("--max-loras-per-batch", type=int, default=8)
    p.add_argument("--context-length", type=int)
    a = p.parse_args()
    record = os.environ.get("RELAX_TEST_SGLANG_ARGV")
    if record:
        with open(record, "a") as f:
            f.write(json.dumps(sys.argv[1:]) + "\n")
    from tests.integration import fake_sglang

    sys.argv = [
        "fake_sglang",
        "--port",
        str(a.port),
        "--checkpoint",
        a.model_path,
        "--weight-version",
        a.weight_version,
        # A slow server, when a test needs generation to take time.
        "--generate-delay-s",
        os.environ.get("RELAX_TEST_SGLANG_DELAY_S", "0"),
        "--step-delay-s",
        os.environ.get("RELAX_TEST_SGLANG_STEP_DELAY_S", "0"),
        "--warmup-s",
        os.environ.get("RELAX_TEST_SGLANG_WARMUP_S", "0"),
        "--tp-size",
        str(a.tp_size),
        "--dp-size",
        str(a.dp_size),
        "--max-loras-per-batch",
        str(a.max_loras_per_batch),
    ]
    if a.enable_lora:
        sys.argv.append("--enable-lora")
    if a.max_lora_rank is not None:
        sys.argv += ["--max-lora-rank", str(a.max_lora_rank)]
    if a.lora_target_modules:
        sys.argv += ["--lora-target-modules", *a.lora_target_modules]
    if a.context_length is not None:
        sys.argv += ["--context-length", str(a.context_length)]
    fake_sglang.main()


if __name__ == "__main__":
    main()

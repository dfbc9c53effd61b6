"""The GPU bring-up kit's `sglang_ipc` part: the colocate hand-off of the trainer's CUDA tensors
to an SGLang server by IPC handles (tests/integration/test_sglang_ipc.py's gpu-marked test).

The test's server is the SGLang stand-in (tests/integration/fake_sglang.py, torch only), which
maps the handles as SGLang 0.5.23's /update_weights_from_tensor does; SGLang itself is not
needed, and whether it is installed is recorded beside the result. The test runs under pytest in
its own process group, bounded by --ipc-timeout; on the CPU (no CUDA IPC) the part is skipped.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys

from bench import gpu_parts as g

TEST = (
    "tests/integration/test_sglang_ipc.py"
    "::test_cuda_weights_reach_a_colocated_server_by_ipc_handles"
)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def part_sglang_ipc(args) -> dict:
    """pytest on the IPC hand-off test: its outcome, counts and the log's tail."""
    if not g.ON_GPU:
        raise g.Skip("CUDA IPC needs a GPU (the CPU tests cover the hand-off through files)")
    if importlib.util.find_spec("pytest") is None:
        raise g.Skip("pytest is not importable here; carry its wheel (.whl/)")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-rs"]
    proc = subprocess.Popen(
        [*cmd, TEST], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        log, _ = proc.communicate(timeout=args.ipc_timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        raise RuntimeError(f"the IPC test ran past {args.ipc_timeout} s: {log[-2000:]}") from None
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", log)}
    out = {
        "test": TEST,
        "server": "SGLang stand-in (tests/integration/fake_sglang.py)",
        "sglang_installed": importlib.util.find_spec("sglang") is not None,
        "exit_code": proc.returncode,
        **counts,
    }
    if proc.returncode != 0 or counts.get("passed", 0) != 1:
        raise RuntimeError(f"{out}\n{log[-3000:]}")
    return out

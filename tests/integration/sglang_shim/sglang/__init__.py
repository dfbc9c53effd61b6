"""Test-only stand-in for the `sglang` package: only `python -m sglang.launch_server` exists.

Put this folder on a child process's PYTHONPATH and `SGLangServer.start` (relax_core/rollout/
sglang_server.py) launches tests/integration/fake_sglang.py with SGLang's own command line, so
the launcher, its arguments and the stop of its process group are tested for real on CPU.
"""

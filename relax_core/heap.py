"""The cyclic garbage collector against a task's long-lived heap.

A task process holds hundreds of thousands of objects that live as long as it does: the modules
of torch, transformers, flytekit and mlflow, the model and its optimizer. CPython's full
collections walk every one of them each time, and the number of objects decides when they run,
not whether they find anything. In the CPU default's `pyflyte run` that was 12 full collections,
2.7 s of the run, up to 0.44 s each in the middle of the RL steps (bench/RESULTS.md).

`freeze_heap()` moves every object the process holds now into the permanent generation, which
collections skip. Objects made afterwards are collected as before; what the process held at the
call is never freed by the cycle collector (reference counting still frees it), so callers freeze
where what they hold is what they keep: after imports and model loads, before a loop.
"""

from __future__ import annotations

import gc


def freeze_heap() -> None:
    """Keep the garbage collector's full collections off everything the process holds now."""
    gc.freeze()

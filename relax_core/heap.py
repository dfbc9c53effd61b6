"""A task's long-lived heap: the cyclic garbage collector, and glibc's handling of freed memory.

A task process holds hundreds of thousands of objects that live as long as it does: the modules
of torch, transformers, flytekit and mlflow, the model and its optimizer. CPython's full
collections walk every one of them each time, and the number of objects decides when they run,
not whether they find anything. In the CPU default's `pyflyte run` that was 12 full collections,
2.7 s of the run, up to 0.44 s each in the middle of the RL steps (bench/RESULTS.md).

`freeze_heap()` moves every object the process holds now into the permanent generation, which
collections skip. Objects made afterwards are collected as before; what the process held at the
call is never freed by the cycle collector (reference counting still frees it), so callers freeze
where what they hold is what they keep: after imports and model loads, before a loop.

Its first call in a process also sets how glibc's malloc treats freed memory (`keep_freed_memory`):
a training step allocates and frees the same activation and gradient buffers every step, and
with glibc's defaults, blocks above 128 KiB are mmap'ed and unmapped each time and the top of the
heap is given back to the kernel, so the next step page-faults the same memory in again.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import sys

log = logging.getLogger(__name__)

MMAP_THRESHOLD = 32 << 20
"""Blocks below this come from the heap, not their own mmap (glibc's most: 32 MiB on 64-bit)."""
TRIM_THRESHOLD = 256 << 20
"""Freed memory at the top of the heap the process keeps before giving any back."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (glibc's malloc.h)
OPT_OUT_ENV = "RELAX_KEEP_FREED_MEMORY"
"""Set to 0 to leave glibc's defaults (the process then returns freed memory sooner)."""

_tuned = False


def freeze_heap() -> None:
    """Keep the garbage collector's full collections off everything the process holds now (and,
    once per process, `keep_freed_memory()`)."""
    keep_freed_memory()
    gc.freeze()


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for reuse instead of returning it to the kernel
    between steps; returns whether it did. Does nothing off glibc, when the user set glibc's own
    variables (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, GLIBC_TUNABLES), when
    RELAX_KEEP_FREED_MEMORY=0, or after its first call. The cost: the process's resident memory
    stays at its peak (plus up to TRIM_THRESHOLD of freed heap) instead of shrinking between
    steps."""
    global _tuned
    if _tuned:
        return False
    _tuned = True
    user_set = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
    if os.environ.get(OPT_OUT_ENV) == "0" or any(v in os.environ for v in user_set):
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # another libc (musl): its allocator is left as it is
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    done = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and done
    if not done:
        log.warning("glibc refused the malloc settings: freed memory is returned as before")
    return done

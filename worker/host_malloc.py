"""glibc's malloc told to keep what a step frees, so the next step does not fault it back in.

Torch's CPU allocator has no cache: every tensor a forward makes is one malloc, and every op's
output is a new tensor (a 2,048-token prefill of SmolLM2-135M makes dozens of 2-25 MB ones per
layer). glibc serves a block above its mmap threshold with a fresh mapping and unmaps it on
free, and returns the free memory at the top of a heap to the OS once it passes the trim
threshold. Its defaults move both with the blocks it sees (the "dynamic threshold"), and the
forward's mix of sizes keeps it giving memory back and faulting it in again, zeroed, 4 KB at a
time. Measured on the 2-core AMX Xeon (SmolLM2-135M, 2,048-token prefill steps of 64 x 128
prompts): 30,000-74,000 page faults per step in bfloat16 and 97,000-141,000 in float32; with
a 512 MB trim threshold, 0-2,000 (~0 once warm). The prefill step took 339-409 -> 320-356 ms
in bfloat16 (4 processes each, alternated A B B A) and 1,578 -> 1,437 ms in float32; with the
256 MB below, through the engine's own call, 0-1,935 faults and 350-365 ms against 410; decode
steps, whose tensors are small, ~1 %. Either setting alone is worse than glibc's defaults (it
turns the other's dynamic adjustment off): only a 512 MB trim threshold, 340,000 faults and
718 ms a step; only the 32 MB mmap threshold, 180,000 and 551 ms. vLLM's CPU backend gets the
same from tcmalloc, preloaded into its engine process where vLLM finds one.

So a CPU engine process sets, once, before its first forward:

    M_MMAP_THRESHOLD  32 MB    blocks up to it come from the heap (glibc's largest allowed)
    M_TRIM_THRESHOLD  256 MB   free memory at a heap's top is kept up to this

The cost is memory a step freed staying mapped for the next one (the peak of one step's
activations, which the next step needs again); what a process allocates for good is
unchanged. Process-wide: the offline `LLM` sets it in its caller's process too.

    FOLIO_MALLOC_KEEP=0   leave malloc as it is
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 256 << 20

_done: bool | None = None


def keep_freed_memory() -> bool:
    """Set the thresholds (once per process); True where glibc took them."""
    global _done
    if _done is None:
        _done = _apply()
    return _done


def _apply() -> bool:
    if not sys.platform.startswith("linux") or os.environ.get("FOLIO_MALLOC_KEEP", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc's: musl and others have other knobs, or none
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # both or neither: either alone turns glibc's dynamic adjustment off and is worse (above)
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1

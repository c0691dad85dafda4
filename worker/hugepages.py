"""Host memory for the KV cache on transparent huge pages (2 MB), where Linux offers them.

A decode step's attention reads each sequence's blocks of one layer: a few KB here and there
across a cache of hundreds of MB. On 4 KB pages nearly every block is a TLB miss, and after the
linear layers have streamed the weights through the caches the page-table entries come from
memory too. On 2 MB pages the whole cache takes a few hundred TLB entries. Measured on a
2-core EPYC (SmolLM2-135M bf16, batch 64 x ~170 tokens): the attention op inside the step 0.58-0.61
-> 0.47-0.49 ms per layer; the decode step, alternated in one process (`benchmarks/
profile_step.py --ab-huge-pages`), 2-6 % shorter (20 pairs: median 0.964, 15 of 20 faster;
`results/huge_pages_ab_2026-12-04.json`). In float32 no gain showed (1.02 in a 12-pair run).

Linux gives a process huge pages only where it asked (`/sys/kernel/mm/transparent_hugepage/
enabled` = madvise, the common default) or everywhere (= always), and only for pages not yet
touched. So the cache gets a mapping of its own (an anonymous mmap, never memory malloc hands
back after someone else used it), madvise(MADV_HUGEPAGE) on its 2 MB-aligned part, then is
zeroed: the first touch, which the kernel now serves with huge pages, and which commits the
memory up front as torch.zeros did. Anywhere that does not work (another OS, THP off, a
madvise error) it is the same zeroed tensor on small pages.

    FOLIO_KV_HUGE_PAGES=0   keep the cache on small pages (plain torch.zeros)
"""

from __future__ import annotations

import mmap
import os
import sys

import torch

HUGE_PAGE = 2 << 20


def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype) in host memory, on huge pages where the OS gives them. The
    tensor keeps its mapping alive; the mapping is unmapped when the tensor is freed."""
    nbytes = dtype.itemsize
    for n in shape:
        nbytes *= n
    if (not sys.platform.startswith("linux") or os.environ.get("FOLIO_KV_HUGE_PAGES", "1") == "0"
            or nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE")):
        return torch.zeros(*shape, dtype=dtype)
    # anonymous and private (a shared one would be shmem, which this THP setting does not cover):
    # zero pages, none touched yet
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
    whole = torch.frombuffer(mm, dtype=torch.uint8)
    offset = -whole.data_ptr() % HUGE_PAGE  # the mapping is 4 KB-aligned; start the tensor on 2 MB
    try:
        mm.madvise(mmap.MADV_HUGEPAGE, offset, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError:
        pass  # THP off in this kernel: small pages, still a correct cache
    return whole[offset:offset + nbytes].view(dtype).view(shape).zero_()


def huge_bytes(t: torch.Tensor) -> int:
    """How many bytes of the mappings under `t` are on huge pages (from /proc/self/smaps: the
    madvise splits the tensor's mapping in up to three, so every one that overlaps it counts;
    0 where smaps cannot be read)."""
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    total, inside = 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo < end and start < hi
                elif inside and head == "AnonHugePages:":
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total

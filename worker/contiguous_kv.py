"""The naive baseline behind the KVCacheManager interface: one contiguous reservation per sequence."""

from __future__ import annotations

from folio.worker.block_manager import cdiv
from folio.worker.sequence import Sequence


class ContiguousKVManager:
    """The naive baseline: each sequence reserves `max_model_len` slots, contiguous, first fit.

    The address space is the same block-granular slot range as the paged pool,
    so the same kernels read it; a reservation is simply a run of consecutive
    blocks, and its block table is that run.
    """

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.reserve_blocks = cdiv(max_model_len, block_size)
        self.regions: dict[int, list[int]] = {}  # seq_id -> its block run
        self.gaps: list[tuple[int, int]] = [(0, num_blocks)]  # sorted (start, length)
        self._copies: list[tuple[int, int]] = []

    def get_computed_blocks(self, seq: Sequence, count: bool = True) -> tuple[list[int], int]:
        return [], 0

    def cache_blocks(self, seq: Sequence) -> None:
        """The baseline has no prefix cache: nothing to register."""

    def _reserve(self) -> list[int] | None:
        n = self.reserve_blocks
        for i, (start, length) in enumerate(self.gaps):
            if length >= n:
                if length == n:
                    del self.gaps[i]
                else:
                    self.gaps[i] = (start + n, length - n)
                return list(range(start, start + n))
        return None

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] = (),
                       reserve: int = 0) -> bool:
        if seq.seq_id in self.regions:
            return True
        region = self._reserve()
        if region is None:
            return False
        self.regions[seq.seq_id] = region
        return True

    def free(self, seq: Sequence) -> None:
        region = self.regions.pop(seq.seq_id, None)
        if region is None:
            return
        self.gaps.append((region[0], len(region)))
        self.gaps.sort()
        merged: list[tuple[int, int]] = []
        for start, length in self.gaps:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((start, length))
        self.gaps = merged

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        region = self._reserve()
        if region is None:
            return False
        self.regions[child.seq_id] = region
        used = cdiv(parent.num_computed_tokens, self.block_size)
        src = self.regions[parent.seq_id]
        self._copies.extend(zip(src[:used], region[:used]))
        return True

    def swap_out(self, seq: Sequence) -> bool:
        return False  # the baseline has no swap space: its victims are recomputed

    def swap_in(self, seq: Sequence, reserve: int = 0) -> bool:
        return False

    def swapped_blocks(self, seq: Sequence) -> int:
        return 0

    def host_block_table(self, seq: Sequence) -> list[int]:
        return []

    def adopt_swapped(self, seq: Sequence, num_blocks: int) -> list[int] | None:
        return None  # no swap space: an imported request recomputes

    def take_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        return [], []

    def block_table(self, seq: Sequence) -> list[int]:
        return self.regions[seq.seq_id]

    def take_copies(self) -> list[tuple[int, int]]:
        out, self._copies = self._copies, []
        return out

    def max_blocks_per_seq(self, num_tokens: int) -> int:
        return self.reserve_blocks

    @property
    def num_free_blocks(self) -> int:
        return sum(length for _, length in self.gaps)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    # no swap space and no prefix cache: its victims are recomputed
    num_free_cpu_blocks = 0
    cpu_usage = 0.0
    prefix_queries = 0
    prefix_hits = 0

    def slot_stats(self, seqs: list[Sequence]) -> tuple[int, int]:
        used = sum(s.num_computed_tokens for s in seqs if s.seq_id in self.regions)
        return used, len(self.regions) * self.reserve_blocks * self.block_size

    def cached_block_hashes(self) -> set:
        return set()  # no prefix cache

    def prefix_cache_changes(self) -> tuple[dict, bool]:
        return {}, False

    def check_invariants(self, seqs: list[Sequence]) -> None:
        live = {s.seq_id for s in seqs}
        assert set(self.regions) <= live, "regions for dead sequences"
        owned = [b for r in self.regions.values() for b in r]
        gap_blocks = [b for start, length in self.gaps for b in range(start, start + length)]
        assert len(set(owned)) == len(owned), "overlapping reservations"
        assert sorted(owned + gap_blocks) == list(range(self.num_blocks)), "blocks lost or doubled"

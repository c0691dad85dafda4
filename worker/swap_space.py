"""CPU swap space: a pool of host blocks holding the KV of swapped-out sequences.

    swap_out(seq): device table [d0 d1 d2] -> host blocks [h0 h1 h2]; pairs (d, h) queued
    swap_in(seq):  host blocks -> new device blocks; pairs (h, d) queued

The queued pairs are copied in one batched call per direction before the next
forward (swap-outs first: a device block freed by a swap-out may be handed to a
swap-in of the same step). Host blocks freed by a swap-in are released only when
the step's pairs are taken, so no swap-out of the same step can overwrite them
before they were read.
"""

from __future__ import annotations

from folio.worker.block_pool import BlockPool


class SwapSpace:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.pool = BlockPool(num_blocks)
        self.tables: dict[int, list[int]] = {}  # seq_id -> host blocks, in logical order
        self._out: list[tuple[int, int]] = []  # (device block, host block)
        self._in: list[tuple[int, int]] = []  # (host block, device block)
        self._release: list[int] = []  # host blocks to free once this step's copies are taken

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.num_blocks if self.num_blocks else 0.0

    def holds(self, seq_id: int) -> bool:
        return seq_id in self.tables

    def store(self, seq_id: int, device_blocks: list[int]) -> bool:
        """Reserve host blocks for `device_blocks` and queue the copies; False if they do not fit."""
        if len(device_blocks) > self.pool.num_free:
            return False
        host = self.pool.allocate(len(device_blocks))
        self.tables[seq_id] = host
        self._out.extend(zip(device_blocks, host))
        return True

    def load(self, seq_id: int, device_blocks: list[int]) -> None:
        """Queue the copies of `seq_id`'s host blocks into `device_blocks`, then release them."""
        host = self.tables.pop(seq_id)
        self._in.extend(zip(host, device_blocks))
        self._release.extend(host)

    def adopt(self, seq_id: int, num_blocks: int) -> list[int] | None:
        """Host blocks for an imported sequence (its contents written by the caller)."""
        if num_blocks > self.pool.num_free:
            return None
        host = self.pool.allocate(num_blocks)
        self.tables[seq_id] = host
        return host

    def drop(self, seq_id: int) -> None:
        host = self.tables.pop(seq_id, None)
        if host:
            self.pool.free(reversed(host))

    def take_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's (swap-out pairs, swap-in pairs); frees the host blocks swapped in."""
        out, into = self._out, self._in
        self._out, self._in = [], []
        if self._release:
            self.pool.free(self._release)
            self._release = []
        return out, into

    def check_invariants(self, live_seq_ids: set[int]) -> None:
        assert set(self.tables) <= live_seq_ids, "host blocks held for dead sequences"
        refs = [0] * self.num_blocks
        for host in self.tables.values():
            for b in host:
                refs[b] += 1
        for b in self._release:
            refs[b] += 1
        assert all(r <= 1 for r in refs), "a host block is held twice"
        self.pool.check_invariants(refs)

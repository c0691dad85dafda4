"""The runner of a tensor-parallel engine (tensor_parallel.py): rank 0 in the engine's
process, ranks 1..N-1 in followers it starts (Ray actors in its placement group, or
processes: tp_ranks.py).

Rank 0 owns the scheduler, the block manager and the block tables (the engine's). Before
each operation on the KV cache or the model it announces it to the followers (one
broadcast: the step's input tensors, or the blocks to swap / copy / read / write; vLLM's
SchedulerOutput broadcast), then every rank runs it on its shard:

    run     forward (all-reduce after o and down) + the same LM-head calls (all-gather)
    swap    each rank's share of every block, device <-> its own swap space
    read    (export) each rank's share, gathered on rank 0: blocks carry every rank's heads
    write   (import) each rank takes its heads' share

A follower that dies makes rank 0's next collective raise: the engine fails its requests
(fault_isolation.py) and the worker restarts as a whole. A step that raises on rank 0 after
it was announced breaks the group too (the followers may be inside one of its collectives):
fault isolation cannot re-run parts of a batch on a group, so no single request is blamed.
"""

from __future__ import annotations

import os
import subprocess
import weakref

import torch

from folio.worker.errors import EngineFailedError
from folio.worker.model_runner import ModelRunner, step_tensors
from folio.worker.tensor_parallel import Group


class TPModelRunner(ModelRunner):
    """Rank 0: a ModelRunner whose model is sharded and whose every operation is announced."""

    group: Group
    followers: list

    def attach(self, group: Group, followers: list) -> None:
        """The group this rank 0 leads and its followers (tp_ranks.py); they stop with the runner."""
        self.group, self.followers = group, followers
        self._finalizer = weakref.finalize(self, _stop, group, followers)

    def close(self) -> None:
        if self.broken is not None:  # the followers may sit in a collective: no stop broadcast
            self.group.close()
            for p in self.followers:
                p.kill()
        self._finalizer()

    broken: str | None = None  # why the group can no longer run a step

    def process_ids(self) -> list[int]:
        return [os.getpid()] + [f.pid for f in self.followers]

    def run(self, scheduled, kv):
        if self.broken is not None:
            raise EngineFailedError(self.broken)
        inputs = self.prepare(scheduled, kv)  # nothing announced yet: a fault here is the batch's
        try:
            batches = self.logit_batches(inputs)
            self.group.broadcast(("run", step_tensors(inputs), batches))
            return inputs.sample_seqs, self.execute(inputs, batches)
        except Exception as e:
            # the followers may be waiting in a collective of this step: no other step (nor
            # fault isolation's re-runs of parts of it) can run on this group any more
            self.broken = f"tensor-parallel group broken in a step: {type(e).__name__}: {e}"
            raise EngineFailedError(self.broken) from e

    def swap(self, swap_out, swap_in) -> int:
        if swap_out or swap_in:
            self.group.broadcast(("swap", swap_out, swap_in))
        return super().swap(swap_out, swap_in)

    def copy_blocks(self, pairs) -> None:
        if pairs:
            self.group.broadcast(("copy", pairs))
        super().copy_blocks(pairs)

    def healthy(self) -> bool:
        if self.broken is not None:
            return False
        try:
            self.group.broadcast(("probe",))
        except Exception:
            return False
        return super().healthy()

    @property
    def block_shape(self) -> tuple[int, ...]:  # every rank's KV heads, rank after rank
        layers, kv, bs, heads, dim = self.kv_blocks.shape[1:]
        return (layers, kv, bs, heads * self.group.size, dim)

    def read_blocks(self, blocks: list[int], on_host: bool) -> torch.Tensor:
        self.group.broadcast(("read", blocks, on_host))
        return torch.cat(self.group.all_gather(super().read_blocks(blocks, on_host)), dim=-2)

    def write_host_blocks(self, blocks: list[int], data: torch.Tensor) -> None:
        self.group.broadcast(("write", blocks, data))
        super().write_host_blocks(blocks, rank_share(data, self.group))



def _stop(group: Group, followers: list) -> None:
    if group.pg is not None:
        try:
            group.broadcast(("stop",))
        except Exception:  # a follower died: the others get killed below
            pass
    for p in followers:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    group.close()


def rank_share(data: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's KV heads of blocks that carry every rank's ([..., heads * N, head_dim])."""
    n = data.shape[-2] // group.size
    return data[..., group.rank * n: (group.rank + 1) * n, :]


def follow(runner: ModelRunner, group: Group) -> None:
    """A follower's loop: run what rank 0 announces until it says stop (or the group breaks)."""
    while True:
        op, *args = group.broadcast()
        if op == "stop":
            return
        if op == "run":
            runner.replay(*args)
        elif op == "swap":
            runner.swap(*args)
        elif op == "copy":
            runner.copy_blocks(*args)
        elif op == "probe":
            runner.healthy()
        elif op == "read":
            group.all_gather(runner.read_blocks(*args))
        elif op == "write":
            blocks, data = args
            runner.write_host_blocks(blocks, rank_share(data, group))

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

A step that raises on one rank leaves the group in step (guarded_step): that rank takes part
in the rest of the step's collectives on zeros (the model's collective_plan), then all ranks
exchange their outcomes in one all-gather. Rank 0 raises RankStepError, an ordinary fault, so
fault isolation (fault_isolation.py) re-runs halves of the batch as new steps down to the
requests that fail alone, on whichever rank they fail: one request cannot take the group
down. A collective that fails (a follower died, a timeout) breaks the group for good: the
engine fails its requests and the worker restarts as a whole.
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
        if self.group.broken is not None:  # the followers may sit in a collective: no stop broadcast
            self.group.close()
            for p in self.followers:
                p.kill()
        self._finalizer()

    def process_ids(self) -> list[int]:
        return [os.getpid()] + [f.pid for f in self.followers]

    def run(self, scheduled, kv):
        if self.group.broken is not None:
            raise EngineFailedError(self.group.broken)
        inputs = self.prepare(scheduled, kv)  # nothing announced yet: a fault here is the batch's
        batches = self.logit_batches(inputs)
        self.group.broadcast(("run", step_tensors(inputs), batches))
        plan = self.model.collective_plan(inputs.input_ids.numel(), [len(b) for b in batches])
        logits, failed = guarded_step(self.group, plan, self.device, lambda: self.execute(inputs, batches))
        if failed is not None:
            raise RankStepError(f"rank {failed[0]} of the tensor-parallel group: {failed[1]}")
        return inputs.sample_seqs, logits

    def swap(self, swap_out, swap_in) -> int:
        if swap_out or swap_in:
            self.group.broadcast(("swap", swap_out, swap_in))
        return super().swap(swap_out, swap_in)

    def copy_blocks(self, pairs) -> None:
        if pairs:
            self.group.broadcast(("copy", pairs))
        super().copy_blocks(pairs)

    def healthy(self) -> bool:
        """Every rank's probe (a dummy forward and LM-head call) passes."""
        if self.group.broken is not None:
            return False
        try:
            self.group.broadcast(("probe",))
            _, failed = guarded_step(self.group, self.model.collective_plan(1, [1]), self.device, self.probe)
        except Exception:
            return False
        return failed is None

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


class RankStepError(RuntimeError):
    """A rank's part of an announced step raised. Every rank finished the step's collectives,
    so the group is still in step: an ordinary fault that fault isolation can bisect."""


def guarded_step(group: Group, plan: list, device, part):
    """(part(), None), or (None, (rank, reason)) when `part` (this rank's share of an announced
    step) raised on any rank. A rank whose part raised takes part in the rest of `plan` (the
    step's collectives) on zeros, so the others finish theirs, then every rank learns every
    rank's outcome (one all-gather). A failed collective raises EngineFailedError: the group is
    broken. On success the collectives taken part in must be the plan's, or the plan is stale
    and the next drain would hang: the group is declared broken then too."""
    group.issued = 0
    err = out = None
    try:
        out = part()
    except Exception as e:
        if group.broken is not None:
            raise
        err = e
        group.drain(plan, device)
    else:
        if group.issued != len(plan):
            group.broken = (f"tensor-parallel step took part in {group.issued} collectives, its plan has "
                            f"{len(plan)} (LlamaModel.collective_plan is out of date)")
            raise EngineFailedError(group.broken)
    failed = group.agree(err)
    return (out, None) if failed is None else (None, failed)


def follow(runner: ModelRunner, group: Group) -> None:
    """A follower's loop: run what rank 0 announces until it says stop (or the group breaks)."""
    while True:
        op, *args = group.broadcast()
        if op == "stop":
            return
        if op == "run":
            tensors, batches = args
            plan = runner.model.collective_plan(tensors["input_ids"].numel(), [len(b) for b in batches])
            guarded_step(group, plan, runner.device, lambda: runner.replay(tensors, batches))
        elif op == "swap":
            runner.swap(*args)
        elif op == "copy":
            runner.copy_blocks(*args)
        elif op == "probe":
            guarded_step(group, runner.model.collective_plan(1, [1]), runner.device, runner.probe)
        elif op == "read":
            group.all_gather(runner.read_blocks(*args))
        elif op == "write":
            blocks, data = args
            runner.write_host_blocks(blocks, rank_share(data, group))

"""Tensor parallelism (Megatron-style): one model over N processes, one device each.

    ranks:     0 (the engine: scheduler, block manager, sampling) ... N-1 (followers)
    sharding:  attention heads and KV heads split across ranks; qkv and gate_up by output rows
               (column-parallel), o and down by input columns (row-parallel: one all-reduce each);
               the embedding and the LM head by vocabulary rows (vocab-parallel: an all-reduce,
               and an all-gather of the logits)

A model whose KV heads are fewer than the ranks replicates them (as vLLM does): rank r holds
KV head r // (N / num_kv_heads). Vocabulary shards are ceil(V / N) rows, the last one padded
with zero rows, so the gathered logits are trimmed back to V.

The group is torch.distributed, two process groups over one store (as vLLM's device and CPU
groups): the model's all-reduces and all-gathers run on the device's (NCCL on CUDA, gloo on CPU),
the pickled step broadcasts, the outcome exchange and host-side KV reads on a gloo group (the
same one on CPU). Each collective picks its group by its tensor's device. The row-parallel sums add the ranks' partial products in another order than
one device does: outputs equal a single device's up to rounding (near-ties may flip).
"""

from __future__ import annotations

import datetime
import pickle
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from folio.worker.errors import ConfigError, EngineFailedError
from folio.worker.fault_isolation import describe

STATUS_BYTES = 256  # a rank's outcome of a step: a failed flag and the start of its reason


@dataclass(frozen=True)
class Shards:
    """What rank `rank` of `size` holds of a model's heads, MLP and vocabulary."""

    rank: int
    size: int
    num_heads: int  # the model's
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def of(cls, rank: int, size: int, num_heads: int, num_kv_heads: int, intermediate_size: int,
           vocab_size: int) -> "Shards":
        if size < 1 or not 0 <= rank < size:
            raise ConfigError(f"tensor-parallel rank {rank} of {size}")
        if num_heads % size:
            raise ConfigError(f"tensor_parallel_size={size} must divide the model's {num_heads} attention heads")
        if (num_kv_heads % size if num_kv_heads >= size else size % num_kv_heads):
            raise ConfigError(f"tensor_parallel_size={size} and the model's {num_kv_heads} KV heads: one must "
                              "divide the other")
        if intermediate_size % size:
            raise ConfigError(f"tensor_parallel_size={size} must divide the model's intermediate size "
                              f"{intermediate_size}")
        return cls(rank, size, num_heads, num_kv_heads, intermediate_size, vocab_size)

    @property
    def heads(self) -> range:
        n = self.num_heads // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    @property
    def kv_heads(self) -> range:
        if self.num_kv_heads >= self.size:
            n = self.num_kv_heads // self.size
            return range(self.rank * n, (self.rank + 1) * n)
        h = self.rank // (self.size // self.num_kv_heads)  # replicated
        return range(h, h + 1)

    @property
    def intermediate(self) -> range:
        n = self.intermediate_size // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    @property
    def vocab_shard_size(self) -> int:
        return -(-self.vocab_size // self.size)

    @property
    def vocab(self) -> range:
        n = self.vocab_shard_size
        return range(min(self.rank * n, self.vocab_size), min((self.rank + 1) * n, self.vocab_size))


def pad_vocab(rows: torch.Tensor, shards: Shards) -> torch.Tensor:
    """This rank's vocabulary rows of an embedding / LM head weight, zero-padded to the shard size."""
    pad = shards.vocab_shard_size - rows.shape[0]
    return torch.cat([rows, rows.new_zeros(pad, *rows.shape[1:])]) if pad else rows


class Group:
    """The collectives of one tensor-parallel group: a process group of its own (not
    torch.distributed's global one, so one process may hold several engines), rendezvous
    through a TCPStore that rank 0 hosts. `pg`: the device tensors' group; `cpu_pg`: host
    tensors' (gloo; the same group on a CPU). `pg` None: one rank, every collective a no-op."""

    def __init__(self, shards: Shards, pg=None, cpu_pg=None) -> None:
        self.shards = shards
        self.pg = pg
        self.cpu_pg = cpu_pg if cpu_pg is not None else pg
        self.store = None  # the rendezvous (rank 0 hosts it), kept alive as long as the group
        self.collective_seconds = 0.0  # this rank's wall time in the model's all-reduces and all-gathers
        self.issued = 0  # collectives this rank took part in since the step began (guarded_step)
        self.broken: str | None = None  # why a collective itself failed: the ranks are out of step for good

    @classmethod
    def join(cls, shards: Shards, host: str, port: int, device: torch.device = torch.device("cpu"),
             timeout_s: float = 60.0) -> "Group":
        """Rank 0 hosts the store on `port`; the others connect to it. On CUDA the device group
        is NCCL (its own timeout: NCCL's default; a dead rank is found by its actor's death too)."""
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, shards.size, shards.rank == 0, timeout=timeout)
        cpu_pg = dist.ProcessGroupGloo(dist.PrefixStore("cpu", store), shards.rank, shards.size, timeout)
        pg = cpu_pg
        if device.type == "cuda":
            if device.index is not None:  # NCCL binds its communicator to the current device
                torch.cuda.set_device(device)
            pg = dist.ProcessGroupNCCL(dist.PrefixStore("device", store), shards.rank, shards.size)
        g = cls(shards, pg, cpu_pg)
        g.store = store
        return g

    def _group(self, x: torch.Tensor):
        """The process group for a collective on `x`: host tensors on gloo, device ones on the device's."""
        return self.cpu_pg if x.device.type == "cpu" else self.pg

    @property
    def size(self) -> int:
        return self.shards.size

    @property
    def rank(self) -> int:
        return self.shards.rank

    def _collective(self, work) -> None:
        """Run one collective (a callable returning its Work); a failure marks the group broken."""
        if self.broken is not None:
            raise EngineFailedError(self.broken)
        t0 = time.perf_counter()
        try:
            work().wait()
        except Exception as e:  # a rank died or timed out: no later collective can line up
            self.broken = f"tensor-parallel group broken in a collective: {type(e).__name__}: {e}"
            raise EngineFailedError(self.broken) from e
        finally:
            self.collective_seconds += time.perf_counter() - t0
        self.issued += 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.pg is not None:
            self._collective(lambda: self._group(x).allreduce([x]))
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.pg is None:
            return [x]
        parts = [torch.empty_like(x) for _ in range(self.size)]
        x = x.contiguous()
        self._collective(lambda: self._group(x).allgather([parts], [x]))
        return parts

    def drain(self, plan: list[tuple[str, tuple, torch.dtype]], device) -> None:
        """The collectives of `plan` this rank has not taken part in yet this step, on zeros:
        a rank whose part of a step raised keeps the others' collectives lined up."""
        for op, shape, dtype in plan[self.issued:]:
            zeros = torch.zeros(shape, dtype=dtype, device=device)
            self.all_reduce(zeros) if op == "all_reduce" else self.all_gather(zeros)

    def agree(self, err: BaseException | None) -> tuple[int, str] | None:
        """Every rank's outcome of a step, exchanged in one all-gather: (the first rank that
        failed, its reason), or None when every rank succeeded."""
        if self.pg is None:
            return None if err is None else (0, describe(err))
        status = torch.zeros(STATUS_BYTES, dtype=torch.uint8)
        if err is not None:
            reason = describe(err).encode()[: STATUS_BYTES - 1]
            status[0] = 1
            status[1: 1 + len(reason)] = torch.frombuffer(bytearray(reason), dtype=torch.uint8)
        for rank, part in enumerate(self.all_gather(status)):
            if part[0]:
                return rank, bytes(part[1:].tolist()).rstrip(b"\0").decode(errors="replace")
        return None

    def broadcast(self, obj=None):
        """Rank 0's `obj` (pickled) on every rank."""
        if self.pg is None:
            return obj
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
            n = torch.tensor([data.numel()], dtype=torch.long)
        else:
            n = torch.zeros(1, dtype=torch.long)
        self._collective(lambda: self.cpu_pg.broadcast([n], opts))
        if self.rank != 0:
            data = torch.empty(int(n.item()), dtype=torch.uint8)
        self._collective(lambda: self.cpu_pg.broadcast([data], opts))
        return obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[rows, vocab shard] on each rank -> [rows, vocab] (all ranks)."""
        if self.pg is None:
            return logits
        return torch.cat(self.all_gather(logits), dim=-1)[:, : self.shards.vocab_size]

    def embed(self, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel embedding: each rank looks up the ids in its shard, zeros elsewhere; summed."""
        if self.pg is None:
            return torch.nn.functional.embedding(input_ids, weight)
        local = input_ids - self.shards.vocab.start
        outside = (local < 0) | (local >= weight.shape[0])
        h = torch.nn.functional.embedding(local.clamp(0, weight.shape[0] - 1), weight)
        return self.all_reduce(h.masked_fill(outside[:, None], 0))

    def close(self) -> None:
        self.pg = self.cpu_pg = None


def single(num_heads: int, num_kv_heads: int, intermediate_size: int, vocab_size: int) -> Group:
    """The group of one rank (no tensor parallelism)."""
    return Group(Shards.of(0, 1, num_heads, num_kv_heads, intermediate_size, vocab_size))

"""The attention plan: what paged attention derives from a batch's layout alone (which rows
decode, which prefill, the blocks each reads, the masks), the same for every layer, so the
model runner builds it once per step (ops.plan_attention) and each layer's attention reads it.

The torch path (reference.py) uses all of it: decode sequences grouped into chunks of
at most _DECODE_CHUNK_BYTES of K+V, prefills with their causal masks. The C++ CPU path
(cpu_attention.py) takes the decode sequences and the prefills as rows (in_place=True): no
chunks, no masks.
The Triton path (backend.py) only reads max_query_len.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Gather at most this many bytes of K+V per chunk of decode sequences: small enough to
# stay in the CPU's cache between the gather and the attention that reads it. Sequences
# are chunked in order of context length, so a chunk pads only to its own longest
# context. Measured on a 2-core EPYC, batch 64 x ~300 tokens (4 kv heads x 64), per layer:
# one strided bmm per kv head 17 ms; fused SDPA per ~4 MiB chunk 4-5 ms; SDPA unchunked 18 ms.
_DECODE_CHUNK_BYTES = 4 << 20


@dataclass
class DecodeChunk:
    rows: torch.Tensor  # [n] int64: rows of q (one new token per sequence)
    blocks: torch.Tensor  # [n * num_blocks] int64: each sequence's first num_blocks blocks
    num_blocks: int  # blocks gathered per sequence (of the chunk's longest context)
    mask: torch.Tensor  # [n, 1, 1, num_blocks * block_size] bool: True inside the context


@dataclass
class PrefillSeq:
    start: int  # rows [start, end) of q
    end: int
    blocks: torch.Tensor  # [num_blocks] int64
    ctx: int  # context length including the new tokens
    mask: torch.Tensor | None  # [end - start, ctx] bool: causal, offset by the cached context;
    #                            None when nothing is cached (plain causal: the kernel skips blocks)


@dataclass
class PrefillBatch:
    """Fresh prompts of one length (nothing cached: plain causal), attended in one call: a batch
    of 16 prompts of 128 tokens ran 16 SDPA calls and 32 gathers per layer before."""

    rows: torch.Tensor  # [n * q_len] int64: rows of q, sequence by sequence
    blocks: torch.Tensor  # [n * num_blocks] int64: each sequence's blocks
    n: int
    q_len: int  # = its context length


@dataclass
class DecodeRows:
    """The decode sequences as the C++ kernel reads them (cpu_attention.py): in place, no chunks."""

    rows: torch.Tensor  # [n] int64: rows of q
    block_tables: torch.Tensor  # [n, max_blocks] int32, contiguous
    seq_lens: torch.Tensor  # [n] int64


@dataclass
class PrefillRows:
    """The prefill sequences as the C++ kernel reads them (cpu_attention.py): in place."""

    block_tables: torch.Tensor  # [n, max_blocks] int32, contiguous
    seq_lens: torch.Tensor  # [n] int64: context including the new tokens
    q_starts: torch.Tensor  # [n] int64: first row of q
    q_lens: torch.Tensor  # [n] int64: new tokens (> 1)


@dataclass
class AttentionPlan:
    """What paged_attention derives from the batch layout alone; the same for every layer,
    so the model runner builds it once per step."""

    decode: list[DecodeChunk]
    prefill: list[PrefillSeq]
    max_query_len: int | None = None  # longest new-token count of the batch
    decode_rows: DecodeRows | None = None  # instead of `decode` (plan_attention(..., in_place=True))
    prefill_batches: list[PrefillBatch] = field(default_factory=list)  # the rest of the prefills
    max_seq_len: int | None = None  # longest context of the batch (the Triton kernel's split)
    prefill_rows: PrefillRows | None = None  # instead of `prefill` and `prefill_batches` (in_place=True)
    # an in-place plan's prefills as the torch path reads them (prefill_plan), made on first use
    # by a kernel path that sends them there (cpu_attention.py), then read by every layer
    torch_prefills: AttentionPlan | None = None

    @property
    def prefills(self) -> bool:
        return bool(self.prefill or self.prefill_batches
                    or (self.prefill_rows is not None and self.prefill_rows.q_lens.numel()))


def plan_attention(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                   block_size: int, kv_bytes_per_token: int, in_place: bool = False) -> AttentionPlan:
    """kv_bytes_per_token: K + V bytes of one token in one layer (2 * kv_heads * head_dim * itemsize).
    in_place: the decode sequences as DecodeRows and the prefills as PrefillRows (for kernels
    that read the cache in place)."""
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    if in_place:
        return _in_place_plan(block_tables, seq_lens, qsl, lens)
    tables = block_tables.to(torch.long)
    decode_idx = [s for s in range(len(lens)) if qsl[s + 1] - qsl[s] == 1]
    chunks = []
    for members, nb in _decode_chunks([lens[s] for s in decode_idx], block_size, kv_bytes_per_token):
        seqs = [decode_idx[m] for m in members]
        ctx = torch.tensor([lens[s] for s in seqs])
        chunks.append(DecodeChunk(
            rows=torch.tensor([qsl[s] for s in seqs], dtype=torch.long),
            blocks=tables[seqs, :nb].reshape(-1),
            num_blocks=nb,
            mask=(torch.arange(nb * block_size)[None, :] < ctx[:, None])[:, None, None, :],
        ))
    prefill, batches = _prefills(tables, qsl, lens, block_size)
    return AttentionPlan(chunks, prefill, max(b - a for a, b in zip(qsl, qsl[1:])) if lens else 0,
                         prefill_batches=batches)


def prefill_plan(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                 block_size: int) -> AttentionPlan:
    """plan_attention's prefills alone (its decode sequences left out): for a kernel path that
    runs the decode rows in place and the prefills through the torch path."""
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    prefill, batches = _prefills(block_tables.to(torch.long), qsl, lens, block_size)
    return AttentionPlan([], prefill, max(b - a for a, b in zip(qsl, qsl[1:])) if lens else 0,
                         prefill_batches=batches)


def _prefills(tables: torch.Tensor, qsl: list[int], lens: list[int],
              block_size: int) -> tuple[list[PrefillSeq], list[PrefillBatch]]:
    """The prefill sequences: fresh prompts of one length batched, the others one by one with masks."""
    prefill, fresh = [], {}
    for s in range(len(lens)):
        q_len = qsl[s + 1] - qsl[s]
        if q_len > 1:
            ctx = lens[s]
            if q_len == ctx:
                fresh.setdefault(ctx, []).append(s)
                continue
            q_pos = torch.arange(ctx - q_len, ctx)
            mask = torch.arange(ctx)[None, :] <= q_pos[:, None]
            prefill.append(PrefillSeq(qsl[s], qsl[s + 1], tables[s, : (ctx + block_size - 1) // block_size], ctx,
                                      mask))
    batches = []
    for ctx, seqs in fresh.items():
        nb = (ctx + block_size - 1) // block_size
        if len(seqs) == 1:
            s = seqs[0]
            prefill.append(PrefillSeq(qsl[s], qsl[s + 1], tables[s, :nb], ctx, None))
        else:
            batches.append(PrefillBatch(torch.cat([torch.arange(qsl[s], qsl[s + 1]) for s in seqs]),
                                        tables[seqs, :nb].reshape(-1), len(seqs), ctx))
    return prefill, batches


def _in_place_plan(block_tables: torch.Tensor, seq_lens: torch.Tensor, qsl: list[int], lens: list[int]) -> AttentionPlan:
    """The decode and the prefill sequences as rows, for the kernels that read the cache in place."""
    def rows_of(seqs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.tensor(seqs, dtype=torch.long)
        return (block_tables.index_select(0, idx).to(torch.int32).contiguous(),
                seq_lens.index_select(0, idx).to(torch.long).contiguous())
    dec = [s for s in range(len(lens)) if qsl[s + 1] - qsl[s] == 1]
    pre = [s for s in range(len(lens)) if qsl[s + 1] - qsl[s] > 1]
    rows = DecodeRows(torch.tensor([qsl[s] for s in dec], dtype=torch.long), *rows_of(dec))
    prefill_rows = PrefillRows(*rows_of(pre), torch.tensor([qsl[s] for s in pre], dtype=torch.long),
                               torch.tensor([qsl[s + 1] - qsl[s] for s in pre], dtype=torch.long))
    return AttentionPlan([], [], max(b - a for a, b in zip(qsl, qsl[1:])) if lens else 0, rows,
                         prefill_rows=prefill_rows)


def _decode_chunks(ctx_lens: list[int], block_size: int, bytes_per_token: int) -> list[tuple[list[int], int]]:
    """Group positions of `ctx_lens` (sorted by length) into (members, padded blocks) chunks."""
    order = sorted(range(len(ctx_lens)), key=ctx_lens.__getitem__)
    chunks: list[tuple[list[int], int]] = []
    members: list[int] = []
    for i in order:
        nb = (ctx_lens[i] + block_size - 1) // block_size
        if members and (len(members) + 1) * nb * block_size * bytes_per_token > _DECODE_CHUNK_BYTES:
            chunks.append((members, (ctx_lens[members[-1]] + block_size - 1) // block_size))
            members = []
        members.append(i)
    if members:
        chunks.append((members, (ctx_lens[members[-1]] + block_size - 1) // block_size))
    return chunks


def kv_bytes_per_token(k_cache: torch.Tensor) -> int:
    return 2 * k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()

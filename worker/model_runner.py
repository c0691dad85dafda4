"""Builds the batch tensors for one step and runs the model on them.

For each scheduled (sequence, n): its tokens [num_computed, num_computed + n)
are packed into one flat batch:

    input_ids / positions / slot_mapping   [num_tokens]
    query_start_loc                        [num_seqs + 1]   cumulative n
    seq_lens                               [num_seqs]       num_computed + n
    block_tables                           [num_seqs, max_blocks] (zero-padded)

A sequence whose tokens are then all computed is sampled from its last row.

ModelRunner is the engine's Runner (runner.py) on a real model: `run` = prepare + execute.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from folio import kernels
from folio.kernels.linear import warm_row_buckets
from folio.worker import hugepages
from folio.worker.block_manager import KVCacheManager, cdiv
from folio.worker.models.llama import AttentionMetadata, LlamaModel
from folio.worker.runner import ModelInfo
from folio.worker.sampler import SampleResult, sample
from folio.worker.sequence import Sequence


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    sample_rows: list[int]  # rows of the hidden states to sample from
    sample_seqs: list[Sequence]  # the sequence of each of those rows
    # prompt logprobs to compute: (request, index of the first prompt token, rows predicting them)
    prompt_rows: list = field(default_factory=list)


def step_tensors(inputs: ModelInputs) -> dict[str, torch.Tensor]:
    """What a tensor-parallel follower needs of a step's inputs (on the CPU, for the broadcast)."""
    m = inputs.meta
    return {"input_ids": inputs.input_ids.cpu(), "positions": inputs.positions.cpu(),
            "slot_mapping": m.slot_mapping.cpu(), "block_tables": m.block_tables.cpu(), "seq_lens": m.seq_lens.cpu(),
            "query_start_loc": m.query_start_loc.cpu()}


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, num_cpu_blocks: int = 0, layout: str = "block_major",
                 info: ModelInfo | None = None) -> None:
        c = model.config
        self.model = model
        self.info = info  # set by runner.load_runner
        self.block_size = block_size
        self.device = device
        # One allocation for the whole cache, laid out
        #   block_major: [blocks, layers, k|v, block_size, kv_heads, head_dim] (the default)
        #   layer_major: [layers, k|v, blocks, block_size, kv_heads, head_dim]
        # Either way each layer sees K and V as views of DESIGN.md's shape [blocks, block_size,
        # kv_heads, head_dim] (strided in block_major), and kv_blocks is a blocks-first view.
        # block_major keeps a block's K and V of every layer in one contiguous range, so a run of
        # swapped blocks is one copy (vLLM's "cross-layer blocks"). On this 2-core CPU swaps run at
        # 59-78 % of a plain copy of the same bytes, layer_major at 43-74 % (preemption.py). Its
        # cost is on CPU only: a layer's blocks are strided, so attention's gathers of in-order
        # blocks lose the prefetcher's sequential streams (decode 4 % slower at block size 16).
        kv_heads = model.num_kv_heads  # this rank's, under tensor parallelism

        def cache(n: int, **kw) -> torch.Tensor:
            # in host memory on huge pages (hugepages.py: attention's scattered block reads miss the
            # TLB on 4 KB pages); pinned host blocks and device caches as torch allocates them
            host = kw.get("device", torch.device("cpu")).type == "cpu" and not kw.get("pin_memory")
            alloc = (lambda *shape: hugepages.zeros(*shape, dtype=dtype)) if host else (
                lambda *shape: torch.zeros(*shape, dtype=dtype, **kw))
            if layout == "block_major":
                return alloc(n, c.num_layers, 2, block_size, kv_heads, c.head_dim)
            return alloc(c.num_layers, 2, n, block_size, kv_heads, c.head_dim).permute(2, 0, 1, 3, 4, 5)

        self.kv_blocks = cache(num_blocks, device=device)  # [blocks, layers, k|v, block_size, kv_heads, head_dim]
        self.kv_caches = [(self.kv_blocks[:, i, 0], self.kv_blocks[:, i, 1]) for i in range(c.num_layers)]
        # Swap space, same layout; pinned so device <-> host copies run at full speed on CUDA.
        # Committed up front (zeroed), as pinning does on CUDA: left to first-touch page
        # faults, swap-outs ran at 15-34 % of a plain copy instead of 29-48 % (preemption.py).
        self.host_blocks = cache(num_cpu_blocks, pin_memory=device.type == "cuda")
        self.bytes_per_block = self.kv_blocks[0].numel() * self.kv_blocks.element_size()
        # per-block views for swap_blocks, made once (slicing them per swap cost more than the copy
        # setup itself); built when the first swap needs them
        self._block_views: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    @property
    def block_shape(self) -> tuple[int, ...]:
        return tuple(self.kv_blocks.shape[1:])

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> int:
        """Run a step's swaps, all blocks and layers in one call per direction (outs first).
        Returns the bytes moved."""
        if self._block_views is None:
            self._block_views = list(self.kv_blocks.unbind(0)), list(self.host_blocks.unbind(0))
        dev, host = self._block_views
        for pairs, src, dst, src_views, dst_views in ((swap_out, self.kv_blocks, self.host_blocks, dev, host),
                                                      (swap_in, self.host_blocks, self.kv_blocks, host, dev)):
            if pairs:
                self.model.ops.swap_blocks(src, dst, pairs, src_views, dst_views)
        if (swap_out or swap_in) and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return (len(swap_out) + len(swap_in)) * self.bytes_per_block

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            mapping = torch.tensor(pairs, dtype=torch.long, device=self.device)
            self.model.ops.copy_blocks([k for k, _ in self.kv_caches], [v for _, v in self.kv_caches], mapping)

    def warm_up(self, max_num_tokens: int, max_num_seqs: int) -> int:
        """Build the linear layers' per-shape kernel state for every batch size the engine can
        run (kernels/linear.py: warm_row_buckets); the LM head only sees sampled rows."""
        m = self.model
        layers = [lin for layer in m.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [
            (m.lm_head, max_num_seqs)]
        if self.lanes is None:
            return warm_row_buckets(layers, max_num_tokens)
        # oneDNN's state is per thread count: the lanes run on one thread, this one on n (wide)
        self.lanes.each(lambda: warm_row_buckets(layers, max_num_tokens))
        with self.lanes.wide():
            return warm_row_buckets(layers, max_num_tokens)

    lanes = None  # forward_lanes.Lanes: a CPU batch split over one-thread lanes (load_shard sets it)

    def run(self, scheduled: list[tuple[Sequence, int]], kv: KVCacheManager
            ) -> tuple[list[Sequence], torch.Tensor | None]:
        parts = self.lanes.split(scheduled) if self.lanes is not None else None
        if parts is None:
            inputs = self.prepare(scheduled, kv)
            if self.lanes is None:
                return inputs.sample_seqs, self.execute(inputs)
            with self.lanes.wide():
                return inputs.sample_seqs, self.execute(inputs)
        prepared = [self.prepare(part, kv) for part in parts]
        logits = [x for x in self.lanes.map(self.execute, prepared) if x is not None]
        return [s for inputs in prepared for s in inputs.sample_seqs], (torch.cat(logits) if logits else None)

    def sample(self, logits: torch.Tensor, params: list, generators: list, seqs: list[Sequence], eos_token_ids,
               grammars) -> SampleResult:
        return sample(logits, params, generators, seqs, eos_token_ids, grammars)

    def process_ids(self) -> list[int]:
        return [os.getpid()]

    def healthy(self) -> bool:
        try:
            self.probe()
            return True
        except Exception:
            return False

    def probe(self) -> None:
        """A forward of one dummy token that writes no KV (slot -1), and one LM-head call;
        .item() syncs, so a device error surfaces here (raised)."""
        dev = self.device
        meta = AttentionMetadata(slot_mapping=torch.tensor([-1], dtype=torch.long, device=dev),
                                 block_tables=torch.zeros((1, 1), dtype=torch.int32, device=dev),
                                 seq_lens=torch.ones(1, dtype=torch.int32, device=dev),
                                 query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=dev))
        self._plan(meta)
        zero = torch.zeros(1, dtype=torch.long, device=dev)
        hidden = self.model.forward(zero, zero, meta, self.kv_caches)
        self.model.compute_logits(hidden).float().sum().item()

    def read_blocks(self, blocks: list[int], on_host: bool) -> torch.Tensor:
        src = self.host_blocks if on_host else self.kv_blocks
        return src.index_select(0, torch.tensor(blocks, dtype=torch.long, device=src.device)).cpu()

    def write_host_blocks(self, blocks: list[int], data: torch.Tensor) -> None:
        self.host_blocks.index_copy_(0, torch.tensor(blocks, dtype=torch.long), data.to(self.host_blocks.dtype))

    def prepare(self, scheduled: list[tuple[Sequence, int]], kv: KVCacheManager) -> ModelInputs:
        B = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        prompt_rows: list = []
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            end = start + n
            table = kv.block_table(seq)
            if n == 1:
                ids.append(seq.token_ids[start])
                pos.append(start)
                slots.append(table[start // B] * B + start % B)
            else:
                ids.extend(seq.token_ids[start:end])
                pos.extend(range(start, end))
                slots.extend([table[p // B] * B + p % B for p in range(start, end)])
            qsl.append(qsl[-1] + n)
            seq_lens.append(end)
            tables.append(table[: cdiv(end, B)])
            if end == seq.num_tokens:
                sample_rows.append(qsl[-1] - 1)
                sample_seqs.append(seq)
            group = seq.group
            if group.prompt_logprobs is not None:  # position j's logits give prompt token j + 1's logprob
                lo, hi = max(start, group.prompt_logprobs_done - 1), min(end, len(group.prompt_token_ids) - 1)
                if lo < hi:
                    prompt_rows.append((group, lo + 1, range(qsl[-2] + lo - start, qsl[-2] + hi - start)))
        width = max(len(t) for t in tables)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        )
        self._plan(meta)
        return ModelInputs(torch.tensor(ids, dtype=torch.long, device=dev),
                           torch.tensor(pos, dtype=torch.long, device=dev), meta, sample_rows, sample_seqs,
                           prompt_rows)

    def _plan(self, meta: AttentionMetadata) -> None:
        """The layout every layer's attention reads (kernels/attention_plan.py), once per step."""
        meta.plan = self.model.ops.plan_attention(meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                                  self.block_size, kernels.kv_bytes_per_token(self.kv_caches[0][0]))

    def execute(self, inputs: ModelInputs, batches: list[list[int]] | None = None) -> torch.Tensor | None:
        """Run the model; logits [len(sample_rows), vocab] in the model's dtype (the sampler makes
        float32 what it needs to), or None if nothing samples.
        The LM-head calls are those of `batches` (logit_batches(inputs) when not given), in order."""
        hidden = self.model.forward(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches)
        batches = iter(self.logit_batches(inputs) if batches is None else batches)
        if inputs.prompt_rows:
            self._prompt_logprobs(hidden, inputs.prompt_rows, batches)
        if not inputs.sample_rows:
            return None
        return self._logits(hidden, next(batches), as_float=False)

    def _logits(self, hidden: torch.Tensor, rows: list[int], as_float: bool = True) -> torch.Tensor:
        idx = torch.tensor(rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, idx))
        return logits.float() if as_float else logits

    PROMPT_LOGITS_ROWS = 256  # prompt positions per LM-head call (bounds the [rows, vocab] logits)

    def logit_batches(self, inputs: ModelInputs) -> list[list[int]]:
        """The hidden rows of each LM-head call a step makes, in order: prompt logprobs'
        chunks, then the sampled rows (a tensor-parallel follower replays the same calls)."""
        out = [list(rows[a: a + self.PROMPT_LOGITS_ROWS]) for _, _, rows in inputs.prompt_rows
               for a in range(0, len(rows), self.PROMPT_LOGITS_ROWS)]
        return out + [inputs.sample_rows] if inputs.sample_rows else out

    def replay(self, tensors: dict, batches: list[list[int]]) -> None:
        """A tensor-parallel follower's step: rank 0's inputs (step_tensors) on this rank's shard."""
        t = {k: v.to(self.device) for k, v in tensors.items()}  # broadcast on the CPU
        meta = AttentionMetadata(slot_mapping=t["slot_mapping"], block_tables=t["block_tables"],
                                 seq_lens=t["seq_lens"], query_start_loc=t["query_start_loc"])
        self._plan(meta)
        hidden = self.model.forward(t["input_ids"], t["positions"], meta, self.kv_caches)
        for rows in batches:
            self._logits(hidden, rows)

    def _prompt_logprobs(self, hidden: torch.Tensor, prompt_rows: list, batches) -> None:
        """Each requested prompt token's logprob and the top-k, appended to its request's list
        (only positions it has none for yet: a forward run again after a fault or a recompute
        adds nothing twice)."""
        computed = []
        for group, first, rows in prompt_rows:
            k = group.params.prompt_logprobs
            targets = group.prompt_token_ids[first : first + len(rows)]
            out: list[dict[int, float]] = []
            for a in range(0, len(rows), self.PROMPT_LOGITS_ROWS):
                idx = next(batches)
                lp = torch.log_softmax(self._logits(hidden, idx), dim=-1)
                tgt = torch.tensor(targets[a : a + len(idx)], dtype=torch.long, device=self.device)
                chosen = lp.gather(1, tgt[:, None])[:, 0].tolist()
                top = lp.topk(k, dim=-1) if k else None
                for r, (t, c) in enumerate(zip(targets[a : a + len(idx)], chosen)):
                    d = {t: c}
                    if top is not None:
                        for v, i in zip(top.values[r].tolist(), top.indices[r].tolist()):
                            d.setdefault(i, v)
                    out.append(d)
            computed.append((group, first, out))
        for group, first, out in computed:  # kept only once every row is computed
            have = len(group.prompt_logprobs)
            if first <= have:
                group.prompt_logprobs.extend(out[have - first:])


"""Decode GGUF tensors to float32: the whole tensor, or only a slice's rows and blocks.

The 8- and 4-bit block formats Folio meets most (Q8_0, Q4_0, Q4_1) are decoded here in torch;
the K-quants and the rest go through gguf's own numpy dequantizers. A tensor-parallel rank
decodes only its rows / blocks (gguf_loader.GGUFTensors asks for them).
"""

from __future__ import annotations

import numpy as np
import torch

from folio.worker.errors import ModelLoadError


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian float16 from a (..., 2) uint8 tensor, as float32."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, 16) packed bytes -> (n, 32): the low nibbles are elements 0..15, the high ones 16..31."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:  # 2-byte scale, 32 int8
    return _f16(blocks[:, :2]) * blocks[:, 2:].contiguous().view(torch.int8).float()


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:  # 2-byte scale, 16 bytes of 4-bit (q - 8)
    return _f16(blocks[:, :2]) * (_nibbles(blocks[:, 2:]).float() - 8.0)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:  # 2-byte scale, 2-byte min, 16 bytes of 4-bit q
    return _f16(blocks[:, :2]) * _nibbles(blocks[:, 4:]).float() + _f16(blocks[:, 2:4])


_BLOCK_DEQUANT = {"Q8_0": (34, _q8_0), "Q4_0": (18, _q4_0), "Q4_1": (20, _q4_1)}


def dequantize(t, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> torch.Tensor:
    """A gguf ReaderTensor as a float32 torch tensor in PyTorch's (row-major) shape, or only its
    rows [a, b) and columns [c, d) of a 2-D tensor. Each row of a GGUF tensor is stored whole (its
    quantized blocks run along the row), so a row range reads only those rows' bytes; a column
    range at block boundaries reads only those blocks, one elsewhere decodes the rows and narrows.
    A tensor-parallel rank thus reads and decodes its own slice, never the whole model."""
    import gguf

    kind = t.tensor_type.name
    shape = list(torch_shape(t))
    raw = np.asarray(t.data)
    if (rows or cols) and len(shape) != 2:
        raise ValueError(f"tensor {t.name!r}: a row or column slice of a {len(shape)}-D tensor")
    if rows is not None:
        raw, shape[0] = raw[rows[0]:rows[1]], rows[1] - rows[0]
    narrow = None
    if cols is not None:
        # (quantized rows are bytes, float rows their elements)
        elems, nbytes = gguf.GGML_QUANT_SIZES[t.tensor_type] if raw.dtype == np.uint8 else (1, 1)
        if cols[0] % elems == 0 and (cols[1] % elems == 0 or cols[1] == shape[1]):
            raw = raw[:, cols[0] // elems * nbytes:-(-cols[1] // elems) * nbytes]
            shape[1] = cols[1] - cols[0]
        else:  # not at a block boundary: decode the rows, keep the columns
            narrow = cols
    w = _decode(t, kind, np.ascontiguousarray(raw), tuple(shape) if narrow is None else (shape[0], -1))
    return w if narrow is None else w[:, narrow[0]:narrow[1]].contiguous()


def torch_shape(t) -> tuple[int, ...]:
    """A gguf ReaderTensor's shape in PyTorch's order (GGUF lists the innermost dimension first)."""
    return tuple(int(d) for d in reversed(t.shape))


def _decode(t, kind: str, raw: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """`raw` (contiguous: the tensor's data, or the rows and blocks of a slice) decoded to float32."""
    import gguf

    if kind in ("F32", "F16"):
        return torch.from_numpy(raw.astype(np.float32)).reshape(shape)
    if kind == "BF16":
        bits = torch.from_numpy(raw.reshape(-1).copy()).view(torch.int16).to(torch.int32) << 16
        return bits.view(torch.float32).reshape(shape)
    if kind in _BLOCK_DEQUANT:
        size, fn = _BLOCK_DEQUANT[kind]
        blocks = torch.from_numpy(raw.reshape(-1).copy()).reshape(-1, size)
        return fn(blocks).reshape(shape)
    try:  # the K-quants and the rest: gguf's own numpy dequantizers
        return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, t.tensor_type),
                                                     dtype=np.float32)).reshape(shape)
    except NotImplementedError as e:
        raise ModelLoadError(f"tensor {t.name!r}: GGUF type {kind} cannot be dequantized: {e}") from e

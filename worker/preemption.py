"""Preemption policy: which running sequence to evict, and how (swap or recompute).

Pure functions; the scheduler applies them and the engine feeds the measured rates.
"""

from __future__ import annotations

from dataclasses import dataclass

from folio.worker.sequence import Sequence

PREEMPTION_MODES = ("auto", "swap", "recompute")


def choose_victim(running: list[Sequence]) -> Sequence:
    """The lowest priority (largest value) first, then the latest arrival."""
    return max(running, key=lambda s: (s.priority, s.arrival_time, s.seq_id))


@dataclass
class PreemptionRates:
    """Measured by the engine as it runs; None until first measured."""

    swap_bytes_per_s: float | None = None  # device <-> host copy, one direction
    prefill_tokens_per_s: float | None = None  # forward throughput on prompt-sized batches

    @staticmethod
    def ema(old: float | None, new: float, weight: float = 0.2) -> float:
        return new if old is None else (1 - weight) * old + weight * new


def choose_mode(mode: str, kv_bytes: int, num_computed_tokens: int, rates: PreemptionRates) -> str:
    """'swap' or 'recompute' for one victim.

    auto: swapping costs the bytes moved out and back in; recomputing costs a prefill
    of every computed token. Until both rates are measured, auto swaps (moving bytes is
    cheaper than recomputing them on every device Folio targets).
    """
    if mode != "auto":
        return mode
    if rates.swap_bytes_per_s is None or rates.prefill_tokens_per_s is None:
        return "swap"
    swap_s = 2 * kv_bytes / rates.swap_bytes_per_s
    recompute_s = num_computed_tokens / rates.prefill_tokens_per_s
    return "swap" if swap_s <= recompute_s else "recompute"

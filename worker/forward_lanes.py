"""Forward lanes: a CPU step's batch split over threads that each run one OpenMP thread.
Off by default (forward_lanes=1): an experiment of #15, see the README's "Forward lanes".

One forward on torch's two OpenMP threads splits every operation statically between them and
joins them at its end: a few hundred barriers per step, and at each one the faster thread
waits, so a core taken by another process stalls the team. With two lanes, each running half
of the batch on one OpenMP thread, a step waits for its slower half once. Measured on the 2-core
EPYC here, 64 streams of 50 -> 100 tokens in-process beside a process taking 0.3 of a core
(cpu_contention.py, benchmarks/results/forward_lanes_contention.json): the lanes lost 17.7 % of
their tok/s to it, one wide forward 31.8 %; served (`folio serve`, serving_path_cost.py, two
A B B A pairs) no gain showed within this machine's noise.

`Lanes(n)` holds n threads whose OpenMP thread count is 1 (OpenMP's thread count is per OS
thread: the step thread keeps its own); `split` cuts a batch into n parts of about equal tokens,
a request's sequences kept together (their prompt logprobs are one list), and `map` runs one
call per part, each on its own lane, and returns their results in order. Each lane has its own
attention scratch buffers (kernels/reference.py keeps them per thread) and writes only its own
sequences' KV slots.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading

# Smaller batches run wide (one forward on n threads). Each lane's Python takes the GIL between
# operations, and with two lanes every operation hands it over: decode steps of 2-16 sequences ran
# in ~2x the time of one wide forward, 32 in about the same, 64 and 128 the same or faster
# (2-core EPYC, 2026-12-03, one pass of what benchmarks/forward_lanes.py now runs A B B A).
MIN_SEQS_PER_LANE = 16


def _one_thread(ready: threading.Barrier) -> None:
    import torch

    torch.set_num_threads(1)  # this thread's OpenMP count (and torch's default for new threads)
    ready.wait()


def split(scheduled: list, lanes: int, min_per_lane: int) -> list[list] | None:
    """`scheduled` ((sequence, tokens) pairs) in up to `lanes` parts of about equal tokens, each
    request's sequences in one part (in their order; the requests in their first one's order);
    None when it has fewer than 2 * min_per_lane pairs or is one request."""
    if len(scheduled) < max(min_per_lane * 2, 2):
        return None
    requests: dict[int, list] = {}
    for seq, n in scheduled:
        requests.setdefault(id(seq.group), []).append((seq, n))
    total = sum(n for _, n in scheduled)
    parts: list[list] = [[]]
    done = 0
    for pairs in requests.values():
        tokens = sum(n for _, n in pairs)
        # a new part once this request's middle would pass the current part's end
        if len(parts) < lanes and parts[-1] and done + tokens / 2 >= total * len(parts) / lanes:
            parts.append([])
        parts[-1].extend(pairs)
        done += tokens
    return parts if len(parts) > 1 else None


class Lanes:
    def __init__(self, n: int) -> None:
        import torch

        if n < 2:
            raise ValueError(f"forward lanes need at least 2 threads, got {n}")
        self.n = n
        ready = threading.Barrier(n + 1)
        self._pool = concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="folio-lane",
                                                           initializer=_one_thread, initargs=(ready,))
        for _ in range(n):  # make every lane now (the pool makes one per submit until it has n)
            self._pool.submit(int)
        ready.wait()
        # the calling (step) thread runs on one OpenMP thread too: a team of its own would spin
        # after each of its parallel regions (libgomp's GOMP_SPINCOUNT), taking a core from the lanes
        torch.set_num_threads(1)

    @contextlib.contextmanager
    def wide(self):
        """The calling thread on n OpenMP threads for a batch too small to split (one prefill,
        a few decodes: a lane alone would leave a core idle), then on one again."""
        import torch

        torch.set_num_threads(self.n)
        try:
            yield
        finally:
            torch.set_num_threads(1)

    def split(self, scheduled: list) -> list[list] | None:
        return split(scheduled, self.n, MIN_SEQS_PER_LANE)

    def map(self, fn, items: list) -> list:
        """fn(item) for each item, each on its own lane; the first exception is raised after
        every call has ended (no lane still runs on the batch when this returns)."""
        futures = [self._pool.submit(fn, item) for item in items]
        concurrent.futures.wait(futures)
        return [f.result() for f in futures]

    def each(self, fn) -> None:
        """fn() once on every lane (warm-up: the state oneDNN keeps per thread count and thread)."""
        barrier = threading.Barrier(self.n)

        def run(_):
            barrier.wait()  # one call per lane: none takes a second before all have one
            fn()
        self.map(run, range(self.n))

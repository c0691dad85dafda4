"""Where a tensor-parallel group's ranks 1..N-1 run (tp_runner.py runs them): as Ray actors
in the worker's placement group, or as processes of rank 0's own.

- In a cluster (rank 0 is a worker actor scheduled in a placement group of N bundles, one GPU
  each, packed on one node: cluster/launcher.py), rank r is a `RankActor` in bundle r, one GPU
  of its own (as Ray Serve LLM places vLLM's ranks). Rank 0 owns the actors: when its process
  dies Ray kills them, and the restarted worker starts a new group in the same bundles.
- Elsewhere (the offline `LLM`, a worker outside a placement group) rank r is a fresh
  interpreter that rank 0 starts (not multiprocessing: no re-import of the caller's __main__,
  no fork of a process holding threads).

Either way a follower is held through the same handle (`pid`, `wait(timeout)` raising
subprocess.TimeoutExpired, `kill()`, as subprocess.Popen has), joins the group's TCPStore on
rank 0's loopback port, and follows rank 0's announcements until it says stop or the group
breaks. Each rank sees one device: with Ray its own GPU is device 0 (`own_device`); without,
rank r takes the r-th device after config.device's.
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def current_placement_group():
    """The Ray placement group this process was scheduled in, or None (no Ray, or not in one)."""
    if "ray" not in sys.modules:  # the offline engine never imports Ray for this
        return None
    import ray

    if not ray.is_initialized():
        return None
    from ray.util import get_current_placement_group

    return get_current_placement_group()


def run_follower(config, rank: int, port: int, threads: int, own_device: bool) -> None:
    """Load rank `rank`'s shard, join the group and follow rank 0 until it stops."""
    import torch

    from folio.worker.runner import load_shard
    from folio.worker.tp_runner import follow

    torch.set_num_threads(threads)
    runner, group = load_shard(config, rank, port, own_device=own_device)
    try:
        follow(runner, group)
    finally:
        group.close()


def follower_main() -> None:
    """A follower process's entry: (config, rank, port, threads) pickled on stdin."""
    config, rank, port, threads = pickle.loads(sys.stdin.buffer.read())
    run_follower(config, rank, port, threads, own_device=False)


def start_processes(config, port: int, threads: int) -> list[subprocess.Popen]:
    procs = []
    for rank in range(1, config.tensor_parallel_size):
        p = subprocess.Popen([sys.executable, "-c", "from folio.worker.tp_ranks import follower_main; "
                              "follower_main()"], stdin=subprocess.PIPE)
        p.stdin.write(pickle.dumps((config, rank, port, threads)))
        p.stdin.close()
        procs.append(p)
    return procs


class RankActor:
    """Rank r of a group as a Ray actor (placed in bundle r of its worker's placement group)."""

    def pid(self) -> int:
        return os.getpid()

    def follow(self, config, rank: int, port: int, threads: int) -> None:
        run_follower(config, rank, port, threads, own_device=True)


class RayRank:
    """A follower actor behind Popen's interface: its `follow` call ends with the group."""

    def __init__(self, actor, pid, done) -> None:
        self.actor, self._pid, self.done = actor, pid, done  # pid: a ref until first read

    @property
    def pid(self) -> int:
        import ray

        if not isinstance(self._pid, int):
            self._pid = ray.get(self._pid)
        return self._pid

    def wait(self, timeout: float | None = None) -> None:
        import ray

        ready, _ = ray.wait([self.done], timeout=timeout)
        if not ready:
            raise subprocess.TimeoutExpired(f"rank actor {self.pid}", timeout)
        self.kill()  # it has followed to the end: free its bundle

    def kill(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)


def start_actors(pg, config, port: int, threads: int) -> list[RayRank]:
    """Ranks 1..N-1 as actors in bundles 1..N-1 of `pg`, each taking its bundle's resources."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if len(pg.bundle_specs) < config.tensor_parallel_size:
        from folio.worker.errors import ConfigError

        raise ConfigError(f"tensor_parallel_size={config.tensor_parallel_size} but this worker's placement "
                          f"group has {len(pg.bundle_specs)} bundles (one per rank)")
    ranks = []
    try:
        for rank in range(1, config.tensor_parallel_size):
            spec = pg.bundle_specs[rank]
            actor = ray.remote(RankActor).options(
                num_cpus=spec.get("CPU", 0), num_gpus=spec.get("GPU", 0), max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank)).remote()
            # (in this order: the actor runs one call at a time, and follow lasts as long as the group)
            ranks.append(RayRank(actor, actor.pid.remote(), actor.follow.remote(config, rank, port, threads)))
    except BaseException:
        for r in ranks:
            r.kill()
        raise
    return ranks


def start_followers(config, port: int, threads: int) -> tuple[list, bool]:
    """Ranks 1..N-1 (actors in this worker's placement group, else processes) and whether each
    rank has a device of its own (own_device: Ray gave it one GPU)."""
    pg = current_placement_group()
    if pg is None:
        return start_processes(config, port, threads), False
    return start_actors(pg, config, port, threads), True

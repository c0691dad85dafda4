"""`folio serve`: start a cluster and keep it up until SIGINT / SIGTERM.

Starts Ray locally (or joins `--address`), an embedded Redis unless `--redis-url`
is given, one worker per GPU, the coordinator and the router. On SIGINT/SIGTERM it
stops admitting, gives in-flight requests `--grace-period-s` to finish, aborts the
rest and releases everything (workers leave the Redis registry at once).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time

from folio.cluster.policies import POLICIES


def add_serve_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="run a Folio cluster: Ray workers, router, coordinator, Redis state")
    p.add_argument("--model", required=True, help="local Hugging Face checkpoint directory")
    p.add_argument("--num-workers", type=int, default=1, help="workers, one per GPU")
    p.add_argument("--redis-url", default=None, help="external Redis (default: an embedded server)")
    p.add_argument("--router", choices=POLICIES, default="prefix-aware")
    p.add_argument("--address", default=None, help="join this Ray cluster instead of starting one")
    p.add_argument("--namespace", default="folio", help="Redis key prefix and Ray namespace")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--preemption-mode", choices=["auto", "swap", "recompute"], default="auto")
    p.add_argument("--swap-space-gb", type=float, default=4.0)
    p.add_argument("--worker-num-cpus", type=float, default=0.5)
    p.add_argument("--grace-period-s", type=float, default=30.0, help="drain time on SIGINT/SIGTERM")
    return p


def cluster_config(args):
    from folio.cluster.app import ClusterConfig

    engine = dict(block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                  kv_cache_memory_gb=args.kv_cache_memory_gb, max_model_len=args.max_model_len,
                  max_num_seqs=args.max_num_seqs, dtype=args.dtype, preemption_mode=args.preemption_mode,
                  swap_space_gb=args.swap_space_gb)
    return ClusterConfig(model=args.model, num_workers=args.num_workers, redis_url=args.redis_url,
                         router=args.router, address=args.address, namespace=args.namespace, engine=engine,
                         worker_num_cpus=args.worker_num_cpus)


def serve(args) -> int:
    from folio.cluster.app import FolioCluster
    from folio.worker.errors import FolioError

    try:
        cluster = FolioCluster(cluster_config(args))
    except FolioError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    try:
        cluster.start()
    except FolioError as e:
        print(f"error: {e}", file=sys.stderr)
        cluster.shutdown(grace_s=0)  # whatever did start
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs its own handlers
        signal.signal(sig, lambda *_: stop.set())
    print(f"folio serve: ready in {time.monotonic() - t0:.1f} s: {args.num_workers} workers, router "
          f"{args.router}, redis {cluster.redis_url}" + (" (embedded)" if cluster.redis else ""), flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        print(f"folio serve: draining (up to {args.grace_period_s:.0f} s)", flush=True)
        cluster.shutdown(grace_s=args.grace_period_s)
        print("folio serve: stopped", flush=True)
    return 0

"""`folio serve`: start a cluster and keep it up until SIGINT / SIGTERM.

Starts Ray locally (or joins `--address`), an embedded Redis unless `--redis-url`
is given, one worker per GPU, the coordinator and the router. On SIGINT/SIGTERM it
stops admitting, gives in-flight requests `--grace-period-s` to finish, aborts the
rest and releases everything (workers leave the Redis registry at once).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

from folio.cluster.policies import POLICIES


def add_serve_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="run a Folio cluster: Ray workers, router, coordinator, Redis state")
    p.add_argument("--model", required=True, help="a local Hugging Face checkpoint directory or a GGUF file")
    p.add_argument("--tokenizer", default=None, help="the tokenizer's directory (default: the model's own)")
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
    p.add_argument("--kv-cache-layout", choices=["block_major", "layer_major"], default="block_major",
                   help="block_major: a block's KV for all layers contiguous (fast swaps); layer_major: "
                        "a layer's blocks contiguous (faster CPU attention gathers)")
    p.add_argument("--worker-num-cpus", type=float, default=0.5)
    p.add_argument("--torch-threads", type=int, default=None,
                   help="CPU threads per worker's forward (default: the cores / --num-workers)")
    p.add_argument("--grace-period-s", type=float, default=30.0, help="drain time on SIGINT/SIGTERM")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address everything started here listens on: HTTP, gRPC, metrics and a Ray started "
                        "here (loopback by default; 0.0.0.0 for every interface, as in the Helm chart)")
    p.add_argument("--http-port", type=int, default=8000, help="OpenAI-compatible HTTP API (0: off)")
    p.add_argument("--grpc-port", type=int, default=50051, help="gRPC API (0: off)")
    p.add_argument("--serve-proxy-port", type=int, default=0,
                   help="also run Ray Serve's own HTTP proxy on this port (the same API, one process hop "
                        "more; 0: none). The frontend replicas serve --http-port themselves")
    p.add_argument("--metrics-port", type=int, default=0, help="a separate Prometheus port (0: only /metrics)")
    p.add_argument("--api-key", default=os.environ.get("FOLIO_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $FOLIO_API_KEY)")
    p.add_argument("--max-num-requests", type=int, default=256,
                   help="requests in flight per frontend replica; more get 429 / RESOURCE_EXHAUSTED")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="the model's name in the API (default: the checkpoint's); more names are aliases")
    p.add_argument("--max-body-bytes", type=int, default=8 * 2**20,
                   help="the largest HTTP request body accepted; a larger one gets 413")
    return p


def cluster_config(args):
    from folio.cluster.app import ClusterConfig

    engine = dict(block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                  kv_cache_memory_gb=args.kv_cache_memory_gb, max_model_len=args.max_model_len,
                  max_num_seqs=args.max_num_seqs, dtype=args.dtype, preemption_mode=args.preemption_mode,
                  swap_space_gb=args.swap_space_gb, kv_cache_layout=args.kv_cache_layout)
    if args.tokenizer is not None:  # absolute: the workers and the frontends run in other processes
        if not os.path.exists(args.tokenizer):
            from folio.worker.errors import ModelLoadError

            raise ModelLoadError(f"the tokenizer path {args.tokenizer!r} does not exist")
        engine["tokenizer"] = os.path.abspath(args.tokenizer)
    return ClusterConfig(model=args.model, num_workers=args.num_workers, redis_url=args.redis_url,
                         router=args.router, address=args.address, host=args.host, namespace=args.namespace,
                         engine=engine, worker_num_cpus=args.worker_num_cpus, torch_threads=args.torch_threads)


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
    try:
        frontends = start_frontends(args, cluster)
    except Exception as e:
        print(f"error: the frontends did not start: {e}", file=sys.stderr)
        cluster.shutdown(grace_s=0)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs its own handlers
        signal.signal(sig, lambda *_: stop.set())
    print(f"folio serve: ready in {time.monotonic() - t0:.1f} s: {args.num_workers} workers, router "
          f"{args.router}, redis {redis_description(cluster)}" + frontends, flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        print(f"folio serve: draining (up to {args.grace_period_s:.0f} s)", flush=True)
        if cluster.redis is not None:  # a signal to the whole group killed it too: leave it dead
            cluster.redis.stop_supervising()
        cluster.drain(args.grace_period_s)  # in-flight requests finish through the frontends
        if frontends:
            from ray import serve as ray_serve

            ray_serve.shutdown()
        cluster.shutdown(grace_s=0)
        print("folio serve: stopped", flush=True)
    return 0


def redis_description(cluster) -> str:
    """The Redis URL without its password, for the ready line. The embedded server's full
    URL goes to a file only this user can read (its directory is 0700, the file 0600),
    removed with the server: clients on this machine (tests, `folio drain`) read it there."""
    from folio.cluster.state import redact_url

    if cluster.redis is None:
        return redact_url(cluster.redis_url)
    path = os.path.join(cluster.redis.dir, "url")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(cluster.redis_url + "\n")
    return f"{cluster.redis.redacted_url} (embedded; URL with its password in {path})"


def frontend_config(args, cluster):
    """The frontends' configuration from `folio serve`'s arguments and the started cluster."""
    from folio.deploy.frontend import FrontendConfig
    from folio.worker.config import EngineConfig
    from folio.worker.models.config import ModelConfig
    from folio.worker.sizing import max_model_len

    cfg = cluster.config
    engine = EngineConfig(model=cfg.model, **cfg.engine)
    return FrontendConfig(model=os.path.abspath(cfg.model), tokenizer=cfg.engine.get("tokenizer"),
                          redis_url=cluster.redis_url, namespace=cfg.namespace, router=cfg.router,
                          max_model_len=max_model_len(engine, ModelConfig.from_dir(cfg.model)),
                          block_size=engine.block_size, num_workers=cfg.num_workers,
                          max_num_requests=args.max_num_requests, api_key=args.api_key,
                          served_model_name=args.served_model_name, grpc_port=args.grpc_port or None,
                          http_port=args.http_port or None,
                          metrics_port=args.metrics_port or None, host=args.host, max_num_seqs=args.max_num_seqs,
                          max_body_bytes=args.max_body_bytes)


def start_frontends(args, cluster) -> str:
    """The Serve app (HTTP on --http-port, gRPC on --grpc-port); returns a description."""
    if not args.http_port and not args.grpc_port:
        return ""
    from ray import serve as ray_serve

    from folio.deploy.serve_app import build_app

    # the replicas serve HTTP themselves (http_server.py); Serve's proxy only on request
    if args.serve_proxy_port:
        ray_serve.start(proxy_location="HeadOnly", http_options={"host": args.host, "port": args.serve_proxy_port})
    else:
        ray_serve.start(proxy_location="Disabled")
    ray_serve.run(build_app(frontend_config(args, cluster)), name="folio", route_prefix="/")
    parts = []
    if args.http_port:
        parts.append(f"http://{args.host}:{args.http_port}")
    if args.grpc_port:
        parts.append(f"grpc://{args.host}:{args.grpc_port}")
    return ", serving " + " and ".join(parts)


def add_drain_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("drain", help="stop a running cluster's workers admitting; wait for in-flight requests "
                                     "(a Kubernetes preStop hook)")
    p.add_argument("--address", default="auto", help="the Ray cluster")
    p.add_argument("--namespace", default="folio")
    p.add_argument("--redis-url", required=True)
    p.add_argument("--grace-period-s", type=float, default=30.0)
    return p


def drain_main(args) -> int:
    """Every live worker stops admitting, gets `--grace-period-s` for its in-flight requests,
    then aborts the rest. Prints how many were aborted per worker."""
    import ray

    from folio.cluster.state import ClusterState
    from folio.cluster.worker_client import actor_name

    ray.init(address=args.address, namespace=args.namespace, log_to_driver=False)
    try:
        ids = sorted(ClusterState(args.redis_url, args.namespace).live_loads())
        handles = {w: ray.get_actor(actor_name(args.namespace, w), namespace=args.namespace) for w in ids}
        aborted = ray.get([h.drain.remote(args.grace_period_s) for h in handles.values()],
                          timeout=args.grace_period_s + 30)
        for w, n in zip(handles, aborted):
            print(f"folio drain: {w} drained, {n} requests aborted", flush=True)
    finally:
        ray.shutdown()
    return 0

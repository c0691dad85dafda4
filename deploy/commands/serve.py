"""`folio serve`: start a cluster and keep it up until SIGINT / SIGTERM.

Starts Ray locally (or joins `--address`), an embedded Redis unless `--redis-url`
is given, one worker per GPU, the coordinator and the router. On SIGINT/SIGTERM it
stops admitting, gives in-flight requests `--grace-period-s` to finish, aborts the
rest and releases everything (workers leave the Redis registry at once).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time

from folio.cluster.policies import POLICIES
from folio.deploy.engine_flags import add_engine_flags, engine_kwargs
from folio.worker.config import SERVER_DEFAULTS, EngineConfig


def _at_least_one(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="run a Folio cluster: Ray workers, router, coordinator, Redis state")
    p.add_argument("--num-workers", type=int, default=1, help="workers, one per GPU")
    p.add_argument("--redis-url", default=None, help="external Redis (default: an embedded server)")
    p.add_argument("--router", choices=POLICIES, default="prefix-aware")
    p.add_argument("--address", default=None, help="join this Ray cluster instead of starting one")
    p.add_argument("--namespace", default="folio", help="Redis key prefix and Ray namespace")
    p.add_argument("--worker-num-cpus", type=float, default=0.5)
    p.add_argument("--torch-threads", type=int, default=None,
                   help="CPU threads per worker's forward (default: the cores / --num-workers)")
    p.add_argument("--grace-period-s", type=float, default=30.0,
                   help="drain time on SIGINT/SIGTERM, and of a frontend replica that Serve stops (a redeploy, "
                        "fewer replicas)")
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
    p.add_argument("--frontend-replicas", type=_at_least_one, default=1,
                   help="frontend replicas (tokenizing, detokenizing, the APIs), sharing the HTTP, gRPC and "
                        "metrics ports and their metrics; as vLLM's --api-server-count")
    p.add_argument("--max-num-requests", type=int, default=256,
                   help="requests in flight per frontend replica; more get 429 / RESOURCE_EXHAUSTED")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="the model's name in the API (default: the checkpoint's); more names are aliases")
    p.add_argument("--max-body-bytes", type=int, default=8 * 2**20,
                   help="the largest HTTP request body accepted; a larger one gets 413")
    p.add_argument("--stream-interval", type=_at_least_one, default=1,
                   help="tokens per streamed chunk, as vLLM's: larger values cost the frontend and the "
                        "clients less per token; the first and last chunks go at once (a request's "
                        "stream_interval may ask for more)")
    add_engine_flags(p, defaults=SERVER_DEFAULTS)  # the engines run on the workers
    return p


def cluster_config(args):
    """The cluster's configuration from `folio serve`'s arguments; the engine's from its flags."""
    from folio.cluster.launcher import ClusterConfig

    engine_args = engine_kwargs(args)
    if engine_args.pop("tokenizer") is not None:  # absolute: the workers and the frontends run in other processes
        if not os.path.exists(args.tokenizer):
            from folio.worker.errors import ModelLoadError

            raise ModelLoadError(f"the tokenizer path {args.tokenizer!r} does not exist")
        engine_args["tokenizer"] = os.path.abspath(args.tokenizer)
    return ClusterConfig(model=args.model, num_workers=args.num_workers, redis_url=args.redis_url,
                         router=args.router, address=args.address, host=args.host, namespace=args.namespace,
                         engine_args=engine_args, worker_num_cpus=args.worker_num_cpus,
                         torch_threads=args.torch_threads)


class Stopped(BaseException):
    """A SIGINT or SIGTERM while the cluster starts: raised where the main thread is, so the
    start unwinds and releases what did start (Ray's own handler, which ray.init installs for
    SIGTERM when it runs on the main thread, ended the process at once and left the embedded
    Redis running; it now runs on a thread of its own, cluster/ray_start.py)."""


def _stopper(stop: threading.Event):
    """The handler while the cluster starts: it records the stop, then raises it where the main
    thread is. An exception raised inside an at-fork hook, a `__del__` or a weakref callback is
    only printed ("Exception ignored"): the record ends the start at its next check instead."""

    def stop_now(signum, frame) -> None:
        stop.set()
        raise Stopped(signum)

    return stop_now


def _adopt_orphans() -> None:
    """Make this process the child subreaper of everything it starts (Linux): a process of its
    Ray node whose parent dies first (Ray's dashboard and runtime-env agents, when a stop
    interrupts ray.init, outlived the raylet that started them, for good) becomes its child,
    so `_end_children` can end it."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def _end_children(timeout_s: float = 5.0) -> None:
    """Whatever this process (and what it started) left running once the cluster is shut down:
    SIGTERM, then SIGKILL after `timeout_s`; reaped either way."""
    import psutil

    left = psutil.Process().children(recursive=True)
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(left, timeout=timeout_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=timeout_s)


def _cancel_abort_alarm() -> None:
    """A SIGTERM that arrives while ray.init connects this process to its node meets the failure
    signal handler of Ray's core worker (absl's, "*** SIGTERM received ..."): it passes the signal
    on, and also arms alarm(3) to abort the process, so the clean-up ended in SIGABRT 3 s later
    (exit -6, the clean-up cut short). Folio uses no alarm of its own: cancel it."""
    signal.alarm(0)
    signal.signal(signal.SIGALRM, signal.SIG_IGN)


def _exit_at_once(code: int) -> None:
    """Exit without the interpreter's finalization, once everything started is released. A stop
    that cut ray.init short leaves this process's half-made core worker (its C++ threads) behind:
    the finalization then crashed (SIGSEGV) after a clean stop."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _on_signals(handler) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


def main(args) -> int:
    from folio.cluster.launcher import FolioCluster
    from folio.worker.errors import FolioError

    from folio.deploy.serve_binds import check_ports

    try:
        cluster = FolioCluster(cluster_config(args))
    except FolioError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ports = {"--http-port": args.http_port, "--grpc-port": args.grpc_port, "--metrics-port": args.metrics_port}
    if args.address is None and (taken := check_ports(args.host, ports)):  # (joined: they bind on the head)
        print(f"error: {taken}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    stage = "the cluster did not start"
    _adopt_orphans()
    stop = threading.Event()
    stop_now = _stopper(stop)
    try:
        _on_signals(stop_now)
        cluster.start(on_ray_up=lambda: _on_signals(stop_now))  # again: over the core worker's
        stage = "the frontends did not start"
        frontends = start_frontends(args, cluster)
        _on_signals(lambda *_: stop.set())
        if stop.is_set():  # a stop whose exception was swallowed on the way
            raise Stopped(signal.SIGTERM)
    except (Exception, Stopped, SystemExit) as e:  # SystemExit: a handler of Ray's, should one run
        _on_signals(signal.SIG_IGN)  # a second Ctrl-C does not cut the clean-up short
        cluster.settle()  # a ray.init the stop interrupted ends first: its core worker sets absl's handlers
        _on_signals(signal.SIG_IGN)  # over those
        _cancel_abort_alarm()
        stopped = isinstance(e, (Stopped, SystemExit))
        print("folio serve: stopped while starting" if stopped else
              f"error: {e}" if isinstance(e, FolioError) else f"error: {stage}: {e}", file=sys.stderr, flush=True)
        cluster.shutdown(grace_s=0)  # whatever did start
        _end_children()
        if stopped:
            _exit_at_once(0)
        return 2
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
        if frontends and args.address:  # another cluster's Serve: remove this one's applications from it
            from ray import serve as ray_serve

            ray_serve.shutdown()
        # (a Ray started here goes whole with cluster.shutdown: Serve's graceful shutdown waited 30 s
        # for a controller that a SIGTERM to the whole process group, as systemd sends it, had killed)
        cluster.shutdown(grace_s=0)
        _end_children()
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
    from folio.worker.models.model_config import ModelConfig
    from folio.worker.sizing import max_model_len

    cfg = cluster.config
    engine_config = EngineConfig(model=cfg.model, **cfg.engine_args)
    return FrontendConfig(model=os.path.abspath(cfg.model), tokenizer=cfg.engine_args.get("tokenizer"),
                          redis_url=cluster.redis_url, namespace=cfg.namespace, router=cfg.router,
                          max_model_len=max_model_len(engine_config, ModelConfig.from_dir(cfg.model)),
                          block_size=engine_config.block_size, num_workers=cfg.num_workers,
                          max_num_requests=args.max_num_requests, api_key=args.api_key,
                          served_model_name=args.served_model_name, grpc_port=args.grpc_port or None,
                          http_port=args.http_port or None,
                          metrics_port=args.metrics_port or None, host=args.host, max_num_seqs=args.max_num_seqs,
                          max_body_bytes=args.max_body_bytes, stream_interval=args.stream_interval,
                          drain_s=args.grace_period_s)


def start_frontends(args, cluster) -> str:
    """The Serve app (HTTP on --http-port, gRPC on --grpc-port); returns a description."""
    if not args.http_port and not args.grpc_port:
        return ""
    from ray import serve as ray_serve

    from folio.cluster.launcher import SERVE_CONTROLLER_ENV
    from folio.deploy.serve_deployment import build_app

    # the replicas serve HTTP themselves (deploy/http_server.py); Serve's proxy only on request. A controller
    # started here gets the launcher's settings for it (on a joined Ray, its nodes' env may lack them)
    controller = {"runtime_env": {"env_vars": {k: os.environ[k] for k in SERVE_CONTROLLER_ENV if k in os.environ}}}
    if args.serve_proxy_port:
        ray_serve.start(proxy_location="HeadOnly", http_options={"host": args.host, "port": args.serve_proxy_port},
                        controller_options=controller)
    else:
        ray_serve.start(proxy_location="Disabled", controller_options=controller)
    try:
        ray_serve.run(build_app(frontend_config(args, cluster), args.frontend_replicas), name="folio",
                      route_prefix="/")
    except Exception as e:  # a port taken since the check, say: the replicas' own error with Serve's
        from folio.deploy.serve_binds import deploy_failure

        raise RuntimeError(" ".join(filter(None, (str(e), deploy_failure(ray_serve))))) from e
    parts = []
    if args.http_port:
        parts.append(f"http://{args.host}:{args.http_port}")
    if args.grpc_port:
        parts.append(f"grpc://{args.host}:{args.grpc_port}")
    return ", serving " + " and ".join(parts)

"""Starting (or joining) Ray for a Folio cluster: where it binds, and ray.init run so that a stop
that arrives meanwhile is never lost.

    start = RayStart(address=None, namespace="folio", num_gpus=2, host="127.0.0.1", temp_dir=d)
    start.run()      # the main thread waits; a signal handler's exception interrupts the wait
    ...
    start.settle()   # before any clean-up: ray.init, if still running, ends first
"""

from __future__ import annotations

import logging
import os
import threading

INIT_SETTLE_S = 60.0  # how long a clean-up waits for an interrupted ray.init to end


def bind_ray_to(host: str) -> dict:
    """ray.init options so that a Ray started here listens only where `folio serve` was told.

    Ray 2.60's servers (GCS, raylet and object manager, every worker's core-worker gRPC
    port, the dashboard and runtime-env agents) bind to 127.0.0.1 when the node's IP is
    127.0.0.1 and to every interface otherwise; there is no finer bind option. ray.init
    turns a loopback `_node_ip_address` into the machine's routable IP unless Ray is in
    its single-machine mode (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, the default on macOS
    and Windows), so a loopback --host selects that mode; it is a single-machine cluster
    anyway. Another specific --host is the IP Ray advertises (its servers still listen on
    all interfaces); 0.0.0.0 / :: leave Ray's defaults.
    """
    import ipaddress

    if host == "localhost":
        host = "127.0.0.1"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:  # a name: resolved by Ray as the node address
        return {"_node_ip_address": host}
    if ip.is_unspecified:
        return {}
    if ip.is_loopback:
        from ray._private import ray_constants

        os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"  # Ray's child processes
        ray_constants.ENABLE_RAY_CLUSTER = False  # read by ray.init's address resolution
        return {"_node_ip_address": "127.0.0.1"}
    return {"_node_ip_address": host}


class _NotMainThreadWarning(logging.Filter):
    """Ray warns that it set no SIGTERM handler when ray.init runs off the main thread: that is
    the point here (the process's own handler stays), not news for the operator."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


class RayStart:
    """ray.init on a thread of its own, waited for by the caller.

    On the main thread ray.init replaces the process's SIGTERM handler with Ray's own
    (sys.exit), and a signal that lands while it runs raises in whatever Python code the main
    thread is in: inside an at-fork hook of a process Ray spawns, the exception is printed as
    "ignored" and the stop is lost (`folio serve` then came up and served, its SIGTERM
    forgotten); inside the core worker's creation it met absl's failure handler (SIGABRT,
    SIGSEGV at exit). Off the main thread ray.init sets no handler, nothing it runs is
    interrupted, and the signal's handler runs on the main thread, which only waits here.
    The thread then stays until `release`: Ray starts its GCS and raylet with PR_SET_PDEATHSIG,
    which kills them when the *thread* that started them ends, not the process.
    """

    def __init__(self, *, address: str | None, namespace: str, num_gpus: int, host: str,
                 temp_dir: str | None) -> None:
        if address:
            self._kwargs = dict(address=address, namespace=namespace, log_to_driver=False)
        else:
            self._kwargs = dict(num_gpus=num_gpus, num_cpus=max(os.cpu_count() or 1, 2), namespace=namespace,
                                include_dashboard=False, log_to_driver=False, _temp_dir=temp_dir,
                                **bind_ray_to(host))
        self._thread = threading.Thread(target=self._init, name="folio-ray-init", daemon=True)
        self._error: BaseException | None = None
        self._release = threading.Event()
        self._done = threading.Event()  # not Thread.join: on 3.11 a join that a signal's exception
        # interrupts marks the thread stopped while it runs (bpo-45274's fix releases its lock)

    def _init(self) -> None:
        import ray

        quiet = _NotMainThreadWarning()
        logging.getLogger("ray._private.worker").addFilter(quiet)
        try:
            ray.init(**self._kwargs)
        except BaseException as e:  # raised again on the waiting thread
            self._error = e
        finally:
            logging.getLogger("ray._private.worker").removeFilter(quiet)
            self._done.set()
        if self._error is None:  # Ray's processes die with the thread that started them: it stays
            self._release.wait()

    def run(self) -> None:
        """Start ray.init and wait for it; its error is raised here. An exception raised by a
        signal handler while this waits leaves ray.init running: `settle` before cleaning up."""
        self._thread.start()
        self._done.wait()
        if self._error is not None:
            raise self._error

    def settle(self, timeout_s: float = INIT_SETTLE_S) -> bool:
        """Wait for an interrupted ray.init to end (a shutdown in the middle of it is undefined);
        True if it has."""
        return self._thread.ident is None or self._done.wait(timeout_s)

    def release(self) -> None:
        """Once Ray is shut down: the thread that started it ends."""
        self._release.set()

"""A frontend replica that Serve stops finishes what it serves first.

Serve stops a healthy replica when the application is redeployed (a Helm upgrade that
changes serveConfigV2: every replica is replaced) or scaled down. Its clients are on the
replica's own HTTP and gRPC servers (http_server.py), which Serve does not see, so Serve's
graceful shutdown found nothing of its own to wait for and killed the replica after its grace
period: every stream on it was cut mid-answer, and the counts of its last second were lost.

Serve calls the deployment's `__del__` before that kill; there the replica
1. stops listening (HTTP and gRPC): new connections go to the other replicas on the port;
2. lets every request in flight finish, within `drain_s` (`folio serve --grace-period-s`,
   the chart's `serve.gracePeriodSeconds`), as uvicorn and gRPC's own graceful stops do:
   idle keep-alive connections close at once, a stream's connection after its last event;
3. ends what is left at the end: each request is aborted on its worker and its client gets a
   503 in OpenAI's shape (UNAVAILABLE over gRPC) that it may retry elsewhere: as the answer,
   or as a stream's last event before `data: [DONE]` (cut, the stream ended inside its body
   and the client saw a broken connection, not why). What that does not end within half of
   CUT_S (a client that reads nothing, a request whose body is still arriving) is cut: a 503
   where no response has started (uvicorn's own cut answered a plain-text 500), else the
   connection closed;
4. publishes its metrics a last time (replica_metrics.py), the drained requests included.
The log tells what was in flight at the start and what was left and cut at the end (counted
before the cut: an attack found "0 left" after every drain, counted after it).

Serve's deadline for all of it (`graceful_shutdown_timeout_s`) is drain_s + MARGIN_S. A
replica replaced in a rollout is stopped only once its successor runs (`max_surge_percent`),
so the port always has a listener. A frozen replica is no case for a drain: it fails its
health checks and Serve kills it at once (RAY_SERVE_FORCE_STOP_UNHEALTHY_REPLICAS, set by
cluster/launcher.py and the chart), rather than leaving it on the port for the grace period.
"""

from __future__ import annotations

import asyncio
import logging
import time

from folio.worker.errors import ShuttingDownError

DRAIN_S = 30.0
CUT_S = 1.0  # past the drain, for the servers to close what was cut
MARGIN_S = 3.0  # Serve's own steps before `__del__` (a 0.2 s wait loop, its quiesce), the cut and the last publish
log = logging.getLogger("ray.serve")  # the replica's log file (Serve's logger is the one that writes there)


def serve_options(drain_s: float) -> dict:
    """The deployment options of a replica that drains for `drain_s`."""
    return dict(graceful_shutdown_timeout_s=drain_s + MARGIN_S, graceful_shutdown_wait_loop_s=0.2,
                max_surge_percent=100)


async def drain(replica, drain_s: float) -> dict:
    """Stop `replica` (a FolioFrontend) taking work, wait up to `drain_s` for what it serves (its
    requests, and HTTP requests whose body is still arriving), cut what is left, then publish its
    figures a last time; returns what it logs."""
    t0, frontend, http = time.monotonic(), replica.frontend, replica.http

    def serving() -> tuple[int, int]:  # requests in flight, HTTP connections open
        return frontend.in_flight, http.open_connections() if http is not None else 0
    requests, connections = serving()
    log.info("folio: draining this frontend replica: %d requests in flight, %d HTTP connections open (up to %.0f s)",
             requests, connections, drain_s)
    replica.watch_task.cancel()  # a replica on its way out restarts no coordinator
    stops = []  # each server's own graceful stop, with a bound past ours: what is left at ours is cut here
    if http is not None:
        stops.append(asyncio.ensure_future(http.stop(drain_s + CUT_S)))
    grpc_task = getattr(replica, "grpc_task", None)
    if grpc_task is not None:
        stops.append(asyncio.ensure_future(_stop_grpc(replica, grpc_task, drain_s + CUT_S)))
    _, pending = await asyncio.wait(stops, timeout=drain_s) if stops else ((), ())
    left, left_connections = serving()  # before the cut, which ends them
    if pending:  # the requests left end with a 503 (UNAVAILABLE): an HTTP stream with an error event and [DONE]
        frontend.cut(ShuttingDownError(f"this frontend replica stopped and its grace period ({drain_s:g} s) is "
                                       "over: the request was aborted; retry it"))
        _, pending = await asyncio.wait(pending, timeout=CUT_S / 2)
    if pending:  # what the errors did not end (a client that reads nothing, a body still arriving)
        if http is not None:
            http.cut()  # a 503 where no response has started (the client can retry), else the stream cut
        if replica.grpc is not None:
            await replica.grpc.stop(0)  # UNAVAILABLE for the calls left
        await asyncio.wait(pending, timeout=CUT_S / 2)
    replica.metrics_stop.set()
    try:
        await asyncio.to_thread(frontend.metrics.replicas.publish)
    except Exception as e:  # Redis away: its last second's counts go with it
        log.warning("folio: the replica's last metrics were not published: %s", e)
    done = dict(requests=requests, connections=connections, left=left, left_connections=left_connections,
                seconds=round(time.monotonic() - t0, 3))
    log.info("folio: drained: %(requests)d requests in flight at the start, %(left)d left and cut; %(connections)d "
             "HTTP connections open at the start, %(left_connections)d left; in %(seconds).3f s", done)
    return done


async def _stop_grpc(replica, task: asyncio.Task, grace_s: float) -> None:
    if not task.done():  # still starting: it has served nothing
        task.cancel()
        return
    if replica.grpc is not None:
        await replica.grpc.stop(grace_s)  # refuses new calls at once

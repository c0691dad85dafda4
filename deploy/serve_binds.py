"""Ray Serve's one wildcard bind, narrowed to the node's loopback address.

Ray Serve 2.60 starts, in every replica, an inter-deployment gRPC server (its ASGI
service: it runs the deployment's HTTP app) on `[::]:0`, hard-coded, with no option.
With `folio serve --host 127.0.0.1` everything else listens on loopback (cluster/launcher.py:
Ray's node IP is 127.0.0.1), so that port would be the one way in from the network, past
the proxy. `narrow_replica_grpc_bind()`, called when this module's deployment is loaded
in the replica, rewrites that one bind to 127.0.0.1 when the node's IP is loopback; on a
routable node IP (Kubernetes) nothing changes. It wraps a name in Ray's private replica
module: if a Ray upgrade moves it, this does nothing and tests/e2e/test_binds.py fails.
"""

from __future__ import annotations

import ipaddress
import logging

log = logging.getLogger("folio.serve_binds")


def _loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return ip == "localhost"


def narrow_replica_grpc_bind() -> bool:
    """Returns whether the wrapper is in place."""
    try:
        from ray.serve._private import replica
    except ImportError:
        return False
    original = getattr(replica, "add_port_to_grpc_server", None)
    if original is None:
        log.warning("ray.serve replica has no add_port_to_grpc_server: its gRPC bind is left as Ray makes it")
        return False
    if getattr(original, "_folio_narrowed", False):
        return True

    def add_port(server, address: str):
        if address.startswith("[::]:"):
            import ray

            ip = ray.util.get_node_ip_address()
            if _loopback(ip):
                address = f"127.0.0.1:{address.rsplit(':', 1)[1]}"
        return original(server, address)

    add_port._folio_narrowed = True
    replica.add_port_to_grpc_server = add_port
    return True


def check_ports(host: str, ports: dict[str, int]) -> str | None:
    """`folio serve`'s ports (flag -> port; 0: off), before anything starts: one given twice, or
    one that cannot be bound as the frontends bind it (SO_REUSEPORT), is an error at once. Before,
    a port in use failed the start ~20 s later with "Failed to update the deployments
    ['FolioFrontend']", naming neither the port nor the cause (2026-12-07)."""
    from folio.deploy.http_server import reuseport_socket

    flags: dict[int, str] = {}
    for flag, port in ports.items():
        if not port:
            continue
        if port in flags:
            return f"{flags[port]} and {flag} are both {port}"
        flags[port] = flag
        try:
            reuseport_socket(host, port).close()
        except RuntimeError as e:
            return f"{flag} {port}: cannot bind {host}:{port}: {e.__cause__}"
    return None


def deploy_failure(serve, app: str = "folio", deployment: str = "FolioFrontend") -> str:
    """The last line of a failed deployment's message: the replicas' own error (Serve's deploy
    error names none), or "" when Serve has none."""
    try:
        message = serve.status().applications[app].deployments[deployment].message
    except Exception:  # no status to read: the deploy error alone
        return ""
    lines = [line.strip() for line in (message or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""

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

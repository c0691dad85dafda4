"""`folio serve`'s ports, checked before anything starts (deploy/serve_binds.py): real sockets on
loopback. A port in use failed the start ~20 s later with Serve's "Failed to update the
deployments ['FolioFrontend']", naming neither the port nor the cause (2026-12-07)."""

import socket
import types

from folio.deploy.http_server import reuseport_socket
from folio.deploy.serve_binds import check_ports, deploy_failure


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_port_another_process_holds_is_named_with_its_flag():
    with socket.socket() as held:  # no SO_REUSEPORT: nobody can share it
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        why = check_ports("127.0.0.1", {"--http-port": free_port(), "--metrics-port": port})
    assert why is not None and why.startswith(f"--metrics-port {port}: cannot bind 127.0.0.1:{port}")
    assert "Address already in use" in why


def test_a_port_given_twice_and_ports_that_are_free():
    port = free_port()
    assert check_ports("127.0.0.1", {"--http-port": port, "--grpc-port": port}) == \
        f"--http-port and --grpc-port are both {port}"
    assert check_ports("127.0.0.1", {"--http-port": free_port(), "--grpc-port": 0,
                                     "--metrics-port": free_port()}) is None


def test_a_port_a_replica_shares_is_free_to_share():
    """Another frontend's socket (SO_REUSEPORT, as the replicas bind) is no error: it is how
    replicas share a port."""
    sock = reuseport_socket("127.0.0.1", 0)
    try:
        assert check_ports("127.0.0.1", {"--http-port": sock.getsockname()[1]}) is None
    finally:
        sock.close()


def test_the_replicas_own_error_is_the_last_line_of_the_deployments_message():
    """Serve's status object, as `serve.status()` returns it (its message: the replica's traceback)."""
    trace = ("Traceback (most recent call last):\n  File \"http_server.py\", line 42\n"
             "RuntimeError: the HTTP API cannot bind 127.0.0.1:8000: [Errno 98] Address already in use\n\n")
    status = types.SimpleNamespace(applications={"folio": types.SimpleNamespace(
        deployments={"FolioFrontend": types.SimpleNamespace(message=trace)})})
    serve = types.SimpleNamespace(status=lambda: status)
    assert deploy_failure(serve) == ("RuntimeError: the HTTP API cannot bind 127.0.0.1:8000: [Errno 98] "
                                     "Address already in use")
    assert deploy_failure(types.SimpleNamespace(status=lambda: types.SimpleNamespace(applications={}))) == ""

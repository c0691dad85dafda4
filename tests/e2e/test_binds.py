"""What `folio serve --host 127.0.0.1` listens on: every socket of its whole process tree
(the CLI, Ray's GCS, raylet, agents and workers, Serve's proxy and replicas, Redis)."""

import ipaddress

import psutil
import pytest
import redis


def listening_sockets(pid: int) -> list[tuple[int, str, str, int]]:
    """(pid, process name, ip, port) of every listening inet socket of `pid` and its descendants."""
    root = psutil.Process(pid)
    out = []
    for p in [root, *root.children(recursive=True)]:
        try:
            name = p.name()
            conns = p.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        out += [(p.pid, name, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return out


def is_loopback(ip: str) -> bool:
    a = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None:
        a = a.ipv4_mapped  # ::ffff:127.0.0.1, how a dual-stack socket shows a v4 loopback bind
    return a.is_loopback


@pytest.mark.parametrize("ip, loopback", [("127.0.0.1", True), ("::1", True), ("::ffff:127.0.0.1", True),
                                          ("0.0.0.0", False), ("::", False), ("192.0.2.2", False),
                                          ("::ffff:0.0.0.0", False), ("fe80::1%eth0", False)])
def test_is_loopback(ip, loopback):
    assert is_loopback(ip) is loopback


def test_nothing_listens_beyond_loopback(folio_server):
    socks = listening_sockets(folio_server["pid"])
    ports = {port for *_, port in socks}
    names = {name for _, name, *_ in socks}
    # the check saw the whole tree: Ray's servers, Redis, and the HTTP port
    assert {"gcs_server", "raylet", "redis-server"} <= names, socks
    assert int(folio_server["http"].rsplit(":", 1)[1]) in ports
    wide = [s for s in socks if not is_loopback(s[2])]
    assert not wide, f"listening beyond 127.0.0.1: {wide}"


def test_the_embedded_redis_refuses_a_client_without_the_password(folio_server):
    url = folio_server["redis"]
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=port, socket_timeout=5).ping()
    assert redis.Redis.from_url(url, socket_timeout=5).ping()
    password = redis.connection.parse_url(url)["password"]
    assert password and password not in folio_server["ready"]  # the ready line shows it redacted

"""The API key on every route of both APIs and on the metrics port, against the live
`folio serve` (conftest's `folio_server`, started with --api-key). Open without a key:
HTTP /health, gRPC health and reflection; everything else answers 401 / UNAUTHENTICATED
without the key or with a wrong one, and accepts the scheme in any case."""

import json
import urllib.error
import urllib.request

import grpc
import pytest

from folio.deploy.auth import bearer_ok
from folio.v1 import generate_pb2 as pb
from folio.v1 import generate_pb2_grpc as pb_grpc

from conftest import FOLIO_SERVER_KEY as KEY

BODIES = {"/v1/completions": {"prompt": "hi", "max_tokens": 1},
          "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}}
ROUTES = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
          ("GET", "/metrics"), ("GET", "/docs"), ("GET", "/openapi.json")]
GOOD = [f"Bearer {KEY}", f"bearer {KEY}", f"BEARER {KEY}", f"bEaReR  {KEY} "]
BAD = [None, "", KEY, f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", f"Basic {KEY}", "Bearer", f"Token {KEY}"]


def call(url: str, method: str, authorization: str | None, body: dict | None = None) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    if authorization is not None:
        headers["Authorization"] = authorization
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_bearer_check():
    assert all(bearer_ok(KEY, h) for h in GOOD)
    assert not any(bearer_ok(KEY, h) for h in BAD)
    assert bearer_ok(None, None) and bearer_ok("", "anything")


@pytest.mark.parametrize("method, path", ROUTES)
def test_every_http_route_needs_the_key(folio_server, method, path):
    url = folio_server["http"] + path
    for auth in BAD:
        status, body = call(url, method, auth, BODIES.get(path))
        assert status == 401, (path, auth, status)
        assert json.loads(body)["error"]["type"] == "authentication_error"
    for auth in GOOD:
        status, body = call(url, method, auth, BODIES.get(path))
        assert status == 200, (path, auth, status, body[:200])


def test_health_is_open(folio_server):
    assert call(folio_server["http"] + "/health", "GET", None)[0] == 200


def test_the_metrics_port_needs_the_key(folio_server):
    for auth in BAD:
        assert call(folio_server["metrics"], "GET", auth)[0] == 401, auth
    for auth in GOOD:
        status, body = call(folio_server["metrics"] + "/metrics", "GET", auth)
        assert status == 200 and b"folio_requests_total" in body


def _grpc_calls(stub):
    r = pb.GenerateRequest(text="hi", sampling=pb.SamplingParameters(max_tokens=1))
    return {"Generate": lambda md: stub.Generate(r, metadata=md),
            "GenerateStream": lambda md: list(stub.GenerateStream(r, metadata=md)),
            "Abort": lambda md: stub.Abort(pb.AbortRequest(request_id="none"), metadata=md),
            "GetModelInfo": lambda md: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md)}


def test_every_grpc_method_needs_the_key(folio_server):
    with grpc.insecure_channel(folio_server["grpc"]) as ch:
        calls = _grpc_calls(pb_grpc.GenerationStub(ch))
        assert set(calls) == set(pb.DESCRIPTOR.services_by_name["Generation"].methods_by_name)  # all of them
        for name, fn in calls.items():
            for auth in BAD:
                md = () if auth is None else (("authorization", auth),)
                with pytest.raises(grpc.RpcError) as e:
                    fn(md)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, (name, auth)
            for auth in GOOD:
                fn((("authorization", auth),))

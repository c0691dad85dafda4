"""An HTTP/1.0 request's response of no stated length ends where its connection does (RFC 9112
section 6.3), as h11 answers it.

uvicorn's httptools protocol sent such a response (every stream: server-sent events) chunked,
which HTTP/1.0 may not use (RFC 9112 section 6.1: a server sends Transfer-Encoding only to a
1.1 request): a 1.0 client read the chunk sizes as part of the text, and a proxy that speaks 1.0
to its upstream (nginx's default `proxy_http_version`) passed them on. `close_delimited` is
called by the protocol (http_deadlines.py) on each httptools request cycle of an HTTP/1.0
request: its response, if it states no length, goes out as it comes, with `connection: close`
(uvicorn keeps no HTTP/1.0 connection alive), and the close ends it.
"""

from __future__ import annotations

UNBOUNDED = float("inf")


def close_delimited(cycle) -> None:
    """Make httptools' `cycle` (an HTTP/1.0 request's) send a response with no length as it
    comes, ended by the connection's close, instead of in chunks."""
    send = cycle.send

    async def send_close_delimited(message) -> None:
        if message["type"] == "http.response.start" and not cycle.response_started:
            stated = any(k.lower() in (b"content-length", b"transfer-encoding") for k, _ in message.get("headers", ()))
            if not stated and cycle.scope["method"] != "HEAD" and message["status"] not in (204, 304):
                cycle.chunked_encoding, cycle.expected_content_length = False, UNBOUNDED
        elif (message["type"] == "http.response.body" and not message.get("more_body", False)
              and cycle.expected_content_length == UNBOUNDED):
            cycle.expected_content_length = len(message.get("body", b""))  # the last part: uvicorn's count ends at 0
        await send(message)
    cycle.send = send_close_delimited

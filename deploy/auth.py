"""The API key check shared by the HTTP API, the metrics port and gRPC.

`Authorization: Bearer <key>`: the scheme is case-insensitive (RFC 7235), the key is
compared in constant time (hmac.compare_digest). No key configured: everything is open.
"""

from __future__ import annotations

import hmac


def bearer_ok(api_key: str | None, authorization: str | None) -> bool:
    if not api_key:
        return True
    if not authorization:
        return False
    scheme, _, token = authorization.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(errors="surrogatepass"),
                                                         api_key.encode(errors="surrogatepass"))

"""The separate Prometheus port (`folio serve --metrics-port`): a small threaded HTTP server
bound to the configured host that serves the registry at any path, behind the same API key
as the HTTP API (`Authorization: Bearer <key>`, 401 otherwise). prometheus_client's own
`start_http_server` has no auth, hence this. OpenMetrics when the Accept header asks for it.
Bound with SO_REUSEPORT: every frontend replica on a node serves it, each with the figures of
all of them (replica_metrics.py); a second replica failed to bind it, and a deployment of two
never ran (2026-12-07).

    server = start_metrics_server(registry, port, host, api_key)   # serves in a daemon thread
    server.shutdown()
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client.exposition import choose_encoder

from folio.deploy.auth import bearer_ok


def start_metrics_server(registry, port: int, host: str, api_key: str | None) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if not bearer_ok(api_key, self.headers.get("Authorization")):
                body = json.dumps({"error": {"message": "a valid API key is required: Authorization: Bearer <key>",
                                             "type": "authentication_error", "param": None,
                                             "code": "invalid_api_key"}}).encode()
                self._send(401, body, "application/json")
                return
            encoder, content_type = choose_encoder(self.headers.get("Accept") or "")
            self._send(200, encoder(registry), content_type)

        def _send(self, status: int, body: bytes, ctype: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # scrapes are not news
            pass

    class Server(ThreadingHTTPServer):
        allow_reuse_port = True  # the replicas of a deployment share the port, as the API ports

    server = Server((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="folio-metrics-port", daemon=True).start()
    return server

"""The daemon's HTTP endpoints: /metrics, /healthz and an index page."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import CollectorRegistry

log = logging.getLogger(__name__)

INDEX = b"""<!doctype html>
<html><head><meta charset="utf-8"><title>tramprof</title></head>
<body><h1>tramprof</h1>
<ul><li><a href="/metrics">/metrics</a> Prometheus metrics</li>
<li><a href="/healthz">/healthz</a> health</li></ul></body></html>
"""


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) with a clear error."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"listen address must be HOST:PORT, got {value!r}")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)


class _Server6(ThreadingHTTPServer):
    address_family = socket.AF_INET6


class MetricsServer:
    """Serves the registry on a background thread; ``healthy`` decides /healthz."""

    def __init__(self, listen: str, registry: CollectorRegistry,
                 healthy: Callable[[], tuple[bool, str]]) -> None:
        host, port = parse_listen(listen)
        server_registry = registry
        health = healthy

        class Handler(BaseHTTPRequestHandler):
            server_version = "tramprof"

            def do_GET(self) -> None:
                path = urlsplit(self.path).path
                if path == "/metrics":
                    encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
                    try:
                        body = encoder(server_registry)
                    except Exception:
                        log.exception("metrics collection failed")
                        self._reply(500, b"metrics collection failed\n", "text/plain")
                        return
                    self._reply(200, body, content_type)
                elif path == "/healthz":
                    ok, why = health()
                    self._reply(200 if ok else 503, (why + "\n").encode(), "text/plain")
                elif path == "/":
                    self._reply(200, INDEX, "text/html; charset=utf-8")
                else:
                    self._reply(404, b"not found\n", "text/plain")

            def _reply(self, code: int, body: bytes, content_type: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                log.debug("http: " + format, *args)

        server_class = _Server6 if ":" in host else ThreadingHTTPServer
        self._server = server_class((host, port), Handler)
        self._server.daemon_threads = True
        self.address = self._server.server_address
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="tramprof-http", daemon=True)

    def start(self) -> None:
        self._thread.start()
        log.info("serving metrics on http://%s:%d/metrics", self.address[0], self.address[1])

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

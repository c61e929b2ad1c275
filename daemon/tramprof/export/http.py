"""The daemon's HTTP endpoints.

``/metrics`` (Prometheus text or OpenMetrics, by the Accept header),
``/profile?seconds=N&format=F&pid=P`` (the last N seconds of stacks),
``/healthz``, and ``/`` (a flame graph of the last window). Loopback by
default; for the network case optional TLS and HTTP basic auth (``/healthz``
stays open for kubelet probes: it reveals nothing).
"""

from __future__ import annotations

import base64
import hmac
import logging
import socket
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import CollectorRegistry

from tramprof.config import parse_listen
from tramprof.export.formats import FORMATS, IndexPage
from tramprof.model import Profile

log = logging.getLogger(__name__)

MAX_PIDS_PER_QUERY = 1000


@dataclass(frozen=True)
class HttpSecurity:
    """TLS and basic-auth settings; empty strings disable each."""

    tls_cert_file: str = ""
    tls_key_file: str = ""
    basic_auth_user: str = ""
    basic_auth_password: str = ""

    @staticmethod
    def from_files(cert: str, key: str, user: str, password_file: str) -> HttpSecurity:
        password = ""
        if password_file:
            with open(password_file) as f:
                password = f.read().strip()
            if not password:
                raise ValueError(f"{password_file}: empty password")
        return HttpSecurity(cert, key, user, password)

    def authorized(self, header: str | None) -> bool:
        if not self.basic_auth_user:
            return True
        if not header or not header.startswith("Basic "):
            return False
        try:
            user, _, password = base64.b64decode(header[6:]).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return False
        return (hmac.compare_digest(user, self.basic_auth_user)
                & hmac.compare_digest(password, self.basic_auth_password))


ProfileSource = Callable[[float], Profile]


class _Server(ThreadingHTTPServer):
    """TLS handshakes happen in the request threads, so a client that connects
    and stalls cannot block the accept loop."""

    daemon_threads = True
    tls: ssl.SSLContext | None = None

    def get_request(self) -> tuple[socket.socket, object]:
        sock, address = super().get_request()
        if self.tls is not None:
            sock.settimeout(30)
            sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, address


class _Server6(_Server):
    address_family = socket.AF_INET6


class MetricsServer:
    """Serves the endpoints on background threads."""

    def __init__(self, listen: str, registry: CollectorRegistry,
                 healthy: Callable[[], tuple[bool, str]],
                 profiles: ProfileSource | None = None, index_seconds: float = 10.0,
                 security: HttpSecurity | None = None) -> None:
        host, port = parse_listen(listen)
        handler = _make_handler(registry, healthy, profiles, index_seconds,
                                security or HttpSecurity())
        server_class = _Server6 if ":" in host else _Server
        self._server = server_class((host, port), handler)
        if security and security.tls_cert_file:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(security.tls_cert_file, security.tls_key_file)
            self._server.tls = context
        self.address = self._server.server_address
        self.scheme = "https" if security and security.tls_cert_file else "http"
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="tramprof-http", daemon=True)

    def start(self) -> None:
        self._thread.start()
        log.info("serving on %s://%s:%d/ (metrics at /metrics)", self.scheme,
                 self.address[0], self.address[1])

    def close(self) -> None:
        # shutdown() waits for serve_forever() to return: it would wait
        # forever when start() never ran (the sampler failed to load).
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()


def _make_handler(registry: CollectorRegistry, healthy: Callable[[], tuple[bool, str]],
                  profiles: ProfileSource | None, index_seconds: float,
                  security: HttpSecurity) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "tramprof"

        def do_GET(self) -> None:
            url = urlsplit(self.path)
            if url.path == "/healthz":
                ok, why = healthy()
                self._reply(200 if ok else 503, (why + "\n").encode(), "text/plain")
                return
            if not security.authorized(self.headers.get("Authorization")):
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Basic realm="tramprof"')
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            try:
                if url.path == "/metrics":
                    encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
                    self._reply(200, encoder(registry), content_type)
                elif url.path == "/profile" and profiles is not None:
                    self._profile(parse_qs(url.query))
                elif url.path == "/" and profiles is not None:
                    body = IndexPage.render(profiles(index_seconds))
                    self._reply(200, body, "text/html; charset=utf-8")
                else:
                    self._reply(404, b"not found\n", "text/plain")
            except _BadRequest as exc:
                self._reply(400, f"{exc}\n".encode(), "text/plain")
            except Exception:
                log.exception("serving %s failed", url.path)
                self._reply(500, b"internal error\n", "text/plain")

        def _profile(self, query: dict[str, list[str]]) -> None:
            assert profiles is not None
            seconds = _float(query, "seconds", 60.0)
            fmt = query.get("format", ["folded"])[0]
            if fmt not in FORMATS:
                raise _BadRequest(f"format must be one of {', '.join(FORMATS)}")
            pids = _pids(query)
            profile = profiles(seconds)
            if pids:
                profile = profile.only_pids(pids)
            writer = FORMATS[fmt]
            extra = {}
            if writer.filename:
                extra["Content-Disposition"] = f'attachment; filename="{writer.filename}"'
            self._reply(200, writer.encode(profile), writer.content_type, extra)

        def _reply(self, code: int, body: bytes, content_type: str,
                   headers: dict[str, str] | None = None) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            log.debug("http: " + format, *args)

    return Handler


class _BadRequest(ValueError):
    pass


def _float(query: dict[str, list[str]], name: str, default: float) -> float:
    if name not in query:
        return default
    try:
        value = float(query[name][0])
    except ValueError:
        raise _BadRequest(f"{name} must be a number") from None
    if not 0 < value <= 86400:
        raise _BadRequest(f"{name} must be in (0, 86400]")
    return value


def _pids(query: dict[str, list[str]]) -> set[int]:
    pids = set()
    for item in query.get("pid", []):
        for part in item.split(","):
            if not part.strip().isdigit():
                raise _BadRequest(f"pid must be a process id, got {part!r}")
            pids.add(int(part))
    if len(pids) > MAX_PIDS_PER_QUERY:
        raise _BadRequest(f"at most {MAX_PIDS_PER_QUERY} pids")
    return pids

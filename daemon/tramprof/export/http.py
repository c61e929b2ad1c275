"""The daemon's HTTP endpoints (one job, over 400 lines: serving them, with the
limits that keep one client from starving the others).

``/metrics`` (Prometheus text or OpenMetrics by the Accept header, gzipped
when the client accepts it, ``name[]`` to select families: prometheus-client's
own exposition), ``/profile?seconds=N&format=F&pid=P`` (the last N seconds of
stacks), ``/debug/pprof/profile?seconds=N&pid=P`` (the next N seconds, as
Go's endpoint records them: see ``recorder``), ``/healthz``, and ``/`` (a
flame graph of the last window). Loopback by default; for the network case
optional TLS and HTTP basic auth (``/healthz`` stays open for kubelet probes:
it reveals nothing).

Any local process is a possible client, so the server bounds what one can
take:

- A connection has ``request_timeout`` seconds to deliver its request line
  and headers: one deadline for the whole head, so trickling a byte at a
  time does not extend it, and at most ``MAX_REQUEST_HEAD`` bytes. Every
  later socket operation (writing the answer) has the same timeout.
- At most ``max_connections`` connections are served at once, one thread
  each. The accept loop answers any further one ``503`` and closes it at
  once (over TLS it only closes it: nothing can be said before a
  handshake). A flood of idle connections so costs at most that many
  threads, and blocks /healthz for at most ``request_timeout``.
- At most ``max_profile_requests`` profile renderings (``/profile`` and the
  flame-graph page ``/``) run at once; more get ``429`` with
  ``Retry-After``, so clients cannot crowd out the sampling loop. As many
  recordings (``/debug/pprof/profile``) may wait at once, each for at most
  ``max_record_seconds``; their rendering then waits for a rendering slot.
- A loopback listener answers only requests whose ``Host`` names a loopback
  address or ``localhost`` (any port), and ``421`` to others: a web page in
  a browser on the node cannot read the profiles through DNS rebinding.
  Other listeners answer any ``Host``, unless ``allowed_hosts`` is given.
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import hmac
import io
import ipaddress
import logging
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from prometheus_client.exposition import gzip_accepted
from prometheus_client.registry import CollectorRegistry

from tramprof.config import parse_listen
from tramprof.export.exposition import encode
from tramprof.export.formats import FORMATS, IndexPage
from tramprof.export.recorder import Recorder, RecordingFailed
from tramprof.model import Profile

log = logging.getLogger(__name__)

MAX_PIDS_PER_QUERY = 1000
# Defaults of MetricsServer's limits.
REQUEST_TIMEOUT = 10.0
MAX_CONNECTIONS = 64
MAX_PROFILE_REQUESTS = 2
# Request line and headers together; a browser's cookies for localhost fit.
MAX_REQUEST_HEAD = 64 * 1024
# Seconds a client is told to wait when every profile slot is taken.
PROFILE_RETRY_AFTER = 2
# Bytes per write of an answer (each has the request timeout).
_WRITE_CHUNK = 256 * 1024
# The paths that render a profile (CPU heavy): limited to max_profile_requests.
PROFILE_PATHS = frozenset({"/profile", "/"})
#: Go's path for a CPU profile of the next N seconds.
RECORD_PATH = "/debug/pprof/profile"
#: Go's default duration of a recording, and our longest (the request holds a
#: connection and a thread that long).
RECORD_SECONDS = 30.0
MAX_RECORD_SECONDS = 300.0
# Each recording makes the daemon drain twice: at least a second between its
# two drains, as Go's whole seconds, so clients cannot make it drain nonstop.
MIN_RECORD_SECONDS = 1.0
# gzip level of /metrics. On the 10k-series exposition (1005 KiB) level 1
# takes 9 ms for 68 KiB, level 6 30 ms for 53 KiB, level 9 (prometheus-client's
# own choice) 160 ms for 48 KiB (benchmarks/bench_metrics.py): the daemon's
# CPU matters more than 15 KiB per scrape.
METRICS_GZIP_LEVEL = 1


def _bare_response(status: str, text: str, *headers: str) -> bytes:
    body = text.encode()
    head = [f"HTTP/1.0 {status}", "Content-Type: text/plain", f"Content-Length: {len(body)}",
            *headers, "Connection: close"]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


_BUSY = _bare_response("503 Service Unavailable", "too many connections, try again\n",
                       "Retry-After: 1")
_HEAD_TOO_LARGE = _bare_response("431 Request Header Fields Too Large",
                                 f"request line and headers exceed {MAX_REQUEST_HEAD} bytes\n")


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
        """Whether an Authorization header carries the configured credentials.
        Anything malformed (not ASCII, not base64, no colon) is simply not
        authorized. Compared as UTF-8 bytes: ``hmac.compare_digest`` refuses
        ``str`` arguments that are not ASCII."""
        if not self.basic_auth_user:
            return True
        scheme, _, token = (header or "").strip().partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            # ValueError covers UnicodeEncodeError and binascii.Error.
            credentials = base64.b64decode(token.strip().encode("ascii"), validate=True)
        except ValueError:
            return False
        user, colon, password = credentials.partition(b":")
        return (bool(colon)
                & hmac.compare_digest(user, self.basic_auth_user.encode())
                & hmac.compare_digest(password, self.basic_auth_password.encode()))


# Host[:port] or [IPv6][:port] (RFC 9110 section 7.2).
_HOST_HEADER = re.compile(r"(?:\[(?P<ip6>[0-9A-Fa-f:.]+)\]|(?P<name>[^:\[\]/\s]+))(?::[0-9]*)?")

_Network = ipaddress.IPv4Network | ipaddress.IPv6Network
_Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def _ip(text: str) -> _Address | None:
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


class HostPolicy:
    """Which ``Host`` headers a listener answers.

    On a loopback listener, and on any listener when ``allowed`` is not
    empty, a request must name ``localhost``, a loopback address, or an
    entry of ``allowed`` (host names, IP addresses, networks such as
    ``10.0.0.0/8``; the port is not compared). Otherwise every request is
    answered."""

    def __init__(self, listen_host: str, allowed: Iterable[str] = ()) -> None:
        self._names: set[str] = set()
        self._networks: list[_Network] = []
        for entry in allowed:
            item = entry.strip().lower().removeprefix("[").removesuffix("]")
            try:
                self._networks.append(ipaddress.ip_network(item, strict=False))
                continue
            except ValueError:
                pass
            name = item.removesuffix(".")
            if not name or _HOST_HEADER.fullmatch(name) is None or ":" in name:
                raise ValueError(f"allowed_hosts: {entry!r} is not a host name, "
                                 "an IP address or a network")
            self._names.add(name)
        address = _ip(listen_host)
        loopback = (address.is_loopback if address is not None
                    else listen_host.lower() == "localhost")
        self.restricted = loopback or bool(self._names or self._networks)

    def accepts(self, host_header: str | None) -> bool:
        if not self.restricted:
            return True
        match = _HOST_HEADER.fullmatch((host_header or "").strip())
        if match is None:
            return False
        if match["ip6"] is not None:
            address = _ip(match["ip6"])
            if address is None or ":" not in match["ip6"]:  # brackets hold IPv6 only
                return False
        else:
            name = match["name"].lower().removesuffix(".")
            if name == "localhost" or name in self._names:
                return True
            address = _ip(name)
            if address is None:
                return False
        return address.is_loopback or any(address in net for net in self._networks)


ProfileSource = Callable[[float], Profile]


class _HeadTooLarge(Exception):
    pass


class _RequestHead(io.RawIOBase):
    """What the handler reads the request line and headers from: the
    connection's bytes until ``deadline`` (monotonic) and ``limit`` bytes.
    The socket timeout is set to the time left before each receive, so a
    client trickling bytes cannot stretch it."""

    def __init__(self, sock: socket.socket, deadline: float, limit: int) -> None:
        super().__init__()
        self._sock = sock
        self._deadline = deadline
        self._left = limit

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("request head not received in time")
        if self._left <= 0:
            raise _HeadTooLarge
        self._sock.settimeout(remaining)
        with memoryview(buffer) as view:
            received = self._sock.recv_into(view[:self._left])
        self._left -= received
        return received


class _Server(ThreadingHTTPServer):
    """TLS handshakes happen in the request threads (bounded by the request
    timeout), so a client that connects and stalls cannot block the accept
    loop. ``max_connections`` is enforced on the accept loop."""

    daemon_threads = True
    # The kernel's queue of connections not yet accepted: short bursts
    # (many scrapers at once) wait there instead of having their SYN dropped
    # and retried a second later. It costs no thread.
    request_queue_size = 128
    tls: ssl.SSLContext | None = None

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 max_connections: int) -> None:
        self.max_connections = max_connections
        self.connections = 0
        self._count_lock = threading.Lock()
        self._refusing = False
        super().__init__(address, handler)

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, address = super().get_request()
        if self.tls is not None:
            sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, address

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._count_lock:
            full = self.connections >= self.max_connections
            warn = full and not self._refusing  # once per episode
            if full:
                self._refusing = True
            else:
                self.connections += 1
        if full:
            if warn:
                log.warning("http: %d connections open, refusing more until one ends",
                            self.max_connections)
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)  # starts the thread
        except BaseException:
            self._release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release()

    def _release(self) -> None:
        with self._count_lock:
            self.connections -= 1
            if self.connections <= self.max_connections // 2:
                self._refusing = False

    def _refuse(self, request: socket.socket) -> None:
        """503 without reading the request (a short write to a fresh socket
        never blocks). What the client already sent is read first so that
        closing does not turn into a reset that could discard the answer."""
        if not isinstance(request, ssl.SSLSocket):
            try:
                request.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    request.recv(MAX_REQUEST_HEAD)
                request.send(_BUSY)
            except OSError:
                pass
        self.shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Resets, TLS failures, timeouts while writing: the client's doing.
        # (Errors of the endpoints themselves are logged in do_GET.)
        log.debug("http: connection from %s failed", client_address, exc_info=True)


class _Server6(_Server):
    address_family = socket.AF_INET6


class MetricsServer:
    """Serves the endpoints on background threads.

    ``request_timeout`` (seconds), ``max_connections``,
    ``max_profile_requests`` and ``allowed_hosts`` bound what clients can
    take; the module docstring explains each."""

    def __init__(self, listen: str, registry: CollectorRegistry,
                 healthy: Callable[[], tuple[bool, str]],
                 profiles: ProfileSource | None = None, index_seconds: float = 10.0,
                 security: HttpSecurity | None = None, *,
                 request_timeout: float = REQUEST_TIMEOUT,
                 max_connections: int = MAX_CONNECTIONS,
                 max_profile_requests: int = MAX_PROFILE_REQUESTS,
                 allowed_hosts: Iterable[str] = (),
                 recorder: Recorder | None = None,
                 max_record_seconds: float = MAX_RECORD_SECONDS) -> None:
        if not 0 < request_timeout <= 3600:
            raise ValueError("request_timeout must be in (0, 3600] seconds")
        if not 1 <= max_connections <= 65536:
            raise ValueError("max_connections must be 1..65536")
        if not 1 <= max_profile_requests <= max_connections:
            raise ValueError("max_profile_requests must be 1..max_connections")
        if not MIN_RECORD_SECONDS <= max_record_seconds <= 86400:
            raise ValueError("max_record_seconds must be in [1, 86400]")
        host, port = parse_listen(listen)
        server_class = _Server6 if ":" in host else _Server
        self._server = server_class((host, port), BaseHTTPRequestHandler, max_connections)
        self.hosts = HostPolicy(str(self._server.server_address[0]), allowed_hosts)
        self._server.RequestHandlerClass = _make_handler(
            registry, healthy, profiles, index_seconds, security or HttpSecurity(),
            self.hosts, request_timeout, threading.BoundedSemaphore(max_profile_requests),
            _Recordings(recorder, threading.BoundedSemaphore(max_profile_requests),
                        max_record_seconds))
        if security and security.tls_cert_file:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(security.tls_cert_file, security.tls_key_file)
            self._server.tls = context
        self.address = self._server.server_address
        self.scheme = "https" if security and security.tls_cert_file else "http"
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="tramprof-http", daemon=True)

    @property
    def connections(self) -> int:
        """Connections being served now (accepted, not yet closed)."""
        return self._server.connections

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


_Response = tuple[int, bytes, str, dict[str, str]]
_BUSY_PROFILES: _Response = (429, b"too many profile requests at once, try again\n",
                             "text/plain", {"Retry-After": str(PROFILE_RETRY_AFTER)})


@dataclass(frozen=True)
class _Recordings:
    recorder: Recorder | None
    slots: threading.BoundedSemaphore
    max_seconds: float


def _metrics(registry: CollectorRegistry, query: dict[str, list[str]], accept: str,
             accept_encoding: str) -> _Response:
    """What prometheus-client's own exporters answer (``_bake_output``): the
    format the Accept header asks for, only the ``name[]`` families when
    given, gzipped when the client takes gzip (Prometheus does); written by
    ``export.exposition``."""
    source = registry.restricted_registry(query["name[]"]) if "name[]" in query else registry
    body, content_type = encode(source, accept)
    headers = {"Vary": "Accept, Accept-Encoding"}
    if gzip_accepted(accept_encoding):
        body = gzip.compress(body, compresslevel=METRICS_GZIP_LEVEL, mtime=0)
        headers["Content-Encoding"] = "gzip"
    return 200, body, content_type, headers


def _make_handler(registry: CollectorRegistry, healthy: Callable[[], tuple[bool, str]],
                  profiles: ProfileSource | None, index_seconds: float,
                  security: HttpSecurity, hosts: HostPolicy, request_timeout: float,
                  profile_slots: threading.BoundedSemaphore,
                  recordings: _Recordings) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "tramprof"
        # StreamRequestHandler.setup() applies it to the connection.
        timeout = request_timeout

        def setup(self) -> None:
            super().setup()
            # The head is read through a deadline and a size limit instead.
            self.rfile.close()
            self.rfile = io.BufferedReader(_RequestHead(
                self.connection, time.monotonic() + request_timeout, MAX_REQUEST_HEAD))

        def handle(self) -> None:
            try:
                super().handle()
            except _HeadTooLarge:
                self.close_connection = True
                with contextlib.suppress(OSError):
                    self.wfile.write(_HEAD_TOO_LARGE)

        def do_GET(self) -> None:
            # The head is in; from here each socket operation has the timeout.
            self.connection.settimeout(request_timeout)
            host = self.headers.get_all("Host") or []
            if len(host) != 1 or not hosts.accepts(host[0]):
                self._reply(421, b"misdirected request: this server answers only requests "
                                 b"for localhost or a loopback address (Host header)\n",
                            "text/plain")
                return
            url = urlsplit(self.path)
            if url.path == "/healthz":
                ok, why = healthy()
                self._reply(200 if ok else 503, (why + "\n").encode(), "text/plain")
                return
            if not security.authorized(self.headers.get("Authorization")):
                self._reply(401, b"", "text/plain",
                            {"WWW-Authenticate": 'Basic realm="tramprof"'})
                return
            try:
                if url.path == "/metrics":
                    self._reply(*_metrics(registry, parse_qs(url.query),
                                          self.headers.get("Accept", ""),
                                          self.headers.get("Accept-Encoding", "")))
                elif url.path == RECORD_PATH and recordings.recorder is not None:
                    self._reply(*self._record(parse_qs(url.query)))
                elif url.path in PROFILE_PATHS and profiles is not None:
                    if not profile_slots.acquire(blocking=False):
                        self._reply(*_BUSY_PROFILES)
                        return
                    try:  # the slot covers the work, not the client reading the answer
                        response = self._render(url.path, parse_qs(url.query))
                    finally:
                        profile_slots.release()
                    self._reply(*response)
                else:
                    self._reply(404, b"not found\n", "text/plain")
            except _BadRequest as exc:
                self._reply(400, f"{exc}\n".encode(), "text/plain")
            except Exception:
                log.exception("serving %s failed", url.path)
                self._reply(500, b"internal error\n", "text/plain")

        def _record(self, query: dict[str, list[str]]) -> _Response:
            """Go's semantics: the next ``seconds`` (default 30), as pprof."""
            assert recordings.recorder is not None
            seconds = _float(query, "seconds", RECORD_SECONDS, recordings.max_seconds,
                             MIN_RECORD_SECONDS)
            pids = _pids(query)
            if not recordings.slots.acquire(blocking=False):
                return _BUSY_PROFILES
            try:
                profile = recordings.recorder.record(seconds)
            except RecordingFailed as exc:
                return (503, f"recording failed: {exc}\n".encode(), "text/plain",
                        {"Retry-After": str(PROFILE_RETRY_AFTER)})
            finally:
                recordings.slots.release()
            if pids:
                profile = profile.only_pids(pids)
            # The client has waited for the recording: wait for a rendering
            # slot too rather than refuse now.
            if not profile_slots.acquire(timeout=request_timeout):
                return _BUSY_PROFILES
            try:
                writer = FORMATS["pprof"]
                body = writer.encode(profile)
            finally:
                profile_slots.release()
            return (200, body, writer.content_type,
                    {"Content-Disposition": f'attachment; filename="{writer.filename}"'})

        def _render(self, path: str, query: dict[str, list[str]]) -> _Response:
            assert profiles is not None
            if path == "/":
                body = IndexPage.render(profiles(index_seconds))
                return 200, body, "text/html; charset=utf-8", {}
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
            return 200, writer.encode(profile), writer.content_type, extra

        def _reply(self, code: int, body: bytes, content_type: str,
                   headers: dict[str, str] | None = None) -> None:
            try:
                self._send(code, body, content_type, headers)
            except OSError:
                # A reset, a timeout, a client that stopped waiting (a
                # recording takes its N seconds): the client's doing.
                self.close_connection = True
                log.debug("http: answer to %r not delivered", self.path, exc_info=True)

        def _send(self, code: int, body: bytes, content_type: str,
                  headers: dict[str, str] | None) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            # In pieces: the timeout bounds each (a stalled client), not the
            # whole of a large profile going to a slow one.
            with memoryview(body) as view:
                for offset in range(0, len(view), _WRITE_CHUNK):
                    self.wfile.write(view[offset:offset + _WRITE_CHUNK])

        def log_message(self, format: str, *args: object) -> None:
            log.debug("http: " + format, *args)

    return Handler


class _BadRequest(ValueError):
    pass


def _float(query: dict[str, list[str]], name: str, default: float,
           maximum: float = 86400, minimum: float | None = None) -> float:
    if name not in query:
        return default
    try:
        value = float(query[name][0])
    except ValueError:
        raise _BadRequest(f"{name} must be a number") from None
    if minimum is not None and not minimum <= value <= maximum:
        raise _BadRequest(f"{name} must be in [{minimum:g}, {maximum:g}]")
    if minimum is None and not 0 < value <= maximum:
        raise _BadRequest(f"{name} must be in (0, {maximum:g}]")
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

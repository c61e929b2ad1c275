"""The HTTP server's limits against local clients: idle-connection timeout
and connection cap, the Host check on loopback listeners, the /profile
concurrency limit, malformed basic-auth headers. Real servers on
127.0.0.1 port 0, real sockets, short timeouts."""

from __future__ import annotations

import base64
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from prometheus_client.registry import CollectorRegistry
from tramprof.export.http import PROFILE_RETRY_AFTER, HostPolicy, HttpSecurity, MetricsServer
from tramprof.model import Profile, Stack

# Every wait in this file is bounded by this (seconds).
PATIENCE = 5.0


def _profile() -> Profile:
    return Profile((Stack(1, "app", "app", ("main", "work"), 30),),
                   start_ns=1_700_000_000_000_000_000, duration_ns=10_000_000_000,
                   frequency_hz=99)


@pytest.fixture
def serve() -> Iterator[Callable[..., MetricsServer]]:
    servers: list[MetricsServer] = []

    def start(**kw: object) -> MetricsServer:
        kw.setdefault("profiles", lambda seconds: _profile())
        server = MetricsServer("127.0.0.1:0", CollectorRegistry(), lambda: (True, "ok"),
                               **kw)  # type: ignore[arg-type]
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


class Reply:
    def __init__(self, data: bytes) -> None:
        head, _, self.body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        assert lines[0].startswith("HTTP/"), f"no HTTP answer: {data[:200]!r}"
        self.status = int(lines[0].split()[1])
        self.headers = {k.strip().lower(): v.strip()
                        for k, _, v in (line.partition(":") for line in lines[1:])}


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def get(server: MetricsServer, path: str = "/healthz", host: str | None = None,
        headers: tuple[tuple[str, bytes], ...] = (), hosts: tuple[str, ...] | None = None,
        ) -> Reply:
    """One request over a fresh connection; ``host`` defaults to the
    listener's address, ``hosts`` sends any number of Host headers."""
    port = server.address[1]
    if hosts is None:
        hosts = (f"127.0.0.1:{port}" if host is None else host,)
    lines = [f"GET {path} HTTP/1.1".encode()]
    lines += [b"Host: " + h.encode("latin-1") for h in hosts]
    lines += [name.encode() + b": " + value for name, value in headers]
    lines.append(b"Connection: close")
    with socket.create_connection(("127.0.0.1", port), timeout=PATIENCE) as sock:
        sock.sendall(b"\r\n".join(lines) + b"\r\n\r\n")
        return Reply(_read_all(sock))


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + PATIENCE
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


# --------------------------------------------------------------------------
# Idle connections: timeout and cap
# --------------------------------------------------------------------------


def test_idle_connections_beyond_the_cap_do_not_stop_healthz(serve):
    timeout, cap, flood = 1.0, 4, 12
    server = serve(request_timeout=timeout, max_connections=cap)
    threads_before = threading.active_count()
    opened = time.monotonic()
    idle = [socket.create_connection(("127.0.0.1", server.address[1]), timeout=PATIENCE)
            for _ in range(flood)]
    try:
        wait_for(lambda: server.connections == cap, "the cap to fill")
        # One thread per held connection, none for the ones beyond the cap.
        assert threading.active_count() - threads_before <= cap
        busy = get(server)
        assert busy.status == 503 and busy.headers["retry-after"] == "1"
        assert time.monotonic() - opened < timeout, "too slow to see the cap in force"
        # The held connections time out, and /healthz answers again.
        wait_for(lambda: get(server).status == 200, "/healthz to answer 200")
        assert time.monotonic() - opened < timeout + 2.0
        # What the flood got: the first `cap` were held and closed without
        # an answer when the timeout passed, the others refused with 503.
        answers = []
        for sock in idle:
            answers.append(_read_all(sock))
        assert answers.count(b"") == cap
        refused = [Reply(a) for a in answers if a]
        assert [r.status for r in refused] == [503] * (flood - cap)
        assert time.monotonic() - opened >= timeout * 0.9, "closed before the timeout"
        wait_for(lambda: server.connections == 0, "every connection to be released")
    finally:
        for sock in idle:
            sock.close()


def test_idle_connection_is_closed_after_the_timeout(serve):
    timeout = 0.5
    server = serve(request_timeout=timeout)
    with socket.create_connection(("127.0.0.1", server.address[1]), timeout=PATIENCE) as sock:
        start = time.monotonic()
        assert sock.recv(1) == b""
        elapsed = time.monotonic() - start
    assert timeout * 0.8 <= elapsed < timeout + 1.0
    assert get(server).status == 200


def test_trickled_request_head_is_cut_at_the_deadline(serve):
    """The timeout is a deadline for the whole head, not per byte."""
    timeout = 0.5
    server = serve(request_timeout=timeout)
    with socket.create_connection(("127.0.0.1", server.address[1]), timeout=PATIENCE) as sock:
        start = time.monotonic()
        sock.sendall(b"GET /healthz HTTP/1.1\r\n")
        closed = False
        while time.monotonic() - start < 3.0 and not closed:
            try:
                sock.sendall(b"X")
            except OSError:
                closed = True
                break
            sock.settimeout(0.1)
            try:
                closed = sock.recv(1) == b""
            except TimeoutError:
                pass
            except OSError:
                closed = True
        elapsed = time.monotonic() - start
    assert closed, "the server kept a trickling client for 3 s"
    assert elapsed < timeout + 1.0


def test_oversized_request_head_is_refused(serve):
    server = serve()
    big = tuple((f"X-Filler-{i}", b"y" * 1000) for i in range(70))  # ~72 KiB of headers
    assert get(server, headers=big).status == 431
    assert get(server).status == 200


def test_limits_are_validated():
    for bad in ({"request_timeout": 0}, {"max_connections": 0},
                {"max_profile_requests": 0}, {"max_connections": 2, "max_profile_requests": 3},
                {"allowed_hosts": ["bad host:x"]}, {"max_record_seconds": 0.5},
                {"max_record_seconds": 86401}):
        with pytest.raises(ValueError):
            MetricsServer("127.0.0.1:0", CollectorRegistry(), lambda: (True, "ok"),
                          **bad)  # type: ignore[arg-type]


# --------------------------------------------------------------------------
# Host header (DNS rebinding)
# --------------------------------------------------------------------------


def test_loopback_listener_rejects_foreign_host(serve):
    server = serve()
    port = server.address[1]
    for host in ("evil.example", f"evil.example:{port}", f"localhost.evil.example:{port}",
                 f"127.0.0.1.nip.io:{port}", f"0.0.0.0:{port}", f"10.1.2.3:{port}",
                 f"[127.0.0.1]:{port}", f"[::1:{port}", f"localhost:{port}/x", ""):
        for path in ("/healthz", "/metrics", "/profile", "/", "/debug/pprof/profile"):
            reply = get(server, path, host=host)
            assert reply.status == 421, (host, path)
            assert b"Host" in reply.body
    assert get(server, hosts=()).status == 421  # no Host at all
    assert get(server, hosts=("localhost", "evil.example")).status == 421


def test_loopback_listener_accepts_loopback_names(serve):
    server = serve()
    port = server.address[1]
    for host in (f"localhost:{port}", "localhost", f"LocalHost:{port}", "localhost.",
                 f"127.0.0.1:{port}", "127.0.0.1", f"127.0.0.2:{port}",
                 f"[::1]:{port}", "[::1]", f"[::ffff:127.0.0.1]:{port}"):
        assert get(server, host=host).status == 200, host
        assert get(server, "/profile", host=host).status == 200, host


def test_allowed_hosts_extend_a_loopback_listener(serve):
    server = serve(allowed_hosts=["tramprof.internal"])
    port = server.address[1]
    assert get(server, host=f"tramprof.internal:{port}").status == 200
    assert get(server, host=f"TRAMPROF.internal:{port}").status == 200
    assert get(server, host=f"localhost:{port}").status == 200
    assert get(server, host=f"other.internal:{port}").status == 421


def test_host_policy_of_other_listeners():
    # Meant to be scraped remotely: any Host, unless an allow-list is given.
    for listen in ("0.0.0.0", "::", "10.1.2.3", "fd00::1"):
        policy = HostPolicy(listen)
        assert not policy.restricted
        assert policy.accepts("evil.example") and policy.accepts(None)
    policy = HostPolicy("0.0.0.0", ["prometheus.example", "10.0.0.0/8", "[fd00::1]"])
    assert policy.restricted
    for ok in ("prometheus.example:9947", "Prometheus.Example", "10.2.3.4:9947",
               "[fd00::1]:9947", "localhost:9947", "127.0.0.1"):
        assert policy.accepts(ok), ok
    for bad in ("evil.example", "11.2.3.4:9947", "[fd00::2]:9947", "", None):
        assert not policy.accepts(bad), bad
    for loopback in ("127.0.0.1", "127.5.5.5", "::1", "localhost"):
        assert HostPolicy(loopback).restricted, loopback
        assert not HostPolicy(loopback).accepts("evil.example")
        assert HostPolicy(loopback).accepts("localhost:1")
    for entry in ("", "a:b", "http://x", "two words"):
        with pytest.raises(ValueError):
            HostPolicy("127.0.0.1", [entry])


# --------------------------------------------------------------------------
# /profile concurrency
# --------------------------------------------------------------------------


def test_profile_requests_beyond_the_limit_get_429(serve):
    entered, release = threading.Event(), threading.Event()

    def slow_profiles(seconds: float) -> Profile:
        entered.set()
        assert release.wait(PATIENCE)
        return _profile()

    server = serve(profiles=slow_profiles, max_profile_requests=1)
    first: list[Reply] = []
    worker = threading.Thread(target=lambda: first.append(get(server, "/profile?seconds=5")))
    worker.start()
    try:
        assert entered.wait(PATIENCE)
        for path in ("/profile", "/profile?format=pprof", "/"):
            reply = get(server, path)
            assert reply.status == 429, path
            assert reply.headers["retry-after"] == str(PROFILE_RETRY_AFTER)
        # The rest of the server is not held up.
        assert get(server).status == 200
        assert get(server, "/metrics").status == 200
    finally:
        release.set()
        worker.join(PATIENCE)
    assert [r.status for r in first] == [200]
    assert first[0].body == b"app;main;work 30\n"
    # The slot is free again, also after a request that failed validation.
    assert get(server, "/profile?format=gif").status == 400
    assert get(server, "/profile").status == 200
    assert get(server, "/").status == 200


# --------------------------------------------------------------------------
# Basic auth with malformed headers
# --------------------------------------------------------------------------


def _basic(raw: bytes) -> bytes:
    return b"Basic " + base64.b64encode(raw)


def test_malformed_authorization_is_401_and_harmless(serve, capsys):
    server = serve(security=HttpSecurity(basic_auth_user="prom", basic_auth_password="s3cret"))
    for value in (b"Basic \xc3\xa9\xc3\xa9\xff",            # raw non-ASCII bytes
                  _basic("prom:pässwörd".encode()),         # valid base64, non-ASCII inside
                  _basic("prüm:s3cret".encode()),
                  _basic(b"\xff\xfe:\xff"),                 # not even UTF-8
                  b"Basic !!!garbage!!!", b"Basic", b"Basic ", b"Bearer abc",
                  _basic(b"proms3cret"),                    # no colon
                  _basic(b"prom:wrong"), _basic(b"prom:s3cret") + b"=="):
        reply = get(server, "/metrics", headers=(("Authorization", value),))
        assert reply.status == 401, value
        assert reply.headers["www-authenticate"] == 'Basic realm="tramprof"'
    assert get(server, "/metrics").status == 401
    good = _basic(b"prom:s3cret")
    assert get(server, "/metrics", headers=(("Authorization", good),)).status == 200
    assert get(server, "/metrics",
               headers=(("Authorization", b"basic " + good[6:]),)).status == 200
    assert get(server).status == 200
    assert "Traceback" not in capsys.readouterr().err


def test_non_ascii_credentials_compare_as_utf8():
    security = HttpSecurity(basic_auth_user="prüm", basic_auth_password="pässwörd")
    assert security.authorized(_basic("prüm:pässwörd".encode()).decode())
    assert not security.authorized(_basic("prüm:passwort".encode()).decode())
    # http.server hands header values over decoded as Latin-1.
    assert not security.authorized("Basic " + "prüm:pässwörd")
    assert not security.authorized(None)
    assert HttpSecurity().authorized("Basic \u00e9")  # no auth configured

"""sd_notify without libsystemd: the exact datagrams on a real AF_UNIX socket."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest
from tramprof.commands.sdnotify import Notifier


@pytest.fixture
def manager(tmp_path) -> Iterator[tuple[str, socket.socket]]:
    """A stand-in for systemd's notification socket (filesystem path)."""
    path = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(2)
    yield path, sock
    sock.close()


def receive(sock: socket.socket) -> bytes:
    return sock.recv(4096)


def nothing_queued(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        sock.recv(4096)
    except BlockingIOError:
        return True
    finally:
        sock.settimeout(2)
    return False


def test_messages_are_exact_datagrams(manager):
    path, sock = manager
    notifier = Notifier.from_environment({"NOTIFY_SOCKET": path})
    assert notifier.enabled
    assert notifier.ready("sampling at 99 Hz on 2 CPUs")
    assert receive(sock) == b"READY=1\nSTATUS=sampling at 99 Hz on 2 CPUs"
    assert notifier.ready()
    assert receive(sock) == b"READY=1"
    assert notifier.status("draining\nevery 10 s")  # newlines would break the framing
    assert receive(sock) == b"STATUS=draining every 10 s"
    assert notifier.watchdog()
    assert receive(sock) == b"WATCHDOG=1"
    assert notifier.stopping()
    assert receive(sock) == b"STOPPING=1"
    assert notifier.stopping("signal 15")
    assert receive(sock) == b"STOPPING=1\nSTATUS=signal 15"
    assert notifier.reloading()
    first, second = receive(sock).split(b"\n")
    assert first == b"RELOADING=1"
    assert second.startswith(b"MONOTONIC_USEC=") and int(second.split(b"=")[1]) > 0
    assert nothing_queued(sock)
    notifier.close()


def test_abstract_socket():
    name = f"tramprof-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(2)
        with Notifier.from_environment({"NOTIFY_SOCKET": "@" + name}) as notifier:
            assert notifier.ready("up")
            data = sock.recv(4096)
    assert data == b"READY=1\nSTATUS=up"


def test_unset_is_a_silent_no_op():
    notifier = Notifier.from_environment({})
    assert not notifier.enabled
    assert not notifier.ready("x")
    assert not notifier.status("x")
    assert not notifier.watchdog()
    assert not notifier.watchdog_if_due()
    assert not notifier.stopping()
    assert notifier.watchdog_interval() is None
    notifier.close()


def test_unusable_address_is_disabled(caplog):
    notifier = Notifier.from_environment({"NOTIFY_SOCKET": "vsock:2:1234"})
    assert not notifier.enabled and not notifier.ready()
    assert "not an AF_UNIX address" in caplog.text


def test_send_failure_is_reported_not_raised(tmp_path, caplog):
    notifier = Notifier.from_environment({"NOTIFY_SOCKET": str(tmp_path / "gone")})
    assert notifier.enabled
    assert not notifier.ready()
    assert not notifier.watchdog()
    assert caplog.text.count("cannot notify systemd") == 1  # logged once


def test_environment_is_unset_on_request(monkeypatch, manager):
    path, sock = manager
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    notifier = Notifier.from_environment(unset_environment=True)
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        assert name not in os.environ
    assert notifier.watchdog_interval() == 30.0
    assert notifier.ready()
    assert receive(sock) == b"READY=1"


@pytest.mark.parametrize(("env", "expected"), [
    ({"WATCHDOG_USEC": "30000000"}, 30.0),
    ({"WATCHDOG_USEC": "500000", "WATCHDOG_PID": "{me}"}, 0.5),
    ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, None),  # meant for another process
    ({"WATCHDOG_USEC": "0"}, None),
    ({"WATCHDOG_USEC": "soon"}, None),
    ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "x"}, None),
    ({"WATCHDOG_PID": "{me}"}, None),
    ({}, None),
])
def test_watchdog_interval(env, expected):
    env = {k: v.format(me=os.getpid()) for k, v in env.items()}
    notifier = Notifier.from_environment({"NOTIFY_SOCKET": "/run/nothing", **env})
    assert notifier.watchdog_interval() == expected


def test_watchdog_if_due_pings_at_half_the_interval(manager):
    path, sock = manager
    notifier = Notifier.from_environment({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "10000000"})
    assert notifier.watchdog_if_due(now=100.0)  # first call always pings
    assert receive(sock) == b"WATCHDOG=1"
    assert not notifier.watchdog_if_due(now=104.9)
    assert notifier.watchdog_if_due(now=105.0)
    assert receive(sock) == b"WATCHDOG=1"
    assert not notifier.watchdog_if_due(now=106.0)
    assert nothing_queued(sock)


def test_watchdog_if_due_without_watchdog_sends_nothing(manager):
    path, sock = manager
    notifier = Notifier.from_environment({"NOTIFY_SOCKET": path})
    assert not notifier.watchdog_if_due(now=0.0)
    assert nothing_queued(sock)


def test_one_socket_is_reused(manager):
    """One descriptor for the daemon's lifetime: no socket() per watchdog ping."""
    path, sock = manager
    notifier = Notifier.from_environment({"NOTIFY_SOCKET": path})
    assert notifier.status("one")
    assert receive(sock) == b"STATUS=one"
    fd = notifier._sock.fileno()  # type: ignore[union-attr]
    assert notifier.status("two")
    assert notifier._sock.fileno() == fd  # type: ignore[union-attr]
    assert receive(sock) == b"STATUS=two"

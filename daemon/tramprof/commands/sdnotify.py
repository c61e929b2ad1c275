"""The systemd notification protocol (sd_notify(3)) without libsystemd.

A service started with ``Type=notify`` gets the address of systemd's
notification socket in ``$NOTIFY_SOCKET``: a filesystem path, or an abstract
socket written with a leading ``@``. Each notification is one datagram of
newline-separated ``KEY=VALUE`` assignments (``READY=1``, ``STATUS=...``,
``WATCHDOG=1``, ``STOPPING=1``, ``RELOADING=1``). With ``WatchdogSec=``, the
manager sets ``$WATCHDOG_USEC`` (and ``$WATCHDOG_PID``, the process meant to
ping) and restarts the service when no ``WATCHDOG=1`` arrives in time.

Outside systemd (no ``$NOTIFY_SOCKET``) every method is a cheap no-op, so the
daemon calls them unconditionally. A failed send is logged once and
reported by the return value; it never raises: systemd going away must not
take the profiler down with it.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping

log = logging.getLogger(__name__)

__all__ = ["Notifier"]


def _socket_address(value: str) -> str | None:
    """The AF_UNIX address for ``$NOTIFY_SOCKET``, or None when unusable."""
    if value.startswith("@"):
        return "\0" + value[1:]  # abstract namespace
    if value.startswith("/"):
        return value
    return None  # e.g. vsock:CID:PORT (systemd >= 254 in VMs): not supported here


def _one_line(text: str) -> str:
    """A value must not break the KEY=VALUE framing."""
    return " ".join(text.split())


class Notifier:
    """Sends notifications to the service manager, or does nothing at all.

    Keeps one datagram socket open once the first message was sent, so
    notifications keep working after the daemon has dropped privileges or
    file system access.
    """

    def __init__(self, address: str | None, *, watchdog_usec: int | None = None,
                 watchdog_pid: int | None = None) -> None:
        self._address = address
        self._sock: socket.socket | None = None
        self._watchdog_usec = watchdog_usec
        self._watchdog_pid = watchdog_pid
        self._last_watchdog: float | None = None
        self._warned = False

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None, *,
                         unset_environment: bool = False) -> Notifier:
        """A notifier for ``$NOTIFY_SOCKET`` (a no-op one when it is not set).

        With ``unset_environment`` the variables are removed from
        ``os.environ`` so that child processes do not notify in our name.
        """
        env = os.environ if environ is None else environ
        raw = env.get("NOTIFY_SOCKET", "")
        address = _socket_address(raw) if raw else None
        if raw and address is None:
            log.warning("NOTIFY_SOCKET=%r is not an AF_UNIX address; not notifying systemd",
                        raw)
        usec: int | None = None
        text = env.get("WATCHDOG_USEC", "")
        if text:
            try:
                usec = int(text)
            except ValueError:
                log.warning("ignoring WATCHDOG_USEC=%r: not an integer", text)
            else:
                usec = usec if usec > 0 else None
        pid: int | None = None
        text = env.get("WATCHDOG_PID", "")
        if text:
            try:
                pid = int(text)
            except ValueError:
                log.warning("ignoring WATCHDOG_PID=%r: not an integer", text)
                usec = None  # the watchdog may be meant for someone else
        if unset_environment and environ is None:
            for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
                os.environ.pop(name, None)
        return cls(address, watchdog_usec=usec, watchdog_pid=pid)

    @property
    def enabled(self) -> bool:
        """True when there is a service manager to notify."""
        return self._address is not None

    # -- messages -------------------------------------------------------------

    def notify(self, **fields: str | int) -> bool:
        """Send one datagram of ``KEY=VALUE`` lines (keys upper-cased).

        Returns True when it was sent, False when there is no manager or the
        send failed (logged once)."""
        if self._address is None or not fields:
            return False
        lines = [f"{key.upper()}={_one_line(str(value))}" for key, value in fields.items()]
        return self._send("\n".join(lines).encode())

    def ready(self, status: str | None = None) -> bool:
        """Start-up finished (``Type=notify``: ``systemctl start`` returns now)."""
        if status is None:
            return self.notify(READY=1)
        return self.notify(READY=1, STATUS=status)

    def status(self, text: str) -> bool:
        """Free-form one-line status, shown by ``systemctl status``."""
        return self.notify(STATUS=text)

    def watchdog(self) -> bool:
        """Keep-alive for ``WatchdogSec=``; call at least every interval/2."""
        sent = self.notify(WATCHDOG=1)
        if sent:
            self._last_watchdog = time.monotonic()
        return sent

    def watchdog_if_due(self, now: float | None = None) -> bool:
        """Ping the watchdog when half its interval passed since the last ping.

        Meant for a main loop that wakes at least every interval/4: it sends
        no more datagrams than needed. Returns True when a ping was sent."""
        interval = self.watchdog_interval()
        if interval is None or self._address is None:
            return False
        now = time.monotonic() if now is None else now
        if self._last_watchdog is not None and now - self._last_watchdog < interval / 2:
            return False
        sent = self.notify(WATCHDOG=1)
        if sent:
            self._last_watchdog = now
        return sent

    def reloading(self) -> bool:
        """A reload (e.g. after SIGHUP) began; send ``ready()`` when it is done.

        Carries ``MONOTONIC_USEC`` as ``Type=notify-reload`` (systemd >= 253)
        requires; older managers ignore the field."""
        return self.notify(RELOADING=1, MONOTONIC_USEC=time.clock_gettime_ns(
            time.CLOCK_MONOTONIC) // 1000)

    def stopping(self, status: str | None = None) -> bool:
        """Shutdown began: the manager stops waiting for watchdog pings."""
        if status is None:
            return self.notify(STOPPING=1)
        return self.notify(STOPPING=1, STATUS=status)

    def watchdog_interval(self) -> float | None:
        """The watchdog timeout in seconds, or None when there is no watchdog
        for this process (none configured, or ``$WATCHDOG_PID`` names
        another process)."""
        if self._watchdog_usec is None:
            return None
        if self._watchdog_pid is not None and self._watchdog_pid != os.getpid():
            return None
        return self._watchdog_usec / 1_000_000

    # -- transport -------------------------------------------------------------

    def _send(self, payload: bytes) -> bool:
        assert self._address is not None
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            sent = self._sock.sendto(payload, self._address)
        except OSError as exc:
            if not self._warned:
                self._warned = True
                log.warning("cannot notify systemd at %s: %s",
                            self._address.replace("\0", "@"), exc.strerror or exc)
            return False
        return sent == len(payload)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> Notifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

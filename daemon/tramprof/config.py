"""Daemon settings, declared once: built-in defaults, then an optional TOML
file, then ``TRAMPROF_<NAME>`` environment variables, then CLI flags.

Default frequency: 99 Hz. Odd, so sampling does not run in lock-step with
100/250/1000 Hz timer ticks and periodic work (which would over- or under-count
it); low enough that the sampler costs well under 1% of a CPU; high enough for
useful profiles within one 10 s interval (~1,000 samples per busy CPU).
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

DEFAULT_LISTEN = "127.0.0.1:9947"
DEFAULT_FREQUENCY = 99
DEFAULT_INTERVAL = 10.0
#: Labels a process's series can be grouped by (``group_by``).
GROUP_LABELS = ("comm", "exe", "container_id", "pod_uid", "pid")
#: Perf events the sampler can attach to; "auto" takes cycles where the CPU
#: has a PMU, else cpu-clock (VMs).
EVENTS = ("auto", "cycles", "cpu-clock")
# The scan program covers 8 KiB per run and chains its runs by tail calls, at
# most 33 in a row; 32 runs leave one for the end-of-window check.
MAX_SCAN_BYTES = 32 * 8192
ENV_PREFIX = "TRAMPROF_"
#: Trampoline arena pages one process may install in the BPF maps (65,536 for
#: all processes): 4,096 pages are 16 MiB of stubs, ~1M Python functions at
#: CPython's 16-byte stride.
DEFAULT_STUB_PAGES = 4096


class ConfigError(ValueError):
    """A setting is unknown or has a bad value; the message names the key."""


@dataclass(frozen=True)
class Config:
    listen: str = DEFAULT_LISTEN
    frequency: int = DEFAULT_FREQUENCY
    interval: float = DEFAULT_INTERVAL
    pids: tuple[int, ...] = ()
    event: str = "auto"
    max_keys: int = 16384
    max_user_stacks: int = 16384
    max_kernel_stacks: int = 8192
    scan_window_bytes: int = 65536
    max_stub_pages_per_process: int = DEFAULT_STUB_PAGES
    proc_root: str = "/proc"
    log_level: str = "info"
    group_by: tuple[str, ...] = ("comm",)
    stack_series_per_group: int = 20
    function_series_per_group: int = 50
    max_series: int = 10000
    max_process_series: int = 1000
    symbol_memory_bytes: int = 128 << 20
    # "UID:GID" a root daemon switches to once started, keeping only the
    # capabilities it needs; "" keeps the uid (capabilities are dropped anyway).
    run_as: str = "65534:65534"
    max_label_bytes: int = 1024
    series_expiry: float = 600.0
    profile_retention: float = 300.0
    tls_cert_file: str = ""
    tls_key_file: str = ""
    basic_auth_user: str = ""
    basic_auth_password_file: str = ""
    # HTTP limits: a request's head must arrive within this many seconds;
    # connections and concurrent profile renderings are capped; a loopback
    # listener accepts only loopback Host names and these.
    http_request_timeout: float = 10.0
    http_max_connections: int = 64
    http_max_profile_requests: int = 2
    http_allowed_hosts: tuple[str, ...] = ()

    def run_as_ids(self) -> tuple[int, int] | None:
        """(uid, gid) of ``run_as``, None to keep the uid."""
        if not self.run_as:
            return None
        uid, gid = self.run_as.split(":")
        return int(uid), int(gid)

    def validated(self) -> Config:
        for f in fields(self):
            check_setting(f.name, getattr(self, f.name))
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError("tls_cert_file: set both tls_cert_file and tls_key_file, "
                              "or neither")
        if bool(self.basic_auth_user) != bool(self.basic_auth_password_file):
            raise ConfigError("basic_auth_user: set both basic_auth_user and "
                              "basic_auth_password_file, or neither")
        return self


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) with a clear error."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"listen address must be HOST:PORT, got {value!r}")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)


def check_setting(name: str, value: Any) -> None:
    """Raise ConfigError when ``value`` is not valid for setting ``name``: the
    one set of rules, used by ``Config`` and by every component that takes a
    setting's value directly (the sampler, the series tracker)."""
    check = _CHECKS.get(name)
    why = check(value) if check is not None else ""
    if why:
        raise ConfigError(f"{name}: {why}")


def _range(low: float, high: float, unit: str = "") -> Callable[[Any], str]:
    return lambda v: "" if low <= v <= high else f"must be {low:g}..{high:g}{unit}"


def _listen(value: str) -> str:
    try:
        parse_listen(value)
    except ValueError as exc:
        return str(exc)
    return ""


_CHECKS: dict[str, Callable[[Any], str]] = {
    "listen": _listen,
    "frequency": _range(1, 10000, " (Hz)"),
    "interval": _range(0.1, 3600, " (seconds)"),
    "pids": lambda v: "" if all(p > 0 for p in v) else "must be positive process ids",
    "event": lambda v: "" if v in EVENTS else f"must be one of {', '.join(EVENTS)}",
    "max_keys": _range(64, 1 << 22),
    "max_user_stacks": _range(64, 1 << 22),
    "max_kernel_stacks": _range(64, 1 << 22),
    "scan_window_bytes": lambda v: "" if 512 <= v <= MAX_SCAN_BYTES and v % 512 == 0
    else f"must be a multiple of 512 from 512 to {MAX_SCAN_BYTES} (bytes)",
    "max_stub_pages_per_process": _range(16, 65536),
    "log_level": lambda v: "" if v in ("debug", "info", "warning", "error")
    else "must be debug, info, warning or error",
    "group_by": lambda v: "" if v and set(v) <= set(GROUP_LABELS) and len(set(v)) == len(v)
    else f"must be a non-empty list of distinct labels from {', '.join(GROUP_LABELS)}",
    "stack_series_per_group": _range(1, 10000),
    "function_series_per_group": _range(1, 10000),
    "max_series": _range(10, 10_000_000),
    "max_process_series": _range(10, 1_000_000),
    "symbol_memory_bytes": _range(1 << 20, 1 << 36, " (bytes)"),
    "run_as": lambda v: "" if v == "" or (v.count(":") == 1 and all(
        p.isascii() and p.isdigit() and int(p) < 1 << 32 for p in v.split(":")))
    else 'must be "UID:GID" (numbers) or "" to keep the uid',
    "max_label_bytes": _range(64, 65536),
    "series_expiry": _range(1, 86400 * 7, " (seconds)"),
    "profile_retention": _range(1, 86400, " (seconds)"),
    "http_request_timeout": _range(0.1, 3600, " (seconds)"),
    "http_max_connections": _range(1, 65536),
    "http_max_profile_requests": _range(1, 65536),
}

# The type each setting takes in TOML; tuples are lists of the element type.
_KINDS: dict[str, type] = {f.name: type(f.default) for f in fields(Config)}
_ELEMENTS: dict[str, type] = {"pids": int, "group_by": str, "http_allowed_hosts": str}


def _coerce(key: str, value: Any) -> Any:
    want = _KINDS[key]
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if want is tuple:
        element = _ELEMENTS[key]
        if not isinstance(value, list) or not all(
                isinstance(v, element) and not isinstance(v, bool) for v in value):
            raise ConfigError(f"{key}: expected a list of {element.__name__}")
        return tuple(value)
    if not isinstance(value, want) or isinstance(value, bool):
        raise ConfigError(f"{key}: expected {want.__name__}, got {type(value).__name__}")
    return value


def from_mapping(data: Mapping[str, Any], base: Config | None = None) -> Config:
    """Apply a parsed TOML table onto ``base``; unknown keys and bad types are errors."""
    changes: dict[str, Any] = {}
    for key, value in data.items():
        if key not in _KINDS:
            raise ConfigError(f"{key}: unknown setting (known: {', '.join(sorted(_KINDS))})")
        changes[key] = _coerce(key, value)
    return replace(base or Config(), **changes).validated()


def _parse_env(key: str, text: str) -> Any:
    want = _KINDS[key]
    try:
        if want is int:
            return int(text)
        if want is float:
            return float(text)
        if want is tuple:
            element = _ELEMENTS[key]
            return [element(part) for part in text.replace(",", " ").split()]
    except ValueError:
        raise ConfigError(f"{key}: environment variable {ENV_PREFIX}{key.upper()}="
                          f"{text!r} is not a valid {want.__name__}") from None
    return text


def from_environment(environ: Mapping[str, str], base: Config | None = None) -> Config:
    """Apply ``TRAMPROF_<SETTING>`` variables; unknown TRAMPROF_ variables are errors."""
    data = {}
    for name, text in environ.items():
        if not name.startswith(ENV_PREFIX) or name in _NOT_SETTINGS:
            continue
        key = name[len(ENV_PREFIX):].lower()
        if key not in _KINDS:
            raise ConfigError(f"{key}: unknown setting in environment variable {name}")
        data[key] = _parse_env(key, text)
    return from_mapping(data, base)


# Variables of the same prefix that are not daemon settings.
_NOT_SETTINGS = frozenset({"TRAMPROF_TRAMPOLINES", "TRAMPROF_TRAMPOLINES_JITDUMP"})


def load_file(path: str) -> Config:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    try:
        return from_mapping(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def load(path: str | None, environ: Mapping[str, str] | None = None,
         overrides: Mapping[str, Any] | None = None) -> Config:
    """File, then environment, then explicit overrides (CLI flags)."""
    config = load_file(path) if path else Config()
    config = from_environment(os.environ if environ is None else environ, config)
    return replace(config, **{k: v for k, v in (overrides or {}).items()
                              if v is not None}).validated()


def describe() -> list[tuple[str, str, str]]:
    """(setting, environment variable, default) for documentation."""
    return [(f.name, f"{ENV_PREFIX}{f.name.upper()}", repr(f.default)) for f in fields(Config)]

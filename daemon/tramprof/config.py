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
    # HTTP address for /metrics, /profile, /healthz and the flame graph page:
    # "HOST:PORT" or "[IPv6]:PORT". 127.0.0.1 serves only this host; use
    # "0.0.0.0:9947" (or the host's address) for a Prometheus elsewhere, and then
    # consider TLS and basic authentication (below).
    listen: str = DEFAULT_LISTEN
    # Samples per second on every CPU, 1..10000. 99 (odd) avoids running in
    # lock-step with 100/250/1000 Hz timer ticks; sampling costs well under 1% of
    # a CPU at this rate.
    frequency: int = DEFAULT_FREQUENCY
    # Seconds between drains of the in-kernel counters, 0.1..3600. Each drain
    # names the new stacks and updates /metrics; /healthz turns unhealthy after 3
    # intervals + 5 s without one.
    interval: float = DEFAULT_INTERVAL
    # Process ids to profile; empty means every process on the host. Pids are
    # those of the initial pid namespace (as `ps` on the host shows them).
    pids: tuple[int, ...] = ()
    # Perf event that triggers a sample: "cycles" (hardware PMU), "cpu-clock"
    # (software timer, works in VMs without a virtual PMU) or "auto" (cycles where
    # available, else cpu-clock).
    event: str = "auto"
    # Entries of the BPF map that counts samples per (process, thread, kernel
    # stack, user stack) in one interval, 64..4194304. Samples that do not fit are
    # counted in tramprof_lost_samples_total{reason="counts_map_full"}: raise this
    # if that grows.
    max_keys: int = 16384
    # Distinct user stacks in one interval, 64..4194304, of each kind (with
    # trampoline frames, and without: two maps); samples past it are counted
    # in tramprof_lost_samples_total{reason="user_stacks_map_full"}.
    max_user_stacks: int = 16384
    # Kernel stack map entries, 64..4194304. A full or colliding bucket loses the
    # sample's kernel stack ([kernel stack lost]; counted in
    # tramprof_kernel_stacks_lost_total{reason="collision"}), not the sample.
    max_kernel_stacks: int = 8192
    # Stack bytes scanned, from the sampled stack pointer up, for the return
    # addresses of trampolines tramprof does not control (CPython 3.12+ -X perf):
    # a multiple of 512 up to 262144. A Python frame takes ~0.5 KiB of native
    # stack on CPython 3.13, so 65536 reaches ~130 frames deep; deeper stacks lose
    # their root-side frames (tramprof_scan_windows_exhausted_total). Run time per
    # sample grows with the bytes actually scanned (benchmarks/bench_unwind.py).
    scan_window_bytes: int = 65536
    # Trampoline arena pages one process may install in the BPF maps, 16..65536;
    # a process asking for more is refused, counted in
    # tramprof_unwind_refusals_total{reason="map_full"}, and unwound by frame
    # pointers.
    max_stub_pages_per_process: int = DEFAULT_STUB_PAGES
    # Where procfs is read: the sampled processes' /proc/PID files and
    # /proc/kallsyms. Sampled pids are those of the initial pid namespace, so this
    # must be a procfs of that namespace (the host's /proc, or a copy of it
    # mounted elsewhere).
    proc_root: str = "/proc"
    # "debug", "info", "warning" or "error". Logs go to stderr (the journal
    # under systemd, `kubectl logs` on Kubernetes).
    log_level: str = "info"
    # What makes a process group, the unit of the stack and function series:
    # one or more of "comm" (process name), "exe" (executable path),
    # "container_id" and "pod_uid" (from the process's cgroup) and "pid". Each
    # group has its own hottest stacks and functions; its series carry `process`
    # (the name) and a label for each choice but comm. "pid" makes a group of
    # every process: for looking at one host, not for a fleet. README.md
    # ("Grouping") shows how to join pod_uid with kube-state-metrics.
    group_by: tuple[str, ...] = ("comm",)
    # Stacks of a process group that get a series of their own (the hottest),
    # 1..10000; the others are counted in stack="[other]".
    stack_series_per_group: int = 20
    # Functions of a process group that get series (self and total; those with
    # the most total samples), 1..10000; the others' self samples are counted in
    # function="[other]".
    function_series_per_group: int = 50
    # Stack and function series of all groups together, [other] included,
    # 10..10000000. Past it new stacks and functions go to [other], counted in
    # tramprof_dropped_series_total{reason="budget"}. A scraper's sample_limit
    # must leave room for it, max_process_series and ~100 more self-metric
    # series (deploy/prometheus/).
    max_series: int = 10000
    # Process names that get their own tramprof_samples_total series,
    # 10..1000000; samples of any others are counted under process="[other]".
    max_process_series: int = 1000
    # Memory for the perf map and jitdump indexes of all processes together,
    # in bytes (1 MiB..64 GiB). Past it, the least recently sampled processes'
    # indexes are dropped (their JIT frames stay unnamed for ten minutes):
    # tramprof_symbol_memory_bytes and tramprof_symbol_evictions_total show it.
    symbol_memory_bytes: int = 128 << 20
    # Memory for the names and places of frames remembered by address, all
    # processes together, in bytes (1 MiB..64 GiB; estimated at ~224 bytes an
    # address). Past it, the least recently sampled processes' caches are
    # emptied and their frames looked up again as they are sampled:
    # tramprof_address_cache_entries and tramprof_address_cache_evictions_total
    # show it.
    address_cache_bytes: int = 32 << 20
    # Kernel memory for unwind tables of native code without frame pointers
    # (rows compiled from .eh_frame, loaded for objects seen in samples and
    # evicted least recently sampled first); 0 turns the tables off.
    unwind_table_bytes: int = 64 << 20
    # Share of a Python process's CPU time its trampoline runtime may cost,
    # 0..1 (e.g. 0.02); 0 means no budget: the runtime is always on. The daemon
    # measures each process's cost and switches the runtime's hook on and off
    # (windows of 1 s at a random phase) to stay within it; samples taken
    # while it is off carry "[python frames paused]" instead of Python names.
    # Applies to processes under tramprof_trampolines 0.1 with ABI 2 or later.
    python_overhead_budget: float = 0.0
    # Scheduler slice, in seconds, the daemon's main loop asks the kernel for
    # (0.0001..0.1; 0 keeps the kernel's default, ~0.7-3 ms). A short one
    # lets the loop run at once when a process is sampled for the first time,
    # so a short-lived one is read before it exits; it changes when the loop
    # runs, not how much CPU it gets. Linux 6.12 and later honour it (earlier
    # kernels ignore it: tramprof_scheduler_slice_seconds shows 0).
    scheduler_slice: float = 0.0001
    # Directory where the compiled BPF program is kept (an absolute path), so
    # that the next start on the same kernel, bcc and tramprof loads it in
    # place of compiling (seconds and ~150 MB less at start-up); "" compiles
    # at every start. Created (0700) if missing; used only if it and its
    # files belong to the daemon's user or root and no one else can write them.
    program_cache_dir: str = "/var/cache/tramprof"
    # "UID:GID" a root daemon switches to once started, keeping only the
    # capabilities it needs; "" keeps the uid (capabilities are dropped anyway).
    run_as: str = "65534:65534"
    # Longest stack or function label, in UTF-8 bytes, 64..65536. A longer
    # stack keeps its leaf end and starts with "…;", a longer name ends in "…"
    # (counted in tramprof_dropped_series_total{reason="label_too_long"}). A
    # scraper's label_value_length_limit must allow it.
    max_label_bytes: int = 1024
    # Seconds without samples after which a stack, function or process series
    # is removed and its budget freed, 1..604800: how exited processes and gone
    # stacks leave /metrics.
    series_expiry: float = 600.0
    # Seconds of drained windows kept for /profile, 1..86400.
    profile_retention: float = 300.0
    # Estimated memory the windows kept for /profile may hold, 1 MiB..64 GiB:
    # past it the oldest leave first, so a node with very many distinct
    # stacks keeps fewer seconds (tramprof_profile_store_seconds shows how
    # many) rather than more memory. ~1 MiB holds 10 s of 1,200 stacks of 45
    # frames, each sampled once.
    profile_store_bytes: int = 16 << 20
    # PEM certificate (chain) to serve HTTPS with; set together with
    # tls_key_file. "" serves plain HTTP.
    tls_cert_file: str = ""
    # PEM private key of tls_cert_file.
    tls_key_file: str = ""
    # User name HTTP basic authentication asks for on every endpoint but
    # /healthz; set together with basic_auth_password_file. "" turns it off.
    basic_auth_user: str = ""
    # File holding basic_auth_user's password (surrounding white space is
    # ignored); readable by the daemon only.
    basic_auth_password_file: str = ""
    # Seconds a connection has to send its whole request head, 0.1..3600;
    # slower clients are cut off.
    http_request_timeout: float = 10.0
    # Connections served at once, 1..65536; more are answered 503 and closed.
    http_max_connections: int = 64
    # /profile and flame graph renderings at once, 1..65536; more are answered
    # 429 with Retry-After.
    http_max_profile_requests: int = 2
    # Host names, addresses or networks (10.0.0.0/8) requests may name in
    # their Host header besides localhost and loopback addresses. A loopback
    # listener answers only those (against DNS rebinding from a browser on the
    # host); with entries here, any listener does.
    http_allowed_hosts: tuple[str, ...] = ()
    # Automatic injection (``tramprof inject`` on a process's first sample): off
    # while every selector is empty; a process must match each non-empty one.
    # inject_comm: process names; inject_exe: globs on the executable path;
    # inject_cgroup: globs on the cgroup path; inject_container: container id
    # prefixes ("*": any process in a container). At most one injection per
    # inject_interval seconds, once per process image.
    inject_comm: tuple[str, ...] = ()
    inject_exe: tuple[str, ...] = ()
    inject_cgroup: tuple[str, ...] = ()
    inject_container: tuple[str, ...] = ()
    inject_interval: float = 1.0
    # How long an injection waits for the target to run the activation.
    inject_timeout: float = 5.0
    # Prebuilt runtimes for CPython 3.9-3.11 (_runtime-cp3X.so); "" = shipped ones.
    inject_runtime_dir: str = ""

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
    "address_cache_bytes": _range(1 << 20, 1 << 36, " (bytes)"),
    "python_overhead_budget": _range(0, 1),
    "scheduler_slice": lambda v: "" if v == 0 else _range(0.0001, 0.1, " (seconds)")(v),
    "program_cache_dir": lambda v: "" if v == "" or (v.startswith("/") and "\0" not in v)
    else 'must be an absolute path, or "" to compile at every start',
    "unwind_table_bytes": lambda v: "" if v == 0 else _range(1 << 20, 1 << 34, " (bytes)")(v),
    "run_as": lambda v: "" if v == "" or (v.count(":") == 1 and all(
        p.isascii() and p.isdigit() and int(p) < 1 << 32 for p in v.split(":")))
    else 'must be "UID:GID" (numbers) or "" to keep the uid',
    "max_label_bytes": _range(64, 65536),
    "series_expiry": _range(1, 86400 * 7, " (seconds)"),
    "profile_retention": _range(1, 86400, " (seconds)"),
    "profile_store_bytes": _range(1 << 20, 1 << 36, " (bytes)"),
    "http_request_timeout": _range(0.1, 3600, " (seconds)"),
    "http_max_connections": _range(1, 65536),
    "http_max_profile_requests": _range(1, 65536),
    "inject_interval": _range(0.01, 3600, " (seconds)"),
    "inject_timeout": _range(0.1, 600, " (seconds)"),
}

# The type each setting takes in TOML; tuples are lists of the element type.
_KINDS: dict[str, type] = {f.name: type(f.default) for f in fields(Config)}
_ELEMENTS: dict[str, type] = {"pids": int, "group_by": str, "http_allowed_hosts": str,
                              "inject_comm": str, "inject_exe": str, "inject_cgroup": str,
                              "inject_container": str}


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
_NOT_SETTINGS = frozenset({"TRAMPROF_TRAMPOLINES", "TRAMPROF_TRAMPOLINES_JITDUMP",
                           "TRAMPROF_INJECT_PAUSE_AT"})


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

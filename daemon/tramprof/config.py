"""Daemon settings: built-in defaults, an optional TOML file, CLI flags on top.

Default frequency: 99 Hz. Odd, so sampling does not run in lock-step with
100/250/1000 Hz timer ticks and periodic work (which would over- or under-count
it); low enough that the sampler costs well under 1% of a CPU; high enough for
useful profiles within one 10 s interval (~1,000 samples per busy CPU).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields, replace
from typing import Any

from tramprof.sampler import EVENTS, SamplerConfig

DEFAULT_LISTEN = "127.0.0.1:9947"
DEFAULT_FREQUENCY = 99
DEFAULT_INTERVAL = 10.0


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
    proc_root: str = "/proc"
    log_level: str = "info"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def sampler_config(self) -> SamplerConfig:
        return SamplerConfig(frequency=self.frequency, event=self.event,
                             max_keys=self.max_keys, max_user_stacks=self.max_user_stacks,
                             max_kernel_stacks=self.max_kernel_stacks,
                             max_targets=max(4096, len(self.pids)))

    def validated(self) -> Config:
        _check(1 <= self.frequency <= 10000, "frequency", "must be 1..10000 (Hz)")
        _check(0.1 <= self.interval <= 3600, "interval", "must be 0.1..3600 (seconds)")
        _check(self.event in EVENTS, "event", f"must be one of {', '.join(EVENTS)}")
        _check(all(p > 0 for p in self.pids), "pids", "must be positive process ids")
        for name in ("max_keys", "max_user_stacks", "max_kernel_stacks"):
            _check(64 <= getattr(self, name) <= 1 << 22, name, "must be 64..4194304")
        _check(self.log_level in ("debug", "info", "warning", "error"), "log_level",
               "must be debug, info, warning or error")
        from tramprof.export.http import parse_listen

        try:
            parse_listen(self.listen)
        except ValueError as exc:
            raise ConfigError(f"listen: {exc}") from None
        return self


def _check(ok: bool, key: str, why: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {why}")


_TYPES: dict[str, type] = {
    "listen": str, "frequency": int, "interval": float, "pids": list, "event": str,
    "max_keys": int, "max_user_stacks": int, "max_kernel_stacks": int,
    "proc_root": str, "log_level": str,
}


def from_mapping(data: dict[str, Any], base: Config | None = None) -> Config:
    """Apply a parsed TOML table onto ``base``; unknown keys and bad types are errors."""
    known = {f.name for f in fields(Config)} - {"extra"}
    changes: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            raise ConfigError(f"{key}: unknown setting (known: {', '.join(sorted(known))})")
        want = _TYPES[key]
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, want) or isinstance(value, bool):
            raise ConfigError(f"{key}: expected {want.__name__}, got {type(value).__name__}")
        if isinstance(value, list):
            if not all(isinstance(p, int) and not isinstance(p, bool) for p in value):
                raise ConfigError(f"{key}: expected a list of integers")
            value = tuple(value)
        changes[key] = value
    return replace(base or Config(), **changes).validated()


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

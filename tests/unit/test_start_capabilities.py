"""The start-up capability check of ``tramprof run``: every capability the
daemon will use is asked for before anything is loaded, and a missing one
stops it with a message naming it. Runs against the fake kernel of
test_privileges (in-process, any user, nothing real changes).

The capability sets come from the shipped files: the DaemonSet's
``capabilities.add`` and the systemd unit's ``AmbientCapabilities=``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import pytest
from tramprof.commands import privileges
from tramprof.commands.privileges import (
    PURPOSES,
    PrivilegeError,
    cap_mask,
    check_start_capabilities,
    kallsyms_needs_syslog,
    missing_capabilities,
)

from tests.unit.test_privileges import FakeKernel, FakeProfiler

yaml = pytest.importorskip("yaml")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
NEW_KERNEL = (6, 1)
# kallsyms hides addresses from holders of no CAP_SYSLOG (Debian's defaults).
HIDING = {"kptr_restrict": 0, "perf_event_paranoid": 2}


def daemonset_capabilities() -> set[str]:
    docs = yaml.safe_load_all((DEPLOY / "kubernetes" / "daemonset.yaml").read_text())
    (ds,) = [d for d in docs if d and d.get("kind") == "DaemonSet"]
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    return {"CAP_" + name for name in container["securityContext"]["capabilities"]["add"]}


def unit_capabilities() -> set[str]:
    text = (DEPLOY / "systemd" / "tramprof.service").read_text()
    return {name for line in re.findall(r"^AmbientCapabilities=(.*)$", text, re.M)
            for name in line.split()}


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> Callable[..., FakeKernel]:
    def make(**kwargs: object) -> FakeKernel:
        return FakeKernel(**kwargs).install(monkeypatch)  # type: ignore[arg-type]
    return make


def missing(**kwargs: object) -> dict[str, str]:
    return missing_capabilities(kernel=NEW_KERNEL, **{**HIDING, **kwargs})  # type: ignore[arg-type]


def test_root_needs_nothing_more(kernel):
    kernel()
    assert missing() == {}


def test_sys_admin_alone_is_not_enough(kernel):
    """It stands in for CAP_BPF and CAP_PERFMON, not for what is kept."""
    kernel(caps=cap_mask({"CAP_SYS_ADMIN"}))
    assert list(missing()) == ["CAP_DAC_READ_SEARCH", "CAP_SETGID", "CAP_SETUID",
                               "CAP_SYS_PTRACE", "CAP_SYSLOG", "CAP_CHECKPOINT_RESTORE"]


def test_the_daemonset_grants_exactly_what_is_asked_for(kernel):
    granted = daemonset_capabilities()
    kernel(caps=cap_mask(granted), bounding=cap_mask(granted))
    assert missing() == {}
    # Nothing granted that the check would not ask for.
    assert granted == set(PURPOSES)


@pytest.mark.parametrize("absent", sorted(daemonset_capabilities()))
def test_each_daemonset_capability_is_named_when_missing(kernel, absent):
    granted = daemonset_capabilities() - {absent}
    kernel(caps=cap_mask(granted), bounding=cap_mask(granted))
    assert missing() == {absent: PURPOSES[absent]}


def test_the_systemd_unit_needs_no_setuid(kernel):
    """DynamicUser=: not root, so nothing to leave."""
    granted = unit_capabilities()
    kernel(uid=61234, caps=cap_mask(granted), bounding=cap_mask(granted))
    assert missing() == {}


def test_staying_root_on_purpose_needs_no_setuid(kernel):
    granted = daemonset_capabilities() - {"CAP_SETUID", "CAP_SETGID"}
    kernel(caps=cap_mask(granted))
    assert missing(run_as=None) == {}
    assert set(missing()) == {"CAP_SETUID", "CAP_SETGID"}


def test_sys_admin_stands_in_for_bpf_and_perfmon(kernel):
    granted = daemonset_capabilities() - {"CAP_BPF", "CAP_PERFMON"} | {"CAP_SYS_ADMIN"}
    kernel(caps=cap_mask(granted))
    assert missing() == {}


@pytest.mark.parametrize(("kptr_restrict", "paranoid", "needed"), [
    (0, 1, False),  # everyone sees the addresses
    (0, 2, True),
    (1, -1, True),
    (2, -1, False),  # no one does: CAP_SYSLOG would not help
])
def test_syslog_only_where_kallsyms_needs_it(kernel, kptr_restrict, paranoid, needed):
    assert kallsyms_needs_syslog(kptr_restrict, paranoid) is needed
    kernel(caps=cap_mask(daemonset_capabilities() - {"CAP_SYSLOG"}))
    assert ("CAP_SYSLOG" in missing(kptr_restrict=kptr_restrict,
                                    perf_event_paranoid=paranoid)) is needed


def test_start_up_capabilities_must_be_effective_kept_ones_permitted(kernel):
    k = kernel(caps=cap_mask(daemonset_capabilities()))
    k.eff &= ~cap_mask({"CAP_BPF", "CAP_SETUID", "CAP_SYS_PTRACE"})
    assert set(missing()) == {"CAP_BPF"}


def test_old_kernel_keeps_cap_bpf_and_lacks_checkpoint_restore(kernel, monkeypatch):
    """Linux 5.8 (CAP_BPF, CAP_PERFMON, no CAP_CHECKPOINT_RESTORE) with
    unprivileged BPF disabled: CAP_BPF is also kept, so it must be permitted."""
    monkeypatch.setattr(privileges, "cap_last_cap", lambda: 39)
    monkeypatch.setattr(privileges, "_read_sysctl", lambda name, default: 1)
    granted = daemonset_capabilities() - {"CAP_CHECKPOINT_RESTORE"}
    kernel(caps=cap_mask(granted))
    assert missing_capabilities(kernel=(5, 8)) == {}


def test_no_capabilities_at_all(kernel):
    kernel(uid=1000, caps=0)
    assert list(missing()) == ["CAP_DAC_READ_SEARCH", "CAP_SYS_PTRACE", "CAP_SYSLOG",
                               "CAP_PERFMON", "CAP_BPF", "CAP_CHECKPOINT_RESTORE"]


def test_message_names_each_missing_capability_and_its_use(kernel, monkeypatch):
    monkeypatch.setattr(privileges, "_read_sysctl", lambda name, default: HIDING[name])
    kernel(caps=cap_mask(daemonset_capabilities() - {"CAP_PERFMON", "CAP_SETGID"}))
    with pytest.raises(PrivilegeError) as raised:
        check_start_capabilities()
    first, *reasons = str(raised.value).splitlines()
    assert first.startswith("missing capabilities: CAP_SETGID, CAP_PERFMON; grant them")
    assert reasons == [f"  CAP_SETGID: {PURPOSES['CAP_SETGID']}",
                       f"  CAP_PERFMON: {PURPOSES['CAP_PERFMON']}"]


def test_daemon_refuses_before_loading_anything(kernel, monkeypatch, caplog):
    from tramprof.commands import run as run_cmd
    from tramprof.config import Config

    monkeypatch.setattr(privileges, "_read_sysctl", lambda name, default: HIDING[name])
    monkeypatch.setattr(run_cmd.signal, "signal", lambda *args: None)
    k = kernel(caps=cap_mask(daemonset_capabilities() - {"CAP_BPF"}))
    profiler = FakeProfiler(k)
    server = mock.MagicMock()
    monkeypatch.setattr(run_cmd, "Profiler", lambda config: profiler)
    monkeypatch.setattr(run_cmd, "MetricsServer", lambda *args, **kwargs: server)
    daemon = run_cmd.Daemon(Config())
    with caplog.at_level(logging.INFO):
        assert daemon.run() == 1
    assert profiler.events == []  # no program compiled or loaded
    assert "capset" not in k.steps  # nothing dropped either: it never started
    server.start.assert_not_called()
    server.close.assert_called_once()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [f"missing capabilities: CAP_BPF; grant them (Kubernetes: "
                      "securityContext.capabilities.add, systemd: AmbientCapabilities=) or "
                      "run as root (deploy/README.md, Capabilities)\n"
                      f"  CAP_BPF: {PURPOSES['CAP_BPF']}"]

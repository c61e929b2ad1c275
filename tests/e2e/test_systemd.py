"""tramprof under a real systemd: the shipped unit in a booted Debian 12.

A Debian 12 root with systemd is built once with debootstrap and cached
outside the repository (``ROOT``); every run boots it with
``systemd-nspawn --boot --volatile=overlay`` (changes go to a tmpfs and
vanish), installs tramprof from wheels built here into /opt/tramprof exactly
as deploy/README.md says, installs deploy/systemd/tramprof.service and checks
that

* ``systemctl start`` returns only once the daemon said READY=1 (Type=notify)
  and the unit is active (running),
* /metrics answers and samples are counted,
* the daemon runs with the unit's capabilities and, after start-up, only
  those it keeps (CapEff), with NoNewPrivs set,
* ``systemctl reload`` does not kill it,
* the journal has the daemon's lines at their priorities (info 6, warning
  4; sd-daemon prefixes, JOURNAL_STREAM detection) and Documentation=,
* ``systemctl stop`` leaves no sampling program loaded in the (shared) kernel,
* a configuration error fails the unit at once (exit 78, priority 3) and
  it is not restarted (RestartPreventExitStatus=),
* the container powers off cleanly.

Marked ``system``: run it with ``make test-system`` (``pytest -m system
tests/e2e/test_systemd.py``). It needs root, systemd-nspawn
(systemd-container), debootstrap and network access to the Debian mirror
(first run only) and to PyPI (the dependency wheels, first run only).

Run this file as a script to build (or check) the cached root alone:
``python tests/e2e/test_systemd.py --build-root``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from tramprof.commands.scheduling import thread_slice

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("TRAMPROF_TEST_CACHE", "/var/cache/tramprof-test"))
ROOT = CACHE / "roots" / "bookworm-systemd"
WHEEL_CACHE = CACHE / "wheels"
SUITE = "bookworm"
ROOT_PACKAGES = (
    "systemd", "systemd-sysv", "dbus", "libpam-systemd", "python3", "python3-venv",
    "python3-pip", "python3-bpfcc", "bpftool", "gcc", "libc6-dev", "make", "curl",
    "ca-certificates", "procps", "iproute2", "linux-headers-amd64",
)
# Bump when the way the root is made changes; the package list is hashed in too.
ROOT_RECIPE = "2"
BPF_PROG_TYPE_PERF_EVENT = "7"  # as /proc/PID/fdinfo shows prog_type
PORT = 19947  # not the default 9947: the container shares the host's network

# Capabilities the container may hand to its services: the unit's set plus
# what systemd inside needs for the hardening options (mount namespaces,
# cgroups, dropping privileges). nspawn's defaults cover the latter; these are
# added: CAP_BPF/CAP_PERFMON/CAP_SYSLOG/CAP_NET_ADMIN/CAP_CHECKPOINT_RESTORE
# are not in nspawn's default set.
CONTAINER_CAPS = "CAP_BPF,CAP_PERFMON,CAP_SYSLOG,CAP_NET_ADMIN,CAP_CHECKPOINT_RESTORE"

# Capability bits (linux/capability.h).
CAP_BITS = {"CAP_DAC_READ_SEARCH": 2, "CAP_NET_ADMIN": 12, "CAP_SYS_PTRACE": 19,
            "CAP_SYS_ADMIN": 21, "CAP_SYSLOG": 34, "CAP_PERFMON": 38, "CAP_BPF": 39,
            "CAP_CHECKPOINT_RESTORE": 40}
# The unit's CapabilityBoundingSet= and what the daemon keeps after start-up.
UNIT_CAPS = {"CAP_BPF", "CAP_PERFMON", "CAP_SYSLOG", "CAP_NET_ADMIN", "CAP_SYS_PTRACE",
             "CAP_DAC_READ_SEARCH", "CAP_CHECKPOINT_RESTORE"}
KEPT_CAPS = {"CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH", "CAP_CHECKPOINT_RESTORE"}


class SetupError(RuntimeError):
    """The environment cannot run this test; the message says why."""


def _missing_tools() -> str | None:
    if os.geteuid() != 0:
        return "needs root (debootstrap, systemd-nspawn, BPF)"
    for tool, package in (("systemd-nspawn", "systemd-container"),
                          ("debootstrap", "debootstrap"), ("bpftool", "bpftool")):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install {package})"
    return None


pytestmark = [pytest.mark.system]


# --------------------------------------------------------------------------
# The cached root
# --------------------------------------------------------------------------


def debian_mirror() -> str:
    """The Debian archive URI the host's apt uses for the main suite."""
    texts = []
    for path in [Path("/etc/apt/sources.list"),
                 *sorted(Path("/etc/apt/sources.list.d").glob("*.sources")),
                 *sorted(Path("/etc/apt/sources.list.d").glob("*.list"))]:
        with contextlib.suppress(OSError):
            texts.append((path.suffix, path.read_text()))
    for suffix, text in texts:
        if suffix == ".sources":
            for stanza in re.split(r"\n\s*\n", text):
                fields = dict(re.findall(r"^(\w[\w-]*):\s*(.*)$", stanza, re.M))
                uris = fields.get("URIs", "").split()
                if fields.get("Types", "deb").split()[0] == "deb" and \
                        SUITE in fields.get("Suites", "").split() and uris:
                    return uris[0]
        else:
            for line in text.splitlines():
                words = line.split("#", 1)[0].split()
                if len(words) >= 3 and words[0] == "deb":
                    rest = [w for w in words[1:] if not w.startswith("[")]
                    if len(rest) >= 2 and rest[1] == SUITE:
                        return rest[0]
    return "http://deb.debian.org/debian"


def _recipe_id() -> str:
    script = (REPO / "deploy" / "install-deps.sh").read_bytes()
    digest = hashlib.sha256(" ".join((ROOT_RECIPE, SUITE, *ROOT_PACKAGES)).encode() + script)
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _run(argv: list[str], log: Path | None = None, **kw: object) -> None:
    if log is None:
        subprocess.run(argv, check=True, **kw)  # type: ignore[call-overload]
        return
    with open(log, "ab") as out:
        out.write(f"\n$ {' '.join(argv)}\n".encode())
        out.flush()
        proc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, **kw)  # type: ignore[call-overload]
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise SetupError(f"{' '.join(argv[:3])} ... failed ({proc.returncode}); "
                         f"log {log}:\n{tail}")


def _chroot(root: Path, script: str, log: Path) -> None:
    """Run a shell script in the root with /proc, /sys and /dev mounted."""
    mounts = []
    try:
        for src, fstype in (("proc", "proc"), ("sysfs", "sysfs")):
            target = root / src.replace("sysfs", "sys")
            _run(["mount", "-t", fstype, src, str(target)], log)
            mounts.append(target)
        _run(["mount", "--bind", "/dev", str(root / "dev")], log)
        mounts.append(root / "dev")
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
               "DEBIAN_FRONTEND": "noninteractive", "HOME": "/root"}
        _run(["chroot", str(root), "/bin/sh", "-euc", script], log, env=env)
    finally:
        for target in reversed(mounts):
            subprocess.run(["umount", "-l", str(target)], check=False)


def build_root(log: Path | None = None) -> Path:
    """The cached root, built first if missing or made by another recipe.

    Idempotent and safe to call from concurrent runs: builds under an
    exclusive lock into a temporary directory that is renamed into place
    only when complete."""
    recipe = _recipe_id()
    stamp = ROOT / ".tramprof-test-root"
    with _locked(ROOT.with_name(ROOT.name + ".lock")):
        if stamp.is_file() and stamp.read_text().strip() == recipe:
            return ROOT
        work = ROOT.with_name(f"{ROOT.name}.building")
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        log = log or ROOT.with_name(ROOT.name + ".build.log")
        log.write_text("")
        mirror = debian_mirror()
        _run(["debootstrap", "--variant=minbase", "--include=" + ",".join(ROOT_PACKAGES),
              SUITE, str(work), mirror], log)
        # Same header strategy as on a real host: the project's own script
        # (exact linux-headers-$(uname -r) if Debian has them, else the
        # generic package linked under /lib/modules/$(uname -r)). The kernel
        # is the host's, so `uname -r` inside is right.
        shutil.copy(REPO / "deploy" / "install-deps.sh", work / "root" / "install-deps.sh")
        (work / "etc" / "resolv.conf").unlink(missing_ok=True)
        shutil.copy("/etc/resolv.conf", work / "etc" / "resolv.conf")
        _chroot(work, "sh /root/install-deps.sh && apt-get clean && "
                "rm -rf /var/lib/apt/lists/* /root/install-deps.sh && "
                # No serial getty fighting over the pipe console; no network
                # management (the host's network is shared).
                "systemctl mask console-getty.service getty@.service "
                "systemd-networkd.service systemd-resolved.service "
                "systemd-timesyncd.service apt-daily.timer apt-daily-upgrade.timer "
                "e2scrub_all.timer fstrim.timer >/dev/null 2>&1 || true; "
                "echo tramprof-test > /etc/hostname; "
                "printf '' > /etc/machine-id", log)
        (work / ".tramprof-test-root").write_text(recipe + "\n")
        if ROOT.exists():
            shutil.rmtree(ROOT)
        work.rename(ROOT)
        return ROOT


def _kernel_headers_linked(root: Path) -> bool:
    build = root / "lib" / "modules" / os.uname().release / "build"
    if not build.is_symlink():
        return build.exists()
    target = Path(os.readlink(build))
    return (root / target.relative_to("/")).exists() if target.is_absolute() else False


# --------------------------------------------------------------------------
# Wheels
# --------------------------------------------------------------------------


def _wheel_requirements(wheel: Path) -> list[str]:
    """Names of a wheel's unconditional dependencies (Requires-Dist)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    names = []
    for line in text.splitlines():
        if line.startswith("Requires-Dist:") and ";" not in line:
            names.append(re.split(r"[\s<>=!~\[(]", line.split(":", 1)[1].strip())[0])
    return names


def build_wheelhouse(dest: Path) -> Path:
    """tramprof's wheel (built from a copy of the tree, so the repository is
    not written to) and its dependencies' wheels, pinned to the versions
    installed here and cached across runs."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tramprof-src-") as tmp:
        src = Path(tmp) / "src"
        shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "dist", "__pycache__", "*.pyc", "_speedups*.so", "*.egg-info",
            ".pytest_cache", ".mypy_cache", ".ruff_cache"))
        # The root's Python is 3.11: a compiled part built by another would
        # not install there, so the wheel is then built without it.
        env = dict(os.environ)
        if sys.version_info[:2] != (3, 11):
            env["TRAMPROF_PURE_PYTHON"] = "1"
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        "--no-build-isolation", "--disable-pip-version-check",
                        "-w", str(dest), str(src)], check=True, capture_output=True, env=env)
    pins = []
    for name in _wheel_requirements(next(dest.glob("tramprof-*.whl"))):
        try:
            pins.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pins.append(name)
    with _locked(WHEEL_CACHE.with_name("wheels.lock")):
        WHEEL_CACHE.mkdir(parents=True, exist_ok=True)
        have = {p.name.split("-")[0].lower().replace("_", "-") + "==" + p.name.split("-")[1]
                for p in WHEEL_CACHE.glob("*.whl")}
        want = [p for p in pins if p.lower().replace("_", "-") not in have]
        if want:
            proc = subprocess.run(
                [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
                 "--only-binary=:all:", "--python-version", "3.11", "-d", str(WHEEL_CACHE),
                 *want], capture_output=True, text=True)
            if proc.returncode != 0:
                raise SetupError(f"pip download {' '.join(want)} failed:\n{proc.stderr}")
    for wheel in WHEEL_CACHE.glob("*.whl"):
        shutil.copy(wheel, dest / wheel.name)
    return dest


# --------------------------------------------------------------------------
# The booted container
# --------------------------------------------------------------------------


def loaded_program_ids() -> set[int]:
    """Ids of every BPF program loaded in the (shared) kernel."""
    out = subprocess.run(["bpftool", "prog", "show", "--json"], capture_output=True,
                         text=True, check=True).stdout
    return {int(p["id"]) for p in json.loads(out)}


def program_ids_of(pid: int) -> dict[int, str]:
    """Id -> name of the BPF programs a (host) process holds descriptors of.

    Other test suites may load tramprof's program concurrently, so the
    daemon's own programs are told apart by the descriptors it holds."""
    ids = {}
    for fd in Path(f"/proc/{pid}/fdinfo").iterdir():
        with contextlib.suppress(OSError):
            fields = dict(line.split(":", 1) for line in fd.read_text().splitlines()
                          if ":" in line)
            if "prog_id" in fields:
                ids[int(fields["prog_id"])] = fields.get("prog_type", "").strip()
    return ids


def host_pid(leader: int, pid_in_container: int) -> int:
    """The host's pid of a process known as ``pid_in_container`` in the container."""
    namespace = os.readlink(f"/proc/{leader}/ns/pid")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if os.readlink(entry / "ns" / "pid") != namespace:
                continue
            nspid = re.search(r"^NSpid:\s*(.*)$", (entry / "status").read_text(), re.M)
            if nspid and int(nspid.group(1).split()[-1]) == pid_in_container:
                return int(entry.name)
    raise AssertionError(f"no host process for container pid {pid_in_container}")


class Machine:
    """A booted systemd-nspawn container; commands run in it via nsenter."""

    def __init__(self, root: Path, wheels: Path, console: Path) -> None:
        self.console = console
        self._console_file = open(console, "wb")  # noqa: SIM115 - closed in close()
        argv = [
            "systemd-nspawn", "--quiet", "--boot", "--register=no", "--keep-unit",
            "--directory", str(root), "--volatile=overlay",
            "--machine", f"tramprof-test-{os.getpid()}",
            "--capability", CONTAINER_CAPS,
            # nspawn's own seccomp filter blocks bpf() and perf_event_open()
            # whatever the capabilities; the unit's filter is what is tested.
            "--system-call-filter", "bpf perf_event_open",
            "--bind-ro", "/sys/kernel/btf",
            "--bind-ro", f"{REPO}:/src",
            "--bind-ro", f"{wheels}:/wheelhouse",
            "--console", "pipe",
        ]
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                     stdout=self._console_file, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.leader = self._find_leader(timeout=60)

    def _find_leader(self, timeout: float) -> int:
        """The container's init: nspawn is its (sub-reaper) parent."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SetupError(f"systemd-nspawn exited {self.proc.returncode}:\n"
                                 + self.console_tail())
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit():
                    continue
                try:
                    status = (entry / "status").read_text()
                except OSError:
                    continue
                ppid = re.search(r"^PPid:\s*(\d+)", status, re.M)
                name = re.search(r"^Name:\s*(\S+)", status, re.M)
                if ppid and int(ppid.group(1)) == self.proc.pid and name and \
                        name.group(1) == "systemd":
                    return int(entry.name)
            time.sleep(0.1)
        raise SetupError("the container's systemd did not start:\n" + self.console_tail())

    def console_tail(self, lines: int = 40) -> str:
        self._console_file.flush()
        text = self.console.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def run(self, command: str, check: bool = True,
            timeout: float = 300) -> subprocess.CompletedProcess[str]:
        argv = ["nsenter", "--target", str(self.leader), "--mount", "--uts", "--ipc",
                "--net", "--pid", "--cgroup", "--root", "--wd",
                "/usr/bin/env", "-i", "PATH=/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8",
                "SYSTEMD_PAGER=", "/bin/sh", "-c", command]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"in the container: {command}\nexit {proc.returncode}\n"
                                 f"stdout: {proc.stdout}\nstderr: {proc.stderr}")
        return proc

    def wait_booted(self, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SetupError("the container stopped while booting:\n" + self.console_tail())
            proc = self.run("systemctl is-system-running", check=False, timeout=30)
            state = proc.stdout.strip()
            if state in ("running", "degraded"):
                return state
            time.sleep(0.5)
        raise SetupError(f"boot did not finish within {timeout} s (state {state!r}):\n"
                         + self.console_tail())

    def poweroff(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.run("systemctl poweroff --no-block", check=False, timeout=30)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
                raise
        return self.proc.returncode

    def close(self) -> None:
        """Kill whatever is left: the container's init first (that ends its
        whole pid namespace; nspawn killed alone would leave it running)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.leader, signal.SIGKILL)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._console_file.close()


def _caps(status: str, field: str) -> set[str]:
    value = int(re.search(rf"^{field}:\s*([0-9a-f]+)", status, re.M).group(1), 16)  # type: ignore[union-attr]
    return {name for name, bit in CAP_BITS.items() if value >> bit & 1} | (
        {f"bit{b}" for b in range(64) if value >> b & 1 and b not in CAP_BITS.values()})


def journal_entries(m: Machine, match: str) -> list[tuple[str, int]]:
    """(MESSAGE, PRIORITY) of the journal entries matching ``match``."""
    out = m.run(f"journalctl --no-pager -o json {match}").stdout
    entries = []
    for line in out.splitlines():
        entry = json.loads(line)
        message = entry.get("MESSAGE")
        if isinstance(message, str):  # bytes come as a list of numbers
            entries.append((message, int(entry["PRIORITY"])))
    return entries


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


# --------------------------------------------------------------------------
# The test
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def machine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Machine]:
    why = _missing_tools()
    if why:
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp("systemd")
    began = time.monotonic()
    try:
        root = build_root()
        if not _kernel_headers_linked(root):
            raise SetupError(f"{root} has no kernel headers for {os.uname().release}: "
                             f"remove it to have it rebuilt")
        wheels = build_wheelhouse(tmp / "wheelhouse")
    except SetupError as exc:
        pytest.fail(str(exc))
    print(f"\nroot and wheels ready in {time.monotonic() - began:.1f} s")
    began = time.monotonic()
    m = Machine(root, wheels, tmp / "console.log")
    try:
        state = m.wait_booted()
        print(f"container booted ({state}) in {time.monotonic() - began:.1f} s")
        yield m
    finally:
        m.close()
        print("console:\n" + m.console.read_text(errors="replace")[-4000:])


def test_unit_under_systemd(machine: Machine) -> None:
    m = machine
    began = time.monotonic()
    # Installation as deploy/README.md describes it.
    m.run("python3 -m venv --system-site-packages /opt/tramprof && "
          "/opt/tramprof/bin/pip install -q --no-index --find-links /wheelhouse tramprof && "
          "install -D -m 0644 /src/deploy/tramprof.example.toml /etc/tramprof/tramprof.toml && "
          f"sed -i 's/^listen = .*/listen = \"127.0.0.1:{PORT}\"/; "
          "s/^interval = .*/interval = 2.0/' /etc/tramprof/tramprof.toml && "
          "install -m 0644 /src/deploy/systemd/tramprof.service "
          "/etc/systemd/system/tramprof.service && "
          "install -d /usr/local/share/man/man1 && /opt/tramprof/bin/tramprof man "
          ">/usr/local/share/man/man1/tramprof.1 && systemctl daemon-reload")
    # The root has no man(1) to look Documentation= up with: the host's
    # verify of the unit (test_deploy_manifests.py) checks the man page.
    verify = m.run("systemd-analyze verify --man=no /etc/systemd/system/tramprof.service",
                   check=False)
    assert verify.returncode == 0 and not (verify.stdout + verify.stderr).strip(), verify
    assert m.run("systemctl show -p Documentation --value tramprof").stdout.strip() == \
        '"man:tramprof(1)"'  # a list of quoted strings

    # Type=notify: `systemctl start` returns only after READY=1 (or fails).
    start = m.run("systemctl start tramprof", check=False, timeout=240)  # unit: 180 s
    journal = m.run("journalctl -u tramprof --no-pager -o cat", check=False).stdout
    assert start.returncode == 0, f"start failed: {start.stderr}\n{journal}"
    props = dict(line.split("=", 1) for line in m.run(
        "systemctl show tramprof -p ActiveState -p SubState -p Type -p MainPID "
        "-p StatusText -p WatchdogUSec -p NRestarts").stdout.splitlines())
    assert (props["ActiveState"], props["SubState"], props["Type"]) == \
        ("active", "running", "notify"), (props, journal)
    assert props["WatchdogUSec"] != "0", props
    assert props["StatusText"], "the daemon should report a status line"
    pid = int(props["MainPID"])

    # Serves metrics, inside and (shared network) from the host.
    deadline = time.monotonic() + 60
    metrics = ""
    while time.monotonic() < deadline:
        metrics = m.run(f"curl -fsS http://127.0.0.1:{PORT}/metrics", check=False).stdout
        if re.search(r"^tramprof_drains_total [1-9]", metrics, re.M):
            break
        time.sleep(0.5)
    assert re.search(r"^tramprof_drains_total [1-9]", metrics, re.M), metrics[-2000:]
    assert re.search(r"^tramprof_samples_total\{.*\} [1-9]", metrics, re.M), metrics[-2000:]
    assert _get(f"http://127.0.0.1:{PORT}/healthz").strip() == "ok"

    # Least privilege: a dynamic (non-root) user, started with the unit's
    # set, kept only what reading other processes needs; sandboxed.
    status = m.run(f"cat /proc/{pid}/status").stdout
    uid = int(re.search(r"^Uid:\s+(\d+)", status, re.M).group(1))  # type: ignore[union-attr]
    assert uid != 0, status
    assert _caps(status, "CapEff") == _caps(status, "CapPrm") == KEPT_CAPS, status
    assert _caps(status, "CapInh") == _caps(status, "CapAmb") == set(), status
    assert _caps(status, "CapBnd") == UNIT_CAPS, status
    assert re.search(r"^NoNewPrivs:\s*1", status, re.M), status
    assert re.search(r"^Seccomp:\s*2", status, re.M), status
    invocation = m.run("systemctl show -p InvocationID --value tramprof").stdout.strip()
    journal = m.run(f"journalctl --no-pager -o cat _SYSTEMD_INVOCATION_ID={invocation}").stdout
    assert "capabilities kept: CAP_DAC_READ_SEARCH, CAP_SYS_PTRACE, CAP_CHECKPOINT_RESTORE" \
        in journal, journal
    # CAP_SYSLOG reached the daemon (ProtectKernelLogs= would have removed it).
    assert "kernel frames stay unnamed" not in journal, journal
    # The main loop's scheduler slice passes the system call filter (the
    # container runs on this kernel: it honours one when it reports one).
    assert "sched_setattr refused" not in journal, journal
    if thread_slice():
        assert "main loop: 0.10 ms scheduler slice" in journal, journal

    # ExecReload (SIGHUP) re-reads the file and applies a new frequency
    # without the capabilities it started with, and without a restart (a
    # restart-only setting is kept, with a warning).
    m.run("sed -i 's/^frequency = .*/frequency = 49/; s/^max_keys = .*/max_keys = 8192/' "
          "/etc/tramprof/tramprof.toml && systemctl reload tramprof")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and "configuration reloaded" not in journal:
        time.sleep(0.5)
        journal = m.run(f"journalctl --no-pager -o cat "
                        f"_SYSTEMD_INVOCATION_ID={invocation}").stdout
    assert "configuration reloaded: 49 Hz" in journal, journal
    time.sleep(3)  # a drain at the new frequency
    assert m.run("systemctl is-active tramprof", check=False).stdout.strip() == "active", \
        m.run("journalctl -u tramprof --no-pager -o cat -n 30", check=False).stdout
    assert int(m.run("systemctl show -p MainPID --value tramprof").stdout) == pid
    assert int(m.run("systemctl show -p NRestarts --value tramprof").stdout) == 0

    # Every line of the daemon reaches the journal with its own priority
    # (the sd-daemon prefix, stripped from MESSAGE), not SyslogLevel='s 6.
    entries = journal_entries(m, f"_SYSTEMD_INVOCATION_ID={invocation}")
    # Text lines in the journal: "logger: message", no time, no level name.
    priorities = {message.split(": ", 1)[1]: priority for message, priority in entries
                  if re.match(r"tramprof(\.\w+)+: ", message)}
    kept = next(msg for msg in priorities if msg.startswith("capabilities kept:"))
    assert priorities[kept] == 6, entries
    assert priorities["configuration reloaded: 49 Hz, interval 2.0 s, all processes"] == 6
    warned = "reload: max_keys change only at restart; keeping the running values"
    assert priorities[warned] == 4, entries
    assert not [msg for msg, _ in entries if re.match(r"<\d>|\d{4}-", msg)], entries

    ours = program_ids_of(host_pid(m.leader, pid))
    assert BPF_PROG_TYPE_PERF_EVENT in ours.values(), f"no sampling program held: {ours}"
    assert set(ours) <= loaded_program_ids()
    m.run("systemctl stop tramprof", timeout=60)
    result = m.run("systemctl show -p Result -p ExecMainStatus -p ActiveState tramprof").stdout
    assert "Result=success" in result and "ActiveState=inactive" in result, result
    left = set(ours) & loaded_program_ids()
    assert not left, f"stopping must unload the daemon's BPF programs; still loaded: {left}"

    # The first start compiled and kept the program in CacheDirectory=; a
    # restart with the same settings loads it from there, no compiler.
    first = m.run(f"journalctl --no-pager -o cat _SYSTEMD_INVOCATION_ID={invocation}").stdout
    assert "compiled program kept in /var/cache/tramprof" in first, first
    m.run("sed -i 's/^max_keys = .*/max_keys = 16384/' /etc/tramprof/tramprof.toml")
    m.run("systemctl start tramprof", timeout=240)
    again = m.run("systemctl show -p InvocationID --value tramprof").stdout.strip()
    journal = m.run(f"journalctl --no-pager -o cat _SYSTEMD_INVOCATION_ID={again}").stdout
    assert "BPF program loaded from the cache" in journal, journal
    assert "BPF program compiled" not in journal, journal
    m.run("systemctl stop tramprof", timeout=60)
    journal = m.run("journalctl -u tramprof --no-pager -o cat").stdout
    print(f"service test in {time.monotonic() - began:.1f} s; journal:\n{journal[-3000:]}")

    # A configuration error: the unit fails at once with EX_CONFIG and
    # stays failed; Restart=on-failure would have started it again after
    # RestartSec=5s, and again, for ever.
    m.run("sed -i 's/^frequency = .*/frequency = 0/' /etc/tramprof/tramprof.toml")
    start = m.run("systemctl start tramprof", check=False, timeout=120)
    assert start.returncode != 0, start
    time.sleep(8)  # past RestartSec=
    failed = dict(line.split("=", 1) for line in m.run(
        "systemctl show tramprof -p ActiveState -p Result -p ExecMainStatus -p NRestarts"
    ).stdout.splitlines())
    assert failed == {"ActiveState": "failed", "Result": "exit-code", "ExecMainStatus": "78",
                      "NRestarts": "0"}, failed
    # (By unit: a process that exits at once may leave its lines without
    # the invocation's id.)
    entries = journal_entries(m, "-u tramprof")
    assert ("tramprof: configuration error: /etc/tramprof/tramprof.toml: frequency: "
            "must be 1..10000 (Hz)", 3) in entries, entries

    began = time.monotonic()
    assert m.poweroff() == 0, m.console_tail()
    print(f"powered off in {time.monotonic() - began:.1f} s")


# --------------------------------------------------------------------------
# The container recipe, without a container engine
# --------------------------------------------------------------------------


def containerfile_script(containerfile: Path) -> str:
    """deploy/container/Containerfile as one shell script: ARG/ENV become
    exports, COPY copies from /ctx (the build context), RUN runs, under the
    file's SHELL options. Enough for this recipe (no multi-stage, no flags)."""
    lines: list[str] = []
    text = re.sub(r"\\\n", " ", containerfile.read_text())
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        if instruction in ("ARG", "ENV"):
            lines.append("export " + rest)
        elif instruction == "COPY":
            src, dest = rest.split()
            if src == ".":
                lines.append(f"mkdir -p {dest} && cp -a /ctx/. {dest}/")
            else:
                lines.append(f"mkdir -p \"$(dirname {dest})\" && cp -a /ctx/{src} {dest}")
        elif instruction == "RUN":
            lines.append(rest)
        elif instruction in ("FROM", "SHELL", "LABEL", "EXPOSE", "HEALTHCHECK", "ENTRYPOINT",
                             "CMD", "USER", "WORKDIR"):
            continue
        else:
            raise AssertionError(f"unexpected instruction {instruction} in {containerfile}")
    return "\n".join(lines) + "\n"


def test_container_recipe_builds_a_working_image(tmp_path: Path) -> None:
    """The Containerfile's steps, run in the same Debian 12 base (the cached
    root, changes discarded): the generic headers merged for
    BCC_KERNEL_SOURCE load the real program with /lib/modules empty, as on
    a node whose kernel the image never saw. pip works offline from the
    wheelhouse and the distribution's setuptools."""
    why = _missing_tools()
    if why:
        pytest.skip(why)
    try:
        root = build_root()
        wheels = build_wheelhouse(tmp_path / "wheelhouse")
    except SetupError as exc:
        pytest.fail(str(exc))
    context = tmp_path / "context"
    shutil.copytree(REPO, context, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".venv-*", "build", "dist", "__pycache__", "*.pyc", "*.egg-info",
        ".pytest_cache", ".mypy_cache", ".ruff_cache", "tests", "benchmarks"))
    script = tmp_path / "build.sh"
    script.write_text(
        "set -euo pipefail\n"
        # (pip reads PIP_NO_BUILD_ISOLATION=0 as --no-build-isolation)
        "export PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheelhouse PIP_NO_BUILD_ISOLATION=0\n"
        # The distribution already ran install-deps.sh in this root; the
        # recipe's own run of it must still work (it installs nothing new).
        + containerfile_script(REPO / "deploy" / "container" / "Containerfile")
        + "test -z \"$(ls -A /lib/modules)\"\n"
        "/opt/tramprof/bin/tramprof run --config /etc/tramprof/tramprof.toml --print-bpf "
        ">/dev/null\n"
        "timeout 120 /opt/tramprof/bin/python -c '"
        "from tramprof.sampler.program import Sampler, SamplerConfig\n"
        "s = Sampler(SamplerConfig()); s.start()\n"
        "print(\"image: program loaded on\", s.event_name); s.close()'\n")
    began = time.monotonic()
    proc = subprocess.run(
        ["systemd-nspawn", "--quiet", "--register=no", "--keep-unit", "--volatile=overlay",
         "--directory", str(root), "--capability", "CAP_BPF,CAP_PERFMON,CAP_SYSLOG",
         "--system-call-filter", "bpf perf_event_open", "--bind-ro", "/sys/kernel/btf",
         "--bind-ro", f"{context}:/ctx", "--bind-ro", f"{wheels}:/wheelhouse",
         "--bind-ro", f"{script}:/build.sh", "/bin/bash", "/build.sh"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
    print(f"container recipe in {time.monotonic() - began:.1f} s")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    assert "image: program loaded on" in output, output[-5000:]


if __name__ == "__main__":
    if sys.argv[1:] == ["--build-root"]:
        t0 = time.monotonic()
        print(build_root(), f"{time.monotonic() - t0:.0f} s")
    else:
        sys.exit("usage: test_systemd.py --build-root")

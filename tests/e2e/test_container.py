"""The container image, built and run the way Kubernetes runs it.

deploy/container/Containerfile is built with podman from a Debian 12 base
made here (deploy/container/debian-base.sh: debootstrap, trimmed like
debian:12-slim; no registry is needed), and run with what
deploy/kubernetes/daemonset.yaml asks for, read from that file so the two
cannot drift: the host's pid namespace, a network namespace of its own,
``drop: ALL`` plus exactly the listed capabilities, no_new_privs, a
read-only root file system with the manifest's volumes (the ConfigMap's
configuration, /sys/kernel/btf, a 64 MiB memory-backed /tmp), uid 0, its
memory and CPU limits, and the seccomp profile a RuntimeDefault runtime
applies (containerd >= 1.6 and Docker >= 20.10 allow bpf(2) to CAP_BPF and
perf_event_open(2) to CAP_PERFMON holders; containers-common's profile,
podman's, only to CAP_SYS_ADMIN ones, so the two rules are added to it when
it lacks them).

Checked: a known native target on the host shows in the container's
/metrics with its exact call chain, the exposition parses with promtool, the
daemon leaves uid 0 and keeps only the three read-only capabilities, and it
stops cleanly on SIGTERM. Then, once for each capability the DaemonSet adds,
a run without that one capability exits 1 naming it.

The base tarball and the images are cached (/var/cache/tramprof-test/images
and podman's storage), the image under a tag that hashes every input of the
build, so a rerun with unchanged sources builds nothing. Marked ``system``:
``make test-system`` (``pytest -m system tests/e2e/test_container.py``).
Needs root, podman, debootstrap, promtool and gcc; the Debian mirror (base,
packages) and PyPI (dependency wheels) on the first run.

Run as a script to build (or find) the image alone and print its figures:
``python -m tests.e2e.test_container --build``.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import hashlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from tramprof.commands.privileges import CAPABILITIES, PURPOSES, RUNTIME_CAPABILITIES

from tests.e2e.test_systemd import CACHE, SetupError, _locked, build_wheelhouse, debian_mirror
from tests.inject.conftest import build_runtimes

REPO = Path(__file__).resolve().parents[2]
RUNTIMES = REPO / "daemon" / "tramprof" / "inject" / "runtimes"
CONTAINER = REPO / "deploy" / "container"
CONTAINERFILE = CONTAINER / "Containerfile"
DOCKERIGNORE = CONTAINER / "Containerfile.dockerignore"
BASE_SCRIPT = CONTAINER / "debian-base.sh"
K8S = REPO / "deploy" / "kubernetes"
IMAGES = CACHE / "images"
BASE_REPO = "localhost/tramprof-test/debian"
IMAGE_REPO = "localhost/tramprof-test/tramprof"
# Bump when the way the image is built here changes (options, build args).
IMAGE_RECIPE = "1"
# The configuration is the ConfigMap's, drained every 2 s instead of 10 s so
# the test waits less.
INTERVAL = 2.0
# bcc compiles the program at start-up: seconds, more on a loaded machine.
START_TIMEOUT = 180.0
# securityContext fields podman_run_options() mirrors (pod and container).
MIRRORED_SECURITY = {"privileged", "allowPrivilegeEscalation", "readOnlyRootFilesystem",
                     "runAsUser", "runAsGroup", "runAsNonRoot", "capabilities",
                     "seccompProfile", "appArmorProfile"}

pytestmark = [pytest.mark.system]


def _missing_tools() -> str | None:
    if os.geteuid() != 0:
        return "needs root (podman as root, debootstrap, BPF)"
    for tool, package in (("podman", "podman"), ("debootstrap", "debootstrap"),
                          ("promtool", "prometheus"), ("nsenter", "util-linux")):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install {package})"
    return None


def _run(argv: list[str], timeout: float = 600, check: bool = True,
         **kw: object) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          **kw)  # type: ignore[call-overload]
    if check and proc.returncode != 0:
        raise SetupError(f"{' '.join(argv[:4])} ... exited {proc.returncode}:\n"
                         f"{(proc.stdout + proc.stderr)[-4000:]}")
    return proc  # type: ignore[no-any-return]


# --------------------------------------------------------------------------
# What the DaemonSet asks for
# --------------------------------------------------------------------------


def _k8s(name: str, kind: str) -> dict:
    docs = [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


DAEMON = "tramprof"
PREPARE = "prepare"  # the init container that fills the program cache


def pod_container(name: str = DAEMON) -> dict:
    """The DaemonSet's container (or init container) ``name``."""
    pod = _k8s("daemonset.yaml", "DaemonSet")["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == [DAEMON], pod["containers"]
    (container,) = [c for c in (*pod["containers"], *pod.get("initContainers", ()))
                    if c["name"] == name]
    return container


def daemonset_capabilities(name: str = DAEMON) -> list[str]:
    """The capabilities the DaemonSet adds, in its order (after drop: ALL)."""
    caps = pod_container(name)["securityContext"]["capabilities"]
    assert caps["drop"] == ["ALL"], caps
    return ["CAP_" + name for name in caps["add"]]


def _memory_bytes(quantity: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "K": 10**3, "M": 10**6, "G": 10**9}
    match = re.fullmatch(r"(\d+)([KMG]i?)?", quantity)
    assert match, f"unsupported quantity {quantity!r}"
    return int(match.group(1)) * units.get(match.group(2) or "", 1)


def _cpus(quantity: str) -> str:
    return str(int(quantity[:-1]) / 1000) if quantity.endswith("m") else quantity


def podman_run_options(config_dir: Path, seccomp: Path | None,
                       without: str | None = None, name: str = DAEMON) -> list[str]:
    """``podman run`` options for everything the DaemonSet's pod spec sets
    that a single container (``name``) can have; fails on a setting it does
    not know, so a change to the manifest is either mirrored here or noticed."""
    pod = _k8s("daemonset.yaml", "DaemonSet")["spec"]["template"]["spec"]
    container = pod_container(name)
    sc = container["securityContext"]
    pod_sc = pod.get("securityContext", {})
    assert set(sc) | set(pod_sc) <= MIRRORED_SECURITY, set(sc) | set(pod_sc)
    assert not pod.get("hostIPC") and pod.get("hostUsers", True), "not mirrored"
    options = []
    options.append("--pid=host" if pod.get("hostPID") else "--pid=private")
    # Its own network namespace, with only the loopback device: the test
    # reaches the daemon by entering it (no bridge, no host firewall rules).
    options.append("--network=host" if pod.get("hostNetwork") else "--network=none")
    assert sc.get("privileged") is False
    # Kubernetes ignores the image's HEALTHCHECK (the pod has probes).
    options.append("--no-healthcheck")
    uid = sc.get("runAsUser", pod_sc.get("runAsUser"))
    gid = sc.get("runAsGroup", pod_sc.get("runAsGroup", uid))
    options.append(f"--user={uid}:{gid}")
    assert not (sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) and uid == 0)
    caps = [c for c in daemonset_capabilities(name) if c != without]
    options += ["--cap-drop=all", "--cap-add=" + ",".join(caps)]
    if sc.get("allowPrivilegeEscalation") is False:
        options.append("--security-opt=no-new-privileges")
    for level in (sc, pod_sc):
        if level.get("seccompProfile"):
            assert level["seccompProfile"]["type"] == "RuntimeDefault", level
    if seccomp is not None:
        options.append(f"--security-opt=seccomp={seccomp}")
    assert sc.get("appArmorProfile", {}).get("type", "Unconfined") == "Unconfined"
    if Path("/sys/kernel/security/apparmor").is_dir():
        options.append("--security-opt=apparmor=unconfined")
    if sc.get("readOnlyRootFilesystem"):
        # Only the manifest's volumes are writable (no tmpfs of podman's own).
        options += ["--read-only", "--read-only-tmpfs=false"]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        target = mount["mountPath"]
        mode = "ro" if mount.get("readOnly") else "rw"
        if "configMap" in volume:
            assert volume["configMap"]["name"] == \
                _k8s("configmap.yaml", "ConfigMap")["metadata"]["name"], volume
            options.append(f"--volume={config_dir}:{target}:ro")
        elif "hostPath" in volume:
            options.append(f"--volume={volume['hostPath']['path']}:{target}:{mode}")
        elif "emptyDir" in volume:
            spec = volume["emptyDir"] or {}
            assert spec.get("medium") == "Memory", "only memory-backed emptyDirs are mirrored"
            size = _memory_bytes(spec["sizeLimit"]) if "sizeLimit" in spec else None
            options.append(f"--tmpfs={target}:rw,mode=1777,nosuid,nodev"
                           + (f",size={size}" if size else ""))
        else:
            raise AssertionError(f"volume {volume} is not mirrored by this test")
    limits = container.get("resources", {}).get("limits", {})
    if "memory" in limits:
        options.append(f"--memory={_memory_bytes(limits['memory'])}")
    if "cpu" in limits:
        options.append(f"--cpus={_cpus(limits['cpu'])}")
    return options


def daemonset_args(name: str = DAEMON) -> list[str]:
    return list(pod_container(name)["args"])


def write_config(directory: Path) -> Path:
    """The ConfigMap's files, as the kubelet mounts them; shorter interval."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in _k8s("configmap.yaml", "ConfigMap")["data"].items():
        if name.endswith(".toml"):
            text, count = re.subn(r"^interval = .*$", f"interval = {INTERVAL}", text,
                                  flags=re.M)
            assert count == 1, text
            tomllib.loads(text)
        (directory / name).write_text(text)
    return directory


# --------------------------------------------------------------------------
# The engine on this host
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Engine:
    """podman, with the options this host needs to run a container at all
    (for builds too): a runtime other than the default, the ulimits."""

    options: list[str]


def host_ulimits() -> list[str]:
    """podman raises a container's open-file and process limits to 2^20 by
    default, which a root without CAP_SYS_RESOURCE cannot: ask for the
    limits this process has instead (processes: at most pid_max)."""
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())

    def bound(value: int, cap: int) -> int:
        return cap if value == resource.RLIM_INFINITY else min(value, cap)

    return [f"--ulimit=nofile={bound(nofile[0], 1 << 20)}:{bound(nofile[1], 1 << 20)}",
            f"--ulimit=nproc={bound(nproc[0], pid_max)}:{bound(nproc[1], pid_max)}"]


def find_engine(base: str) -> Engine:
    """crun refuses cgroup v1 hosts whose v2 hierarchy holds a controller
    ("cgroups in hybrid mode not supported"); runc runs there."""
    ulimits = host_ulimits()
    probe = _run(["podman", "run", "--rm", *ulimits, "--network=none", base, "true"],
                 check=False, timeout=120)
    if probe.returncode == 0:
        return Engine(ulimits)
    runc = shutil.which("runc")
    if runc is None:
        raise SetupError(f"podman cannot run a container here and runc is not installed "
                         f"(apt-get install runc):\n{probe.stderr}")
    engine = Engine([f"--runtime={runc}", *ulimits])
    _run(["podman", "run", "--rm", *engine.options, "--network=none", base, "true"],
         timeout=120)
    return engine


def runtime_default_seccomp(dest: Path) -> Path | None:
    """podman's default seccomp profile as a RuntimeDefault of containerd,
    CRI-O or Docker has it: bpf(2) allowed to CAP_BPF and perf_event_open(2)
    to CAP_PERFMON holders. None when podman's profile already does that."""
    info = json.loads(_run(["podman", "info", "--format", "json"]).stdout)
    path = Path(info["host"]["security"].get("seccompProfilePath")
                or "/usr/share/containers/seccomp.json")
    profile = json.loads(path.read_text())
    grants = {"bpf": "CAP_BPF", "perf_event_open": "CAP_PERFMON"}
    rules = profile["syscalls"]

    def allowed(name: str, cap: str) -> bool:
        return any(name in r["names"] and r["action"] == "SCMP_ACT_ALLOW"
                   and r.get("includes", {}).get("caps") == [cap] for r in rules)

    if all(allowed(name, cap) for name, cap in grants.items()):
        return None
    out = []
    for rule in rules:
        named = [n for n in rule["names"] if n in grants]
        if not named or rule["action"] == "SCMP_ACT_ALLOW":
            out.append(rule)
            continue
        # A rule refusing them to non-CAP_SYS_ADMIN holders: refuse only
        # to holders of neither CAP_SYS_ADMIN nor the narrow capability.
        if rest := [n for n in rule["names"] if n not in grants]:
            out.append({**rule, "names": rest})
        for name in named:
            narrowed = copy.deepcopy(rule)
            narrowed["names"] = [name]
            excludes = narrowed.setdefault("excludes", {})
            excludes["caps"] = [*excludes.get("caps", []), grants[name]]
            out.append(narrowed)
    out += [{"names": [name], "action": "SCMP_ACT_ALLOW", "includes": {"caps": [cap]}}
            for name, cap in grants.items()]
    dest.write_text(json.dumps({**profile, "syscalls": out}))
    return dest


# --------------------------------------------------------------------------
# Base and image, cached
# --------------------------------------------------------------------------


def _image_exists(name: str) -> bool:
    return subprocess.run(["podman", "image", "exists", name]).returncode == 0


def base_image() -> str:
    """The Debian 12 base image: the tarball is made once by
    debian-base.sh (cached by its content and the mirror), imported into
    podman's storage whenever that lacks it."""
    mirror = debian_mirror()
    recipe = hashlib.sha256(BASE_SCRIPT.read_bytes() + mirror.encode()).hexdigest()[:16]
    tarball = IMAGES / f"debian-12-base-{recipe}.tar"
    name = f"{BASE_REPO}:12-{recipe}"
    with _locked(IMAGES / "base.lock"):
        if not tarball.is_file():
            began = time.monotonic()
            _run(["sh", str(BASE_SCRIPT), str(tarball), mirror], timeout=900)
            print(f"base tarball made in {time.monotonic() - began:.1f} s")
            for old in IMAGES.glob("debian-12-base-*.tar"):
                if old != tarball:
                    old.unlink()
        if not _image_exists(name):
            _run(["podman", "import", "--change", 'CMD ["bash"]', str(tarball), name])
    return name


def _ignored(relative: str, patterns: list[str]) -> bool:
    """.dockerignore matching: a pattern is anchored at the context's root
    and excludes whatever lies below a match; ``**/`` matches at any depth."""
    parts = relative.split("/")
    prefixes = ["/".join(parts[:i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        if pattern.startswith("**/"):
            if any(fnmatch.fnmatchcase(part, pattern[3:]) for part in parts):
                return True
        elif any(fnmatch.fnmatchcase(prefix, pattern) for prefix in prefixes):
            return True
    return False


def context_files() -> list[str]:
    """The build context's files: the working tree's (committed or not,
    git's ignores applied) less Containerfile.dockerignore's patterns."""
    patterns = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    listed = _run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others",
                   "--exclude-standard"]).stdout.split("\0")
    built = [str(p.relative_to(REPO)) for p in sorted(RUNTIMES.glob("*")) if p.is_file()]
    return sorted({f for f in [*listed, *built]
                   if f and (REPO / f).is_file() and not _ignored(f, patterns)})


@dataclass
class Built:
    image: str
    base: str
    engine: Engine
    build_seconds: float | None  # None: found in the cache
    size_bytes: int


def build_image(work: Path) -> Built:
    """Build (or find) the image. Its tag hashes the context, the base
    image and the dependency wheels: unchanged inputs build nothing."""
    base = base_image()
    engine = find_engine(base)
    build_runtimes()  # package data the image ships (git ignores built objects)
    context = work / "context"
    digest = hashlib.sha256(f"{IMAGE_RECIPE}\0{base}".encode())
    for name in context_files():
        (context / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, context / name)
        digest.update(name.encode() + b"\0" + (context / name).read_bytes() + b"\0")
    wheels = build_wheelhouse(work / "wheelhouse")
    for wheel in list(wheels.glob("tramprof-*.whl")):
        wheel.unlink()  # built from the context in the image
    for wheel in sorted(p.name for p in wheels.glob("*.whl")):
        digest.update(wheel.encode())
    image = f"{IMAGE_REPO}:{digest.hexdigest()[:16]}"
    with _locked(IMAGES / "image.lock"):
        seconds = None
        if not _image_exists(image):
            began = time.monotonic()
            # Docker's image format: the OCI one has no SHELL (the RUN steps
            # would lose -o pipefail) and no HEALTHCHECK.
            proc = subprocess.run(
                ["podman", "build", "--format=docker", "--network=host",
                 *engine.options, "--file", str(context / CONTAINERFILE.relative_to(REPO)),
                 "--build-arg", f"BASE_IMAGE={base}",
                 "--volume", f"{wheels}:/wheels:ro", "--build-arg", "PIP_NO_INDEX=1",
                 "--build-arg", "PIP_FIND_LINKS=/wheels", "--tag", image, str(context)],
                capture_output=True, text=True, timeout=1800)
            seconds = time.monotonic() - began
            (work / "build.log").write_text(proc.stdout + proc.stderr)
            if proc.returncode != 0:
                raise SetupError(f"podman build failed ({proc.returncode}):\n"
                                 + (proc.stdout + proc.stderr)[-5000:])
            # Older builds of this test's images (and their layers): only
            # the newest image and its base are kept.
            for repo, keep in ((IMAGE_REPO, image), (BASE_REPO, base)):
                tags = _run(["podman", "images", "--format", "{{.Repository}}:{{.Tag}}",
                             repo]).stdout.split()
                for old in tags:
                    if old != keep:
                        _run(["podman", "rmi", old], check=False)
    size = int(_run(["podman", "image", "inspect", "--format", "{{.Size}}", image]).stdout)
    return Built(image, base, engine, seconds, size)


# --------------------------------------------------------------------------
# A running container
# --------------------------------------------------------------------------


class Container:
    """``podman run -d`` of the image with the DaemonSet's options."""

    def __init__(self, built: Built, options: list[str], name: str) -> None:
        self.name = name
        self.started = time.monotonic()
        _run(["podman", "run", "--detach", "--name", name, *built.engine.options,
              *options, built.image, *daemonset_args()], timeout=120)
        self.pid = int(_run(["podman", "inspect", "--format", "{{.State.Pid}}", name]).stdout)

    def get(self, path: str) -> str:
        """GET from inside the container's network namespace (the pod IP's
        place): the host's Python, entered into that namespace only."""
        code = ("import sys, urllib.request\n"
                f"r = urllib.request.urlopen('http://127.0.0.1:9947{path}', timeout=10)\n"
                "sys.stdout.write(r.read().decode())\n")
        proc = subprocess.run(["nsenter", f"--net=/proc/{self.pid}/ns/net", sys.executable,
                               "-c", code], capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            raise OSError(proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed")
        return proc.stdout

    def running(self) -> bool:
        state = _run(["podman", "inspect", "--format", "{{.State.Running}}", self.name],
                     check=False)
        return state.stdout.strip() == "true"

    def logs(self) -> str:
        proc = _run(["podman", "logs", self.name], check=False)
        return proc.stdout + proc.stderr

    def wait_healthy(self, timeout: float = START_TIMEOUT) -> float:
        """Seconds from `podman run` until /healthz answered "ok"."""
        deadline = self.started + timeout
        while time.monotonic() < deadline:
            if not self.running():
                raise AssertionError(f"the container exited:\n{self.logs()[-4000:]}")
            with contextlib.suppress(OSError):
                if self.get("/healthz").strip() == "ok":
                    return time.monotonic() - self.started
            time.sleep(0.2)
        raise AssertionError(f"not healthy within {timeout} s:\n{self.logs()[-4000:]}")

    def stop(self) -> int:
        """SIGTERM (podman stop), then the exit code."""
        _run(["podman", "stop", "--time", "30", self.name], check=False, timeout=60)
        return int(_run(["podman", "inspect", "--format", "{{.State.ExitCode}}",
                         self.name]).stdout)


# --------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------


@dataclass
class Setup:
    built: Built
    config: Path
    seccomp: Path | None


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    why = _missing_tools()
    if why:
        pytest.skip(why)
    work = tmp_path_factory.mktemp("container")
    began = time.monotonic()
    try:
        built = build_image(work)
        seccomp = runtime_default_seccomp(work / "seccomp.json")
    except SetupError as exc:
        pytest.fail(str(exc))
    how = (f"built in {built.build_seconds:.1f} s" if built.build_seconds is not None
           else "found in the cache")
    print(f"\nimage {built.image} {how}; {built.size_bytes / 1e6:.0f} MB; "
          f"ready after {time.monotonic() - began:.1f} s (engine "
          f"{' '.join(built.engine.options)})")
    return Setup(built, write_config(work / "config"), seccomp)


def _stack_samples(exposition: str, process: str) -> dict[str, float]:
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        if family.name == "tramprof_stack_samples":
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.labels.get("process") == process:
                    samples[sample.labels["stack"]] = sample.value
    return samples


def _is_libc_start(frame: str) -> bool:
    return frame in {"__libc_start_call_main", "__libc_start_main_impl",
                     "__libc_start_main", "_start"} or frame.startswith("libc.so.6+0x")


def _status_of(pid: int) -> str:
    return Path(f"/proc/{pid}/status").read_text()


def _caps(status: str, field: str) -> set[str]:
    value = int(re.search(rf"^{field}:\s*([0-9a-f]+)", status, re.M).group(1), 16)  # type: ignore[union-attr]
    return {name for name, bit in CAPABILITIES.items() if value >> bit & 1}


def test_image_has_no_kernel_modules_tree_and_no_sources(setup):
    """bcc finds the generic headers through BCC_KERNEL_SOURCE, not through
    /lib/modules/$(uname -r) (the node's kernel is unknown at build time);
    the sources are gone once installed."""
    proc = _run(["podman", "run", "--rm", *setup.built.engine.options, "--network=none",
                 "--entrypoint=/bin/sh", setup.built.image, "-c",
                 "ls -A /lib/modules; ls -d /usr/src/*; echo BCC_KERNEL_SOURCE=$BCC_KERNEL_SOURCE"])
    lines = proc.stdout.split()
    assert "/usr/src/tramprof" not in lines, lines
    assert "/usr/src/kernel-headers" in lines, lines
    assert "BCC_KERNEL_SOURCE=/usr/src/kernel-headers" in lines, lines
    assert not [line for line in lines if not line.startswith(("/usr/src/", "BCC_"))], lines


def test_image_ships_the_injectable_runtimes(setup):
    """The runtimes injected into CPython 3.9-3.11 are in the installed
    package, byte for byte as built, where the daemon looks by default."""
    manifest = json.loads((RUNTIMES / "MANIFEST.json").read_text())
    script = ("import hashlib, json; from tramprof.inject.injector import RuntimeStore as R; "
              "d = R(None).directory; print(json.dumps({p.name: hashlib.sha256("
              "p.read_bytes()).hexdigest() for p in d.glob('*.so')}))")
    proc = _run(["podman", "run", "--rm", *setup.built.engine.options, "--network=none",
                 "--entrypoint=/opt/tramprof/bin/python", setup.built.image, "-c", script])
    shipped = json.loads(proc.stdout)
    assert shipped == {name: info["sha256"] for name, info in manifest["runtimes"].items()}
    assert {"_runtime-cp39.so", "_runtime-cp311.so"} <= shipped.keys()


def test_image_profiles_the_host_as_the_daemonset_runs_it(setup, targets, start_target,
                                                          tmp_path):
    # The known target, under a name no other process on the host has.
    name = f"cc{os.getpid() % 10**6}"
    binary = tmp_path / name
    shutil.copy(targets / "chain", binary)
    target = start_target(str(binary), "300")
    container_name = f"tramprof-test-{os.getpid()}"
    try:
        # The init container first, as the kubelet runs it: it fills the
        # node's program cache (or finds it filled by an earlier run).
        began = time.monotonic()
        prepare = subprocess.run(
            ["podman", "run", "--rm", "--name", f"{container_name}-{PREPARE}",
             *setup.built.engine.options,
             *podman_run_options(setup.config, setup.seccomp, name=PREPARE),
             setup.built.image, *daemonset_args(PREPARE)],
            capture_output=True, text=True, timeout=START_TIMEOUT)
        output = prepare.stdout + prepare.stderr
        print(f"init container done in {time.monotonic() - began:.1f} s")
        assert prepare.returncode == 0, output[-3000:]
        assert "the program cache in /var/cache/tramprof is ready" in output, output[-3000:]
        # The daemon is the container's init (the image's ENTRYPOINT).
        container = Container(setup.built, podman_run_options(setup.config, setup.seccomp),
                              container_name)
        startup = container.wait_healthy()
        print(f"container healthy {startup:.1f} s after podman run")
        assert "BPF program loaded from the cache" in container.logs(), container.logs()[-3000:]
        # Wait for two drains with the target in them.
        deadline = time.monotonic() + 60
        stacks: dict[str, float] = {}
        while time.monotonic() < deadline:
            exposition = container.get("/metrics")
            stacks = _stack_samples(exposition, name)
            if sum(stacks.values()) >= 2 * INTERVAL * 99 * 0.5:
                break
            time.sleep(INTERVAL / 2)
        total = sum(stacks.values())
        assert total >= 2 * INTERVAL * 99 * 0.5, (total, stacks, container.logs()[-3000:])

        def exact(stack: str) -> bool:
            """As tests/bpf/test_record.py: libc's start, then exactly the chain."""
            frames = stack.split(";")
            if "main" not in frames:
                return False
            at = frames.index("main")
            return frames[at:] == ["main", "chain_a", "chain_b", "chain_c"] and \
                all(_is_libc_start(f) for f in frames[:at])

        good = sum(v for s, v in stacks.items() if exact(s))
        assert good / total >= 0.95, sorted(stacks.items(), key=lambda kv: -kv[1])[:5]

        check = subprocess.run(["promtool", "check", "metrics"], input=exposition,
                               capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr

        # After start-up: uid 65534, only the three read-only capabilities,
        # no_new_privs; as the daemon says in its log.
        status = _status_of(container.pid)
        assert re.search(r"^Uid:\s+65534\s+65534\s+65534\s+65534$", status, re.M), status
        assert re.search(r"^Gid:\s+65534\s+65534\s+65534\s+65534$", status, re.M), status
        assert _caps(status, "CapEff") == _caps(status, "CapPrm") == set(RUNTIME_CAPABILITIES)
        assert _caps(status, "CapAmb") == _caps(status, "CapInh") == set()
        assert re.search(r"^NoNewPrivs:\s*1$", status, re.M), status
        logs = container.logs()
        assert "capabilities kept: CAP_DAC_READ_SEARCH, CAP_SYS_PTRACE, " \
            "CAP_CHECKPOINT_RESTORE" in logs and "uid 0 -> 65534" in logs, logs[-3000:]
        assert "kernel frames stay unnamed" not in logs, logs[-3000:]
        assert "ERROR" not in logs, logs[-3000:]

        began = time.monotonic()
        assert container.stop() == 0, container.logs()[-3000:]
        print(f"stopped in {time.monotonic() - began:.1f} s")
        assert "stopped" in container.logs().splitlines()[-1]
    finally:
        for name in (container_name, f"{container_name}-{PREPARE}"):
            subprocess.run(["podman", "rm", "--force", "--time", "5", name],
                           capture_output=True, timeout=60)
        target.stop()


@pytest.mark.parametrize("absent", daemonset_capabilities())
def test_each_capability_of_the_daemonset_is_required(setup, absent):
    name = f"tramprof-test-{os.getpid()}-{absent.lower()}"
    began = time.monotonic()
    try:
        proc = subprocess.run(
            ["podman", "run", "--rm", "--name", name, *setup.built.engine.options,
             *podman_run_options(setup.config, setup.seccomp, without=absent),
             setup.built.image, *daemonset_args()],
            capture_output=True, text=True, timeout=START_TIMEOUT)
    finally:
        subprocess.run(["podman", "rm", "--force", "--time", "5", name],
                       capture_output=True, timeout=60)
    output = proc.stdout + proc.stderr
    print(f"without {absent}: exit {proc.returncode} after {time.monotonic() - began:.1f} s")
    assert proc.returncode == 1, output[-3000:]
    assert f"missing capabilities: {absent}; grant them" in output, output[-3000:]
    assert f"  {absent}: {PURPOSES[absent]}" in output, output[-3000:]
    # Refused before compiling or loading anything.
    assert "sampling on" not in output and "capabilities kept" not in output, output


if __name__ == "__main__":
    if sys.argv[1:] != ["--build"]:
        sys.exit("usage: python -m tests.e2e.test_container --build")
    with tempfile.TemporaryDirectory(prefix="tramprof-image-") as tmp:
        t0 = time.monotonic()
        b = build_image(Path(tmp))
        how = "cached" if b.build_seconds is None else f"built in {b.build_seconds:.1f} s"
        print(f"{b.image}: {b.size_bytes / 1e6:.0f} MB, {how}, "
              f"{time.monotonic() - t0:.1f} s in all")

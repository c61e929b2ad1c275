"""deploy/prometheus: the fleet configurations (agent, central), the recording
and alert rules with their promtool unit tests, and the Kubernetes
PrometheusRule that carries the same rules."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.test_dashboard import check_expression

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = REPO / "deploy" / "prometheus"
AGENT_CONFIG = PROMETHEUS_DIR / "agent.yml"
CENTRAL_CONFIG = PROMETHEUS_DIR / "central.yml"
RULES_DIR = PROMETHEUS_DIR / "rules"
RULE_FILES = (RULES_DIR / "tramprof-recording.rules.yml",
              RULES_DIR / "tramprof-alerts.rules.yml")
RULE_TESTS = RULES_DIR / "tramprof-rules.test.yml"
PROMETHEUS_RULE = REPO / "deploy" / "kubernetes" / "prometheusrule.yaml"

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (Debian package: prometheus)")

REGENERATE = (".venv/bin/python -c 'from tests.unit.test_prometheus_rules import "
              "write_prometheus_rule; write_prometheus_rule()'")


def load_yaml(path: Path) -> Any:
    with path.open(encoding="utf-8") as f:
        return yaml.safe_load(f)


def rule_groups() -> list[dict[str, Any]]:
    return [group for path in RULE_FILES for group in load_yaml(path)["groups"]]


def all_rules() -> list[dict[str, Any]]:
    return [rule for group in rule_groups() for rule in group["rules"]]


def render_prometheus_rule() -> str:
    """deploy/kubernetes/prometheusrule.yaml from the rule files: their groups,
    comments included, under ``spec.groups``."""
    head = f"""\
# The rules of deploy/prometheus/rules/ for the Prometheus Operator
# (monitoring.coreos.com/v1). Generated from those files, do not edit:
#   {REGENERATE}
# The operator loads PrometheusRules whose labels match the Prometheus
# resource's ruleSelector (and whose namespace its ruleNamespaceSelector
# admits). The labels below are kube-prometheus's defaults; with
# kube-prometheus-stack add `release: <its release name>` instead, or set
# ruleSelectorNilUsesHelmValues=false there.
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: tramprof
  namespace: tramprof
  labels:
    app.kubernetes.io/name: tramprof
    prometheus: k8s
    role: alert-rules
spec:
  groups:
"""
    body = []
    for path in RULE_FILES:
        lines = path.read_text(encoding="utf-8").splitlines()
        start = lines.index("groups:") + 1
        body.extend(("  " + line).rstrip() for line in lines[start:])
    return head + "\n".join(body) + "\n"


def write_prometheus_rule() -> None:
    PROMETHEUS_RULE.write_text(render_prometheus_rule(), encoding="utf-8")


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120)


# --------------------------------------------------------------------------
# The rules themselves
# --------------------------------------------------------------------------


def recorded_labels() -> dict[str, set[str]]:
    """Labels each recording rule keeps: those its level names, and job."""
    return {r["record"]: set(r["record"].split(":")[0].split("_")) | {"job"}
            for r in all_rules() if "record" in r}


def test_rules_name_only_exported_metrics_and_labels() -> None:
    scrape_series = frozenset({"up", "scrape_samples_scraped", "scrape_sample_limit"})
    for rule in all_rules():
        name = rule.get("record") or rule["alert"]
        check_expression(name, rule["expr"], scrape_series, recorded_labels())


def test_recording_rules_follow_the_naming_convention() -> None:
    """level:metric:operations, with the level naming the labels kept."""
    for rule in all_rules():
        if "record" not in rule:
            continue
        level, metric, operation = rule["record"].split(":")
        assert metric.startswith("tramprof_"), rule["record"]
        assert operation.endswith("rate5m"), rule["record"]
        for label in level.split("_"):
            assert label in rule["expr"], f"{rule['record']}: {label} is not kept"


def test_alerts_are_labelled_and_explained() -> None:
    alerts = [r for r in all_rules() if "alert" in r]
    assert {a["alert"] for a in alerts} == {
        "TramprofDown", "TramprofNotReporting", "TramprofNotDraining", "TramprofLosingSamples",
        "TramprofKernelStacksLost", "TramprofProcessEventsLost", "TramprofPythonBudgetRefused",
        "TramprofSeriesBudgetExhausted", "TramprofNearSampleLimit", "TramprofCpusNotSampled"}
    for alert in alerts:
        assert alert["labels"]["severity"] in ("warning", "info"), alert["alert"]
        assert set(alert["annotations"]) == {"summary", "description"}, alert["alert"]
        assert "{{ $labels.instance }}" in alert["annotations"]["summary"], alert["alert"]


def test_every_rule_has_a_unit_test() -> None:
    tests = load_yaml(RULE_TESTS)
    assert [str(RULES_DIR / f) for f in tests["rule_files"]] == [str(p) for p in RULE_FILES]
    tested_alerts = {t["alertname"] for case in tests["tests"]
                     for t in case.get("alert_rule_test", []) if t["exp_alerts"]}
    tested_records = {t["expr"].split("{")[0] for case in tests["tests"]
                      for t in case.get("promql_expr_test", []) if t["exp_samples"]}
    for rule in all_rules():
        if "alert" in rule:
            assert rule["alert"] in tested_alerts, f"{rule['alert']} never fires in a test"
        else:
            assert rule["record"] in tested_records, f"{rule['record']} is never checked"


@needs_promtool
def test_rule_files_pass_promtool_check() -> None:
    result = promtool("check", "rules", *map(str, RULE_FILES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 6 rules found" in result.stdout
    assert "SUCCESS: 10 rules found" in result.stdout


@needs_promtool
def test_rule_unit_tests_pass(tmp_path: Path) -> None:
    result = promtool("test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
    # ...and they can fail: one expected value off by one.
    for path in (*RULE_FILES, RULE_TESTS):
        shutil.copy(path, tmp_path / path.name)
    wrong = tmp_path / RULE_TESTS.name
    text = wrong.read_text()
    assert text.count("value: 36\n") == 1
    wrong.write_text(text.replace("value: 36\n", "value: 37\n"))
    failed = promtool("test", "rules", str(wrong))
    assert failed.returncode != 0 and "3.7E+01" in failed.stdout + failed.stderr


# --------------------------------------------------------------------------
# Agent and central configurations
# --------------------------------------------------------------------------


@needs_promtool
def test_central_config_is_valid_and_loads_the_rules() -> None:
    result = promtool("check", "config", str(CENTRAL_CONFIG))
    assert result.returncode == 0, result.stdout + result.stderr
    config = load_yaml(CENTRAL_CONFIG)
    assert [PROMETHEUS_DIR / f for f in config["rule_files"]] == list(RULE_FILES)


@needs_promtool
def test_agent_config_is_valid_in_agent_mode() -> None:
    result = promtool("check", "config", "--agent", str(AGENT_CONFIG))
    assert result.returncode == 0, result.stdout + result.stderr
    # Agent mode has no rules and no local storage to query.
    config = load_yaml(AGENT_CONFIG)
    assert "rule_files" not in config and "alerting" not in config


def test_agent_config_keeps_the_series_budget() -> None:
    config = load_yaml(AGENT_CONFIG)
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "tramprof", "the alert rules select job=\"tramprof\""
    # 10,000 stack and function series (max_series) plus the self-metrics.
    assert 10_000 < job["sample_limit"] <= 15_000
    assert job["label_value_length_limit"] >= 1024  # max_label_bytes
    (write,) = config["remote_write"]
    actions = [(r.get("action", "replace"), r.get("target_label")) for r in
               write["write_relabel_configs"]]
    assert actions == [("keep", None), ("drop", None), ("replace", "instance"),
                       ("labeldrop", None)]
    keep = write["write_relabel_configs"][0]["regex"]
    # Every series the alert rules read is sent.
    for rule in all_rules():
        for name in ("up", "scrape_samples_scraped", "scrape_sample_limit"):
            if f"{name}{{" in rule["expr"]:
                assert name in keep.split("|"), f"{rule.get('alert')} reads {name}"
    assert config["global"]["external_labels"] == {"node": "${NODE_NAME}"}


def test_kubernetes_prometheus_rule_is_generated_from_the_rule_files() -> None:
    assert PROMETHEUS_RULE.read_text(encoding="utf-8") == render_prometheus_rule(), (
        f"{PROMETHEUS_RULE.name} is out of date: {REGENERATE}")
    manifest = load_yaml(PROMETHEUS_RULE)
    assert manifest["spec"]["groups"] == rule_groups()

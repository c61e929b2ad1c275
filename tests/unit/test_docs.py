"""What the READMEs claim, checked against the code and the deployments: the
capability lists, the grouping labels and the PromQL join shown for them, and
the daemon's names the trampoline runtime's documents point at."""

from __future__ import annotations

import ast
import importlib
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from tramprof.commands.privileges import CAPABILITIES, RUNTIME_CAPABILITIES
from tramprof.config import GROUP_LABELS

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
TRAMPOLINES = REPO / "trampolines"
UNIT = REPO / "deploy" / "systemd" / "tramprof.service"
DAEMONSET = REPO / "deploy" / "kubernetes" / "daemonset.yaml"
PROMTOOL = shutil.which("promtool")


def section(text: str, heading: str) -> str:
    """The body of a Markdown section, up to the next heading of any level."""
    match = re.search(rf"^#+ {re.escape(heading)}\n(.*?)(?=^#+ |\Z)", text, re.M | re.S)
    assert match, f"no section {heading!r}"
    return match.group(1)


def granted_capabilities() -> set[str]:
    """Everything the systemd unit or the DaemonSet grants."""
    unit = set()
    for line in UNIT.read_text().splitlines():
        if line.startswith("CapabilityBoundingSet="):
            unit |= set(line.partition("=")[2].split())
    (container,) = yaml.safe_load(DAEMONSET.read_text())["spec"]["template"]["spec"][
        "containers"]
    added = {"CAP_" + c for c in container["securityContext"]["capabilities"]["add"]}
    return unit | added


def test_readme_privileges_name_every_granted_capability() -> None:
    text = section(README.read_text(), "Privileges")
    named = set(re.findall(r"`(CAP_[A-Z_]+)`", text))
    assert named <= set(CAPABILITIES), named - set(CAPABILITIES)
    granted = granted_capabilities()
    assert granted <= named, f"README's Privileges leaves out {sorted(granted - named)}"


def test_readme_privileges_say_what_the_daemon_keeps() -> None:
    text = " ".join(section(README.read_text(), "Privileges").split())
    kept = re.search(r"the daemon keeps only (.*?) \(plus", text)
    assert kept, text
    assert set(re.findall(r"`(CAP_[A-Z_]+)`", kept.group(1))) == RUNTIME_CAPABILITIES


def test_readme_grouping_table_has_every_group_label() -> None:
    text = section(README.read_text(), "Grouping")
    header, *rows = re.findall(r"^\| `(\w+)`(?: \(default\))? \|", text, re.M)
    assert header == "group_by" and rows == list(GROUP_LABELS)


def grouping_query() -> str:
    (query,) = re.findall(r"```promql\n(.*?)```", section(README.read_text(), "Grouping"),
                          re.S)
    return query.strip()


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed "
                    "(Debian package: prometheus)")
def test_readme_grouping_join_returns_namespace_and_pod(tmp_path: Path) -> None:
    """The query README shows, on series as a PodMonitor stores them (with
    the tramprof pod's own namespace and pod labels) and as two replicas of
    kube-state-metrics report the pod."""
    uid = "4d2c1f7e-1b2a-4c3d-9e8f-0a1b2c3d4e5f"
    tramprof = ('tramprof_stack_samples_total{{job="tramprof",instance="node-1",'
                'namespace="tramprof",pod="tramprof-x7k2p",process="{process}",'
                'pod_uid="{uid}",stack="{stack}"}}')
    tests = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [
                {"series": tramprof.format(process="api", uid=uid, stack="main;serve;hot"),
                 "values": "0+600x10"},
                {"series": tramprof.format(process="api", uid=uid, stack="main;serve;cold"),
                 "values": "0+60x10"},
                # A host process, in no pod.
                {"series": tramprof.format(process="sshd", uid="", stack="main;poll"),
                 "values": "0+120x10"},
                *({"series": f'kube_pod_info{{job="kube-state-metrics",instance="{ksm}",'
                             f'namespace="shop",pod="api-7d9f8",uid="{uid}",node="node-1",'
                             f'created_by_kind="ReplicaSet"}}',
                   "values": "1x10"} for ksm in ("ksm-0", "ksm-1")),
            ],
            "promql_expr_test": [{
                "expr": grouping_query(),
                "eval_time": "10m",
                "exp_samples": [
                    {"labels": f'{{namespace="shop",pod="api-7d9f8",pod_uid="{uid}",'
                               f'process="api",stack="main;serve;hot"}}', "value": 10},
                    {"labels": f'{{namespace="shop",pod="api-7d9f8",pod_uid="{uid}",'
                               f'process="api",stack="main;serve;cold"}}', "value": 1},
                ],
            }],
        }],
    }
    path = tmp_path / "join.test.yml"
    path.write_text(yaml.safe_dump(tests))
    assert PROMTOOL is not None
    result = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def trampolines_api() -> set[str]:
    tree = ast.parse((TRAMPOLINES / "tramprof_trampolines" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError("tramprof_trampolines has no __all__")


@pytest.mark.parametrize("document", ["README.md", "ABI.md"])
def test_trampoline_documents_name_what_exists(document: str) -> None:
    """Daemon modules and functions, runtime functions, files and variables
    the runtime's documents mention are there."""
    text = (TRAMPOLINES / document).read_text()
    daemon_names = {name for name in re.findall(r"`(tramprof(?:\.\w+)+)", text)
                    if name.rpartition(".")[2] not in ("c", "h", "so", "py")}  # files
    assert daemon_names or document == "README.md"
    for dotted in daemon_names:
        module, _, attribute = dotted.rpartition(".")
        try:
            importlib.import_module(dotted)
        except ModuleNotFoundError:
            assert hasattr(importlib.import_module(module), attribute), dotted
    for call in re.findall(r"`tramprof_trampolines\.(\w+)\(", text):
        assert call in trampolines_api(), call
    for path in re.findall(r"`((?:daemon|trampolines|tests|bpf)/[\w/.-]+)`", text):
        assert (REPO / path).exists(), path
    sources = "".join(p.read_text() for p in (TRAMPOLINES / "tramprof_trampolines").glob("*.py"))
    sources += (TRAMPOLINES / "_tramprof_trampolines_boot.py").read_text()
    for variable in re.findall(r"`(TRAMPROF_TRAMPOLINES\w*)", text):
        assert variable in sources, variable

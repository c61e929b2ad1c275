"""A real Prometheus server for the end-to-end tests: started on a free port
from a configuration written here, its log kept for failures."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

PROMETHEUS = shutil.which("prometheus")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrometheusServer:
    """A Prometheus process on a free port, with its log kept for failures."""

    def __init__(self, workdir: Path, name: str, port: int, config: dict[str, Any],
                 args: list[str], env: dict[str, str] | None = None) -> None:
        self.port = port
        config_path = workdir / f"{name}.yml"
        config_path.write_text(yaml.safe_dump(config))
        self.log = (workdir / f"{name}.log").open("w+")
        assert PROMETHEUS is not None
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config_path}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn", *args],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.logs()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"prometheus not ready within 20 s: {self.logs()}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def logs(self) -> str:
        self.log.seek(0)
        return str(self.log.read()[-3000:])

    def get(self, path: str, **params: str | list[str]) -> Any:
        query = urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        data = self.get("/api/v1/query", **params)
        return list(data["result"])

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            return str(r.read().decode())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()



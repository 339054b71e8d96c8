"""Start `python -m jaxkv.serve` as a subprocess (tests, benchmarks) and read its /metrics."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
_READY = re.compile(r"jaxkv serving '(?P<name>[^']+)' at (?P<url>http://\S+/v1)")


class ServerProcess:
    """`python -m jaxkv.serve ARGS` on a free port; `.url` (…/v1), `.base`, `.name` once ready."""

    def __init__(self, args: list[str], timeout: float = 240.0, env: dict | None = None):
        self.args = [sys.executable, "-m", "jaxkv.serve", "--port", "0", *args]
        self.log: list[str] = []
        full_env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
                    "PYTHONUNBUFFERED": "1", **(env or {})}
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full_env.get("PYTHONPATH")]))
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(self.args, env=full_env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1)
        ready = threading.Event()
        self.url = self.name = None

        def pump():
            for line in self.proc.stdout:
                self.log.append(line)
                m = _READY.search(line)
                if m and not ready.is_set():
                    self.url, self.name = m["url"], m["name"]
                    ready.set()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(timeout) or self.url is None:
            self.stop()
            raise RuntimeError("server did not start:\n" + "".join(self.log[-60:]))
        self.startup_s = time.perf_counter() - self.started
        self.base = self.url[: -len("/v1")]

    def metrics(self) -> dict[str, float]:
        """`/metrics` samples as {'name{labels}': value} (labels sorted as printed)."""
        out = {}
        for line in httpx.get(self.base + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def metric(self, name: str, **labels) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        total = 0.0
        for key, value in self.metrics().items():
            base, _, rest = key.partition("{")
            if base == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
                total += value
        return total

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

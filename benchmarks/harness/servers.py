"""Server lifecycle: start minivllm or mlx_lm.server as a subprocess, wait until healthy, always stop it."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.harness.models import OPENBLAS, float32_copy, is_cpu_backend, is_quantized
from benchmarks.harness.results import REPO_ROOT, RESULTS_DIR

SERVER_NAMES = ("minivllm", "mlx-lm")
# How mlx_lm.server runs a quantized model on the CPU backend (defaults: the same compute as minivllm's).
PEER_WEIGHTS = ("float32", "as-given")  # a dequantized float32 copy | the model dir as given (4-bit kernels)
PEER_BLAS = ("openblas", "bundled")  # OpenBLAS preloaded | MLX's bundled reference BLAS (a plain install)


@dataclass
class ServerSpec:
    name: str  # "minivllm" | "mlx-lm"
    model: Path
    env: dict[str, str] = field(default_factory=dict)  # MINIVLLM_* overrides; ignored by mlx-lm
    port: int = 0  # 0: pick a free port
    label: str = ""  # names the log file, e.g. "prefix-cache-off"
    extra_args: list[str] = field(default_factory=list)  # extra CLI args (mlx-lm only)
    startup_timeout_s: float = 900.0  # the real model on CPU dequantizes at load
    replicas: int | None = None  # minivllm only: `minivllm serve --replicas N` on a local Ray Serve
    routing: str = "affinity"  # with replicas: affinity | round-robin | least-loaded
    root: Path = REPO_ROOT  # the checkout whose minivllm server runs (another one: a baseline)
    peer_weights: str = "float32"  # mlx-lm only, on the CPU backend: one of PEER_WEIGHTS
    peer_blas: str = "openblas"  # mlx-lm only, on the CPU backend: one of PEER_BLAS

    def __post_init__(self) -> None:
        if self.peer_weights not in PEER_WEIGHTS:
            raise ValueError(f"peer_weights {self.peer_weights!r}: expected one of {PEER_WEIGHTS}")
        if self.peer_blas not in PEER_BLAS:
            raise ValueError(f"peer_blas {self.peer_blas!r}: expected one of {PEER_BLAS}")


@dataclass
class Server:
    spec: ServerSpec
    base_url: str  # http://127.0.0.1:P
    model_id: str  # the `model` field to send
    served_model: Path  # the directory the server actually loaded
    log_path: Path

    @property
    def api_url(self) -> str:
        return self.base_url + "/v1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_in_use(port: int) -> bool:
    # Connect rather than bind: a port in TIME_WAIT from the previous server is fine to reuse.
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def served_model_dir(spec: ServerSpec) -> Path:
    """By default the peer runs the same weights at the same dtype as minivllm.

    On CPU minivllm dequantizes a quantized dir to float32 at load, while mlx_lm.server would run the
    quantized weights through quantized_matmul, so the peer gets a float32 copy. peer_weights="as-given"
    serves the dir itself, as `mlx_lm.server --model <dir>` does for its users.
    """
    if (
        spec.name == "mlx-lm"
        and spec.peer_weights == "float32"
        and is_cpu_backend()
        and is_quantized(spec.model)
    ):
        return float32_copy(spec.model)
    return spec.model


def _server_command(spec: ServerSpec, model: Path, port: int) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    host = ["--host", "127.0.0.1", "--port", str(port)]
    if spec.name == "minivllm":
        env.update({"MINIVLLM_MODEL": str(model), **spec.env})
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(spec.root), env.get("PYTHONPATH", "")) if p)
        if spec.replicas is not None:
            replicas = ["--replicas", str(spec.replicas), "--routing", spec.routing]
            return [sys.executable, "-m", "server.cli", "serve", *host, *replicas], env
        return [sys.executable, "-m", "uvicorn", "server.app:app", *host], env
    if spec.name == "mlx-lm":
        if spec.peer_blas == "openblas" and is_cpu_backend() and OPENBLAS.exists():
            # MLX's bundled reference BLAS is ~50x slower for float32 matmul; minivllm loads OpenBLAS too.
            # A plain mlx_lm.server install runs on the bundled one (peer_blas="bundled").
            env["LD_PRELOAD"] = ":".join(p for p in (str(OPENBLAS), env.get("LD_PRELOAD", "")) if p)
        elif spec.peer_blas == "bundled":
            preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p and "openblas" not in p]
            env["LD_PRELOAD"] = ":".join(preload)
        cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model), *host, *spec.extra_args]
        return cmd, env
    raise ValueError(f"unknown server {spec.name!r}; expected one of {SERVER_NAMES}")


def _log_tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def _wait_healthy(proc: subprocess.Popen, url: str, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"server exited with code {proc.returncode}; log {log_path}:\n{_log_tail(log_path)}"
            )
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"server not healthy after {timeout_s:.0f} s; log {log_path}:\n{_log_tail(log_path)}")


def _model_id(spec: ServerSpec, base_url: str, model: Path) -> str:
    if spec.name == "mlx-lm":
        return "default_model"  # mlx_lm.server maps this to its --model; other ids trigger a load
    data = httpx.get(base_url + "/v1/models", timeout=5.0).json().get("data") or []
    return data[0]["id"] if data else str(model)


def _stop(proc: subprocess.Popen, timeout_s: float = 15.0) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()  # minivllm serve --replicas shuts Ray Serve and Ray down on SIGTERM
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=15)


@contextlib.contextmanager
def running_server(spec: ServerSpec) -> Iterator[Server]:
    """Start the server as a subprocess, wait until it is healthy, always stop it on exit."""
    port = spec.port or free_port()
    if _port_in_use(port):
        raise RuntimeError(f"port {port} is already in use: refusing to benchmark someone else's server")
    model = served_model_dir(spec)
    cmd, env = _server_command(spec, model, port)
    log_dir = RESULTS_DIR / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    log_path = log_dir / f"{spec.name}{'-' + spec.label if spec.label else ''}-{stamp}-{port}.log"
    base_url = f"http://127.0.0.1:{port}"
    health = base_url + ("/health" if spec.name == "minivllm" else "/v1/models")
    with open(log_path, "w") as log:
        log.write(f"# {' '.join(cmd)}\n# env overrides: {spec.env}\n")
        log.flush()
        # New session: a Ctrl-C in the terminal reaches only us; we stop the server ourselves.
        proc = subprocess.Popen(
            cmd, cwd=spec.root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            _wait_healthy(proc, health, log_path, spec.startup_timeout_s)
            yield Server(spec, base_url, _model_id(spec, base_url, model), model, log_path)
        finally:
            _stop(proc, 120.0 if spec.replicas is not None else 15.0)

"""Run a real tritonserver on tritium's model repository, and clean up after it.

The binary is a system `tritonserver` (as in an NGC container) or the one inside the `nvidia-pytriton`
wheel, which needs its python backend stub copied next to the backend, `LD_LIBRARY_PATH` on the
wheel's libraries and this interpreter's libpython, and this venv's `bin/` first on `PATH` (the stub
finds the venv's site-packages through it). Every server gets a unique shared-memory prefix so that
its `/dev/shm` segments and stub processes can be removed when it exits, or after it was killed.

tritonserver always runs in explicit model-control mode, so that a model whose engine failed (its
`tritium_engine_healthy` gauge at 0) can be unloaded and report not ready. Two keys guard the APIs: the
inference key the read-only ones, the admin key (else a secret only this launcher knows) the others.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tritium.client.triton.repository import PACKAGE_REPOSITORY

SHM_PREFIX = "tritium_"
STUB_NAME = "triton_python_backend_stub"

# Health (live, ready, model ready) is always open; metrics has its own port. With a key, the inference key
# guards the read-only APIs (INFERENCE_APIS) and the admin key the ones that change the server (ADMIN_APIS).
INFERENCE_APIS = "metadata,inference,model-config,statistics"
ADMIN_APIS = "model-repository,shared-memory,trace,logging"
API_KEY_HEADER = "x-api-key"
ADMIN_KEY_HEADER = "x-admin-key"
HEALTH_METRIC = "tritium_engine_healthy"
# In the repository, loaded only when asked (`tritium serve --embeddings`, or --load-model): a third engine's memory
OPT_IN_MODELS = ("tritium_embed",)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass
class ServerOptions:
    """How to run tritonserver: repository, addresses, keys and which models to load."""

    model_repository: Path = PACKAGE_REPOSITORY
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    api_key: str | None = None  # x-api-key: inference, metadata, model config, statistics
    admin_key: str | None = None  # x-admin-key: model repository, shared memory, trace, logging
    # tritonserver always runs in explicit mode, so that a failed model can be unloaded: "none" loads every
    # model of the repository at start-up (but OPT_IN_MODELS unless in `load_models`), "explicit" only `load_models`.
    model_control: Literal["none", "explicit"] = "none"
    load_models: list[str] = field(default_factory=list)
    log_verbose: int = 0
    extra_args: list[str] = field(default_factory=list)


def startup_models(repository: Path, also: list[str]) -> list[str]:
    """Model control "none": every model of `repository` but the opt-in ones (OPT_IN_MODELS), and `also`."""
    found = sorted(c.parent.name for c in Path(repository).glob("*/config.pbtxt"))
    return [n for n in found if n not in OPT_IN_MODELS or n in also] + [n for n in also if n not in found]


@dataclass(frozen=True)
class EngineHealth:
    """One `tritium_engine_healthy` sample: 1 while the model version's engine serves, 0 once it failed."""

    model: str
    version: str
    healthy: bool


def parse_engine_health(metrics_text: str) -> list[EngineHealth]:
    """The `tritium_engine_healthy{model=...,version=...}` samples of a Prometheus text exposition."""
    found = []
    for line in metrics_text.splitlines():
        if not line.startswith(HEALTH_METRIC + "{"):
            continue
        labels_text, _, value = line[len(HEALTH_METRIC) + 1:].rpartition("}")
        labels = dict(_LABEL.findall(labels_text))
        try:
            healthy = float(value.split()[0]) != 0
        except (IndexError, ValueError):
            continue
        if "model" in labels:
            found.append(EngineHealth(labels["model"], labels.get("version", ""), healthy))
    return found


def dependent_ensembles(repository: Path, model: str) -> list[str]:
    """The ensembles of `repository` with a step running `model` (they cannot serve without it)."""
    found = []
    for config in sorted(repository.glob("*/config.pbtxt")):
        text = config.read_text(errors="replace")
        if re.search(r'platform:\s*"ensemble"', text) and re.search(rf'model_name:\s*"{re.escape(model)}"', text):
            found.append(config.parent.name)
    return found


@dataclass
class TritonInstall:
    """Where a tritonserver install lives: the binary, backends, cache folder and extra library path."""

    binary: Path
    backend_dir: Path
    cache_dir: Path | None
    library_path: list[str]


def free_ports(n: int) -> list[int]:
    """`n` loopback TCP ports free at the moment of asking."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (one owned by another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def find_triton(runtime_dir: Path) -> TritonInstall:
    """A system tritonserver, else the pytriton wheel's (its backend tree copied into runtime_dir).
    Raises RuntimeError when neither exists."""
    system = shutil.which("tritonserver") or ("/opt/tritonserver/bin/tritonserver"
                                              if Path("/opt/tritonserver/bin/tritonserver").is_file() else None)
    if system:
        root = Path(system).resolve().parent.parent
        return TritonInstall(Path(system), root / "backends", None, [])
    try:
        import pytriton
    except ImportError as exc:
        raise RuntimeError("no tritonserver found: install nvidia-pytriton==0.7.0 (make setup) or run in an "
                           "NGC tritonserver container") from exc
    root = Path(pytriton.__file__).parent / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / STUB_NAME
    if not stub.is_file():
        raise RuntimeError(f"the pytriton wheel has no python backend stub for Python {version}")
    backends = runtime_dir / "backends"
    shutil.copytree(root / "backends", backends, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(stub, backends / "python" / STUB_NAME)
    libs = Path(pytriton.__file__).parent.parent / "nvidia_pytriton.libs"
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    return TritonInstall(root / "bin" / "tritonserver", backends, root / "caches", [str(libs), libdir])


def clean_stale(prefix: str = SHM_PREFIX) -> list[str]:
    """Remove shared memory segments, stub processes and runtime folders left by tritium servers that
    died (their owning pid is part of the shm prefix / in the folder's pid file). Returns what was removed."""
    removed = []
    shm = Path("/dev/shm")
    dead: set[str] = set()
    if shm.is_dir():
        for seg in shm.iterdir():
            if seg.name.startswith(prefix):
                pid = seg.name[len(prefix):].split("_", 1)[0]
                if pid.isdigit() and not pid_alive(int(pid)):
                    dead.add(f"{prefix}{pid}_")
                    seg.unlink(missing_ok=True)
                    removed.append(str(seg))
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if STUB_NAME in cmd and prefix in cmd:
            owner = cmd.split(prefix, 1)[1].split("_", 1)[0]
            if owner.isdigit() and not pid_alive(int(owner)):
                os.kill(int(proc.name), signal.SIGKILL)
                removed.append(f"stub pid {proc.name}")
    tmp = Path(tempfile.gettempdir())
    for runtime in tmp.glob("tritium-serve-*"):
        pid_file = runtime / "tritonserver.pid"
        try:
            pid = int(pid_file.read_text())
        except (OSError, ValueError):
            continue
        if not pid_alive(pid):
            shutil.rmtree(runtime, ignore_errors=True)
            removed.append(str(runtime))
    return removed


class TritonServer:
    """`with TritonServer(options) as server:` starts tritonserver, waits until ready, stops it on exit."""

    def __init__(self, options: ServerOptions) -> None:
        self.options = options
        self.process: subprocess.Popen[bytes] | None = None
        self.runtime_dir = Path(tempfile.mkdtemp(prefix="tritium-serve-"))
        self.shm_prefix = ""
        self.log_path = self.runtime_dir / "tritonserver.log"
        # With an inference key but no admin key the admin APIs stay closed, behind a secret only this
        # launcher knows (it unloads failed models with it). Never printed or logged.
        self.admin_key = options.admin_key or (secrets.token_urlsafe(32) if options.api_key else None)
        self.handled: set[str] = set()  # models reported by failed_engines() (then unloaded)

    @property
    def http_url(self) -> str:
        """http://host:http_port."""
        return f"http://{self.options.host}:{self.options.http_port}"

    @property
    def grpc_url(self) -> str:
        """host:grpc_port."""
        return f"{self.options.host}:{self.options.grpc_port}"

    @property
    def metrics_url(self) -> str:
        """http://host:metrics_port/metrics."""
        return f"http://{self.options.host}:{self.options.metrics_port}/metrics"

    def command(self, install: TritonInstall) -> list[str]:
        """The tritonserver command line for `install` (explicit model control, keys on the restricted APIs)."""
        o = self.options
        cmd = [
            str(install.binary), f"--model-repository={o.model_repository}",
            f"--backend-directory={install.backend_dir}",
            f"--http-address={o.host}", f"--http-port={o.http_port}",
            f"--grpc-address={o.host}", f"--grpc-port={o.grpc_port}",
            f"--metrics-address={o.host}", f"--metrics-port={o.metrics_port}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            "--model-control-mode=explicit", f"--log-verbose={o.log_verbose}",
            "--exit-timeout-secs=15",
        ]
        if install.cache_dir is not None:
            cmd.append(f"--cache-directory={install.cache_dir}")
        import torch

        if not torch.cuda.is_available():
            cmd += ["--pinned-memory-pool-byte-size=0", "--allow-gpu-metrics=false"]
        for name in (startup_models(o.model_repository, o.load_models) if o.model_control == "none" else o.load_models):
            cmd.append(f"--load-model={name}")
        # Lower-case headers: gRPC metadata keys are lower-cased on the wire, so any other key never matches.
        for apis, header, key in ((INFERENCE_APIS, API_KEY_HEADER, o.api_key),
                                  (ADMIN_APIS, ADMIN_KEY_HEADER, self.admin_key)):
            if key:
                cmd.append(f"--http-restricted-api={apis}:{header}={key}")
                cmd.append(f"--grpc-restricted-protocol={apis}:{header}={key}")
        return cmd + o.extra_args

    def start(self, timeout: float = 300.0) -> None:
        """Start and wait until /v2/health/ready answers 200. Raises RuntimeError (with the server's
        log tail) when it exits or is not ready in time."""
        clean_stale()
        install = find_triton(self.runtime_dir)
        env = dict(os.environ)
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        if install.library_path:
            env["LD_LIBRARY_PATH"] = os.pathsep.join([*install.library_path, env.get("LD_LIBRARY_PATH", "")])
        # The shm prefix carries tritonserver's own pid, known only after the fork: a shell puts its pid
        # ($$) into the prefix and exec's tritonserver, which keeps that pid.
        self.shm_prefix = f"{SHM_PREFIX}$$_"
        script = "exec " + " ".join(shlex.quote(a) for a in self.command(install))
        script = script.replace(f"{SHM_PREFIX}$$_", f"{SHM_PREFIX}'$$'_")
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(["/bin/sh", "-c", script], stdout=log, stderr=subprocess.STDOUT,
                                            env=env, start_new_session=True)
        self.shm_prefix = f"{SHM_PREFIX}{self.process.pid}_"
        (self.runtime_dir / "tritonserver.pid").write_text(str(self.process.pid))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.process.returncode}:\n{self.log_tail()}")
            if self.ready():
                return
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"tritonserver not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def ready(self) -> bool:
        """Whether /v2/health/ready answers 200 now."""
        try:
            with urllib.request.urlopen(f"{self.http_url}/v2/health/ready", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError, http.client.HTTPException):
            return False

    def engine_health(self) -> list[EngineHealth]:
        """Every model version's `tritium_engine_healthy` sample; [] when the metrics port does not answer."""
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=5) as resp:
                return parse_engine_health(resp.read().decode(errors="replace"))
        except (urllib.error.URLError, OSError, http.client.HTTPException):
            return []

    def unload_model(self, name: str, timeout: float = 60.0) -> None:
        """Unload `name` (every version) through the repository API. Raises RuntimeError when refused."""
        url = f"{self.http_url}/v2/repository/models/{urllib.parse.quote(name, safe='')}/unload"
        request = urllib.request.Request(url, data=b"{}", method="POST")
        if self.admin_key:
            request.add_header(ADMIN_KEY_HEADER, self.admin_key)
        try:
            with urllib.request.urlopen(request, timeout=timeout):
                return
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"unloading {name} failed: HTTP {exc.code} {exc.read()[:500]!r}") from exc
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            raise RuntimeError(f"unloading {name} failed: {exc}") from exc

    def failed_engines(self) -> list[EngineHealth]:
        """Model versions whose engine failed, once per model (unloading takes every version): a model is
        reported again only after it served with every version healthy (reloaded by an operator)."""
        samples = self.engine_health()
        failed = {s.model: s for s in samples if not s.healthy}
        self.handled -= {s.model for s in samples} - failed.keys()
        new = [s for name, s in failed.items() if name not in self.handled]
        self.handled |= {s.model for s in new}
        return new

    def log_tail(self, lines: int = 15) -> str:
        """Triton's error lines (they start with E<date>) and the last `lines` lines of its log."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        errors = [line for line in text if line[:1] == "E" and line[1:5].isdigit()]
        return "\n".join([*errors[-20:], "...", *text[-lines:]])

    def stop(self, timeout: float = 30.0) -> None:
        """SIGINT, then SIGKILL after `timeout`; then remove stubs, /dev/shm segments, the runtime dir."""
        proc = self.process
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGINT)
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            except ProcessLookupError:
                pass
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # stubs left in the group
            clean_stale()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)

    def __enter__(self) -> TritonServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


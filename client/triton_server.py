"""Run a real tritonserver on tritium's model repository, and clean up after it.

The binary is a system `tritonserver` (as in an NGC container) or the one inside the `nvidia-pytriton`
wheel, which needs its python backend stub copied next to the backend, `LD_LIBRARY_PATH` on the
wheel's libraries and this interpreter's libpython, and this venv's `bin/` first on `PATH` (the stub
finds the venv's site-packages through it). Every server gets a unique shared-memory prefix so that
its `/dev/shm` segments and stub processes can be removed when it exits, or after it was killed.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

SHM_PREFIX = "tritium_"
STUB_NAME = "triton_python_backend_stub"
PACKAGE_REPOSITORY = Path(__file__).resolve().parent.parent / "model_repository"
# With an API key, every Triton API but health (live, ready, model ready) needs it; metrics has its own port.
RESTRICTED_APIS = "metadata,inference,shared-memory,model-config,model-repository,statistics,trace,logging"


@dataclass
class ServerOptions:
    model_repository: Path = PACKAGE_REPOSITORY
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    api_key: str | None = None
    model_control: str = "none"  # "none" loads everything; "explicit" loads `load_models` only
    load_models: list[str] = field(default_factory=list)
    log_verbose: int = 0
    extra_args: list[str] = field(default_factory=list)


@dataclass
class TritonInstall:
    binary: Path
    backend_dir: Path
    cache_dir: Path | None
    library_path: list[str]


def pid_alive(pid: int) -> bool:
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

    @property
    def http_url(self) -> str:
        return f"http://{self.options.host}:{self.options.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.options.host}:{self.options.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.options.host}:{self.options.metrics_port}/metrics"

    def command(self, install: TritonInstall) -> list[str]:
        o = self.options
        cmd = [
            str(install.binary), f"--model-repository={o.model_repository}",
            f"--backend-directory={install.backend_dir}",
            f"--http-address={o.host}", f"--http-port={o.http_port}",
            f"--grpc-address={o.host}", f"--grpc-port={o.grpc_port}",
            f"--metrics-address={o.host}", f"--metrics-port={o.metrics_port}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            f"--model-control-mode={o.model_control}", f"--log-verbose={o.log_verbose}",
            "--exit-timeout-secs=15",
        ]
        if install.cache_dir is not None:
            cmd.append(f"--cache-directory={install.cache_dir}")
        import torch

        if not torch.cuda.is_available():
            cmd += ["--pinned-memory-pool-byte-size=0", "--allow-gpu-metrics=false"]
        for name in o.load_models:
            cmd.append(f"--load-model={name}")
        if o.api_key:
            # Lower case: gRPC metadata keys are lower-cased on the wire, so any other key never matches.
            cmd.append(f"--http-restricted-api={RESTRICTED_APIS}:x-api-key={o.api_key}")
            cmd.append(f"--grpc-restricted-protocol={RESTRICTED_APIS}:x-api-key={o.api_key}")
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
        try:
            with urllib.request.urlopen(f"{self.http_url}/v2/health/ready", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

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


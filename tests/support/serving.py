"""Start `tritium serve` (a real tritonserver) for the end-to-end tests, and talk to it."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from tritium.client.triton.launcher import free_ports
from tritium.client.triton.remote import grpc_inputs


@dataclass
class Served:
    process: subprocess.Popen[str]
    http: str
    grpc: str
    metrics: str
    output: list[str] = field(default_factory=list)
    server_pid: int = 0  # tritonserver's own pid (also in its shm prefix)
    lines: queue.Queue[str | None] | None = None  # its output after the ready line (None: the end)

    def leftovers(self) -> list[str]:
        """Stub processes and /dev/shm segments of this server still around (none after stop())."""
        return [*shm_segments(f"tritium_{self.server_pid}_"), *(f"stub {p}" for p in stub_pids(self.server_pid))]

    def stop(self) -> str:
        """Stop the launcher (SIGINT, then SIGKILL after 60 s); returns what it printed after it was ready."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.lines is None:
            return self.process.stdout.read() if self.process.stdout else ""
        out = []
        with contextlib.suppress(queue.Empty):
            while (line := self.lines.get(timeout=10)) is not None:
                out.append(line)
        return "".join(out)


def start_serve(*args: str, timeout: float = 240.0, env: dict[str, str] | None = None) -> Served:
    """Run `tritium serve` on free loopback ports and wait until it prints that it is serving."""
    http, grpc, metrics = free_ports(3)
    cmd = [sys.executable, "-m", "tritium.client.cli", "serve", f"--http-port={http}", f"--grpc-port={grpc}",
           f"--metrics-port={metrics}", *args]
    full_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | (env or {})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env)
    served = Served(proc, f"http://127.0.0.1:{http}", f"127.0.0.1:{grpc}", f"http://127.0.0.1:{metrics}/metrics")
    lines = _lines_of(proc)
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:  # a server that prints nothing cannot hold this past the deadline
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if line is None:
            raise RuntimeError("tritium serve exited:\n" + "".join(served.output))
        served.output.append(line)
        if "tritium is serving" in line:
            served.server_pid = tritonserver_pid(served)
            served.lines = lines
            return served
    served.stop()
    raise RuntimeError(f"tritium serve did not become ready within {timeout:g} s:\n" + "".join(served.output))


def _lines_of(proc: subprocess.Popen[str]) -> queue.Queue[str | None]:
    """The process's output lines as they come (None at its end), read on a thread of their own."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def wait_for(condition: Callable[[], bool], timeout: float = 60.0, interval: float = 0.2) -> bool:
    """Poll `condition` until it holds (True) or `timeout` passes (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return False


def wait_until_idle(served: Served, timeout: float = 120.0) -> bool:
    """Wait until the KV cache is empty, no request runs or waits, and the last requests' metrics have been
    pushed (metrics are pushed every 0.5 s and when the engine goes idle: a gauge can read 0 from before a
    short request ran, so the finished-request count must also stay put for longer than a push interval)."""
    names = ("tritium_kv_cache_used_blocks", "tritium_num_requests_running", "tritium_num_requests_waiting")

    def settled() -> bool:
        if not all(metric_value(served, name) == 0 for name in names):
            return False
        finished = metric_value(served, "tritium_e2e_request_latency_seconds_count")
        time.sleep(0.6)
        return finished == metric_value(served, "tritium_e2e_request_latency_seconds_count") and all(
            metric_value(served, name) == 0 for name in names)

    return wait_for(settled, timeout, 0.5)


def metric_value(served: Served, name: str) -> float:
    text = urllib.request.urlopen(served.metrics, timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def text_inputs(prompt: str, stream: bool, sampling: dict[str, Any] | str | None = None, **flags: bool) -> list[Any]:
    """gRPC inputs; `sampling` is JSON-encoded unless it is a string already (sent as is)."""
    values: dict[str, str | bool] = {"text_input": prompt, "stream": stream}
    if sampling is not None:
        values["sampling_parameters"] = sampling if isinstance(sampling, str) else json.dumps(sampling)
    return grpc_inputs(values | flags)


@dataclass
class StreamResult:
    texts: list[str]
    times: list[float]
    errors: list[str]
    finals: int
    outputs: list[dict[str, Any]]


def grpc_stream(url: str, prompt: str, sampling: dict[str, Any] | str | None, model: str = "tritium",
                version: str = "", headers: dict[str, str] | None = None, cancel_after: int | None = None,
                timeout: float = 120, **flags: bool) -> StreamResult:
    """One streamed request over gRPC; returns every response (text, arrival time) until the final one."""
    return grpc_stream_inputs(url, text_inputs(prompt, True, sampling, **flags), model, version, headers,
                              cancel_after, timeout)


def grpc_stream_inputs(url: str, inputs: list[Any], model: str = "tritium", version: str = "",
                       headers: dict[str, str] | None = None, cancel_after: int | None = None,
                       timeout: float = 120) -> StreamResult:
    """Like grpc_stream, for any list of tritonclient gRPC inputs."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    from tritonclient.utils import InferenceServerException

    client.start_stream(callback=lambda result, error: results.put((result, error)), headers=headers)
    out = StreamResult([], [], [], 0, [])
    try:
        client.async_stream_infer(model_name=model, model_version=version, inputs=inputs,
                                  enable_empty_final_response=True)
    except InferenceServerException as exc:  # the stream already failed (e.g. refused by auth)
        with contextlib.suppress(queue.Empty):  # the reason comes through the callback
            out.errors.append(str(results.get(timeout=5)[1]))
        out.errors.append(str(exc))
        client.stop_stream()
        client.close()
        return out
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            result, error = results.get(timeout=timeout)
            if error is not None:
                out.errors.append(str(error))
                break
            response = result.get_response()
            final = response.parameters.get("triton_final_response")
            text = result.as_numpy("text_output")
            if text is not None:
                out.texts.append(b"".join(text.reshape(-1)).decode())
                out.times.append(time.monotonic())
                out.outputs.append({o.name: result.as_numpy(o.name) for o in response.outputs})
            if final is not None and final.bool_param:
                out.finals += 1
                break
            if cancel_after is not None and len(out.texts) >= cancel_after:
                client.stop_stream(cancel_requests=True)
                return out
    finally:
        client.stop_stream()
        client.close()
    return out


def http_generate(base: str, body: dict[str, Any], model: str = "tritium", headers: dict[str, str] | None = None,
                  version: str | None = None) -> requests.Response:
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/generate"
    return requests.post(base + path, json=body, headers=headers, timeout=120)


def http_stream(base: str, body: dict[str, Any], model: str = "tritium") -> Iterator[dict[str, Any]]:
    with requests.post(f"{base}/v2/models/{model}/generate_stream", json=body, stream=True, timeout=120) as resp:
        assert resp.status_code == 200, resp.text
        for line in resp.iter_lines(decode_unicode=True):
            if line and line.startswith("data:"):
                yield json.loads(line[5:])


def shm_segments(prefix: str = "tritium_") -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(prefix))


def stub_processes() -> list[str]:
    out = subprocess.run(["pgrep", "-fa", "triton_python_backend_stub"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "tritium_" in line]


def tritonserver_pid(served: Served) -> int:
    """The tritonserver process that `tritium serve` started (its child)."""
    out = subprocess.run(["pgrep", "-P", str(served.process.pid)], capture_output=True, text=True).stdout.split()
    for pid in out:
        if "tritonserver" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
            return int(pid)
    raise RuntimeError("no tritonserver child found")


def server_log(pid: int) -> str:
    """tritonserver's own log (kept in the launcher's runtime folder while it runs)."""
    for pid_file in Path(tempfile.gettempdir()).glob("tritium-serve-*/tritonserver.pid"):
        if pid_file.read_text().strip() == str(pid):
            return (pid_file.parent / "tritonserver.log").read_text(errors="replace")
    raise RuntimeError(f"no runtime folder for tritonserver {pid}")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def stub_pids(server_pid: int) -> dict[int, str]:
    """The python backend stubs of one tritonserver: pid -> model name."""
    stubs = {}
    for line in stub_processes():
        pid, *args = line.split()
        if any(f"tritium_{server_pid}_" in a for a in args):
            stubs[int(pid)] = Path(args[1]).parent.parent.name if len(args) > 1 else "?"
    return stubs


def listening_addresses(port: int) -> set[str]:
    """Local IPv4/IPv6 addresses with a socket listening on `port` (from /proc/net/tcp*)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


def start_openai(upstreams: list[str], api_key: str | None = None, tokenizer: str | None = None,
                 timeout: float = 60.0) -> tuple[subprocess.Popen[str], str]:
    """Run `tritium openai` on a free port in front of `upstreams`; returns the process and its /v1 URL."""
    (port,) = free_ports(1)
    cmd = [sys.executable, "-m", "tritium.client.cli", "openai", f"--port={port}"]
    cmd += [f"--upstream={u}" for u in upstreams]
    if api_key:
        cmd.append(f"--api-key={api_key}")
    if tokenizer:
        cmd.append(f"--tokenizer={tokenizer}")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if requests.get(base + "/health", timeout=1).status_code == 200:
                return proc, base + "/v1"
        except requests.ConnectionError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(proc.stdout.read() if proc.stdout else "the OpenAI endpoint died")
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("the OpenAI endpoint did not come up")


FAKE_ENGINE_MODEL = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Serves healthy until its first request, then reports its engine failed (as tritium's models do)."""

    def initialize(self, args):
        self.family = pb_utils.MetricFamily(name="tritium_engine_healthy", description="engine serving",
                                            kind=pb_utils.MetricFamily.GAUGE)
        self.healthy = self.family.Metric(labels={"model": args["model_name"], "version": args["model_version"]})
        self.healthy.set(1)

    def execute(self, requests):
        self.healthy.set(0)
        return [pb_utils.InferenceResponse(error=pb_utils.TritonError("the engine failed")) for _ in requests]
'''
FAKE_ENGINE_CONFIG = '''name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "x", data_type: TYPE_INT32, dims: [ 1 ] }} ]
output [ {{ name: "y", data_type: TYPE_INT32, dims: [ 1 ] }} ]
instance_group [ {{ count: 1, kind: KIND_CPU }} ]
'''


@contextlib.contextmanager
def openai_client(upstreams: list[str]) -> Iterator[Any]:
    """The official `openai` client on `tritium openai` in front of `upstreams`; the endpoint ends with the block."""
    import openai

    proc, base = start_openai(upstreams)
    try:
        yield openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
    finally:
        proc.terminate()
        proc.wait(10)


def fake_repository(dest: Path, names: list[str]) -> Path:
    """Python-backend models (input x, output y, INT32) that report tritium_engine_healthy 1 until their
    first request, which fails and sets it to 0: a stand-in for a tritium model whose engine failed."""
    for name in names:
        (dest / name / "1").mkdir(parents=True)
        (dest / name / "config.pbtxt").write_text(FAKE_ENGINE_CONFIG.format(name=name))
        (dest / name / "1" / "model.py").write_text(FAKE_ENGINE_MODEL)
    return dest


def start_openai_with(upstreams: list[str], *args: str, api_key: str | None = None,
                      timeout: float = 60.0) -> tuple[subprocess.Popen[str], str]:
    """Like start_openai, with extra `tritium openai` arguments (e.g. --max-concurrency=2)."""
    (port,) = free_ports(1)
    cmd = [sys.executable, "-m", "tritium.client.cli", "openai", f"--port={port}", *args]
    cmd += [f"--upstream={u}" for u in upstreams]
    if api_key:
        cmd.append(f"--api-key={api_key}")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    if not wait_for(lambda: _healthy(base) or proc.poll() is not None, timeout, 0.3) or proc.poll() is not None:
        proc.kill()
        raise RuntimeError("the OpenAI endpoint did not come up:\n" + (proc.stdout.read() if proc.stdout else ""))
    return proc, base + "/v1"


def _healthy(base: str) -> bool:
    try:
        return requests.get(base + "/health", timeout=1).status_code == 200
    except requests.ConnectionError:
        return False


def raw_http_request(base: str, path: str, body: dict[str, Any], api_key: str | None = None) -> socket.socket:
    """Send a POST over a plain socket and return it unread: the test decides when the client goes away
    (close it), which `requests` does not let it do before the first byte of the answer."""
    host, port = base.split("//", 1)[1].split("/", 1)[0].split(":")
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
    if api_key:
        head += f"Authorization: Bearer {api_key}\r\n"
    conn = socket.create_connection((host, int(port)), timeout=30)
    conn.sendall(head.encode() + b"\r\n" + data)
    return conn


def restricted_keys(server_pid: int) -> dict[str, str]:
    """header -> key of the --http-restricted-api flags on tritonserver's command line (where the launcher's
    own admin secret can be read back, to check that it is printed and logged nowhere)."""
    args = Path(f"/proc/{server_pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    keys = {}
    for arg in args:
        if arg.startswith("--http-restricted-api="):
            header, _, key = arg.rsplit(":", 1)[1].partition("=")
            keys[header] = key
    return keys


API_KEY = "sk-tritium-test"

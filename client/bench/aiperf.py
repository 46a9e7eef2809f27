"""`tritium bench aiperf`: NVIDIA AIPerf (PyPI `aiperf`, genai-perf's successor) against either door of a
running tritium, offline, with the model's own tokenizer folder.

Doors:
- "openai": `tritium openai`'s /v1/chat/completions (or /v1/completions), aiperf's own `chat` /
  `completions` endpoint types; key as `Authorization: Bearer KEY`.
- "triton": tritonserver's HTTP `/v2/models/<model>/generate_stream` (`/generate` without streaming),
  aiperf's `template` endpoint type with the text model's payload (`text_input`, `max_tokens`, `stream`,
  `ignore_eos`) and `text_output` read from every server-sent event; key as `x-api-key: KEY`.

Every request asks for exactly `--output-tokens` tokens (`ignore_eos`), prompts are aiperf's synthetic ones of
`--input-tokens` tokens of the tokenizer, and aiperf counts tokens with that same tokenizer folder: a local
path never reaches the Hugging Face hub. aiperf writes its artifacts (profile_export_aiperf.json / .csv,
profile_export.jsonl per request, inputs.json, logs/) into the artifact folder; `run_aiperf` returns the
figures of its JSON export (TTFT, ITL, request latency, output token throughput, request counts, errors).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Door = Literal["openai", "triton"]
DOORS: tuple[str, ...] = ("openai", "triton")
AIPERF_VERSION = "0.13.0"  # the version this wrapper's command line and export parsing were written against
EXPORT_NAME = "profile_export_aiperf.json"
DEFAULT_OUT = "bench_results/aiperf"

# The text model's request for aiperf's `template` endpoint (a Jinja2 template rendering JSON). `text` is the
# synthetic prompt, `max_tokens` the requested output length, `stream` whether aiperf streams; the extra
# inputs (ignore_eos, ...) are merged into the rendered object.
TRITON_TEMPLATE = ('{"text_input": {{ text|tojson }}{% if max_tokens %}, "max_tokens": {{ max_tokens|tojson }}'
                   '{% endif %}, "stream": {{ stream|tojson }}}')

# Our name -> aiperf's metric tag in profile_export_aiperf.json (each an object with unit, avg and, for
# per-request metrics, min/max/std/p1..p99).
METRICS = {
    "ttft_ms": "time_to_first_token",
    "itl_ms": "inter_token_latency",
    "request_latency_ms": "request_latency",
    "output_token_throughput": "output_token_throughput",  # tokens/s over the run
    "output_token_throughput_per_user": "output_token_throughput_per_user",
    "request_throughput": "request_throughput",  # requests/s
    "input_sequence_length": "input_sequence_length",
    "output_sequence_length": "output_sequence_length",
}
# Environment variables that make aiperf 0.13.0 look a tokenizer *folder* up as a hub repo id in the HF cache
# (HFValidationError "Repo id must be in the form ..."): dropped when the tokenizer is a folder, which
# transformers reads from disk without the hub either way.
HUB_OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


@dataclass
class AiperfRun:
    """One aiperf profile run against one door of a running tritium."""

    door: Door
    url: str  # "openai": the endpoint's base URL (…:9000 or …:9000/v1); "triton": tritonserver's HTTP URL
    tokenizer: str | Path  # the model folder (tokenizer.json, tokenizer_config.json)
    artifact_dir: str | Path
    model: str = "tritium"  # the OpenAI model id, or the Triton model's name
    api_key: str | None = None
    openai_endpoint: Literal["chat", "completions"] = "chat"
    input_tokens: int = 128
    output_tokens: int = 128
    num_requests: int = 64
    concurrency: int = 8
    warmup_requests: int = 0
    streaming: bool = True
    seed: int = 0
    apply_chat_template: bool = False  # "triton": wrap text_input in the model's chat template (tritium's input)
    gpu_telemetry: bool = False  # aiperf's DCGM/pynvml GPU telemetry (off: --no-gpu-telemetry)
    extra_args: list[str] = field(default_factory=list)  # appended to aiperf's command line as they are

    def base_url(self) -> str:
        url = self.url if "://" in self.url else f"http://{self.url}"
        url = url.rstrip("/")
        if self.door == "openai" and url.endswith("/v1"):  # aiperf appends /v1/chat/completions itself
            url = url[: -len("/v1")]
        return url

    def endpoint_path(self) -> str:
        if self.door == "openai":
            return "/v1/chat/completions" if self.openai_endpoint == "chat" else "/v1/completions"
        return f"/v2/models/{self.model}/" + ("generate_stream" if self.streaming else "generate")


@dataclass
class AiperfResult:
    door: str
    returncode: int
    command: list[str]  # with the key header redacted
    artifact_dir: Path
    export: dict[str, Any] | None  # profile_export_aiperf.json as aiperf wrote it (None: not written)
    figures: dict[str, dict[str, float]]  # METRICS names -> {"avg": ..., "p50": ..., ...} (unit: in the name)
    request_count: int  # successful requests
    error_count: int
    errors: list[str]  # "count x code type: message" per distinct error
    duration_s: float | None
    log: str = ""  # aiperf's output when it was captured

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.export is not None and self.error_count == 0

    def summary(self) -> dict[str, Any]:
        """The figures a report needs, JSON-ready."""
        return {"door": self.door, "returncode": self.returncode, "request_count": self.request_count,
                "error_count": self.error_count, "errors": self.errors, "duration_s": self.duration_s,
                "figures": self.figures, "artifact_dir": str(self.artifact_dir)}


def aiperf_executable() -> list[str]:
    """aiperf as a module of this interpreter (the `bench` / `test` extras install it)."""
    return [sys.executable, "-m", "aiperf"]


def check_installed() -> None:
    """Raise RuntimeError when this interpreter has no aiperf."""
    import importlib.util

    if importlib.util.find_spec("aiperf") is None:
        raise RuntimeError(f"aiperf is not installed for {sys.executable}: pip install 'aiperf=={AIPERF_VERSION}' "
                           "(or the bench extra; aiperf needs Python 3.11-3.13)")


def aiperf_command(run: AiperfRun, redact: bool = False) -> list[str]:
    """`aiperf profile ...` for `run` (argv; `redact` replaces the key header by <redacted>, for printing)."""
    if run.door not in DOORS:
        raise ValueError(f"door must be one of {', '.join(DOORS)}, got {run.door!r}")
    cmd = [*aiperf_executable(), "profile", "--model", run.model, "--url", run.base_url()]
    extra: dict[str, Any] = {"ignore_eos": True}  # every request generates exactly output_tokens tokens
    if run.door == "openai":
        cmd += ["--endpoint-type", run.openai_endpoint]
    else:
        cmd += ["--endpoint-type", "template", "--custom-endpoint", run.endpoint_path()]
        # exclude_input_in_output: a non-streamed reply is the generated text alone (streamed ones always are)
        extra = {"payload_template": TRITON_TEMPLATE, "response_field": "text_output", **extra,
                 "exclude_input_in_output": True}
        if run.apply_chat_template:
            extra["apply_chat_template"] = True
    if run.streaming:
        cmd.append("--streaming")
    # JSON form: aiperf splits the key:value form at commas, which the template holds.
    cmd += ["--extra-inputs", json.dumps(extra)]
    if run.api_key:
        cmd += _key_args(run, redact)
    cmd += ["--tokenizer", str(run.tokenizer),
            "--isl", str(run.input_tokens), "--isl-stddev", "0",
            "--osl", str(run.output_tokens), "--osl-stddev", "0",
            "--request-count", str(run.num_requests), "--concurrency", str(run.concurrency),
            "--random-seed", str(run.seed),
            "--artifact-dir", str(run.artifact_dir),
            "--ui-type", "none"]
    if run.warmup_requests:
        cmd += ["--warmup-request-count", str(run.warmup_requests)]
    given = {a.split("=", 1)[0] for a in run.extra_args}
    # tritonserver's metrics are on their own port (not base URL + /metrics): off unless extra_args name them
    if "--server-metrics" not in given:
        cmd.append("--no-server-metrics")
    if not run.gpu_telemetry and "--gpu-telemetry" not in given:
        cmd.append("--no-gpu-telemetry")
    return cmd + list(run.extra_args)


def _key_args(run: AiperfRun, redact: bool) -> list[str]:
    """The key as aiperf takes it and redacts it from its console and its export's `cli_command`: --api-key
    (Authorization: Bearer) for the OpenAI endpoint, --header x-api-key:KEY for tritonserver. (aiperf redacts
    the JSON form of --header in neither, so a key it would split or coerce in the key:value form is refused.)"""
    key = "<redacted>" if redact else str(run.api_key)
    if run.door == "openai":
        return ["--api-key", key]
    value = str(run.api_key)
    if "," in value or value != value.strip() or _coerced(value):
        raise ValueError("aiperf's --header splits at commas and reads numbers, true/false and null as such: "
                         "use a key without those for the triton door")
    return ["--header", f"x-api-key:{key}"]


def _coerced(value: str) -> bool:
    """Whether aiperf's key:value parsing turns `value` into something other than that string."""
    if value.lower() in ("true", "false", "none", "null"):
        return True
    try:
        float(value)
    except ValueError:
        return False
    return True


def aiperf_env(run: AiperfRun, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment aiperf runs in: no hub telemetry; with a tokenizer folder, no HF offline switch (see
    HUB_OFFLINE_VARS: aiperf 0.13.0 would look the folder up in the hub cache)."""
    env = dict(os.environ if base is None else base)
    env["HF_HUB_DISABLE_TELEMETRY"] = "1"
    env.pop("TRITON_INTERPRET", None)
    if Path(run.tokenizer).expanduser().is_dir():
        for name in HUB_OFFLINE_VARS:
            env.pop(name, None)
    return env


def parse_export(path: str | Path) -> dict[str, Any]:
    """The figures of an aiperf JSON export: `figures` (METRICS names -> stats), `request_count` (successful),
    `error_count`, `errors`, `duration_s`."""
    data = json.loads(Path(path).read_text())
    figures: dict[str, dict[str, float]] = {}
    for name, tag in METRICS.items():
        metric = data.get(tag)
        if isinstance(metric, dict):
            figures[name] = {k: float(v) for k, v in metric.items() if k != "unit" and isinstance(v, (int, float))}
    errors = []
    for item in data.get("error_summary") or []:
        details = item.get("error_details") or {}
        text = f"{details.get('code', '')} {details.get('type', '')}: {details.get('message', '')}".strip()
        errors.append(f"{item.get('count', '?')} x {text}")
    return {"figures": figures, "request_count": int(_avg(data, "request_count") or 0),
            "error_count": int(_avg(data, "error_request_count") or 0), "errors": errors,
            "duration_s": _avg(data, "benchmark_duration"), "export": data}


def record_errors(path: Path) -> tuple[int, list[str]]:
    """(failed requests, "count x code type: message" per distinct error) from aiperf's per-request records."""
    if not path.is_file():
        return 0, []
    counts: dict[str, int] = {}
    for line in path.read_text().splitlines():
        try:
            error = json.loads(line).get("error")
        except json.JSONDecodeError:
            continue
        if error:
            text = f"{error.get('code', '')} {error.get('type', '')}: {error.get('message', '')}".strip()
            counts[text] = counts.get(text, 0) + 1
    return sum(counts.values()), [f"{n} x {text}" for text, n in counts.items()]


def _avg(data: dict[str, Any], tag: str) -> float | None:
    metric = data.get(tag)
    return float(metric["avg"]) if isinstance(metric, dict) and metric.get("avg") is not None else None


def run_aiperf(run: AiperfRun, timeout: float | None = None, capture: bool = False,
               env: dict[str, str] | None = None) -> AiperfResult:
    """Run aiperf for `run` and read its JSON export. `capture`: keep aiperf's output (in the result and in
    <artifact_dir>/aiperf_output.log) instead of letting it print; `env`: variables added to this process's
    environment before aiperf_env adjusts it. A run whose requests all failed has no export (aiperf exits 1):
    its figures are empty and its errors come from the per-request records. Raises RuntimeError without
    aiperf, ValueError for a key aiperf cannot take (see _key_args)."""
    check_installed()
    cmd = aiperf_command(run)
    out = Path(run.artifact_dir)
    out.mkdir(parents=True, exist_ok=True)
    export_path = out / EXPORT_NAME
    export_path.unlink(missing_ok=True)  # never read a previous run's figures
    full_env = aiperf_env(run, {**os.environ, **(env or {})})
    try:
        proc = subprocess.run(cmd, env=full_env, timeout=timeout, text=True,
                              stdout=subprocess.PIPE if capture else None,
                              stderr=subprocess.STDOUT if capture else None)
        returncode, log = proc.returncode, proc.stdout or ""
    except subprocess.TimeoutExpired as exc:
        returncode = 124
        raw = exc.stdout or b""
        log = (raw.decode(errors="replace") if isinstance(raw, bytes) else raw) + f"\naiperf ran past {timeout} s"
    if capture:
        (out / "aiperf_output.log").write_text(log)
    parsed: dict[str, Any] = {"figures": {}, "request_count": 0, "error_count": 0, "errors": [],
                              "duration_s": None, "export": None}
    if export_path.is_file():
        parsed = parse_export(export_path)
    else:  # e.g. every request failed: the per-request records still say why
        if returncode == 0:
            returncode = 1  # aiperf said it succeeded but wrote no export
        parsed["error_count"], parsed["errors"] = record_errors(out / "profile_export.jsonl")
    if not parsed["errors"] and returncode != 0:
        parsed["errors"] = [line.strip() for line in log.splitlines() if "ERROR" in line][-5:]
    return AiperfResult(door=run.door, returncode=returncode, command=aiperf_command(run, redact=True),
                        artifact_dir=out, export=parsed["export"], figures=parsed["figures"],
                        request_count=parsed["request_count"], error_count=parsed["error_count"],
                        errors=parsed["errors"], duration_s=parsed["duration_s"], log=log)


def format_result(result: AiperfResult) -> str:
    f = result.figures

    def stat(name: str, key: str) -> str:
        value = f.get(name, {}).get(key)
        return "-" if value is None else f"{value:,.1f}"

    lines = [f"{result.door}: {result.request_count} requests ok, {result.error_count} failed"
             + (f" in {result.duration_s:.1f} s" if result.duration_s else "")
             + ("" if result.returncode == 0 else f" (aiperf exit {result.returncode})"),
             f"  TTFT ms avg/p50/p99      {stat('ttft_ms', 'avg')} / {stat('ttft_ms', 'p50')} / "
             f"{stat('ttft_ms', 'p99')}",
             f"  ITL ms avg/p50/p99       {stat('itl_ms', 'avg')} / {stat('itl_ms', 'p50')} / {stat('itl_ms', 'p99')}",
             f"  latency ms avg/p50/p99   {stat('request_latency_ms', 'avg')} / "
             f"{stat('request_latency_ms', 'p50')} / {stat('request_latency_ms', 'p99')}",
             f"  output tok/s             {stat('output_token_throughput', 'avg')}",
             f"  output tokens/request    {stat('output_sequence_length', 'avg')}",
             f"  artifacts                {result.artifact_dir}"]
    lines += [f"  error: {e}" for e in result.errors]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tritium.client.cli import options

    parser.add_argument("--door", choices=[*DOORS, "both"], default="openai",
                        help="openai: `tritium openai`'s /v1/chat/completions (or --openai-endpoint completions); "
                        "triton: tritonserver's HTTP /v2/models/MODEL/generate_stream; both: one run each")
    parser.add_argument("--openai-url", default="http://127.0.0.1:9000", help="the OpenAI endpoint (…/v1 or not)")
    parser.add_argument("--triton-url", default="http://127.0.0.1:8000", help="tritonserver's HTTP URL")
    parser.add_argument("--openai-endpoint", choices=["chat", "completions"], default="chat")
    options.model(parser, "OpenAI model id / Triton model name", default="tritium")
    options.tokenizer(parser, "model folder whose tokenizer counts tokens (default: the default model's folder)")
    options.api_key(parser, "sent as Authorization: Bearer (openai) / x-api-key (triton) (default: $TRITIUM_API_KEY)")
    parser.add_argument("--input-tokens", type=int, default=128, help="synthetic prompt length (tokens)")
    parser.add_argument("--output-tokens", type=int, default=128, help="tokens generated per request (ignore_eos)")
    options.num_requests(parser, 64)
    options.concurrency(parser, 8, "requests in flight")
    parser.add_argument("--warmup-requests", type=int, default=0)
    parser.add_argument("--no-streaming", action="store_true",
                        help="non-streaming requests (/generate for triton): no TTFT / ITL")
    parser.add_argument("--apply-chat-template", action="store_true",
                        help="triton: send apply_chat_template (the prompt becomes the chat template's user turn)")
    parser.add_argument("--gpu-telemetry", action="store_true", help="let aiperf collect GPU telemetry (DCGM)")
    options.seed(parser, 0, "aiperf's random seed (synthetic prompts)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds one aiperf run may take")
    options.out_dir(parser, default=DEFAULT_OUT, help="artifacts go to OUT_DIR/<door>")
    parser.add_argument("aiperf_args", nargs="*", default=[],
                        help="after --: more `aiperf profile` arguments, passed as they are")


def default_tokenizer() -> Path:
    from tritium.backend.models.registry import ensure_default_model

    return ensure_default_model(progress=False)


def run(args: argparse.Namespace) -> int:
    """`tritium bench aiperf`: one run per door; prints the figures, writes OUT_DIR/aiperf.json; exit 0 when
    every request of every run succeeded."""
    tokenizer = Path(args.tokenizer).expanduser() if args.tokenizer else default_tokenizer()
    extra = [a for a in args.aiperf_args if a != "--"]
    doors = list(DOORS) if args.door == "both" else [args.door]
    results = []
    for door in doors:
        spec = AiperfRun(door=door, url=args.openai_url if door == "openai" else args.triton_url,
                         tokenizer=tokenizer, artifact_dir=Path(args.out_dir) / door, model=args.model,
                         api_key=args.api_key or None, openai_endpoint=args.openai_endpoint,
                         input_tokens=args.input_tokens, output_tokens=args.output_tokens,
                         num_requests=args.num_requests, concurrency=args.concurrency,
                         warmup_requests=args.warmup_requests, streaming=not args.no_streaming, seed=args.seed,
                         apply_chat_template=args.apply_chat_template, gpu_telemetry=args.gpu_telemetry,
                         extra_args=extra)
        try:
            print("$ " + shlex.join(aiperf_command(spec, redact=True)), flush=True)
            results.append(run_aiperf(spec, timeout=args.timeout))
        except (RuntimeError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    print()
    for result in results:
        print(format_result(result))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "aiperf.json").write_text(json.dumps({"aiperf": AIPERF_VERSION, "tokenizer": str(tokenizer),
                                                 "runs": [r.summary() for r in results]}, indent=2))
    expected = args.num_requests
    return 0 if all(r.ok and r.request_count == expected for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tritium bench aiperf", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

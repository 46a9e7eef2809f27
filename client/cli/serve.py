"""`tritium serve`: the model repository on a real tritonserver, until Ctrl-C; models whose engine failed are
unloaded so that they report not ready."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tritium.client.cli import options

if TYPE_CHECKING:
    from tritium.client.triton.launcher import ServerOptions, TritonServer
    from tritium.client.triton.served_model import ServedModel

ADMIN_KEY_ENV = options.ADMIN_KEY_ENV
# The generation engines: what `--lora` / `--enable-lora` (and the ensemble) and `--tensor-parallel-size` apply to;
# tritium_embed stays one rank without adapters.
LORA_MODELS = ("tritium", "tritium_ids")
HEALTH_POLL_S = 1.0  # how often `serve` reads tritium_engine_healthy from the metrics port
# The request `serve` prints for a newcomer to copy: a question the default (instruct) model answers in a
# sentence, through its chat template (a bare question makes it end at once). tests/server/test_server.py sends it.
EXAMPLE_REQUEST = {"text_input": "What is the capital of France?", "apply_chat_template": True, "max_tokens": 32,
                   "temperature": 0}
# ... and for a served model without a chat template (a base model), text to continue.
PLAIN_EXAMPLE_REQUEST = {"text_input": "The capital of France is", "max_tokens": 32, "temperature": 0}


def default_repository() -> Path:
    """The checkout's model_repository/ (an editable install), else ./model_repository."""
    from tritium.client.triton.repository import PACKAGE_REPOSITORY

    return PACKAGE_REPOSITORY if PACKAGE_REPOSITORY.is_dir() else Path("model_repository")


def add_parser(subparsers: Any) -> None:
    """Register `serve` and its options on the top-level subparsers."""
    p = subparsers.add_parser("serve", help="serve the model repository with a real tritonserver")
    options.model(p, help="serve this model: a Hugging Face folder, or the name of a folder in $TRITIUM_CACHE/models "
                  "(`tritium models` lists them); checked before tritonserver starts, then set as model.json's "
                  "model of every tritium model in a copy of the repository (default: what the repository's "
                  "model.json files say; the packaged ones: the embedded default model)")
    options.served_model_name(p, help="the name the server reports for its model, which `tritium openai` serves "
                              "as the model id (default with --model: the folder's name, or the name in "
                              "$TRITIUM_CACHE/models as given; without either: none, and the id is the Triton "
                              "model's name)")
    p.add_argument("--model-repository", default=str(default_repository()))
    options.host(p)
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    options.api_key(p, help="require this x-api-key for inference, metadata, model config and statistics "
                    f"(default: ${options.API_KEY_ENV})")
    p.add_argument("--admin-key", default=os.environ.get(ADMIN_KEY_ENV),
                   help=f"require this x-admin-key for model load/unload, logging, trace and shared memory; "
                   "also the key of the tritium model's runtime LoRA load/unload (give `tritium openai` the same "
                   f"--admin-key) (default: ${ADMIN_KEY_ENV}; with --api-key but no admin key those stay closed)")
    p.add_argument("--model-control", choices=["none", "explicit"], default="none",
                   help="none: load every model at start-up; explicit: only --load-model ones (either way "
                   "a model whose engine fails is unloaded)")
    p.add_argument("--load-model", action="append", help="with --model-control explicit: load this model")
    p.add_argument("--embeddings", action="store_true",
                   help="also load the tritium_embed model (POST /v1/embeddings through `tritium openai`; it is not "
                   "loaded by default: a third engine's memory)")
    p.add_argument("--log-verbose", type=int, default=0)
    options.quantization(p, help="serve the engine models with int8 weights, or int4 (CPU only) (sets "
                         "model.json's quantization in a copy of the repository)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="the engine models' weight and activation dtype (model.json's dtype; default: float32 on a "
                        "CPU, bfloat16 on CUDA; bfloat16 is faster on CPUs with bf16 instructions)")
    p.add_argument("--num-threads", type=int, default=None,
                   help="the engines' intra-op threads on a CPU (model.json's num_threads; default: sized to the host)")
    options.tensor_parallel_size(p, help="shard each engine model over N ranks, one process each (GPUs cuda:0 to "
                                 "cuda:N-1 of CUDA_VISIBLE_DEVICES on CUDA; gloo on a CPU): sets model.json's "
                                 "tensor_parallel_size and, with N > 1, instance_group [{ count: 1, kind: "
                                 "KIND_MODEL }] in a copy of the repository (default: what model.json says)")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                   help="serve the PEFT LoRA adapter in folder PATH as NAME on the tritium and tritium_ids models "
                   "(repeat; sets model.json's enable_lora and lora_modules in a copy of the repository)")
    p.add_argument("--enable-lora", action="store_true",
                   help="turn LoRA on for the tritium and tritium_ids models without adapters at start (load them "
                   "at run time with --admin-key)")
    options.unsafe_no_auth(p)
    p.set_defaults(func=run)


def lora_settings(specs: list[str], enable: bool) -> dict[str, Any]:
    """model.json settings for `--lora NAME=PATH` options (folders made absolute) and `--enable-lora`: {} when
    neither is given. Raises ValueError naming an option that is not NAME=PATH, a name given twice or a
    folder that does not exist."""
    modules: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora {spec!r}: expected NAME=PATH")
        if name in modules:
            raise ValueError(f"--lora {name!r} is given twice")
        folder = Path(path).expanduser().resolve()
        if not folder.is_dir():
            raise ValueError(f"--lora {name}={path}: no such folder")
        modules[name] = str(folder)
    if not modules and not enable:
        return {}
    return {"enable_lora": True, "lora_modules": modules}


def auth_summary(options: ServerOptions) -> str:
    """One line saying which key guards which APIs."""
    inference = "x-api-key" if options.api_key else "open"
    admin = ("x-admin-key" if options.admin_key else
             "closed (no --admin-key)" if options.api_key else "open")
    return (f"inference, metadata, model config, statistics: {inference}; model load/unload, logging, trace, "
            f"shared memory: {admin}; health: open")


def unload_failed_engines(server: TritonServer) -> None:
    """Unload every model whose engine failed, and the ensembles running it, so that their ready endpoints
    say not ready (what happens is printed to stderr; a refused unload is reported, not raised)."""
    from tritium.client.triton.launcher import dependent_ensembles

    for failed in server.failed_engines():
        ensembles = dependent_ensembles(server.options.model_repository, failed.model)
        also = f" (and the ensembles using it: {', '.join(ensembles)})" if ensembles else ""
        print(f"ERROR: model {failed.model} version {failed.version}: the engine failed; unloading it{also} so "
              f"that it reports not ready (see the server log: {server.log_path})", file=sys.stderr, flush=True)
        for name in [*ensembles, failed.model]:
            try:
                server.unload_model(name)
            except RuntimeError as exc:
                print(f"ERROR: model {name}: {exc}", file=sys.stderr, flush=True)
            else:
                print(f"model {name} is being unloaded; load it again (POST /v2/repository/models/{name}/load, "
                      "x-admin-key) or restart the server", file=sys.stderr, flush=True)


def engine_settings(repository: Path, overrides: dict[str, object],
                    generation: dict[str, object]) -> dict[str, dict[str, object]]:
    """The model.json settings to change per engine model of `repository` (those whose model.json has
    max_num_seqs; the codec models are left alone): `overrides` for each, `generation` (LoRA, tensor parallelism)
    for LORA_MODELS too."""
    engines = [m.parent.parent.name for m in repository.glob("*/1/model.json")
               if "max_num_seqs" in json.loads(m.read_text(encoding="utf-8"))]
    return {name: overrides | (generation if name in LORA_MODELS else {}) for name in engines}


def engine_instance_groups(repository: Path, tensor_parallel_size: int | None) -> dict[str, str]:
    """The engine models' instance_group for `--tensor-parallel-size`: one KIND_MODEL instance each with N > 1
    (a KIND_GPU instance holds one GPU, and is refused), else none changed."""
    from tritium.client.triton.repository import MODEL_INSTANCE_GROUP

    if tensor_parallel_size is None or tensor_parallel_size == 1:
        return {}
    return {name: MODEL_INSTANCE_GROUP for name in engine_settings(repository, {}, {}) if name in LORA_MODELS}


def check_tensor_parallel(args: argparse.Namespace, served: ServedModel | None, lora: dict[str, Any]) -> None:
    """Raises ValueError naming --tensor-parallel-size when N > 1 cannot serve: with LoRA, or a --model whose
    heads or sizes N does not divide (before tritonserver starts)."""
    size = args.tensor_parallel_size
    if size is None or size == 1:
        return
    if lora:
        raise ValueError(f"--tensor-parallel-size {size}: LoRA adapters (--lora, --enable-lora) with tensor "
                         "parallelism are not implemented")
    if served is not None and served.folder is not None:
        from tritium.backend.model_config import ModelConfig, ModelFolderError
        from tritium.backend.models.sharding import shard_config

        try:
            shard_config(ModelConfig.from_folder(Path(served.folder)), size)
        except ModelFolderError as exc:
            raise ValueError(f"--tensor-parallel-size {size}: --model {args.model}: {exc}") from None


def served_model(args: argparse.Namespace) -> ServedModel | None:
    """`--model` resolved and checked, named by `--served-model-name`; None without either option. Raises
    ValueError naming --model and why its folder cannot load (the loader's message)."""
    from tritium.backend.model_config import ModelFolderError
    from tritium.client.triton.served_model import ServedModel, resolve_served_model

    if args.model is None:
        return ServedModel(args.served_model_name) if args.served_model_name else None
    try:
        return resolve_served_model(args.model, args.served_model_name)
    except ModelFolderError as exc:
        raise ValueError(f"--model {args.model}: {exc}") from None


def model_settings(repository: Path, served: ServedModel) -> tuple[dict[str, dict[str, object]],
                                                                   dict[str, dict[str, str]]]:
    """(model.json settings, config.pbtxt parameters) per tritium model of `repository` (those with a
    `1/model.json`: the engines and the ensemble's tokenizer models) for `served`: its folder as `model`, and
    the parameters that name it."""
    names = sorted(m.parent.parent.name for m in repository.glob("*/1/model.json"))
    settings: dict[str, dict[str, object]] = {name: {"model": served.folder} for name in names
                                              if served.folder is not None}
    return settings, {name: served.parameters() for name in names}


def repository_changes(args: argparse.Namespace, repository: Path, lora: dict[str, Any],
                       served: ServedModel | None) -> tuple[dict[str, dict[str, object]], dict[str, dict[str, str]]]:
    """(model.json settings, config.pbtxt parameters) per model of `repository` that the options change;
    both empty when they change nothing (the repository is then served as it is)."""
    overrides = {key: value for key, value in (("quantization", args.quantization), ("dtype", args.dtype),
                                               ("num_threads", args.num_threads)) if value is not None}
    generation = lora | ({"tensor_parallel_size": args.tensor_parallel_size}
                         if args.tensor_parallel_size is not None else {})
    settings = engine_settings(repository, overrides, generation) if overrides or generation else {}
    if served is None:
        return settings, {}
    model, parameters = model_settings(repository, served)
    for name, values in model.items():
        settings[name] = settings.get(name, {}) | values
    return settings, parameters


def example_request(served: ServedModel | None) -> dict[str, object]:
    """The request `serve` prints: a question through the chat template, or text to continue when the served
    model has none."""
    if served is None or served.folder is None:
        return EXAMPLE_REQUEST
    from tritium.backend.tokenizer import Tokenizer

    return EXAMPLE_REQUEST if Tokenizer(served.folder).chat_template else PLAIN_EXAMPLE_REQUEST


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT / SIGTERM; returns 0 then, 1 when tritonserver fails to start or exits, 2 when the
    bind policy refuses the address or an option is wrong (a --model that cannot load: before tritonserver
    starts)."""
    from tritium.client.cli.bind_policy import open_bind_refusal
    from tritium.client.triton.launcher import ServerOptions, TritonServer

    if (refusal := open_bind_refusal(args.host, bool(args.api_key), args.unsafe_no_auth)) is not None:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    try:
        lora = lora_settings(args.lora, args.enable_lora)
        served = served_model(args)  # before tritonserver: a folder that cannot load fails here, with its reason
        check_tensor_parallel(args, served, lora)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.admin_key:  # the tritium models read their LoRA admin key from tritonserver's environment
        os.environ[ADMIN_KEY_ENV] = args.admin_key
    repository = Path(args.model_repository).resolve()
    per_model, parameters = repository_changes(args, repository, lora, served)
    groups = engine_instance_groups(repository, args.tensor_parallel_size)
    copied = bool(per_model or parameters or groups)
    if copied:  # a copy of the repository with the models' settings changed; the original stays
        import tempfile

        from tritium.client.triton.repository import copy_with_settings

        copy = Path(tempfile.mkdtemp(prefix="tritium-repository-")) / "repository"
        repository = copy_with_settings(copy, per_model, source=repository, parameters=parameters,
                                        instance_groups=groups)
        for name in sorted(per_model):
            if per_model[name]:
                print(f"serving a copy of the repository with {per_model[name]} for {name}", flush=True)
        for name in sorted(groups):
            print(f"serving {name} with {groups[name]} (its engine places its ranks)", flush=True)
        if served is not None and served.name is not None:
            print(f"serving the model as {served.name!r} (the OpenAI endpoint's model id)", flush=True)
    server_options = ServerOptions(
        model_repository=repository, host=args.host, http_port=args.http_port,
        grpc_port=args.grpc_port, metrics_port=args.metrics_port, api_key=args.api_key or None,
        admin_key=args.admin_key or None, model_control=args.model_control,
        load_models=[*(args.load_model or []), *(["tritium_embed"] if args.embeddings else [])],
        log_verbose=args.log_verbose,
    )
    try:
        return serve_until_stopped(TritonServer(server_options), example_request(served))
    finally:
        if copied:
            import shutil

            shutil.rmtree(repository.parent, ignore_errors=True)


def serve_until_stopped(server: TritonServer, example: dict[str, object]) -> int:
    """Start `server`, print how to reach it, and watch it until SIGINT / SIGTERM; returns 0 then, 1 when
    tritonserver fails to start or exits."""
    import signal
    import threading
    import time

    server_options = server.options
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"starting tritonserver on {server_options.model_repository} ...", flush=True)
    try:
        server.start()
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    key_header = ' -H "x-api-key: $TRITIUM_API_KEY"' if server_options.api_key else ""
    print(
        f"tritium is serving\n  HTTP:    {server.http_url}\n  gRPC:    {server.grpc_url}\n"
        f"  metrics: {server.metrics_url}\n  auth:    {auth_summary(server_options)}\n\n"
        f"try:\n  curl -s{key_header} {server.http_url}/v2/models/tritium/generate \\\n"
        f"    -d '{json.dumps(example)}'\n"
        "Ctrl-C stops the server.",
        flush=True,
    )
    next_health_check = 0.0
    while not stop.is_set():
        if server.process is not None and server.process.poll() is not None:
            print(f"tritonserver exited with {server.process.returncode}:\n{server.log_tail()}", file=sys.stderr)
            server.stop()
            return 1
        if time.monotonic() >= next_health_check:
            next_health_check = time.monotonic() + HEALTH_POLL_S
            unload_failed_engines(server)
        stop.wait(0.25)
    print("stopping ...", flush=True)
    server.stop()
    return 0

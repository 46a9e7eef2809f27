"""`tritium generate` and `tritium chat`: stream text from a running server (or, `generate --local`, from the
engine in this process)."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tritium.client.cli import options


def add_parser(subparsers: Any) -> None:
    """Register `generate` and `chat` and their options on the top-level subparsers."""
    p = subparsers.add_parser("generate", help="stream a completion from a running server (or in-process: --local)")
    p.add_argument("prompt")
    _client_options(p, model_help="a Hugging Face folder, or a name in $TRITIUM_CACHE/models (as `tritium serve "
                    "--model` takes): with --local, the model to run (default: the embedded default model); from a "
                    "server, the model whose chat template --chat uses (default: the one the server reports "
                    "serving when its folder is on this host, else the default model)")
    p.add_argument("--local", action="store_true", help="run the engine in this process instead")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    options.quantization(p, help="with --local: int8 weight-only, or int4 (CPU only)")
    p.set_defaults(func=run_generate)

    p = subparsers.add_parser("chat", help="chat with a running server, one user turn per line")
    _client_options(p, model_help="a Hugging Face folder, or a name in $TRITIUM_CACHE/models: the model whose chat "
                    "template renders the conversation (default: the one the server reports serving when its folder "
                    "is on this host, else the default model)")
    p.add_argument("--system", default=None, help="system message")
    p.set_defaults(func=run_chat)


def _client_options(p: argparse.ArgumentParser, model_help: str) -> None:
    options.url(p, help="server: host:port for gRPC (default 127.0.0.1:8001) or http://host:port for HTTP")
    options.api_key(p)
    options.model(p, help=model_help)
    options.sampling(p)


def sampling_values(args: argparse.Namespace) -> dict[str, Any]:
    """The request's sampling parameters from options.sampling's options (`seed` only when given)."""
    values = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
              "top_k": args.top_k, "stop": args.stop or []}
    if args.seed is not None:
        values["seed"] = args.seed
    return values


def _stream_remote(args: argparse.Namespace, prompt: str) -> str:
    """Stream `prompt`'s completion from --url to stdout; returns the whole text. Raises RuntimeError with
    the server's error."""
    from tritium.client.triton.remote import stream_text

    text = ""
    for delta in stream_text(args.url, prompt, sampling_values(args), api_key=args.api_key or None):
        sys.stdout.write(delta)
        sys.stdout.flush()
        text += delta
    sys.stdout.write("\n")
    return text


@contextlib.contextmanager
def _naming_model(model: str | None) -> Iterator[None]:
    """A model folder that cannot load raises ValueError naming `--model` (when it was given) and the reason."""
    from tritium.backend.model_config import ModelFolderError

    try:
        yield
    except ModelFolderError as exc:
        if model is None:
            raise
        raise ValueError(f"--model {model}: {exc}") from None


def chat_template_folder(args: argparse.Namespace) -> Path:
    """The folder whose chat template renders a served conversation: --model's; else the one the server at
    --url reports serving (`tritium serve --model`) when it is on this host; else the default model's (with a
    warning on stderr when the server serves another model). Raises ValueError naming a --model that does not
    exist."""
    from tritium.backend.models.registry import resolve_model
    from tritium.client.triton.served_model import read_served_model

    if args.model is not None:
        with _naming_model(args.model):
            return resolve_model(args.model)
    try:
        served = read_served_model(args.url, args.api_key or None)
    except RuntimeError:  # the request itself will say what is wrong with the server
        return resolve_model(None)
    if (folder := served.local_folder()) is not None:
        return folder
    if served.folder is not None:
        print(f"warning: the server serves {served.name or 'its model'} from {served.folder}, which is not on this "
              "host: the default model's chat template is used (give --model)", file=sys.stderr)
    return resolve_model(None)


def run_generate(args: argparse.Namespace) -> int:
    """Stream one completion to stdout; returns 0, or 1 when the server or the engine reported an error."""
    if not args.local:
        if args.chat:
            from tritium.backend.tokenizer import Tokenizer

            messages = [{"role": "user", "content": args.prompt}]
            prompt = Tokenizer(chat_template_folder(args)).apply_chat_template(messages)
        else:
            prompt = args.prompt
        try:
            _stream_remote(args, prompt)
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        return 0
    from tritium.backend import EngineConfig, LLMEngine, SamplingParams

    params = SamplingParams(**sampling_values(args))
    with _naming_model(args.model):
        engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, attention_backend=args.attention_backend,
                                        quantization=args.quantization))
    if args.chat:
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
        engine.add_request("cli", None, params, prompt_token_ids=engine.tokenizer.encode(text, False))
    else:
        engine.add_request("cli", args.prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.delta_text)
            sys.stdout.flush()
            if out.finished:
                sys.stdout.write("\n")
                if out.error:
                    print(f"error: {out.error}", file=sys.stderr)
                    return 1
    return 0


def run_chat(args: argparse.Namespace) -> int:
    """A conversation with a running server: one user turn per input line (Ctrl-D ends). Returns 0 at the
    end of input, 1 when the server reported an error."""
    from tritium.backend.tokenizer import Tokenizer

    tokenizer = Tokenizer(chat_template_folder(args))
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.strip()})
        try:
            reply = _stream_remote(args, tokenizer.apply_chat_template(messages))
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        messages.append({"role": "assistant", "content": reply})

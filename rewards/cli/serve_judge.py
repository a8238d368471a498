"""``flowalign serve-judge --model DIR --port P``: serve a local transformers VLM as an OpenAI-compatible judge."""

from __future__ import annotations

import argparse
from pathlib import Path

from flowalign.cli.common import add_number
from flowalign.errors import UserError
from flowalign.limits import MAX_BATCH, MAX_PORT, MAX_SEQUENCE_LENGTH, MAX_TOP_LOGPROBS
from rewards.http_safety import add_safety_flags, limits_from


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("serve-judge", help="serve a local VLM judge over OpenAI-compatible HTTP (needs the 'serve' extra)")
    p.add_argument("--model", required=True, help="local transformers VLM folder (Qwen2.5-VL, Qwen3-VL, ...)")
    add_number(p, "--port", type=int, lo=0, hi=MAX_PORT, default=8000, help="port to listen on (0: a free one, printed at start)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    add_number(p, "--batch-size", type=int, lo=1, hi=MAX_BATCH, default=8, help="requests per forward pass")
    p.add_argument("--served-name", default=None, help="model name clients use (default: the folder's name)")
    add_number(p, "--max-top-logprobs", type=int, lo=0, hi=MAX_TOP_LOGPROBS, default=20, help="largest top_logprobs a request may ask for")
    add_number(p, "--max-prompt-tokens", type=int, lo=1, hi=MAX_SEQUENCE_LENGTH, default=8192,
                   help="most tokens of text one request may hold (more: 413, before the model sees it)")
    add_safety_flags(p)
    return p


def run(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port {args.port}: give a port in 0..65535")
    if not (Path(args.model) / "config.json").is_file():
        raise UserError(f"--model {args.model}: not a model folder (no config.json); give a local transformers VLM folder")
    if args.max_top_logprobs < 1:
        raise UserError(f"--max-top-logprobs {args.max_top_logprobs}: give an integer >= 1")
    limits = limits_from(args, "serve-judge")
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise UserError(f"serve-judge needs FastAPI and uvicorn ({e}); install them with pip install 'flowalign[serve]'") from e
    from rewards.judge_server import serve

    serve(args.model, host=args.host, port=args.port, device=args.device, dtype=args.dtype,
          batch_size=args.batch_size, model_name=args.served_name, max_top_logprobs=args.max_top_logprobs, limits=limits,
          max_prompt_tokens=args.max_prompt_tokens)

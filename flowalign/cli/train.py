"""``flowalign train CONFIG.yaml [key=value ...]``: fine-tune a generator with a reward."""

from __future__ import annotations

import argparse

from flowalign import strict_json


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("train", help="train from a YAML config with key=value overrides")
    p.add_argument("config", help="YAML run config, e.g. configs/tiny/flow_grpo_vvr.yaml")
    p.add_argument("overrides", nargs="*", help="dotted overrides read as YAML, e.g. trainer.lr=1e-4")
    return p


def run(args: argparse.Namespace) -> None:
    from flowalign.config import load_config
    from flowalign.train import train

    cfg = load_config(args.config, args.overrides)
    final = train(cfg)
    if final:
        print(strict_json.dumps({k: v for k, v in final.items() if not isinstance(v, dict)}, indent=2))

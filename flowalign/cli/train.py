"""``flowalign train CONFIG.yaml [key=value ...]``: fine-tune a generator with a reward.

SIGTERM (what schedulers send) finishes the step in flight, saves a checkpoint, releases the run's lock
and exits with code 143 (:mod:`flowalign.signals`); rerunning the command resumes."""

from __future__ import annotations

import argparse

from flowalign import strict_json


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("train", help="train from a YAML config with key=value overrides")
    p.add_argument("config", help="YAML run config, e.g. configs/tiny/flow_grpo_vvr.yaml")
    p.add_argument("overrides", nargs="*", help="dotted overrides read as YAML, e.g. trainer.lr=1e-4")
    p.add_argument("--overwrite", action="store_true",
                   help="train in a non-empty run.output_dir that holds no run (only the run's own files are "
                        "written there; other files are kept)")
    p.add_argument("--check", action="store_true",
                   help="check the whole config (every section, the trainer's too, rewards, data, model folder) "
                        "and stop before loading weights")
    return p


def run(args: argparse.Namespace) -> None:
    from flowalign.config import load_config
    from flowalign.parallel import process_group_released
    from flowalign.train import check_run, train

    cfg = load_config(args.config, args.overrides)
    if args.check:
        trainer_cls, tcfg = check_run(cfg)
        print(f"{args.config}: config OK (trainer {tcfg.name}, {len(cfg.rewards)} reward(s), model {cfg.model.path}, "
              f"output {cfg.run.output_dir}); nothing was loaded or written")
        return
    with process_group_released():  # the process's group, shared by every run in it, ends with the command
        final = train(cfg, overwrite=args.overwrite)
    if final:
        print(strict_json.dumps({k: v for k, v in final.items() if not isinstance(v, dict)}, indent=2))

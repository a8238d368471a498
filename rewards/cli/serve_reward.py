"""``flowalign serve-reward SPEC --port P``: serve any registered reward over HTTP for the ``remote`` reward
(each call under the SPEC's ``timeout_s``, or the server's default deadline)."""

from __future__ import annotations

import argparse

from flowalign.cli.common import add_number
from flowalign.errors import UserError
from flowalign.limits import MAX_PORT
from rewards.http_safety import add_safety_flags, limits_from


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("serve-reward", help="serve a reward over HTTP for {name: remote, url: ...} "
                                            "(needs the 'serve' extra)")
    p.add_argument("spec", metavar="SPEC",
                   help="the reward: a name, or the YAML mapping of a config's rewards: list, e.g. "
                        "\"{name: pickscore, path: /weights/pickscore, device: cuda}\"")
    add_number(p, "--port", type=int, lo=0, hi=MAX_PORT, default=8100, help="port to listen on (0: a free one, printed at start)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface; needs a key)")
    p.add_argument("--device", default="cpu", help="where received samples are put before scoring: cpu, cuda, cuda:1, ...")
    add_safety_flags(p)
    return p


def run(args: argparse.Namespace) -> None:
    from flowalign.cli.common import check_device
    from flowalign.config import reward_spec_from_text

    if not 0 <= args.port <= 65535:
        raise UserError(f"--port {args.port}: give a port in 0..65535")
    spec = reward_spec_from_text(args.spec, "serve-reward SPEC")
    if spec.name == "remote":
        raise UserError("serve-reward SPEC: serve the reward itself, not a remote one")
    if spec.invalid_value is not None:
        raise UserError("serve-reward SPEC: invalid_value is the client's choice; give it in the run config's "
                        "rewards entry (name: remote), not to the server")
    limits = limits_from(args, "serve-reward")
    check_device(args.device)
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise UserError(f"serve-reward needs FastAPI and uvicorn ({e}); install them with pip install 'flowalign[serve]'") from e
    import rewards
    from rewards.reward_server import serve

    from flowalign.video_file import Mp4RoundTrip

    reward = rewards.load(spec.name, **spec.options)
    if spec.video_mp4_fps is not None:  # the served reward scores the videos it receives through the mp4 file
        reward = Mp4RoundTrip(reward, spec.video_mp4_fps)
    # each call's deadline: the SPEC's timeout_s, else the server's default (a hanging reward cannot hold it)
    serve(reward, name=spec.name, spec=spec.model_dump(mode="json"), host=args.host, port=args.port,
          device=args.device, limits=limits, timeout_s=spec.timeout_s)

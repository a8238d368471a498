"""The wire format of ``flowalign serve-reward`` and the ``remote`` reward: samples as JSON-borne bytes.

A request is one JSON object::

    {"prompts": [...], "metadata": [{...}, ...],          # metadata optional, one dict per sample
     "tensor": "<base64 safetensors>"                      # one of: raw samples (exact), ...
     "images": ["<base64 PNG>", ...] | "videos": ["<base64 MP4>", ...]}

``tensor`` holds one tensor ``samples`` of shape ``(B, 3, H, W)`` or ``(B, F, 3, H, W)``: float32 (the
scores equal in-process ones), float16 / bfloat16, or uint8 (``value / 255``, the quantisation a PNG
applies). PNG and MP4 are decoded to uint8 too (MP4's H.264 is lossy on top). The reply is
``{"name", "components": {name: [float | null]}, "valid": [bool], "reasons": [str]}``: ``null`` where a
value is not finite, a reason for every invalid sample ("" for valid ones).

The server decodes nothing before its size is known: a tensor's shape is read from the safetensors
header, an image's from its header, a video's frames one at a time, each checked against the
request's :class:`rewards.http_safety.PixelBudget`.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import struct
from typing import Any

import torch

from rewards.http_safety import BadRequest, PixelBudget, open_image

#: how a client may send samples (``remote``'s ``encoding`` option)
ENCODINGS = ("float32", "uint8", "png", "mp4")
#: safetensors dtypes a request may hold, and their sizes in bytes
TENSOR_DTYPES = {"F32": 4, "F16": 2, "BF16": 2, "U8": 1}
#: largest safetensors header accepted (a real one for a single tensor is ~100 bytes)
MAX_HEADER_BYTES = 1 << 16


# ------------------------------------------------------------------------------------------ client side


def encode_samples(samples: torch.Tensor, encoding: str) -> dict[str, Any]:
    """The request fields carrying ``samples`` (floats in [0, 1]) in ``encoding``."""
    from safetensors.torch import save

    from flowalign.media import to_uint8

    x = samples.detach().cpu()
    if encoding in ("float32", "uint8"):
        tensor = x.float().contiguous() if encoding == "float32" else \
            x.float().nan_to_num(0.0).clamp(0, 1).mul(255).round().to(torch.uint8).contiguous()
        return {"tensor": base64.b64encode(save({"samples": tensor})).decode("ascii")}
    if encoding == "png":
        from PIL import Image

        out = []
        for image in x.nan_to_num(0.0):
            buf = io.BytesIO()
            Image.fromarray(to_uint8(image)).save(buf, format="PNG")
            out.append(base64.b64encode(buf.getvalue()).decode("ascii"))
        return {"images": out}
    import imageio.v3 as iio

    return {"videos": [base64.b64encode(iio.imwrite("<bytes>", to_uint8(v), extension=".mp4", fps=8,
                                                    macro_block_size=1)).decode("ascii")
                       for v in x.nan_to_num(0.0)]}


def bytes_per_sample(samples: torch.Tensor, encoding: str) -> int:
    """Request bytes one sample costs (an upper bound for PNG and MP4: their raw uint8 size), base64 included."""
    per = samples[0].numel() * (4 if encoding == "float32" else 1)
    return per * 4 // 3 + 64


# ------------------------------------------------------------------------------------------ server side


def _b64(value: Any, where: str) -> bytes:
    if not isinstance(value, str):
        raise BadRequest(f"{where} must be a base64 string", param=where)
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as e:
        raise BadRequest(f"{where} is not valid base64 ({e})", param=where) from e


def decode_request(body: Any, budget: PixelBudget) -> tuple[torch.Tensor, list[str], list[dict[str, Any]]]:
    """A request body → ``(samples float32 in [0, 1], prompts, metadata)``; :class:`BadRequest` otherwise."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object with prompts and one of tensor, images, videos")
    prompts = body.get("prompts")
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise BadRequest("prompts must be a non-empty list of strings, one per sample", param="prompts")
    metadata = body.get("metadata") or [{} for _ in prompts]
    if not isinstance(metadata, list) or len(metadata) != len(prompts) or not all(isinstance(m, dict) for m in metadata):
        raise BadRequest(f"metadata must be a list of {len(prompts)} objects, one per prompt", param="metadata")
    given = [k for k in ("tensor", "images", "videos") if k in body]
    if len(given) != 1:
        raise BadRequest("give exactly one of tensor (safetensors), images (PNG) or videos (MP4)")
    kind = given[0]
    if kind == "tensor":
        samples = decode_tensor(_b64(body["tensor"], "tensor"), budget)
    else:
        items = body[kind]
        if not isinstance(items, list) or not items:
            raise BadRequest(f"{kind} must be a non-empty list of base64 strings", param=kind)
        decode = _image if kind == "images" else _video
        pixels = [decode(_b64(item, f"{kind}[{i}]"), budget, f"{kind}[{i}]") for i, item in enumerate(items)]
        if len({p.shape for p in pixels}) != 1:
            raise BadRequest(f"the {kind} of one request must all have the same size", param=kind)
        samples = torch.stack(pixels).float() / 255.0
    if samples.shape[0] != len(prompts):
        raise BadRequest(f"{samples.shape[0]} samples for {len(prompts)} prompts; give one prompt per sample",
                         param="prompts")
    return samples, prompts, metadata


def decode_tensor(raw: bytes, budget: PixelBudget) -> torch.Tensor:
    """safetensors bytes holding ``samples`` → float32, its shape and dtype checked from the header first."""
    from safetensors.torch import load

    if len(raw) < 8:
        raise BadRequest("tensor is not safetensors data (too short)", param="tensor")
    size = struct.unpack("<Q", raw[:8])[0]
    if size > min(MAX_HEADER_BYTES, len(raw) - 8):
        raise BadRequest("tensor is not safetensors data (bad header length)", param="tensor")
    try:
        header = json.loads(raw[8 : 8 + size])
        entry = header["samples"]
        dtype, shape = entry["dtype"], [int(s) for s in entry["shape"]]
    except (ValueError, KeyError, TypeError) as e:
        raise BadRequest(f"tensor must be safetensors data holding one tensor named 'samples' ({e})",
                         param="tensor") from e
    if set(header) - {"samples", "__metadata__"}:
        raise BadRequest("tensor must hold only the tensor 'samples'", param="tensor")
    if dtype not in TENSOR_DTYPES:
        raise BadRequest(f"tensor dtype {dtype} is not one of {', '.join(TENSOR_DTYPES)}", param="tensor")
    if len(shape) not in (4, 5) or shape[-3] != 3 or min(shape) < 1:
        raise BadRequest(f"tensor shape {shape}: give (B, 3, H, W) images or (B, F, 3, H, W) videos", param="tensor")
    frames = shape[1] if len(shape) == 5 else 1
    for i in range(shape[0]):
        budget.take(shape[-1], shape[-2], frames, f"tensor sample {i}")
    try:
        tensor = load(raw)["samples"]
    except Exception as e:  # noqa: BLE001 - safetensors reports malformed data in its own error type
        raise BadRequest(f"tensor is not readable safetensors data ({e})", param="tensor") from e
    return tensor.float() / 255.0 if dtype == "U8" else tensor.float()


def _image(raw: bytes, budget: PixelBudget, where: str) -> torch.Tensor:
    import numpy as np

    return torch.from_numpy(np.asarray(open_image(raw, budget, where)).copy()).permute(2, 0, 1)


def _video(raw: bytes, budget: PixelBudget, where: str) -> torch.Tensor:
    """MP4 bytes → ``(F, 3, H, W)`` uint8. The frame size the stream declares is counted against ``budget``
    before any frame is read (a small file can declare frames of billions of pixels), and each further
    frame before it is kept."""
    import imageio.v3 as iio
    import numpy as np

    frames = []
    try:
        # ffmpeg's reader: opened, it has read the stream's header and no frame yet; closed, ffmpeg is stopped
        with iio.imopen(raw, "r", extension=".mp4") as video, video.legacy_get_reader() as reader:
            width, height = reader.get_meta_data()["size"]
            budget.take(width, height, 1, where)  # the first frame, before it is read
            for frame in reader:
                if frames:
                    budget.take(frame.shape[1], frame.shape[0], 1, where)
                frames.append(torch.from_numpy(np.ascontiguousarray(frame[..., :3])).permute(2, 0, 1))
    except BadRequest:
        raise
    except Exception as e:  # noqa: BLE001 - the video decoders raise many kinds for bad bytes
        raise BadRequest(f"{where} is not a readable MP4 video ({e})", param=where) from e
    if not frames:
        raise BadRequest(f"{where} holds no frames", param=where)
    return torch.stack(frames)

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
header (one check, whatever the shape declares), an image's from its header, a video's frames one at a
time, each checked against the request's :class:`rewards.http_safety.PixelBudget` (413 over it) and
held in the server's :class:`rewards.http_safety.DecodeBudget` (the decoded float32 samples, shared
by every request in progress) before it is allocated. Decoding makes one float32 tensor and fills it
in place: 12 bytes a pixel, plus one image's uint8 pixels at a time.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
import struct
import warnings
from typing import Any

import torch

from rewards.http_safety import PIL_RGB_BYTES, BadRequest, PixelBudget, Reservation, decode_rgb, peek_image

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


def decode_request(body: Any, budget: PixelBudget, reservation: Reservation | None = None
                   ) -> tuple[torch.Tensor, list[str], list[dict[str, Any]]]:
    """A request body → ``(samples float32 in [0, 1], prompts, metadata)``; :class:`BadRequest` otherwise.
    Every allocation of decoded samples is first held in ``reservation`` (None: unbounded), which the
    caller releases once it is done with the samples."""
    reservation = reservation or Reservation()
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
    if kind != "tensor":
        items = body[kind]
        if not isinstance(items, list) or not items:
            raise BadRequest(f"{kind} must be a non-empty list of base64 strings", param=kind)
    # the count is checked before anything is decoded: a mismatch costs nothing
    count = len(body[kind]) if kind != "tensor" else None
    if count is not None and count != len(prompts):
        raise BadRequest(f"{count} samples for {len(prompts)} prompts; give one prompt per sample", param="prompts")
    if kind == "tensor":
        samples = decode_tensor(_b64(body["tensor"], "tensor"), budget, reservation)
    elif kind == "images":
        samples = _images([_b64(item, f"images[{i}]") for i, item in enumerate(body["images"])], budget, reservation)
    else:
        clips = [_video(_b64(item, f"videos[{i}]"), budget, f"videos[{i}]", reservation)
                 for i, item in enumerate(body["videos"])]
        if len({c.shape for c in clips}) != 1:
            raise BadRequest("the videos of one request must all have the same size", param="videos")
        reservation.grow(sum(c.numel() for c in clips) * 4, "videos")
        samples = torch.empty((len(clips), *clips[0].shape), dtype=torch.float32)
        for i in range(len(clips)):
            samples[i].copy_(clips[i])
            clips[i] = None  # type: ignore[call-overload]  # its uint8 frames are freed as soon as copied
        samples.div_(255.0)
    if samples.shape[0] != len(prompts):
        raise BadRequest(f"{samples.shape[0]} samples for {len(prompts)} prompts; give one prompt per sample",
                         param="prompts")
    return samples, prompts, metadata


def _dims(shape: Any) -> list[int]:
    """A safetensors header's shape as positive integers (a float such as ``1e400``, a string or a bool is
    no dimension)."""
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise BadRequest(f"tensor shape {str(shape)[:100]} must be a list of integers", param="tensor")
    return shape


def decode_tensor(raw: bytes, budget: PixelBudget, reservation: Reservation | None = None) -> torch.Tensor:
    """safetensors bytes holding ``samples`` → float32, its shape, dtype and size checked from the header
    first, each in one step whatever the shape declares."""
    if len(raw) < 8:
        raise BadRequest("tensor is not safetensors data (too short)", param="tensor")
    size = struct.unpack("<Q", raw[:8])[0]
    if size > min(MAX_HEADER_BYTES, len(raw) - 8):
        raise BadRequest("tensor is not safetensors data (bad header length)", param="tensor")
    try:
        header = json.loads(raw[8 : 8 + size])
        entry = header["samples"]
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise BadRequest(f"tensor must be safetensors data holding one tensor named 'samples' ({e})",
                         param="tensor") from e
    if set(header) - {"samples", "__metadata__"}:
        raise BadRequest("tensor must hold only the tensor 'samples'", param="tensor")
    if dtype not in TENSOR_DTYPES:
        raise BadRequest(f"tensor dtype {str(dtype)[:20]} is not one of {', '.join(TENSOR_DTYPES)}", param="tensor")
    shape = _dims(shape)
    if len(shape) not in (4, 5) or shape[-3] != 3 or min(shape) < 1:
        raise BadRequest(f"tensor shape {shape}: give (B, 3, H, W) images or (B, F, 3, H, W) videos", param="tensor")
    frames = shape[1] if len(shape) == 5 else 1
    budget.take(shape[-1], shape[-2], frames, "tensor", count=shape[0])
    numel = math.prod(shape)
    nbytes = numel * TENSOR_DTYPES[dtype]
    if offsets != [0, nbytes] or len(raw) - 8 - size != nbytes:
        raise BadRequest(f"tensor data holds {len(raw) - 8 - size} bytes where its header's {dtype} shape {shape} "
                         f"needs {nbytes}", param="tensor")
    (reservation or Reservation()).grow(numel * 4, "tensor")
    # a view of the request's own bytes, then one float32 copy (read-only source: the copy is what is kept)
    torch_dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "U8": torch.uint8}[dtype]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "the given buffer is not writable": it is only read
        view = torch.frombuffer(raw, dtype=torch_dtype, count=numel, offset=8 + size).view(shape)
    samples = torch.empty(shape, dtype=torch.float32)
    samples.copy_(view)
    return samples.div_(255.0) if dtype == "U8" else samples


def _images(raws: list[bytes], budget: PixelBudget, reservation: Reservation) -> torch.Tensor:
    """PNG (or other image) bytes → ``(B, 3, H, W)`` float32: every header read and charged first, then one
    tensor allocated and filled image by image."""
    import numpy as np

    peeked = [peek_image(raw, budget, f"images[{i}]") for i, raw in enumerate(raws)]
    if len({im.size for im in peeked}) != 1:
        raise BadRequest("the images of one request must all have the same size", param="images")
    width, height = peeked[0].size
    # the float32 batch, and one image at a time as PIL decodes it and as a uint8 array
    reservation.grow(len(peeked) * 3 * height * width * 4 + height * width * (PIL_RGB_BYTES + 3), "images")
    samples = torch.empty((len(peeked), 3, height, width), dtype=torch.float32)
    for i in range(len(peeked)):
        pixels = np.asarray(decode_rgb(peeked[i], f"images[{i}]"))
        peeked[i] = None  # type: ignore[call-overload]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # PIL's array is read-only: it is only read
            samples[i].copy_(torch.from_numpy(pixels).permute(2, 0, 1))
        del pixels
    return samples.div_(255.0)


def _video(raw: bytes, budget: PixelBudget, where: str, reservation: Reservation | None = None) -> torch.Tensor:
    """MP4 bytes → ``(F, 3, H, W)`` uint8. The frame size the stream declares is counted against ``budget``
    before any frame is read (a small file can declare frames of billions of pixels), and each further
    frame before it is kept (and held in ``reservation``)."""
    import imageio.v3 as iio
    import numpy as np

    reservation = reservation or Reservation()
    frames = []
    try:
        # ffmpeg's reader: opened, it has read the stream's header and no frame yet; closed, ffmpeg is stopped
        with iio.imopen(raw, "r", extension=".mp4") as video, video.legacy_get_reader() as reader:
            width, height = reader.get_meta_data()["size"]
            budget.take(width, height, 1, where)  # the first frame, before it is read
            reservation.grow(width * height * 6, where)  # its uint8 frame, and its copy in the stack
            for frame in reader:
                if frames:
                    budget.take(frame.shape[1], frame.shape[0], 1, where)
                    reservation.grow(frame.shape[0] * frame.shape[1] * 6, where)
                frames.append(torch.from_numpy(np.ascontiguousarray(frame[..., :3])).permute(2, 0, 1))
    except BadRequest:
        raise
    except Exception as e:  # noqa: BLE001 - the video decoders raise many kinds for bad bytes
        raise BadRequest(f"{where} is not a readable MP4 video ({e})", param=where) from e
    if not frames:
        raise BadRequest(f"{where} holds no frames", param=where)
    return torch.stack(frames)

"""PP-OCRv4 text detection and recognition (PaddleOCR's models, as ONNX) on the CPU with onnxruntime.

The models are the ones the ``rapidocr_onnxruntime`` wheel carries (``ch_PP-OCRv4_det_infer.onnx``,
``ch_PP-OCRv4_rec_infer.onnx``, its character table in the recognition model's metadata), so nothing is
downloaded. The package's own pipeline is not imported: it imports OpenCV, whose wheel needs the system's
libGL, and a pip install alone must be enough. Pre- and post-processing follow PaddleOCR 2.x as Flow-GRPO
calls it (detection limited to 960 px on the longer side, DB post-processing with threshold 0.3, box
threshold 0.6, unclip ratio 1.5, no angle classifier, 48 px high recognition crops, greedy CTC), written
with numpy, scipy and Pillow: boxes are minimum-area rectangles of the probability map's connected regions,
grown by the unclip distance (the rectangle PaddleOCR's polygon offset amounts to for a rectangle).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
from PIL import Image

DET_MODEL, REC_MODEL = "ch_PP-OCRv4_det_infer.onnx", "ch_PP-OCRv4_rec_infer.onnx"
DET_LIMIT_SIDE, DET_THRESH, BOX_THRESH, UNCLIP_RATIO, MIN_SIZE = 960, 0.3, 0.6, 1.5, 3
REC_HEIGHT, REC_MIN_WIDTH = 48, 320
MAX_BOXES = 1000


def models_folder() -> Path | None:
    """The ``models`` folder inside the installed ``rapidocr_onnxruntime`` package (found without
    importing it), or None when the package is not installed."""
    spec = importlib.util.find_spec("rapidocr_onnxruntime")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "models"


def _session(path: Path, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    # a reward shares the machine with the trainer: as many threads as torch uses, not every core
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])


def _normalised(image: Image.Image) -> np.ndarray:
    """(1, 3, H, W) float32 in [-1, 1], BGR as PaddleOCR's models were trained on OpenCV's images."""
    pixels = np.asarray(image.convert("RGB"), dtype=np.float32)[:, :, ::-1] / 255.0
    return ((pixels - 0.5) / 0.5).transpose(2, 0, 1)[None].copy()


def _min_area_rect(points: np.ndarray) -> tuple[np.ndarray, float, float]:
    """The minimum-area rectangle around ``points`` (N, 2): its centre-aligned corners (4, 2), width, height."""
    from scipy.spatial import ConvexHull, QhullError

    try:
        hull = points[ConvexHull(points).vertices]
    except (QhullError, ValueError):  # collinear points: a degenerate rectangle
        hull = points
    best = None
    edges = np.diff(np.vstack([hull, hull[:1]]), axis=0)
    for angle in np.unique(np.arctan2(edges[:, 1], edges[:, 0]) % (np.pi / 2)):
        rotation = np.array([[np.cos(angle), np.sin(angle)], [-np.sin(angle), np.cos(angle)]])
        rotated = hull @ rotation.T
        low, high = rotated.min(0), rotated.max(0)
        area = float(np.prod(high - low))
        if best is None or area < best[0]:
            best = (area, rotation, low, high)
    _, rotation, low, high = best
    corners = np.array([[low[0], low[1]], [high[0], low[1]], [high[0], high[1]], [low[0], high[1]]]) @ rotation
    return corners, float(high[0] - low[0]), float(high[1] - low[1])


def _ordered(corners: np.ndarray) -> np.ndarray:
    """Corners as top-left, top-right, bottom-right, bottom-left (PaddleOCR's ``get_mini_boxes`` order)."""
    by_x = corners[np.argsort(corners[:, 0], kind="stable")]
    left, right = by_x[:2][np.argsort(by_x[:2, 1])], by_x[2:][np.argsort(by_x[2:, 1])]
    return np.array([left[0], right[0], right[1], left[1]], dtype=np.float32)


def _grown(corners: np.ndarray, width: float, height: float, distance: float) -> np.ndarray:
    """The rectangle ``corners`` grown by ``distance`` on every side."""
    centre = corners.mean(0)
    u = (corners[1] - corners[0]) / max(width, 1e-6)
    v = (corners[3] - corners[0]) / max(height, 1e-6)
    w, h = width / 2 + distance, height / 2 + distance
    return np.array([centre - w * u - h * v, centre + w * u - h * v, centre + w * u + h * v, centre - w * u + h * v])


def _mean_inside(prob: np.ndarray, corners: np.ndarray) -> float:
    """The mean of ``prob`` over the pixels inside the polygon ``corners`` (PaddleOCR's "fast" box score)."""
    from PIL import ImageDraw

    h, w = prob.shape
    x0, y0 = np.clip(np.floor(corners.min(0)).astype(int), 0, [w - 1, h - 1])
    x1, y1 = np.clip(np.ceil(corners.max(0)).astype(int), 0, [w - 1, h - 1])
    mask = Image.new("L", (int(x1 - x0 + 1), int(y1 - y0 + 1)))
    ImageDraw.Draw(mask).polygon([tuple(p) for p in (corners - [x0, y0]).round()], fill=1)
    inside = np.asarray(mask, dtype=bool)
    return float(prob[y0:y1 + 1, x0:x1 + 1][inside].mean()) if inside.any() else 0.0


class PPOCR:
    """Detection then recognition on one image at a time; ``read`` returns the recognised lines, top to
    bottom and left to right, each with its mean character confidence."""

    def __init__(self, folder: Path, threads: int = 1):
        self.det = _session(folder / DET_MODEL, threads)
        self.rec = _session(folder / REC_MODEL, threads)
        table = self.rec.get_modelmeta().custom_metadata_map.get("character", "").splitlines()
        if not table:
            raise ValueError(f"{folder / REC_MODEL} holds no character table in its metadata")
        # CTC: index 0 is the blank, the last the space (PaddleOCR's use_space_char)
        self.characters = ["", *table, " "]

    def boxes(self, image: Image.Image) -> list[np.ndarray]:
        """Text boxes (4, 2) in ``image``'s pixels, in reading order."""
        from scipy import ndimage

        w, h = image.size
        ratio = min(1.0, DET_LIMIT_SIDE / max(w, h))
        rw, rh = (max(32, int(round(side * ratio / 32) * 32)) for side in (w, h))
        prob = self.det.run(None, {"x": _normalised(image.resize((rw, rh), Image.BILINEAR))})[0][0, 0]
        labels, count = ndimage.label(prob > DET_THRESH, structure=np.ones((3, 3)))
        boxes = []
        for index, region in enumerate(ndimage.find_objects(labels)[:MAX_BOXES], 1):
            ys, xs = np.nonzero(labels[region] == index)
            points = np.stack([xs + region[1].start, ys + region[0].start], 1).astype(np.float64)
            corners, width, height = _min_area_rect(points)
            if min(width, height) < MIN_SIZE:
                continue
            if _mean_inside(prob, corners) < BOX_THRESH:
                continue
            distance = width * height * UNCLIP_RATIO / (2 * (width + height))
            grown = _grown(corners, width, height, distance)
            if min(width, height) + 2 * distance < MIN_SIZE + 2:
                continue
            box = _ordered(grown) * np.array([w / rw, h / rh], dtype=np.float32)
            box = np.clip(np.round(box), 0, [w - 1, h - 1])
            if np.linalg.norm(box[0] - box[1]) > 3 and np.linalg.norm(box[0] - box[3]) > 3:
                boxes.append(box)
        # reading order: by top edge, and left to right within 10 px of the same line (PaddleOCR's sorted_boxes)
        boxes.sort(key=lambda b: (b[0][1], b[0][0]))
        for i in range(len(boxes) - 1):
            for j in range(i, -1, -1):
                if abs(boxes[j + 1][0][1] - boxes[j][0][1]) < 10 and boxes[j + 1][0][0] < boxes[j][0][0]:
                    boxes[j], boxes[j + 1] = boxes[j + 1], boxes[j]
                else:
                    break
        return boxes

    @staticmethod
    def crop(image: Image.Image, box: np.ndarray) -> Image.Image:
        """The box's content straightened to a rectangle (turned upright when it is much taller than wide)."""
        width = int(max(np.linalg.norm(box[0] - box[1]), np.linalg.norm(box[2] - box[3])))
        height = int(max(np.linalg.norm(box[0] - box[3]), np.linalg.norm(box[1] - box[2])))
        tl, tr, br, bl = box
        quad = (*tl, *bl, *br, *tr)  # Pillow's QUAD: upper left, lower left, lower right, upper right
        crop = image.transform((max(width, 1), max(height, 1)), Image.QUAD, quad, Image.BICUBIC)
        return crop.rotate(90, expand=True) if height >= 1.5 * width else crop

    def recognise(self, crops: list[Image.Image]) -> list[tuple[str, float]]:
        """Each crop's text and mean character confidence (one batch, padded to the widest crop)."""
        if not crops:
            return []
        ratios = [c.width / c.height for c in crops]
        width = int(REC_HEIGHT * max(REC_MIN_WIDTH / REC_HEIGHT, *ratios))
        batch = np.zeros((len(crops), 3, REC_HEIGHT, width), dtype=np.float32)
        for i, (crop, ratio) in enumerate(zip(crops, ratios)):
            resized = min(width, int(math.ceil(REC_HEIGHT * ratio)))
            batch[i, :, :, :resized] = _normalised(crop.resize((resized, REC_HEIGHT), Image.BILINEAR))[0]
        probs = self.rec.run(None, {"x": batch})[0]
        out = []
        for row in probs:
            index, confidence = row.argmax(1), row.max(1)
            keep = (index != 0) & np.concatenate([[True], index[1:] != index[:-1]])
            text = "".join(self.characters[i] for i in index[keep] if i < len(self.characters))
            out.append((text, float(confidence[keep].mean()) if keep.any() else 0.0))
        return out

    def read(self, image: Image.Image) -> list[tuple[str, float]]:
        """The lines recognised in ``image`` with their confidences, in reading order."""
        image = image.convert("RGB")
        return self.recognise([self.crop(image, box) for box in self.boxes(image)])

"""Image → detected objects: background, colour labels, connected components, shape, fill.

Deterministic, no learned parts; numpy + scipy.ndimage only. Follows the method page's verifier steps with
these documented deviations [derived]:

1. Images larger than ``WORK`` px are box-filtered down to it (a box filter keeps pixel values exact
   coverage mixes); smaller ones are analysed at their own size, where every pixel's coverage is still
   known, rather than upsampled (interpolation smears edges). The few pixel-sized parameters (5×5
   majority, 3×3 closing, 2-3 px touching reach) suit 64-128 px; everything else is a fraction of the
   image.
2. Background = the mean colour of the modal (4-bit quantised) bin of the border pixels.
3. Colour labels come from an anti-aliasing mixing model instead of "nearest palette colour within
   ΔE 25" per pixel (see :func:`_labels`): the palette colours present are found from solid patches
   of nearly pure pixels, then each pixel is read as a mix of two of {background, present colours}
   and takes the nearer end. An edge pixel thus keeps its object's colour (a red/white edge is not
   "pink", a blurred black/white edge not "grey", the seam of touching blue and brown not "black"),
   and the mask boundary sits where the shape's boundary is (coverage α ≥ 0.5, measured on luma
   mostly: JPEG keeps luma sharp and halves chroma). Foreground pixels are also > ΔE00 12 from the
   background (method page). A component's *name* is, as in the method page, the palette colour nearest (ΔE00 < 25)
   to its median interior colour.
4. A 5×5 majority vote over the foreground labels replaces the method page's per-colour 3×3 opening: it
   removes JPEG chroma noise without cutting off the sharp tips of stars and triangles (which an
   opening does, shrinking their boxes). Then, per colour, a 3×3 closing (method page), 8-connected
   components; components under 0.2 % of the image are dropped (method page).
5. Shape by soft template matching rather than contour vertex counts (which confuse circles and
   hexagons at 13 px): each shape's anti-aliased template is fitted to the object's coverage map
   (:func:`_classify`). An object lying inside another is seen against that object's colour; pixels
   of other objects, which may hide part of it, are not counted.
6. Outline vs filled: an outlined object's hole-filled mask is mostly background (> 12 %).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from PIL import Image
from scipy import ndimage

from rewards.vvr.geometry import ASPECT, MOMENTS, ROUND_SHAPES, SHAPES, coverages
from rewards.vvr.palette import COLOURS, PALETTE_LAB, PALETTE_RGB, delta_e00, srgb_to_lab
from rewards.vvr.predicates import Box

WORK = 128  # larger images are reduced to this (px, longer side); smaller ones are used as they are
FG_DELTA_E = 12.0  # foreground: farther than this from the background (method page)
NAME_DELTA_E = 25.0  # a colour is named when this close to a palette centre (method page)
MIN_AREA = 0.002  # components smaller than this fraction of the image are dropped (method page)
PURE_RESIDUAL = 30.0  # RGB distance from the background→colour line of a nearly pure pixel
MIN_SHAPE_SCORE = 0.6
ASPECT_WEIGHT = 0.25
DENOISE = 0.15  # coverage within this of 0 or 1 is JPEG noise
BLUR_SIGMAS = (0.6, 1.2)  # working px, besides the sharp template
OUTLINE_BG_FRACTION = 0.12
_EIGHT = np.ones((3, 3), dtype=bool)
_SQUARE2 = np.ones((2, 2), dtype=bool)
# sRGB → (Y, Cb, Cr) (JPEG's BT.601) with chroma weighted down to 0.3
LUMA_WEIGHTED = np.diag([1.0, 0.3, 0.3]) @ np.array(
    [[0.299, 0.587, 0.114], [-0.168736, -0.331264, 0.5], [0.5, -0.418688, -0.081312]]
)
# rectangles and ellipses may be drawn either way round by a generator
FREE_ASPECT = {"rectangle", "ellipse"}


@dataclass
class Component:
    """One detected object. Masks are boolean ``(H, W)`` arrays at working size.

    ``box`` is in image fractions; ``template`` is the float coverage ``(H, W)`` of the matched ideal
    shape (the object's full extent, including parts another object may hide); ``filled_mask`` is the
    hole-filled mask.
    """

    colour: str | None
    shape: str | None
    filled: bool
    box: Box
    mask: np.ndarray
    filled_mask: np.ndarray
    template: np.ndarray

    @property
    def area(self) -> int:
        return int(self.mask.sum())


@dataclass
class Detection:
    """What the segmenter sees: the background's palette name (None if off-palette) and the objects."""

    background: str | None
    components: list[Component]


def _to_working(rgb: np.ndarray) -> np.ndarray:
    """Box-filter larger images down to ``WORK`` px (which keeps pixel values exact coverage mixes)."""
    h, w = rgb.shape[:2]
    if max(h, w) <= WORK:
        return rgb.astype(np.float64)
    scale = WORK / max(h, w)
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    return np.asarray(Image.fromarray(rgb).resize(size, Image.Resampling.BOX), dtype=np.float64)


def _background(rgb: np.ndarray) -> np.ndarray:
    """Mean colour of the most common 4-bit-quantised colour among the 2-px border (spec: the mode)."""
    border = np.concatenate([rgb[:2].reshape(-1, 3), rgb[-2:].reshape(-1, 3), rgb[:, :2].reshape(-1, 3),
                             rgb[:, -2:].reshape(-1, 3)])
    q = (border // 16).astype(np.int64)
    keys = q[:, 0] * 256 + q[:, 1] * 16 + q[:, 2]
    values, counts = np.unique(keys, return_counts=True)
    return border[keys == values[np.argmax(counts)]].mean(0)


def name_colours(rgb: np.ndarray) -> list[str | None]:
    """Palette names of ``(N, 3)`` sRGB colours (0-255): the nearest centre if within ΔE00 25, else None."""
    d = delta_e00(srgb_to_lab(rgb)[:, None], PALETTE_LAB[None])
    k = np.argmin(d, 1)
    return [COLOURS[j] if d[i, j] < NAME_DELTA_E else None for i, j in enumerate(k)]


@lru_cache(maxsize=1)
def _quantised_lab() -> np.ndarray:
    """CIELAB of every 6-bit-per-channel colour (index r<<12 | g<<6 | b), computed once (6 MB)."""
    keys = np.arange(1 << 18)
    return srgb_to_lab(np.stack([keys >> 12, (keys >> 6) & 63, keys & 63], 1) * 4.0 + 1.5)


def _labels(rgb: np.ndarray, bg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-pixel palette index (−1: background) by unmixing, computed once per distinct colour, and
    ``(H, W, 2)`` the two colours each pixel is read as a mix of (−1: background, or a share < 10 %).

    First the palette colours *present* are found: those with a solid patch (surviving a 2×2 erosion)
    of nearly pure pixels (α > 0.8 along the background→colour line, small residual). Then every pixel
    is read as a mix of two of {background, present colours} (the pair with the smallest residual: an anti-aliased edge, or
    the boundary of two touching objects, which would otherwise look like a third colour such as the
    dark band between blue and brown) and takes the end it is closer to; against the background the
    split uses the luma-weighted α, so JPEG's halved chroma does not blur the boundary.
    """
    q = np.clip(rgb, 0, 255).astype(np.int64) // 4  # 6 bits per channel: ≤ 2 units of error
    keys = (q[..., 0] << 12) | (q[..., 1] << 6) | q[..., 2]
    # distinct colours by counting (faster than sorting for 2^18 possible keys)
    seen = np.bincount(keys.ravel(), minlength=1 << 18)
    uniq = np.nonzero(seen)[0]
    lookup = np.zeros(1 << 18, dtype=np.int64)
    lookup[uniq] = np.arange(len(uniq))
    inverse = lookup[keys.ravel()]
    colours = np.stack([uniq >> 12, (uniq >> 6) & 63, uniq & 63], 1) * 4.0 + 1.5
    colours_lab = _quantised_lab()[uniq]
    bg_lab = srgb_to_lab(bg)
    candidates = np.nonzero(delta_e00(PALETTE_LAB, bg_lab) > FG_DELTA_E)[0]
    v = PALETTE_RGB[candidates] - bg  # (K, 3)
    d = colours - bg  # (U, 3)
    alpha = np.clip(d @ v.T / (v * v).sum(1), 0.0, 1.0)  # (U, K)
    resid = np.linalg.norm(d[:, None, :] - alpha[..., None] * v[None], axis=-1)
    # on a collinear tie (grey is half-way between black and white) prefer the purer reading
    nearest = np.argmin(resid + 0.02 * (1 - alpha) * np.linalg.norm(v, axis=1), 1)
    rows = np.arange(len(uniq))
    pure = ((alpha[rows, nearest] > 0.8) & (resid[rows, nearest] < PURE_RESIDUAL))[inverse].reshape(q.shape[:2])
    nearest_px = nearest[inverse].reshape(q.shape[:2])
    # a colour is present where it has a patch at least 2×2 px thick: the band where a blurred black
    # edge passes through pure grey is thinner, an outline's stroke (≥ 3.8 px) is not
    pure_count = np.bincount(nearest_px[pure], minlength=len(candidates))
    present = np.array([k for j, k in enumerate(candidates) if pure_count[j] >= 4
                        and np.count_nonzero(ndimage.binary_erosion(pure & (nearest_px == j), _SQUARE2)) >= 4], dtype=int)
    ends = np.vstack([bg[None], PALETTE_RGB[present]])
    names = np.concatenate([[-1], present])
    best_r = np.full(len(uniq), np.inf)
    label = np.full(len(uniq), -1)
    mix = np.full((len(uniq), 2), -1)  # the colours a pixel is a mix of, where they weigh > 10 %
    for i in range(len(ends)):
        for j in range(i + 1, len(ends)):
            e = ends[j] - ends[i]
            beta = np.clip((colours - ends[i]) @ e / (e @ e), 0.0, 1.0)
            r = np.linalg.norm(colours - ends[i] - beta[:, None] * e, axis=1)
            # on a collinear tie (grey is half-way between black and white) prefer the purer reading
            r += 0.02 * np.minimum(beta, 1 - beta) * np.linalg.norm(e)
            if i == 0:  # against the background, split on the luma-weighted α
                ew = e @ LUMA_WEIGHTED.T
                beta = np.clip((colours - ends[0]) @ LUMA_WEIGHTED.T @ ew / (ew @ ew), 0.0, 1.0)
            better = r < best_r
            best_r[better] = r[better]
            label[better] = np.where(beta[better] >= 0.5, names[j], names[i])
            mix[better, 0] = np.where(beta[better] < 0.9, names[i], -1)
            mix[better, 1] = np.where(beta[better] > 0.1, names[j], -1)
    label[delta_e00(colours_lab, bg_lab) <= FG_DELTA_E] = -1
    return label[inverse].reshape(rgb.shape[:2]), mix[inverse].reshape(*rgb.shape[:2], 2)


def _soft_box(cover: np.ndarray, bbox: tuple[int, int, int, int]) -> tuple[float, float, float, float]:
    """Sub-pixel (x0, y0, x1, y1) of an object from its coverage profiles and its integer box.

    An edge at ``e`` inside pixel ``j`` covers ``j+1-e`` of it, so the edge sits at
    ``x0 + (1 - p[x0]) - p[x0-1]`` whether pixel ``x0`` or ``x0-1`` holds it (p: column profile).
    """
    y0, y1, x0, x1 = bbox

    def edges(p: np.ndarray, lo: int, hi: int) -> tuple[float, float]:
        before = p[lo - 1] if lo > 0 else 0.0
        after = p[hi] if hi < len(p) else 0.0
        return lo + (1 - p[lo]) - before, hi - (1 - p[hi - 1]) + after

    left, right = edges(cover.max(0), x0, x1)
    top, bottom = edges(cover.max(1), y0, y1)
    return left, top, right, bottom


def _denoise(x: np.ndarray) -> np.ndarray:
    """Coverage with JPEG-level noise (±DENOISE) squashed to exactly 0 or 1."""
    return np.clip((x - DENOISE) / (1 - 2 * DENOISE), 0.0, 1.0)


def placements_by_moments(a: np.ndarray) -> list[tuple[str, tuple[float, float, float, float]]]:
    """Each shape's box ``(x0, y0, x1, y1)`` (pixels) on a coverage map ``a`` ``(H, W)`` of positive total,
    placed by moments: the same area and centroid, and for rectangles and ellipses the same second-moment
    aspect (robust to blunted tips and noisy edges)."""
    ys, xs = np.indices(a.shape) + 0.5
    area = a.sum()
    mx, my = (a * xs).sum() / area, (a * ys).sum() / area
    var_x, var_y = (a * (xs - mx) ** 2).sum() / area, (a * (ys - my) ** 2).sum() / area
    moment_aspect = math.sqrt(max(var_x, 0.1) / max(var_y, 0.1))
    placements = []
    for shape in SHAPES:
        rho, ox, oy = MOMENTS[shape]
        asp = moment_aspect if shape in FREE_ASPECT else ASPECT[shape]
        h = math.sqrt(area / (rho * asp))
        w = asp * h
        cx, cy = mx - ox * w, my - oy * h
        placements.append((shape, (cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2)))
    return placements


def _classify(cover: np.ndarray, valid: np.ndarray, bbox: tuple[int, int, int, int]
              ) -> tuple[str | None, tuple[float, float, float, float], np.ndarray]:
    """Best-matching shape of an object's coverage map (a padded crop) → (shape, box, template).

    ``cover``: float coverage of the object's colour (1 in its holes); ``valid``: pixels that count
    (pixels of other objects, which may hide part of this one, do not); ``bbox`` = (y0, y1, x0, x1) of
    its mask. Each shape's anti-aliased template is placed by moments (area, centroid and, for
    rectangles and ellipses, second moments equal to the object's: robust to blunted tips and noisy
    edges) and, when another object touches the box, also over the object's sub-pixel box (which
    tolerates part of the object being hidden). Templates are compared sharp and blurred
    (``BLUR_SIGMAS``, for the three best sharp matches: a blurred hexagon is compared with a blurred
    hexagon rather than a sharp one) by soft IoU Σmin/Σmax over the valid pixels, after squashing
    JPEG-level noise; the best score less the aspect penalty wins.
    Returns the winning template's coverage map.
    """
    a = np.where(valid, cover, 0.0)
    area = a.sum()
    y0, y1, x0, x1 = bbox
    if area <= 0:  # every pixel of the object is claimed by others: no shape can be read (and moments are 0/0)
        return None, (float(x0), float(y0), float(x1), float(y1)), np.zeros_like(a)
    soft = _soft_box(a, bbox)
    aspect = (soft[2] - soft[0]) / (soft[3] - soft[1])
    occluded = not valid[max(0, y0 - 1):y1 + 1, max(0, x0 - 1):x1 + 1].all()
    placements: list[tuple[str, tuple[float, float, float, float]]] = []
    for placed in placements_by_moments(a):
        placements.append(placed)
        if occluded:
            placements.append((placed[0], soft))
    sharp = coverages(placements, a.shape)
    penalty = np.empty(len(placements))
    for i, (shape, _) in enumerate(placements):
        miss = abs(math.log(aspect / ASPECT[shape]))
        if shape in FREE_ASPECT:
            miss = min(miss, abs(math.log(aspect * ASPECT[shape])))
        penalty[i] = ASPECT_WEIGHT * miss
    target = _denoise(a) * valid

    def soft_iou(t: np.ndarray) -> np.ndarray:
        t = _denoise(t) * valid
        inter, union = np.minimum(target, t).sum((1, 2)), np.maximum(target, t).sum((1, 2))
        # a blob fainter than the JPEG noise squashes to nothing; against an equally empty template that
        # is 0/0, which must read as no match (a NaN would win argmax)
        return np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)

    iou = soft_iou(sharp)
    # blurred templates only for the three best sharp matches (the blur comparisons cost the most)
    top = np.argsort(penalty - iou)[:3]
    for sigma in BLUR_SIGMAS:
        iou[top] = np.maximum(iou[top], soft_iou(ndimage.gaussian_filter(sharp[top], (0, sigma, sigma))))
    best = int(np.argmax(iou - penalty))
    best_score = iou[best] - penalty[best]
    shape, box = placements[best]
    return (shape if best_score >= MIN_SHAPE_SCORE else None), box, sharp[best]


def _majority(labels: np.ndarray, foreground: np.ndarray) -> np.ndarray:
    """Each foreground pixel takes the most common label among the foreground pixels of its 5×5 window."""
    present = np.unique(labels[foreground])
    if len(present) < 2:
        return labels
    votes = np.stack([ndimage.uniform_filter((labels == k).astype(np.float32), 5, mode="constant")
                      for k in present])
    return np.where(foreground, present[np.argmax(votes, 0)], -1)


def _cover(pixels: np.ndarray, colour: np.ndarray, under: np.ndarray) -> np.ndarray:
    """Coverage α of ``colour`` in ``pixels`` read as mixes with the colour ``under`` it (luma-weighted)."""
    v = (colour - under) @ LUMA_WEIGHTED.T
    return np.clip((pixels - under) @ LUMA_WEIGHTED.T @ v / (v @ v), 0.0, 1.0)


def segment(rgb: np.ndarray) -> Detection:
    """Detect the objects of an ``(H, W, 3)`` uint8 sRGB image."""
    work = _to_working(rgb)
    H, W = work.shape[:2]
    bg = _background(work)
    labels, mix = _labels(work, bg)
    foreground = labels >= 0
    labels = _majority(labels, foreground)
    # pass 1: per colour, a 3×3 closing (bridges one-pixel JPEG gaps in thin outlines) and components
    found: list[tuple[int, tuple[slice, slice], np.ndarray, np.ndarray, int]] = []  # k, box, mask, filled, area
    for k in np.unique(labels[foreground]):
        lab, _ = ndimage.label(ndimage.binary_closing(labels == k, _EIGHT) & foreground, _EIGHT)
        for idx, sl in enumerate(ndimage.find_objects(lab), start=1):
            own = lab[sl] == idx
            area = np.count_nonzero(own)
            if area >= MIN_AREA * H * W:
                found.append((int(k), sl, _paste(own, sl, (H, W)), _paste(ndimage.binary_fill_holes(own), sl, (H, W)), area))
    # pass 2: shape, box and fill of each, seen against what lies under it
    components: list[Component] = []
    medians = [bg]
    for k, sl, own_full, filled_full, area in found:
        # an object inside another one lies on it: that object is its local background, not an occluder
        hosts = [(np.count_nonzero(f), kk, f) for kk, _, _, f, a in found
                 if kk != k and a > area and np.count_nonzero(f[sl] & own_full[sl]) >= 0.95 * area]
        _, host_k, host = min(hosts, key=lambda h: h[0]) if hosts else (0, -1, None)
        y0, y1, x0, x1 = sl[0].start, sl[0].stop, sl[1].start, sl[1].stop
        # a padded crop, so a template placed by moments may reach past the observed box
        pad = max(2, round(0.25 * max(y1 - y0, x1 - x0)))
        Y0, X0 = max(0, y0 - pad), max(0, x0 - pad)
        crop = (slice(Y0, min(H, y1 + pad)), slice(X0, min(W, x1 + pad)))
        own, filled = own_full[crop], filled_full[crop]
        # pixels showing any other object (even a faint edge of a neighbour) do not count
        other = ((mix[crop] >= 0) & (mix[crop] != k) & (mix[crop] != host_k)).any(-1) & ~own
        if host is None:
            cover = _cover(work[crop], PALETTE_RGB[k], bg)
            valid = ~(foreground[crop] & ~filled) & ~other
        else:  # seen against its host's colour, and only within the host
            cover = _cover(work[crop], PALETTE_RGB[k], PALETTE_RGB[host_k])
            valid = host[crop] & ~(foreground[crop] & (labels[crop] != host_k) & ~filled) & ~other
        cover = np.where(filled & ~own, 1.0, cover)
        shape, (bx0, by0, bx1, by1), tmpl = _classify(cover, valid, (y0 - Y0, y1 - Y0, x0 - X0, x1 - X0))
        box = Box((bx0 + bx1) / 2 / W + X0 / W, (by0 + by1) / 2 / H + Y0 / H, (bx1 - bx0) / W, (by1 - by0) / H)
        if shape in ROUND_SHAPES | {"square", "rectangle"}:
            shape = _by_aspect(shape, box.w / box.h * H / W)
        interior = own & (cover > 0.9)  # the pure inside, free of edge mixes
        medians.append(np.median(work[crop][interior if interior.sum() >= 4 else own], axis=0))
        background_inside = np.count_nonzero(filled & ~foreground[crop]) / filled.sum()
        components.append(Component(
            None, shape, bool(background_inside <= OUTLINE_BG_FRACTION), box, own_full, filled_full,
            _paste(tmpl, crop, (H, W)),
        ))
    names = name_colours(np.array(medians))
    for c, name in zip(components, names[1:]):
        c.colour = name
    return Detection(names[0], components)


def _paste(crop_map: np.ndarray, crop: tuple[slice, slice], hw: tuple[int, int]) -> np.ndarray:
    full = np.zeros(hw, dtype=crop_map.dtype)
    full[crop] = crop_map
    return full


def _by_aspect(shape: str, aspect: float) -> str:
    """Square vs rectangle and circle vs ellipse by the box aspect (threshold half-way, geometrically)."""
    elongated = abs(math.log(aspect)) > 0.5 * math.log(ASPECT["rectangle"])
    if shape in ("circle", "ellipse"):
        return "ellipse" if elongated else "circle"
    return "rectangle" if elongated else "square"

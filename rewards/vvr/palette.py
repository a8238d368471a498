"""The VVR colour palette and the colour science the verifier needs (sRGB → CIELAB D65, CIEDE2000).

Every colour has an sRGB value (what the renderer paints) and its CIELAB centre (what the verifier
compares against). The nine saturated colours were picked by hand to be far apart in ΔE00 (the closest
pairs: blue/purple 23, brown/grey 26.5; all others ≥ 27) and off each other's mixing lines
with white, so that an anti-aliased edge of one colour is not mistaken for another colour. Grey is the
mix of black and white, so the generator never puts the three in one scene.
"""

from __future__ import annotations

import numpy as np

#: name → sRGB (0-255); order is the canonical order of colour names everywhere in VVR
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 35),
    "orange": (255, 140, 0),
    "yellow": (250, 215, 0),
    "green": (30, 150, 50),
    "cyan": (0, 190, 215),
    "blue": (20, 80, 245),
    "purple": (130, 10, 140),
    "pink": (245, 90, 200),
    "brown": (120, 80, 20),
    "black": (0, 0, 0),
    "white": (255, 255, 255),
    "gray": (128, 128, 128),
}
COLOURS: tuple[str, ...] = tuple(PALETTE)

# D65 reference white and the sRGB → XYZ matrix (IEC 61966-2-1)
_WHITE_D65 = np.array([0.95047, 1.0, 1.08883])
_SRGB_TO_XYZ = np.array(
    [
        [0.4124564, 0.3575761, 0.1804375],
        [0.2126729, 0.7151522, 0.0721750],
        [0.0193339, 0.1191920, 0.9503041],
    ]
)


def srgb_to_lab(rgb: np.ndarray) -> np.ndarray:
    """sRGB in [0, 255] (any shape ``(..., 3)``) → CIELAB under D65, float64 ``(..., 3)``."""
    c = np.asarray(rgb, dtype=np.float64) / 255.0
    lin = np.where(c <= 0.04045, c / 12.92, ((c + 0.055) / 1.055) ** 2.4)
    xyz = lin @ _SRGB_TO_XYZ.T / _WHITE_D65
    f = np.where(xyz > (6 / 29) ** 3, np.cbrt(xyz), xyz / (3 * (6 / 29) ** 2) + 4 / 29)
    return np.stack([116 * f[..., 1] - 16, 500 * (f[..., 0] - f[..., 1]), 200 * (f[..., 1] - f[..., 2])], -1)


def delta_e00(lab1: np.ndarray, lab2: np.ndarray) -> np.ndarray:
    """CIEDE2000 colour difference of broadcastable CIELAB arrays ``(..., 3)`` → ``(...)`` (kL=kC=kH=1)."""
    L1, a1, b1 = np.moveaxis(np.asarray(lab1, dtype=np.float64), -1, 0)
    L2, a2, b2 = np.moveaxis(np.asarray(lab2, dtype=np.float64), -1, 0)
    c_bar = (np.hypot(a1, b1) + np.hypot(a2, b2)) / 2
    g = 0.5 * (1 - np.sqrt(c_bar**7 / (c_bar**7 + 25.0**7)))
    a1p, a2p = (1 + g) * a1, (1 + g) * a2
    c1p, c2p = np.hypot(a1p, b1), np.hypot(a2p, b2)
    h1p = np.degrees(np.arctan2(b1, a1p)) % 360
    h2p = np.degrees(np.arctan2(b2, a2p)) % 360
    dLp, dCp = L2 - L1, c2p - c1p
    dh = h2p - h1p
    dh = np.where(dh > 180, dh - 360, np.where(dh < -180, dh + 360, dh))
    dh = np.where(c1p * c2p == 0, 0.0, dh)
    dHp = 2 * np.sqrt(c1p * c2p) * np.sin(np.radians(dh) / 2)
    L_bar, c_bar_p = (L1 + L2) / 2, (c1p + c2p) / 2
    h_sum = h1p + h2p
    h_bar = np.where(
        c1p * c2p == 0,
        h_sum,
        np.where(np.abs(h1p - h2p) <= 180, h_sum / 2, np.where(h_sum < 360, (h_sum + 360) / 2, (h_sum - 360) / 2)),
    )
    t = (
        1
        - 0.17 * np.cos(np.radians(h_bar - 30))
        + 0.24 * np.cos(np.radians(2 * h_bar))
        + 0.32 * np.cos(np.radians(3 * h_bar + 6))
        - 0.20 * np.cos(np.radians(4 * h_bar - 63))
    )
    d_theta = 30 * np.exp(-(((h_bar - 275) / 25) ** 2))
    r_c = 2 * np.sqrt(c_bar_p**7 / (c_bar_p**7 + 25.0**7))
    s_l = 1 + 0.015 * (L_bar - 50) ** 2 / np.sqrt(20 + (L_bar - 50) ** 2)
    s_c = 1 + 0.045 * c_bar_p
    s_h = 1 + 0.015 * c_bar_p * t
    r_t = -np.sin(np.radians(2 * d_theta)) * r_c
    return np.sqrt(
        (dLp / s_l) ** 2 + (dCp / s_c) ** 2 + (dHp / s_h) ** 2 + r_t * (dCp / s_c) * (dHp / s_h)
    )


#: (K, 3) sRGB and CIELAB centres of the palette, in ``COLOURS`` order
PALETTE_RGB = np.array([PALETTE[c] for c in COLOURS], dtype=np.float64)
PALETTE_LAB = srgb_to_lab(PALETTE_RGB)

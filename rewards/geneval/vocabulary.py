"""GenEval's word lists: the 80 COCO classes as GenEval names them, its ten colours, four positions and six tags.

The class names are GenEval's (``computer mouse``, ``tv remote``, ``computer keyboard``, ``hair drier``), in
COCO's category order, which is also the label order of COCO-trained detectors: label ``i`` of an 80-class
COCO model is ``CLASSES[i]`` whatever the model's own ``id2label`` spells it.
"""

from __future__ import annotations

CLASSES: tuple[str, ...] = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
    "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow",
    "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee",
    "skis", "snowboard", "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard",
    "tennis racket", "bottle", "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple",
    "sandwich", "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch",
    "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "computer mouse", "tv remote",
    "computer keyboard", "cell phone", "microwave", "oven", "toaster", "sink", "refrigerator", "book", "clock",
    "vase", "scissors", "teddy bear", "hair drier", "toothbrush",
)
COLOURS: tuple[str, ...] = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
POSITIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
TAGS: tuple[str, ...] = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
NUMBERS: tuple[str, ...] = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


def with_article(name: str) -> str:
    """``"an apple"``, ``"a dog"`` (by the first letter, as GenEval's prompts do)."""
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def plural(name: str) -> str:
    """``"buses"``, ``"dogs"`` (GenEval's rule: ``-es`` after an ``s``, else ``-s``)."""
    return f"{name}es" if name.endswith("s") else f"{name}s"

"""The published transformer configs the tiny twins start from: one source with flowalign plan's assets."""

import json

from flowalign.families import read_index
from pipelines.tiny_twins.published import ARCHITECTURES, PUBLISHED, published_class, published_config


def test_a_release_with_a_shipped_architecture_is_read_from_its_config_file():
    shipped = {name: source for name, (source, _) in PUBLISHED.items() if isinstance(source, str)}
    assert {"qwen_image", "flux2_dev", "flux2_klein_4b", "zimage", "wan22_a14b_expert"} <= set(shipped)
    for name, source in shipped.items():
        saved = json.loads((ARCHITECTURES / source / "config.json").read_text())
        assert published_config(name) == {k: v for k, v in saved.items() if not k.startswith("_")}, name
        component = source.split("/")[-1]
        assert read_index(ARCHITECTURES / source.split("/")[0])[component][1] == published_class(name), name

"""``scripts/device_trip.py``: the tiny models' weights moved aside and back (checked, never overwriting), and
random weights of the same architectures written where they are missing, loadable by each component's class."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.scripts import load_script

TRIP = load_script("device_trip")
REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny-qwen-image-edit"  # the smallest tiny model (2 MB): a transformer, a VAE and a text encoder


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    root = tmp_path / "checkout"
    shutil.copytree(REPO / "assets" / MODEL, root / "assets" / MODEL)
    return root


def _shapes(path: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(path), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def test_pack_moves_the_weights_aside_and_restore_brings_them_back_checked(checkout, tmp_path):
    files = TRIP.weight_files(checkout)
    assert sorted(p.parent.name for p in files) == ["text_encoder", "transformer", "vae"]
    hashes = {p: TRIP.sha256(p) for p in files}
    aside = tmp_path / "aside"
    TRIP.pack(checkout, aside)
    assert not any(p.exists() for p in files) and (aside / "manifest.json").is_file()
    assert (checkout / "assets" / MODEL / "transformer" / "config.json").is_file()  # configs travel
    with pytest.raises(SystemExit, match="already holds packed weights; run `restore` first"):
        TRIP.pack(checkout, aside)
    assert TRIP.restore(checkout, aside) == 3
    assert {p: TRIP.sha256(p) for p in files} == hashes and not (aside / "manifest.json").exists()


def test_restore_never_overwrites_a_file_that_differs(checkout, tmp_path):
    aside = tmp_path / "aside"
    TRIP.pack(checkout, aside)
    TRIP.random_weights(checkout)  # the device's random weights, come back by mistake
    with pytest.raises(SystemExit, match="exists and differs from the packed file"):
        TRIP.restore(checkout, aside)
    assert (aside / "manifest.json").is_file()  # nothing moved, the pack still restorable


def test_random_weights_have_each_components_architecture_and_load(checkout, tmp_path):
    originals = {p.relative_to(checkout): _shapes(p) for p in TRIP.weight_files(checkout)}
    TRIP.pack(checkout, tmp_path / "aside")
    written = TRIP.random_weights(checkout)
    assert sorted(p.relative_to(checkout) for p in written) == sorted(originals)
    for path in written:
        shapes = _shapes(path)
        original = originals[path.relative_to(checkout)]
        assert {k: shapes[k] for k in shapes} == {k: original[k] for k in shapes}  # tied tensors written once
    assert TRIP.random_weights(checkout) == []  # only where weights are missing
    from flowalign.component_config import library_module

    for folder, library, class_name in TRIP.model_components(checkout):
        getattr(library_module(library), class_name).from_pretrained(folder)  # loads without missing weights


def test_aside_inside_the_checkout_is_refused(checkout, capsys):
    with pytest.raises(SystemExit):
        TRIP.main(["pack", "--root", str(checkout), "--aside", str(checkout / "aside")])
    assert "is inside the checkout, where it would travel" in capsys.readouterr().err


def test_the_carried_folders_count_towards_what_travels(tmp_path):
    """What ``pack`` reports beside the checkout: the wheels and the reference tree a device run carries."""
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "a.whl").write_bytes(b"x" * 1000)
    (tmp_path / ".cache" / "flow_grpo" / "flow_grpo").mkdir(parents=True)
    (tmp_path / ".cache" / "flow_grpo" / "flow_grpo" / "ref.py").write_bytes(b"y" * 24)
    assert [TRIP.folder_bytes(tmp_path / name) for name in TRIP.CARRIED] == [1000, 24]
    assert TRIP.folder_bytes(tmp_path / "absent") == 0

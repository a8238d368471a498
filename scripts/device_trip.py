"""Fit the checkout into what a borrowed GPU machine takes, and put it back.

A GPU machine lent for a check receives a copy of the checkout's working tree, at most 64 MiB with the wheels
of ``docs/performance.md``. The tiny models' weights (``assets/*/`` folders with a ``model_index.json``: their
transformers, VAEs and text encoders) are most of the checkout (113 MB of 143). What the GPU check
(``scripts/gpu_check.py``) tests of every recipe (that it runs on CUDA, finite, its update applied) needs their
architectures, not their trained values. So:

    python scripts/device_trip.py pack             # here, before the device run: moves those weights aside
    python scripts/device_trip.py random-weights   # on the GPU machine, before scripts/gpu_check.py
    python scripts/device_trip.py restore          # here, after the device run: moves them back, checked

``pack`` moves each weight file into a folder beside the checkout (``--aside``, default
``../flowalign-device-aside``) with a manifest of their sizes and SHA-256, and says how much of the tree is
left to travel; it refuses when a pack is already aside. ``restore`` moves them back and checks each one against
the manifest; it never overwrites a file that differs (``git checkout -- assets`` restores from git as well).
``random-weights`` writes, for every component whose ``config.json`` is there and whose weights are not, weights
of that architecture drawn with a seed of its own (the component's path), under the file name its library loads.
Never run it here: the folders would then hold random models.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: what travels to a device machine at most (the device notes: the working tree with what is carried)
TRAVEL_LIMIT = 64 * 2**20
#: the weight file a component's library writes and reads
WEIGHT_FILES = {"diffusers": "diffusion_pytorch_model.safetensors", "transformers": "model.safetensors"}
MANIFEST = "manifest.json"
#: the ignored folders a device run carries (docs/performance.md): the wheels, the reference tree
CARRIED = ("wheels", ".cache/flow_grpo")


def model_components(root: Path) -> list[tuple[Path, str, str]]:
    """``(component folder, library, class name)`` of every model component with a ``config.json`` in the
    ``assets/*/model_index.json`` folders under ``root``, in path order."""
    found = []
    for index in sorted((root / "assets").glob("*/model_index.json")):
        entries = json.loads(index.read_text())
        for name, entry in sorted(entries.items()):
            if name.startswith("_") or not isinstance(entry, list) or len(entry) != 2 or entry[0] not in WEIGHT_FILES:
                continue
            folder = index.parent / name
            if (folder / "config.json").is_file():
                found.append((folder, entry[0], entry[1]))
    return found


def weight_files(root: Path) -> list[Path]:
    """The weight files of :func:`model_components` that are there (``*.safetensors``, ``*.bin``)."""
    files = []
    for folder, _, _ in model_components(root):
        files += sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file())
    return files


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def travelling_bytes(root: Path) -> int:
    """Bytes of the tracked files that are there and the untracked ones git does not ignore: what a device run
    sends, besides the paths it carries."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                            capture_output=True, check=True).stdout.decode().split("\0")
    return sum((root / p).stat().st_size for p in listed if p and (root / p).is_file())


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under ``folder`` (0 when it is not there)."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def _write_json(path: Path, data: object) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def pack(root: Path, aside: Path) -> dict:
    """Move the model weights of ``root``'s tiny models into ``aside`` with a manifest; returns the manifest."""
    if (aside / MANIFEST).exists():
        raise SystemExit(f"device_trip pack: {aside} already holds packed weights; run `restore` first "
                         "(or pass another --aside)")
    files = weight_files(root)
    entries = [{"path": str(p.relative_to(root)), "bytes": p.stat().st_size, "sha256": sha256(p)} for p in files]
    aside.mkdir(parents=True, exist_ok=True)
    manifest = {"root": str(root), "files": entries}
    _write_json(aside / MANIFEST, manifest)  # written first: an interrupted pack still restores
    for entry in entries:
        target = aside / entry["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(root / entry["path"]), target)
    return manifest


def restore(root: Path, aside: Path) -> int:
    """Move the packed weights back into ``root``, each checked against the manifest; returns how many moved."""
    manifest_path = aside / MANIFEST
    if not manifest_path.is_file():
        raise SystemExit(f"device_trip restore: no {MANIFEST} in {aside}: nothing is packed there")
    entries = json.loads(manifest_path.read_text())["files"]
    for entry in entries:  # check everything before moving anything
        here, there = root / entry["path"], aside / entry["path"]
        if here.exists() and not there.exists():
            continue  # restored by an earlier, interrupted run
        if not there.is_file():
            raise SystemExit(f"device_trip restore: {there} is missing; restore {entry['path']} with "
                             "`git checkout -- assets`")
        if here.exists() and sha256(here) != entry["sha256"]:
            raise SystemExit(f"device_trip restore: {here} exists and differs from the packed file; move it away "
                             "first (random weights written here?), then restore again")
    moved = 0
    for entry in entries:
        there = aside / entry["path"]
        if not there.exists():
            continue
        if sha256(there) != entry["sha256"]:
            raise SystemExit(f"device_trip restore: {there} does not match its manifest entry; restore "
                             f"{entry['path']} with `git checkout -- assets`")
        shutil.move(str(there), root / entry["path"])
        moved += 1
    manifest_path.unlink()
    return moved


def random_weights(root: Path) -> list[Path]:
    """Weights of each component's architecture, seeded by its path, where a component has none; returns the
    files written."""
    import torch

    from flowalign.component_config import library_module, read_component_config

    written = []
    for folder, library, class_name in model_components(root):
        if any(p.suffix in (".safetensors", ".bin") for p in folder.iterdir()):
            continue
        cls = getattr(library_module(library), class_name)
        torch.manual_seed(zlib.crc32(str(folder.relative_to(root)).encode()))
        if library == "diffusers":
            model = cls.from_config(read_component_config(folder.parent, folder.name, cls))
        else:
            model = cls(cls.config_class.from_pretrained(str(folder)))
        # through the library's own writer (its checkpoint key names, tied tensors once), into a scratch folder:
        # the component's config.json stays as it travelled
        with tempfile.TemporaryDirectory(dir=folder.parent) as scratch:
            model.save_pretrained(scratch)
            path = folder / WEIGHT_FILES[library]
            shutil.move(str(Path(scratch) / WEIGHT_FILES[library]), path)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=["pack", "restore", "random-weights"])
    p.add_argument("--root", type=Path, default=ROOT, help="the checkout (default: this one)")
    p.add_argument("--aside", type=Path, default=None, help="where packed weights wait (default: "
                                                             "../flowalign-device-aside beside the checkout)")
    args = p.parse_args(argv)
    root = args.root.resolve()
    aside = (args.aside or root.parent / "flowalign-device-aside").resolve()
    if aside == root or root in aside.parents:
        p.error(f"--aside {aside} is inside the checkout, where it would travel; give a folder outside it")
    if args.action == "pack":
        manifest = pack(root, aside)
        moved = sum(e["bytes"] for e in manifest["files"])
        left = travelling_bytes(root)
        carried = {name: folder_bytes(root / name) for name in CARRIED}
        total = left + sum(carried.values())
        extra = ", ".join(f"{name}/ {size / 2**20:.1f} MiB" for name, size in carried.items() if size)
        print(f"moved {len(manifest['files'])} weight files ({moved / 1e6:.1f} MB) to {aside}; "
              f"{left / 2**20:.1f} MiB of the checkout travels" + (f", with {extra} carried" if extra else "")
              + f": {total / 2**20:.1f} of {TRAVEL_LIMIT / 2**20:.0f} MiB"
              + (" (too much: carry the reference tree only in the side-by-side's call)" if total > TRAVEL_LIMIT
                 else "") + ". After the device run: python scripts/device_trip.py restore")
    elif args.action == "restore":
        print(f"restored {restore(root, aside)} weight files from {aside}")
    else:
        written = random_weights(root)
        print(f"wrote random weights for {len(written)} components (architecture checks only, not trained models)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A tiny random open_clip model saved as an HPSv2 checkpoint ({"state_dict": ...}), the stand-in for
HPS_v2.1_compressed.pt in tests, and the torchvision import guard the test suite needs on CPU-only torch."""

from __future__ import annotations

import json
from pathlib import Path

import torch

# ViT-H-14's layout at toy size: 32 px images in 8 px patches, 2 layers of width 32 per tower; the
# text tower keeps open_clip's BPE vocabulary (49,408) and 77-token context, so get_tokenizer works.
TINY_HPS_CONFIG = {"embed_dim": 16,
                   "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "head_width": 16, "patch_size": 8},
                   "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2}}


def guard_torchvision_import() -> None:
    """Let torchvision import beside this machine's torch (tests/conftest.py calls it first).

    The torchvision 0.28.0 wheel here (the `dev` extra installs it for open_clip) is the CUDA build
    while torch is the CPU build: its C extension cannot load, and torchvision's _meta_registrations
    then registers fakes for two of its ops unconditionally, so `import torchvision` fails, and with it
    open_clip and transformers' image processors (they import it when it is installed). Defining those
    two op schemas first lets its pure-Python parts load (no test calls a torchvision C op). Where the
    extension loads (a matching build), nothing is changed."""
    import importlib.util
    import sys

    spec = importlib.util.find_spec("torchvision")
    if spec is None or "torchvision" in sys.modules:
        return
    library = next(Path(spec.submodule_search_locations[0]).glob("_C*.so"), None)
    try:
        if library is None:
            raise OSError("no torchvision/_C")
        torch.ops.load_library(str(library))
    except OSError:
        for op in ("nms", "qnms"):
            try:
                torch.library.define(f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            except RuntimeError:
                pass  # already defined by an earlier call


def import_open_clip():
    """open_clip, after the torchvision guard."""
    guard_torchvision_import()
    import open_clip

    return open_clip


def write_tiny_hps(out: Path, seed: int = 0) -> tuple[Path, Path]:
    """Write TinyHPS.json (an open_clip model config) and hps.pt ({"state_dict": random weights}) to
    `out`; returns (config path, checkpoint path)."""
    open_clip = import_open_clip()
    out.mkdir(parents=True, exist_ok=True)
    config = out / "TinyHPS.json"
    config.write_text(json.dumps(TINY_HPS_CONFIG))
    open_clip.add_model_config(config)
    torch.manual_seed(seed)
    model = open_clip.create_model("TinyHPS", pretrained=None)
    checkpoint = out / "hps.pt"
    torch.save({"state_dict": model.state_dict()}, checkpoint)
    return config, checkpoint

"""Small biLMs with random weights in the published layout, written by the project itself (tests, demo, bench)."""
from __future__ import annotations

import json
import os

import numpy as np

from .options import ElmoOptions
from .weights import expected_shapes, write_weights

TINY_OPTIONS = {
    "char_cnn": {"activation": "relu", "embedding": {"dim": 4},
                 "filters": [[1, 4], [2, 8], [3, 16], [4, 32], [5, 64]], "n_highway": 2, "n_characters": 262,
                 "max_characters_per_token": 50},
    "lstm": {"dim": 64, "projection_dim": 16, "n_layers": 2, "cell_clip": 3, "proj_clip": 3,
             "use_skip_connections": True},
}

ORIGINAL_OPTIONS = {
    "char_cnn": {"activation": "relu", "embedding": {"dim": 16},
                 "filters": [[1, 32], [2, 32], [3, 64], [4, 128], [5, 256], [6, 512], [7, 1024]], "n_highway": 2,
                 "n_characters": 262, "max_characters_per_token": 50},
    "lstm": {"dim": 4096, "projection_dim": 512, "n_layers": 2, "cell_clip": 3, "proj_clip": 3,
             "use_skip_connections": True},
}


def random_arrays(options: dict, seed: int = 0, scale: float = 1.0) -> dict[str, np.ndarray]:
    """Random float32 weights with every dataset the options need (projections included when F != P / P < H).

    Scales are chosen so activations are O(1) and both clips are sometimes hit.
    """
    opts = ElmoOptions.from_dict(options)
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in expected_shapes(opts, include_optional=False).items():
        fan_in = shape[-2] if len(shape) >= 2 else 1
        if name.startswith("CNN/W_cnn"):
            fan_in = shape[1] * shape[2]
        std = scale / np.sqrt(fan_in) if len(shape) >= 2 else 0.1 * scale
        if name == "char_embed":
            std = 1.0
        a = rng.normal(0.0, std, size=shape).astype(np.float32)
        if name.endswith("b_carry"):
            a -= 1.0
        out[name] = a
    return out


def write_random_model(directory: str | os.PathLike, options: dict | None = None, seed: int = 0,
                       scale: float = 1.0) -> tuple[str, str]:
    """Write ``options.json`` and ``weights.hdf5`` into ``directory``; returns their paths."""
    options = options or TINY_OPTIONS
    os.makedirs(directory, exist_ok=True)
    opt_path = os.path.join(directory, "options.json")
    w_path = os.path.join(directory, "weights.hdf5")
    with open(opt_path, "w", encoding="utf-8") as fh:
        json.dump(options, fh, indent=2)
    write_weights(w_path, random_arrays(options, seed, scale))
    return opt_path, w_path

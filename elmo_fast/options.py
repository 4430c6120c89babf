"""``options.json`` (spec §7.2): parsed into frozen dataclasses with clear errors."""
from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Any


class OptionsError(ValueError):
    """options.json is missing a key, has a wrong value, or does not match the weights."""


@dataclass(frozen=True)
class CharCNNOptions:
    activation: str
    embedding_dim: int
    filters: tuple[tuple[int, int], ...]
    n_highway: int = 0
    max_characters_per_token: int = 50
    n_characters: int = 262

    @property
    def n_filters(self) -> int:
        return sum(n for _, n in self.filters)


@dataclass(frozen=True)
class LSTMOptions:
    dim: int
    projection_dim: int
    n_layers: int = 1
    cell_clip: float | None = None
    proj_clip: float | None = None
    use_skip_connections: bool = False

    @property
    def has_projection(self) -> bool:
        return self.projection_dim < self.dim


@dataclass(frozen=True)
class ElmoOptions:
    lstm: LSTMOptions
    char_cnn: CharCNNOptions | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def projection_dim(self) -> int:
        return self.lstm.projection_dim

    @property
    def has_cnn_projection(self) -> bool:
        return self.char_cnn is not None and self.char_cnn.n_filters != self.lstm.projection_dim

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "options") -> "ElmoOptions":
        if not isinstance(d, dict):
            raise OptionsError(f"{source}: expected a JSON object, got {type(d).__name__}")
        if "lstm" not in d:
            raise OptionsError(f"{source}: missing the 'lstm' section")
        if not isinstance(d["lstm"], dict):
            raise OptionsError(f"{source}: lstm must be a JSON object, got {type(d['lstm']).__name__} {d['lstm']!r}")
        lo = d["lstm"]
        for key in ("dim", "projection_dim"):
            if key not in lo:
                raise OptionsError(f"{source}: lstm.{key} is missing")

        def _int(sec, key, v, lo_=1):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo_:
                raise OptionsError(f"{source}: {sec}.{key} must be an integer >= {lo_}, got {v!r}")
            return v

        def _clip(key):
            v = lo.get(key)
            if v is None:
                return None
            # ``not v >= 0`` refuses NaN too (Python's json reads NaN), which would make every output NaN;
            # Infinity is a clip that never clips
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise OptionsError(f"{source}: lstm.{key} must be a non-negative number or null, got {v!r}")
            return float(v)

        skip = lo.get("use_skip_connections")
        if skip is None:
            said = "is missing" if "use_skip_connections" not in lo else "is null"
            warnings.warn(f"{source}: lstm.use_skip_connections {said}, so the model is taken to have no residual "
                          "connections (bilm-tf's reading); a weight file cannot tell (both kinds have the same "
                          "shapes) and the published models have them: add the key to say which", stacklevel=3)
            skip = False
        elif not isinstance(skip, bool):
            raise OptionsError(f"{source}: lstm.use_skip_connections must be true or false (a JSON boolean), "
                               f"got {skip!r}")
        lstm = LSTMOptions(
            dim=_int("lstm", "dim", lo["dim"]),
            projection_dim=_int("lstm", "projection_dim", lo["projection_dim"]),
            n_layers=_int("lstm", "n_layers", lo.get("n_layers", 1)),
            cell_clip=_clip("cell_clip"),
            proj_clip=_clip("proj_clip"),
            use_skip_connections=skip,
        )
        if lstm.projection_dim > lstm.dim:
            raise OptionsError(f"{source}: lstm.projection_dim ({lstm.projection_dim}) exceeds lstm.dim ({lstm.dim})")
        cc = None
        if d.get("char_cnn") is not None:
            c = d["char_cnn"]
            if not isinstance(c, dict):
                raise OptionsError(f"{source}: char_cnn must be a JSON object or null, got {type(c).__name__} {c!r}")
            for key in ("filters", "embedding", "activation"):
                if key not in c:
                    raise OptionsError(f"{source}: char_cnn.{key} is missing")
            act = c["activation"]
            if act not in ("relu", "tanh"):
                raise OptionsError(f"{source}: char_cnn.activation must be 'relu' or 'tanh', got {act!r}")
            emb = c["embedding"]
            if not isinstance(emb, dict) or "dim" not in emb:
                raise OptionsError(f"{source}: char_cnn.embedding must be an object with 'dim'")
            if not isinstance(c["filters"], (list, tuple)):
                raise OptionsError(f"{source}: char_cnn.filters must be a list of [width, count] pairs, got "
                                   f"{type(c['filters']).__name__} {c['filters']!r}")
            filters = []
            for f in c["filters"]:
                if not (isinstance(f, (list, tuple)) and len(f) == 2):
                    raise OptionsError(f"{source}: char_cnn.filters entries must be [width, count], got {f!r}")
                filters.append((_int("char_cnn", "filters.width", f[0]), _int("char_cnn", "filters.count", f[1])))
            if not filters:
                raise OptionsError(f"{source}: char_cnn.filters is empty")
            L = _int("char_cnn", "max_characters_per_token", c.get("max_characters_per_token", 50), 3)
            if max(w for w, _ in filters) > L:
                raise OptionsError(f"{source}: a filter is wider than max_characters_per_token={L}")
            cc = CharCNNOptions(
                activation=act,
                embedding_dim=_int("char_cnn", "embedding.dim", emb["dim"]),
                filters=tuple(filters),
                n_highway=_int("char_cnn", "n_highway", c.get("n_highway") or 0, 0),
                max_characters_per_token=L,
                n_characters=_int("char_cnn", "n_characters", c.get("n_characters", 262)),
            )
            if cc.n_filters == lstm.projection_dim and cc.n_highway == 0:
                pass  # no projection and no highway: the CNN output is the token layer (bilm-tf rule)
        return cls(lstm=lstm, char_cnn=cc, raw=d)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ElmoOptions":
        try:
            with open(path, encoding="utf-8-sig") as fh:  # a leading byte-order mark is dropped
                d = json.load(fh)
        except FileNotFoundError:
            raise FileNotFoundError(f"options file not found: {path}") from None
        except IsADirectoryError:
            raise OptionsError(f"options file {path} is a directory, expected an options.json file") from None
        except UnicodeDecodeError as exc:
            raise OptionsError(f"options file {path} is not UTF-8 JSON text (byte {exc.start}: "
                               f"{exc.object[exc.start:exc.start + 1]!r}); is it the weight file or another binary "
                               "file?") from None
        except ValueError as exc:  # json.JSONDecodeError, and the int-digits limit of int()
            raise OptionsError(f"options file {path} is not valid JSON: {exc}") from None
        return cls.from_dict(d, source=str(path))

    def to_inference_dict(self) -> dict[str, Any]:
        """The options dict to write beside dumped weights (``n_characters`` 262, spec §7.1)."""
        d = json.loads(json.dumps(self.raw)) if self.raw else {}
        lstm = self.lstm
        d["lstm"] = {**d.get("lstm", {}), "dim": lstm.dim, "projection_dim": lstm.projection_dim,
                     "n_layers": lstm.n_layers, "cell_clip": lstm.cell_clip, "proj_clip": lstm.proj_clip,
                     "use_skip_connections": lstm.use_skip_connections}
        if self.char_cnn is not None:
            c = self.char_cnn
            d["char_cnn"] = {**d.get("char_cnn", {}), "activation": c.activation, "embedding": {"dim": c.embedding_dim},
                             "filters": [list(f) for f in c.filters], "n_highway": c.n_highway,
                             "max_characters_per_token": c.max_characters_per_token, "n_characters": 262}
        return d

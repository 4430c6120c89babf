"""A second, independent oracle written straight from the spec in float64 NumPy, one row and one step at a
time, with no shortcuts (no dedup, no hoisting, no sorting). Slow; tiny models only."""
from __future__ import annotations

import numpy as np


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def token_layer(ids, arrays, opts):
    """ids (L,) inference ids -> (P,)"""
    table = np.concatenate([np.zeros((1, arrays["char_embed"].shape[1])), arrays["char_embed"]], 0)
    E = table[ids]  # (L, d_c)
    L = len(ids)
    feats = []
    for i, (w, n) in enumerate(opts["char_cnn"]["filters"]):
        W = arrays[f"CNN/W_cnn_{i}"][0].astype(np.float64)  # (w, d_c, n)
        b = arrays[f"CNN/b_cnn_{i}"].astype(np.float64)
        best = np.full(n, -np.inf)
        for p in range(L - w + 1):
            val = b + np.einsum("kc,kco->o", E[p : p + w], W)
            best = np.maximum(best, val)
        feats.append(best)
    v = np.concatenate(feats)
    v = np.maximum(v, 0) if opts["char_cnn"]["activation"] == "relu" else np.tanh(v)
    for k in range(opts["char_cnn"].get("n_highway", 0)):
        g = sigmoid(v @ arrays[f"CNN_high_{k}/W_carry"] + arrays[f"CNN_high_{k}/b_carry"])
        t = np.maximum(v @ arrays[f"CNN_high_{k}/W_transform"] + arrays[f"CNN_high_{k}/b_transform"], 0)
        v = g * t + (1 - g) * v
    if "CNN_proj/W_proj" in arrays:
        v = v @ arrays["CNN_proj/W_proj"] + arrays["CNN_proj/b_proj"]
    return v


def lstm_step(u, h, c, W0, B, WP, lo):
    H = c.shape[0]
    z = np.concatenate([u, h]) @ W0 + B
    i, j, f, o = z[:H], z[H : 2 * H], z[2 * H : 3 * H], z[3 * H :]
    c = sigmoid(f + 1.0) * c + sigmoid(i) * np.tanh(j)
    if lo.get("cell_clip") is not None:
        c = np.clip(c, -lo["cell_clip"], lo["cell_clip"])
    m = sigmoid(o) * np.tanh(c)
    if WP is not None:
        h = m @ WP
        if lo.get("proj_clip") is not None:
            h = np.clip(h, -lo["proj_clip"], lo["proj_clip"])
    else:
        h = m
    return h, c


class NaiveBiLM:
    """Stateful per row, bilm-tf semantics; input: list of rows, each (len+2, 50) ids with boundaries."""

    def __init__(self, arrays, opts):
        self.a = {k: v.astype(np.float64) for k, v in arrays.items()}
        self.opts = opts
        lo = opts["lstm"]
        self.state = {}  # (d, l, row) -> (h, c)
        self.P, self.H, self.nl = lo["projection_dim"], lo["dim"], lo.get("n_layers", 1)

    def run(self, rows):
        lo = self.opts["lstm"]
        out = []
        for r, ids in enumerate(rows):
            n = len(ids)
            x = [token_layer(ids[t], self.a, self.opts) for t in range(n)]
            layers = [[np.concatenate([v, v]) for v in x]]
            per_dir = []
            for d in range(2):
                inp = x
                outs_d = []
                for layer in range(self.nl):
                    pre = f"RNN_{d}/RNN/MultiRNNCell/Cell{layer}/LSTMCell"
                    W0, B = self.a[pre + "/W_0"], self.a[pre + "/B"]
                    WP = self.a.get(pre + "/W_P_0")
                    h, c = self.state.get((d, layer, r), (np.zeros(self.P), np.zeros(self.H)))
                    ys = [None] * n
                    order = range(n) if d == 0 else range(n - 1, -1, -1)
                    for t in order:
                        h, c = lstm_step(inp[t], h, c, W0, B, WP, lo)
                        ys[t] = h + inp[t] if (lo.get("use_skip_connections") and layer > 0) else h
                    if n:
                        self.state[(d, layer, r)] = (h, c)
                    outs_d.append(ys)
                    inp = ys
                per_dir.append(outs_d)
            for layer in range(self.nl):
                layers.append([np.concatenate([per_dir[0][layer][t], per_dir[1][layer][t]]) for t in range(n)])
            out.append(layers)
        return out

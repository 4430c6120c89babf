#!/usr/bin/env bash
# Make the real AllenNLP 2.10.1 ELMo (`allennlp.modules.elmo`: _ElmoBiLm, Elmo, batch_to_ids) runnable here as a
# parity oracle and speed baseline, in its own venv .venv-allennlp next to the project's .venv.
#
#   bash bench/setup_allennlp.sh          # idempotent: a stamp in the venv skips set-up and checks until this
#                                         # script, pyproject.toml, setup.py or csrc/ change (ALLENNLP_SETUP_FORCE=1
#                                         # re-runs them)
#   .venv-allennlp/bin/python -m pytest -q tests/test_allennlp_parity.py
#   .venv-allennlp/bin/python -m pytest bench/bench_cpu_embedding.py --benchmark-only
#
# What is installed, and why (allennlp pins torch<1.13 and pulls spacy, transformers, wandb, ...; we do not):
#   * torch==2.13.0 (CPU, from local disk), numpy, h5py            - what the ELMo code actually computes with;
#   * allennlp==2.10.1 --no-deps                                    - the oracle itself, unmodified;
#   * bilm==0.1.post5 --no-deps (bilm-tf's own package)             - the oracle for its data code: bilm/data.py
#     needs only numpy; bilm/__init__.py imports tensorflow, so tests load the data.py file by path
#     (tests/oracles.py), never `import bilm`;
#   * small pure-Python deps that allennlp's import chain reaches and that are cheap to install for real:
#     tqdm, more-itertools, dill, base58, requests, filelock, rich, huggingface-hub, lmdb, termcolor,
#     and cached-path 1.1.6 --no-deps (the ELMo code path calls cached_path() on the options/weight files);
#   * pytest, pytest-benchmark, and elmo_fast itself (editable, --no-deps), so one process runs both;
#   * a tiny import-stub module, _elmo_oracle_stubs.py (+ a .pth that loads it), written into THIS venv's
#     site-packages only.  It serves placeholder modules for a fixed list of heavy packages (see STUBBED below)
#     that allennlp imports at module level but whose code the ELMo path never executes.  A stub is served only
#     when the real package is absent and only to imports made from allennlp; calling anything taken from a
#     stub raises RuntimeError, so a stub can never silently replace real computation.
#     `python -c "import _elmo_oracle_stubs as s; ..."` -> s.SERVED lists what was stubbed in a process.
# Known limit of the oracle: allennlp refuses `use_skip_connections: false` (ConfigurationError).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
PYTHON="${PYTHON:-python3}"
VENV="${ALLENNLP_VENV:-$ROOT/.venv-allennlp}"
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q)

filter() { grep -v -e "is ignored: it is neither" -e "dependency resolver does not currently" \
                   -e "^allennlp 2.10.1 requires" -e "^cached-path 1.1.6 requires" || true; }

# What the venv was set up from: a stamp holding its hash lets `make test` skip ~70 s of pip and oracle checks.
STAMP="$VENV/.elmo_fast-oracle-setup"
KEY="$( (cat bench/setup_allennlp.sh pyproject.toml setup.py; find csrc -type f 2>/dev/null | LC_ALL=C sort | xargs -r cat) | sha256sum | cut -c1-64)"
installed() {  # the packages are still there (a cheap look, no import)
  "$PY" -c "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in
            ('allennlp', 'bilm', 'cached_path', 'torch', 'elmo_fast', '_elmo_oracle_stubs')))" 2>/dev/null
}
if [ -z "${ALLENNLP_SETUP_FORCE:-}" ] && [ -x "$PY" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$KEY" ] && installed; then
  echo "$VENV is set up (stamp matches this script, pyproject.toml, setup.py, csrc/; ALLENNLP_SETUP_FORCE=1 redoes it)"
  exit 0
fi
rm -f "$STAMP"

if [ ! -x "$PY" ]; then
  echo "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
"${PIP[@]}" "torch==2.13.0" numpy h5py 2>&1 | filter
"${PIP[@]}" --no-deps "allennlp==2.10.1" "cached-path==1.1.6" "bilm==0.1.post5" 2>&1 | filter
"${PIP[@]}" tqdm more-itertools dill base58 requests "filelock>=3.4,<3.8" "rich>=12.1,<13" \
    "huggingface-hub>=0.8.1,<0.11" lmdb "termcolor==1.1.0" pytest pytest-benchmark wheel setuptools 2>&1 | filter
ELMO_FAST_BUILD_CUDA=0 "${PIP[@]}" --no-deps --no-build-isolation -e "$ROOT" 2>&1 | filter

SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cat > "$SITE/_elmo_oracle_stubs.py" <<'PYSTUB'
"""Import-time stand-ins for packages that allennlp 2.10.1 imports but whose code its ELMo path never runs.

Installed by elmo_fast's bench/setup_allennlp.sh into the .venv-allennlp venv only (never into elmo_fast).
A module listed in STUBBED is served by this finder only when (1) no real installation of it exists and
(2) the import comes from allennlp (or from another stub).  Anything taken from a stub is an inert class
that raises if it is ever *called* at run time, so a stub can never silently stand in for real work.
"""
import importlib.abc
import importlib.machinery
import sys
import types

# Exactly the top-level names that `from allennlp.modules.elmo import ...` reaches and that are not installed:
#   spacy, transformers: allennlp/__init__.py imports both; tokenizers/embedders for other models use them.
#   torchvision: allennlp.data.image_loader (vision models).  fairscale: allennlp.nn.parallel / checkpoint
#   (sharded training).  boto3, botocore, google.*: cached_path's S3 / GCS clients (URLs only; the ELMo
#   tests and benchmark give local file paths, which the real cached_path returns unchanged).
#   tensorboardX, nltk, scipy, sklearn: training callbacks and metrics that `from_params` reaches (it imports
#   allennlp.models.archival); the registration test of elmo_fast's token embedder needs from_params.
STUBBED = frozenset({"spacy", "transformers", "torchvision", "fairscale", "boto3", "botocore", "google",
                     "tensorboardX", "nltk", "scipy", "sklearn"})
SERVED = []  # names of the modules this finder created (inspect it to see what was stubbed)


class _StubMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _stub_class(f"{cls.__qualname__}.{name}")

    def __call__(cls, *args, **kwargs):
        # Used as a decorator at import time (e.g. ``@stub.register(...)``): pass the function through.
        if len(args) == 1 and not kwargs and callable(args[0]) and not isinstance(args[0], _StubMeta):
            return args[0]
        raise RuntimeError(f"{cls.__qualname__} is an import stub (bench/setup_allennlp.sh); "
                           "this allennlp code path needs the real package")

    def __getitem__(cls, item):
        return cls

    def __or__(cls, other):
        return cls

    __ror__ = __or__


def _stub_class(qualname):
    return _StubMeta(qualname.rsplit(".", 1)[-1], (object,), {"__qualname__": qualname, "__module__": "stub"})


class _StubModule(types.ModuleType):
    __version__ = "0.0.0+stub"

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _stub_class(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


def _from_allennlp():
    f = sys._getframe(2)
    while f is not None:
        mod = f.f_globals.get("__name__", "") or ""
        if mod.startswith("allennlp") or mod in SERVED:
            return True
        f = f.f_back
    return False


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] not in STUBBED:
            return None
        for finder in sys.meta_path:  # a real installation always wins
            if finder is self:
                continue
            try:
                if finder.find_spec(name, path, target) is not None:
                    return None
            except Exception:  # noqa: BLE001
                continue
        if not _from_allennlp():
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        mod = _StubModule(spec.name)
        mod.__path__ = []
        SERVED.append(spec.name)
        return mod

    def exec_module(self, module):
        pass


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.append(_Finder())
PYSTUB
echo "import _elmo_oracle_stubs" > "$SITE/_elmo_oracle_stubs.pth"

# Check: the oracle imports and runs on torch 2.13 on a random tiny model, next to elmo_fast.
"$PY" - <<'PYCHECK'
import tempfile

import torch
from allennlp.modules.elmo import Elmo, _ElmoBiLm, batch_to_ids  # noqa: F401

import _elmo_oracle_stubs
from elmo_fast import ElmoBiLM
from elmo_fast.testing import TINY_OPTIONS, write_random_model

with tempfile.TemporaryDirectory() as d:
    opt, wts = write_random_model(d, TINY_OPTIONS, seed=0)
    ids = batch_to_ids([["A", "small", "check", "."], ["Ünïcode"], []])
    ref = _ElmoBiLm(opt, wts)(ids)
    ours = ElmoBiLM(opt, wts, backend="reference")(ids)
    diff = max(float((a - b).abs().max()) for a, b in zip(ref["activations"], ours["activations"]))
    assert torch.equal(ref["mask"], ours["mask"]) and diff < 1e-5, diff
stubbed = sorted({n.split(".")[0] for n in _elmo_oracle_stubs.SERVED})
print(f"allennlp ELMo oracle OK on torch {torch.__version__}: max |allennlp - elmo_fast| = {diff:.2e} "
      f"(tiny random model); import stubs served for: {', '.join(stubbed)}")
PYCHECK

# Check: bilm-tf's data code (bilm/data.py) loads by path, without tensorflow.
"$PY" - <<'PYCHECK'
import sys

sys.path.insert(0, "tests")
from oracles import load_bilm_data

data = load_bilm_data()
assert data is not None and "tensorflow" not in sys.modules
print(f"bilm-tf data oracle OK: {data.__file__} (no tensorflow imported)")
PYCHECK

echo "$KEY" > "$STAMP"

"""The original implementations as parity oracles, for the parity suites that `make test-parity` runs from
``.venv-allennlp`` (built by ``bench/setup_allennlp.sh``).

In the project's own venv the oracles are absent and those suites are not collected (`make test` passes
``--ignore``); run by hand there they skip. ``make test-parity`` sets ``ELMO_FAST_REQUIRE_PARITY=1``: then a
missing oracle is an import error, so a parity suite can never pass by skipping.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os

import pytest

REQUIRED = os.environ.get("ELMO_FAST_REQUIRE_PARITY", "") not in ("", "0")
HOW = ("run `make test-parity` (it builds .venv-allennlp with bench/setup_allennlp.sh; "
       "ALLENNLP_SETUP_FORCE=1 make test-parity rebuilds a broken one)")


def require(module: str):
    """``module`` imported; skips the calling test module without it, unless parity is required."""
    if REQUIRED:
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"{module} is not importable in this venv: {HOW}")


def load_bilm_data():
    """bilm-tf's own ``bilm/data.py`` (PyPI ``bilm==0.1.post5``), loaded by path: ``bilm/__init__.py`` imports
    tensorflow, the data module needs only numpy. None when the ``bilm`` distribution is not installed."""
    try:
        dist = importlib.metadata.distribution("bilm")
    except importlib.metadata.PackageNotFoundError:
        return None
    spec = importlib.util.spec_from_file_location("bilm_tf_data", dist.locate_file("bilm/data.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def require_bilm_data():
    data = load_bilm_data()
    if data is None:
        if REQUIRED:
            raise ImportError(f"bilm==0.1.post5 is not installed in this venv: {HOW}")
        pytest.skip(f"bilm (bilm-tf) is not installed in this venv: {HOW}", allow_module_level=True)
    return data


def fixtures_dir(*parts: str) -> str:
    """A folder of the original projects' golden fixtures ($ELMO_FAST_FIXTURES, else /work/fixtures); skips the
    test when it is not on this machine (the fixtures are never committed)."""
    root = os.environ.get("ELMO_FAST_FIXTURES") or "/work/fixtures"
    path = os.path.join(root, *parts)
    if not os.path.isdir(path):
        pytest.skip(f"fixture folder {path} is not here (set ELMO_FAST_FIXTURES)")
    return path

"""bilm-tf's own data code (``bilm/data.py`` of PyPI's ``bilm==0.1.post5``) as a parity oracle.

``bench/setup_allennlp.sh`` installs the package ``--no-deps`` into ``.venv-allennlp``. Its ``bilm/__init__.py``
imports tensorflow, so the module file is loaded by path instead of ``import bilm``; ``bilm/data.py`` itself
needs only numpy.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util


def load_bilm_data():
    """The ``bilm.data`` module, or None when the ``bilm`` distribution is not installed."""
    try:
        dist = importlib.metadata.distribution("bilm")
    except importlib.metadata.PackageNotFoundError:
        return None
    path = dist.locate_file("bilm/data.py")
    spec = importlib.util.spec_from_file_location("bilm_tf_data", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

import random

import numpy as np
import pytest
import torch


def pytest_configure(config):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def pytest_collection_modifyitems(config, items):
    has_gpu = torch.cuda.is_available()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None and not has_gpu:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    random.seed(1234)
    np.random.seed(1234)
    yield


@pytest.fixture
def tiny_model(tmp_path):
    from elmo_fast.testing import write_random_model

    return write_random_model(tmp_path / "tiny")


def triton_available() -> bool:
    from elmo_fast._backend import triton_import_error, triton_interpret

    return triton_import_error() is None and (torch.cuda.is_available() or triton_interpret())


requires_triton = pytest.mark.skipif(
    not triton_available(), reason="needs triton and a GPU, or TRITON_INTERPRET=1 (make test sets it)"
)

import os
import sys
from pathlib import Path

# MKL picks its fp32 GEMM kernels (and so their summation order) by CPU and thread split; the fixtures' reference
# ran on MKL's AVX2 path. Pinning it makes these tests' GEMMs sum like the reference's on any x86 CPU (docs/model.md).
# On an Intel CPU it also selects MKL's AVX2 exp, which rounds unlike the reference's: reference_numerics.py detects that.
os.environ.setdefault("MKL_CBWR", "AVX2,STRICT")

import pytest  # noqa: E402
import torch  # noqa: E402

# the test modules sit in folders that mirror the package (tests/cache/, tests/model/generation/, ...); the shared
# helpers at this root (model_factory, reference_cases, repo_paths, ...) import from each of them
sys.path.insert(0, str(Path(__file__).parent))

from reference_cases import model_case_dirs  # noqa: E402



def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", help="also run the tests marked slow")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: heavier tests, run only with --runslow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="marked slow: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def pytest_generate_tests(metafunc):
    if "case_dir" in metafunc.fixturenames:
        cases = model_case_dirs()
        metafunc.parametrize("case_dir", [str(c) for c in cases], ids=[c.name for c in cases])


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
def accelerator_paths(monkeypatch):
    """The CPU takes the model's CUDA formulations (closed-form attention, gathered-expert MoE, sync-free cache
    writes): what torch.compile and CUDA graphs capture, checked without a GPU."""
    def always(x: torch.Tensor) -> bool:
        return x.dtype != torch.float64 and not torch.is_grad_enabled()

    for name, module in list(sys.modules.items()):
        if name.startswith("modeling_deepseek_v41"):
            if hasattr(module, "fast_path"):
                monkeypatch.setattr(module, "fast_path", always)
    yield
    torch._dynamo.reset()

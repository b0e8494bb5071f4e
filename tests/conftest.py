import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from reference_cases import model_case_dirs  # noqa: E402



def pytest_configure(config):
    config.addinivalue_line("markers", "slow: heavier tests, excluded by -m 'not slow'")


def pytest_generate_tests(metafunc):
    if "case_dir" in metafunc.fixturenames:
        cases = model_case_dirs()
        metafunc.parametrize("case_dir", [str(c) for c in cases], ids=[c.name for c in cases])


@pytest.fixture
def anyio_backend():
    return "asyncio"

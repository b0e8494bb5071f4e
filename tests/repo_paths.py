"""The paths the tests read, the same from every folder under tests/ (the test modules sit one or two levels down)."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
FIXTURES = TESTS / "fixtures"
DEFAULT_CHECKPOINT = ROOT / "examples" / "default-checkpoint"

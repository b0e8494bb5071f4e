"""The README's set-up and the demo's command line, as a new user reads them."""

from __future__ import annotations

import importlib.util
import re

import pytest

from repo_paths import ROOT

README = (ROOT / "README.md").read_text(encoding="utf-8")


def _demo():
    spec = importlib.util.spec_from_file_location("demo", ROOT / "examples" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_help_is_whole_and_every_option_has_help():
    parser = _demo().build_parser()
    text = " ".join(parser.format_help().split())
    assert "answer a question about a picture with DeepSeek-V4.1 through pipeline(\"image-text-to-text\"), DSpark " \
           "drafting on, and print the answer and the measured stats." in text
    options = [action for action in parser._actions if action.option_strings and action.dest != "help"]
    assert {action.dest for action in options} == {"checkpoint", "max_new_tokens"}
    assert all(action.help and "(default: " in action.help for action in options)


@pytest.mark.parametrize("kind", ["missing", "file", "no_config"])
def test_demo_answers_a_wrong_checkpoint_for_that_path(tmp_path, kind):
    demo = _demo()
    path = {"missing": tmp_path / "nope", "file": tmp_path / "weights.bin", "no_config": tmp_path}[kind]
    if kind == "file":
        path.write_bytes(b"")
    with pytest.raises(SystemExit) as stop:
        demo.main(["--checkpoint", str(path)])
    message = str(stop.value)
    assert message.startswith(f"--checkpoint {path} ") and "build_default" not in message


def test_readme_keeps_two_setup_commands():
    setup = README.split("## Set up", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)\n```", setup, re.S)
    assert len(commands) == 2 and commands[0].endswith("python examples/demo.py")
    assert commands[1].endswith("python -m pytest -q tests")


def test_readme_names_python_the_torch_build_and_the_suite():
    required = re.search(r'python_requires=">=([\d.]+)"', (ROOT / "setup.py").read_text()).group(1)
    assert f"Python {required} or newer" in README
    assert "--index-url https://download.pytorch.org/whl/cpu" in README and "CUDA build" in README
    assert re.search(r"\d+ passed, \d+ skipped, about \d+ minutes on 2 CPU cores", README)
    assert "source distribution" in README and "skipped" in README

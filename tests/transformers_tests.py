"""transformers 5.24.0's own common test mixins, fetched from its source distribution (never copied here).

`load_transformers_tests("test_processing_common")` returns that module of the sdist's `tests/` folder. On first
use the sdist is fetched from the package index with pip (`pip download --no-binary :all: --no-deps
transformers==5.24.0`) into `~/.cache/deepseek-v41-tests/` (or `$DEEPSEEK_V41_TESTS_CACHE`), its `tests/` folder is
extracted, and it is made importable as the package `hf_transformers_tests` (so it never clashes with this repo's
`tests/`). When the sdist is not cached and cannot be fetched (an offline machine), the test modules that use the
mixins are skipped with pip's reason and the way to provide it; `DEEPSEEK_V41_REQUIRE_MIXINS=1` makes that an error
(`RuntimeError`) instead, for a CI that must run them.

The sdist lacks the empty `tests/__init__.py` (created in the cache) and four things its top-level test files import; the harness gives each a stand-in:
- `tests/generation/` (`GenerationTesterMixin`) and `tests/exporters/` (`ExportTesterMixin`), imported by
  `test_modeling_common.py`: empty mixin classes (this repo writes its own generation conformance tests);
- `tests/utils/test_configuration_utils.py` (`config_common_kwargs`, imported by `test_configuration_common.py`):
  a non-default value for each argument of the installed `PreTrainedConfig.__init__` (ConfigTester checks that a
  config class passes them through);
- `utils/fetch_hub_objects_for_ci.py` (`url_to_local_path`, which maps the CI's pre-fetched hub files to local
  paths): image URLs map to a deterministic synthetic PNG of the same name made in the cache (this machine has no hub
  access; the tests that use them check structure, not picture content); other URLs are returned unchanged, as the
  real helper does for a file CI did not pre-fetch.

Every mixin test that does not apply to this model is listed in `SKIPPED` with its reason; `skip_inapplicable`
turns that list into skips on a test class.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tarfile
import types
import unittest
from pathlib import Path

TRANSFORMERS_VERSION = "5.24.0"
PACKAGE = "hf_transformers_tests"
CACHE = Path(os.environ.get("DEEPSEEK_V41_TESTS_CACHE", Path.home() / ".cache" / "deepseek-v41-tests"))

# test name -> why it does not apply; one place for every mixin class the suite uses
_ONE_BACKEND = ("one image-processing backend (PIL), the only one that reproduces the reference preprocessing bit "
                "for bit (PIL bicubic ImageOps.pad); there is no second backend to compare or cross-load")
_NO_VIDEO_OR_AUDIO = "DeepSeek-V4.1 takes text and images only: no video processor, no audio processor"
_VIDEO_AUDIO_TESTS = [
    "test_apply_chat_template_audio", *(f"test_apply_chat_template_audio_{i}" for i in range(4)),
    "test_apply_chat_template_decoded_video", "test_apply_chat_template_decoded_video_0",
    "test_apply_chat_template_video", "test_apply_chat_template_video_0", "test_apply_chat_template_video_1",
    "test_apply_chat_template_video_frame_sampling", "test_chat_template_audio_from_video",
    "test_chat_template_audio_sampling_rate", "test_doubly_passed_kwargs_1_videos",
    "test_get_num_multimodal_tokens_matches_processor_call_audio",
    "test_get_num_multimodal_tokens_matches_processor_call_video",
    *(f"{name}_{suffix}" for name in (
        "test_kwargs_overrides_default_subprocessor_kwargs", "test_overlapping_text_image_kwargs_handling",
        "test_structured_kwargs_nested_from_dict", "test_subprocessor_defaults_preserved_by_kwargs",
        "test_unstructured_kwargs", "test_unstructured_kwargs_batched") for suffix in ("1_videos", "2_audio")),
    "test_subprocessor_defaults_2_videos", "test_subprocessor_defaults_3_audio",
]

# test name -> why it does not apply; the one place listing every mixin test the suite skips
SKIPPED: dict[str, dict[str, str]] = {
    "ImageProcessingTestMixin": {
        "test_new_models_require_torchvision_backend": _ONE_BACKEND,
        "test_backends_equivalence": _ONE_BACKEND,
        "test_backends_equivalence_batched": _ONE_BACKEND,
        "test_save_load_backends": _ONE_BACKEND,
        "test_save_load_backends_auto": _ONE_BACKEND,
        "test_can_compile_torchvision_backend": _ONE_BACKEND,
        "test_fast_image_processor_explicit_none_preserved": _ONE_BACKEND,
        "test_call_numpy_4_channels": (
            "DeepSeek-ViT takes RGB only; four-channel input is composited onto white (do_convert_rgb) and "
            "do_convert_rgb=False with four channels is refused with a ValueError"
        ),
        "test_cast_dtype_device": "pixel_values are bf16 by the model's contract (the test expects float32 output)",
        "test_image_processor_preprocess_arguments": (
            "checks the legacy `_valid_processor_keys` / `filter_out_non_signature_kwargs` validation; this "
            "processor validates kwargs the 5.x way (`validate_typed_dict` against DeepseekV41ImageProcessorKwargs)"
        ),
        "test_override_instance_attributes_does_not_affect_other_instances": (
            "checks that a dict `size` and a list `image_mean` are not shared between instances; this processor has "
            "no `size` (the tiling plan sizes each image) and stores `image_mean` as an immutable tuple"
        ),
        "test_pil_can_run_without_torchvision": (
            "marked slow by transformers (a subprocess run); nothing here imports torchvision, which is not installed"
        ),
    },
    "ModelTesterMixin": {
        "test_generation_tester_mixin_inheritance": (
            "GenerationTesterMixin lives in tests/generation/, which the sdist leaves out (the harness has an empty "
            "stand-in); what it checks is tested in tests/model/generation/test_generation_conformance.py"
        ),
        "test_determinism": (
            "converts the outputs to numpy, which has no bfloat16: this model's outputs are bf16 by the reference's "
            "numerics contract (equal repeated forwards: tests/repository/test_modeling_conventions.py::"
            "test_forward_is_deterministic)"
        ),
        **{f"test_model_rope_scaling_from_config_{case}": (
            "runs 1.5 x max_position_embeddings tokens, which this model refuses with a ValueError (DESIGN.md "
            "section 8); 'linear' and 'dynamic' scalings are refused by config validation"
        ) for case in ("0_linear", "1_dynamic", "2_yarn")},
        "test_model_weights_reload_no_missing_tied_weights": (
            "replaces every weight file with one unrelated tensor and expects a load that reports them missing; "
            "DESIGN.md section 8 refuses such a checkpoint before any weight is read, naming the missing and "
            "unexpected tensors (tests/loading/test_loading.py)"
        ),
        "test_reverse_loading_mapping": (
            "asserts that save_pretrained writes the hub's names by default; this model writes the names of "
            "state_dict() by default, so that Trainer's resume, accelerate's load_checkpoint_and_dispatch and "
            "load_state_dict read its checkpoints, and the hub's names with save_original_format=True (both round "
            "trips: tests/repository/test_modeling_conventions.py::"
            "test_save_pretrained_writes_the_state_dict_names_and_the_hub_names_on_request)"
        ),
        "test_bc_torch_dtype": (
            "loads with float16, which this model refuses with a clear error (the reference's activations exceed "
            "float16's range); torch_dtype= and dtype= agree for the supported dtypes: "
            "tests/repository/test_modeling_conventions.py::test_torch_dtype_is_an_alias_of_dtype"
        ),
    },
    "ModelTesterMixin with Engram": {
        **{name: (
            "passes inputs_embeds without input_ids; Engram layers hash the token ids, so an Engram config refuses it "
            "with a ValueError that names the fix (tests/repository/test_modeling_conventions.py::"
            "test_inputs_embeds_without_ids_is_refused_with_engram_layers); DeepseekV41ModelTest runs it without Engram"
        ) for name in ("test_inputs_embeds", "test_inputs_embeds_matches_input_ids")},
    },
    "ProcessorTesterMixin": {
        **{
            f"test_apply_chat_template_image_{index}": (
                "expects one pixel_values row per image; DeepSeek-ViT returns one row per 14x14 patch (the same "
                "checks, with patch counts: tests/processing/test_processor_conventions.py::"
                "test_chat_template_with_image_urls)"
            )
            for index in (0, 1)
        },
        "test_apply_chat_template_tool_calls_no_content": (
            "the chat template does not render tool calls (the DSML tool-call block is not implemented); it "
            "refuses them with a clear error instead of dropping them"
        ),
        "test_get_num_multimodal_tokens_matches_processor_call": (
            "the processor has no `_get_num_multimodal_tokens` (the vLLM-facing helper); span sizes come from "
            "`plan_image` / `span_length`"
        ),
        **{name: _NO_VIDEO_OR_AUDIO for name in _VIDEO_AUDIO_TESTS},
    },
}


def _fetch_sdist() -> Path:
    """The extracted sdist root, fetching it once."""
    root = CACHE / f"transformers-{TRANSFORMERS_VERSION}"
    marker = root / ".complete"
    if marker.exists():
        return root
    CACHE.mkdir(parents=True, exist_ok=True)
    archive = CACHE / f"transformers-{TRANSFORMERS_VERSION}.tar.gz"
    if not archive.exists():
        command = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "--retries", "1",
                   "--timeout", "20", f"transformers=={TRANSFORMERS_VERSION}", "-d", str(CACHE)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0 or not archive.exists():
            _unavailable(
                f"transformers' common test mixins need the transformers {TRANSFORMERS_VERSION} source distribution, "
                f"which is not cached in {CACHE} and could not be fetched (pip download transformers=="
                f"{TRANSFORMERS_VERSION} exited {result.returncode}: {_last_line(result.stderr)}). Run the tests once "
                f"with access to the package index, or put transformers-{TRANSFORMERS_VERSION}.tar.gz into {CACHE} "
                "(the folder $DEEPSEEK_V41_TESTS_CACHE names, if set)."
            )
    prefix = f"transformers-{TRANSFORMERS_VERSION}/tests/"
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and "/models/" not in m.name[len(prefix):]]
        tar.extractall(CACHE, members=members, filter="data")
    marker.write_text("ok\n")
    return root


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no message"


def _unavailable(reason: str) -> None:
    """Skip the calling test module (it is being collected), or raise with DEEPSEEK_V41_REQUIRE_MIXINS=1."""
    if os.environ.get("DEEPSEEK_V41_REQUIRE_MIXINS") == "1":
        raise RuntimeError(reason)
    import pytest

    pytest.skip(reason, allow_module_level=True)


def _stand_in_url_to_local_path(url: str) -> str:
    if not url.lower().endswith((".png", ".jpg", ".jpeg")):
        return url
    from PIL import Image, ImageDraw

    path = CACHE / "stand-in-images" / url.rstrip("/").rsplit("/", 1)[-1]
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        image = Image.new("RGB", (640, 480), (200, 180, 120))
        ImageDraw.Draw(image).ellipse((160, 120, 480, 360), fill=(30, 90, 200))
        image.save(path)
    return str(path)


# a non-default value for each argument of transformers 5.24's PreTrainedConfig.__init__
CONFIG_COMMON_KWARGS = {
    "architectures": ["DeepseekV41ForCausalLM"], "output_hidden_states": True, "return_dict": False,
    "dtype": "float16", "chunk_size_feed_forward": 5, "id2label": {0: "label"}, "label2id": {"label": 0},
    "problem_type": "regression",
}


def _install_stand_ins(tests_dir: Path) -> None:
    fetch = types.ModuleType("fetch_hub_objects_for_ci")
    fetch.url_to_local_path = _stand_in_url_to_local_path
    sys.modules.setdefault("fetch_hub_objects_for_ci", fetch)
    for sub, module_name, name, value in (
        ("generation", "test_utils", "GenerationTesterMixin", None),
        ("exporters", "test_export", "ExportTesterMixin", None),
        ("utils", "test_configuration_utils", "config_common_kwargs", CONFIG_COMMON_KWARGS),
    ):
        package = types.ModuleType(f"{PACKAGE}.{sub}")
        package.__path__ = []
        module = types.ModuleType(f"{PACKAGE}.{sub}.{module_name}")
        setattr(module, name, value if value is not None else type(name, (), {"__doc__": "stand-in: not in the sdist"}))
        setattr(package, module_name, module)
        sys.modules.setdefault(package.__name__, package)
        sys.modules.setdefault(module.__name__, module)


def load_transformers_tests(module: str) -> types.ModuleType:
    """`hf_transformers_tests.<module>` from the transformers 5.24.0 sdist's tests/ (fetched once, cached)."""
    import transformers

    if transformers.__version__ != TRANSFORMERS_VERSION:
        raise RuntimeError(f"The common mixins are those of transformers {TRANSFORMERS_VERSION}; "
                           f"installed is {transformers.__version__}.")
    if PACKAGE not in sys.modules:
        tests_dir = _fetch_sdist() / "tests"
        # the repository's tests/__init__.py is empty and the sdist leaves it out; test_configuration_common reads it
        (tests_dir / "__init__.py").touch(exist_ok=True)
        package = types.ModuleType(PACKAGE)
        package.__path__ = [str(tests_dir)]
        package.__file__ = str(tests_dir / "__init__.py")
        sys.modules[PACKAGE] = package
        _install_stand_ins(tests_dir)
    return importlib.import_module(f"{PACKAGE}.{module}")


def skip_inapplicable(mixin_name: str):
    """Class decorator: each test of `SKIPPED[mixin_name]` becomes a skip carrying its reason."""

    def decorate(cls):
        for name, reason in SKIPPED[mixin_name].items():
            setattr(cls, name, unittest.skip(reason)(lambda self: None))
        return cls

    return decorate

"""Discovery and loading of the reference fixture cases (a checkpoint, its inputs and the reference's outputs)."""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

HERE = Path(__file__).parent
FIXTURES = HERE / "fixtures"


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, also for 1-byte float formats (FP8, E8M0) whose values torch.equal may not compare."""
    raw = (lambda t: t.view(torch.uint8) if t.element_size() == 1 else t)
    return torch.equal(raw(a), raw(b))


def case_roots() -> list[Path]:
    """tests/fixtures, then any folders named in DEEPSEEK_V41_FIXTURES (os.pathsep-separated)."""
    roots = [FIXTURES]
    roots += [Path(p) for p in os.environ.get("DEEPSEEK_V41_FIXTURES", "").split(os.pathsep) if p]
    return roots


def model_case_dirs() -> list[Path]:
    """Every case folder that has a checkpoint and reference outputs; the first of each name wins."""
    seen, cases = set(), []
    for root in case_roots():
        for meta in sorted(root.glob("*/meta.json")):
            folder = meta.parent
            if (folder / "checkpoint" / "config.json").exists() and folder.name not in seen:
                seen.add(folder.name)
                cases.append(folder)
    return cases


@dataclass
class ReferenceCase:
    folder: Path
    meta: dict
    inputs: dict[str, torch.Tensor]
    expected: dict[str, torch.Tensor]

    @property
    def checkpoint(self) -> Path:
        return self.folder / "checkpoint"

    @property
    def config(self) -> dict:
        return json.loads((self.checkpoint / "config.json").read_text())

    @property
    def text_config(self) -> dict:
        return self.config["text_config"]

    @property
    def all_positions_sampled(self) -> bool:
        return self.expected["sampled_positions"].numel() == self.inputs["input_ids"].shape[1]

    def model_inputs(self, length: int | None = None) -> dict[str, torch.Tensor]:
        """input_ids (cut to `length`) and, for image cases, token_types, pixel values and grids."""
        ids = self.inputs["input_ids"]
        kwargs = {"input_ids": ids if length is None else ids[:, :length]}
        if "token_types" in self.inputs:
            kwargs["token_types"] = self.inputs["token_types"][:, : kwargs["input_ids"].shape[1]]
            images = self.meta.get("images", [])
            kwargs["pixel_values"] = torch.cat([self.inputs[f"pixel_values.image{i}"] for i in range(len(images))])
            kwargs["image_grids"] = torch.tensor(
                [[im["n_vit_h"], im["n_vit_w"], im["n_llm_h"], im["n_llm_w"]] for im in images], dtype=torch.long
            )
        return kwargs


@functools.lru_cache(maxsize=None)
def load_case(folder: str) -> ReferenceCase:
    folder = Path(folder)
    return ReferenceCase(
        folder=folder,
        meta=json.loads((folder / "meta.json").read_text()),
        inputs=load_file(folder / "inputs.safetensors"),
        expected=load_file(folder / "expected.safetensors"),
    )


@functools.lru_cache(maxsize=None)
def load_model(folder: str):
    """The case's checkpoint loaded as shipped (quantized weight mode), in eval mode."""
    from transformers import AutoModelForCausalLM

    import modeling_deepseek_v41  # noqa: F401  (registers the Auto classes)

    model = AutoModelForCausalLM.from_pretrained(Path(folder) / "checkpoint")
    return model.eval()

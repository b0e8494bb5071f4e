"""DeepSeek-V4.1 image processor, processor and chat template (no dependency on the model code)."""

from __future__ import annotations

from .image_processing_deepseek_v41 import (
    TOKEN_TYPE_IMAGE,
    TOKEN_TYPE_IMAGE_END,
    TOKEN_TYPE_IMAGE_NEWLINE,
    TOKEN_TYPE_IMAGE_START,
    TOKEN_TYPE_TEXT,
    DeepseekV41ImageProcessor,
    DeepseekV41ImageProcessorKwargs,
    ImagePlan,
    plan_image,
    span_length,
    span_token_types,
)
from .processing_deepseek_v41 import (
    DEFAULT_CHAT_TEMPLATE,
    IMAGE_PLACEHOLDER,
    DeepseekV41Processor,
    DeepseekV41ProcessorKwargs,
)

MODEL_TYPE = "deepseek_v41"


def register_processing(config_class: type | None = None) -> bool:
    """Register the image processor and processor with AutoImageProcessor and AutoProcessor.

    The Auto classes are keyed by the model's config class. Pass it explicitly (the model package does), or
    leave it out to use whatever config class AutoConfig already knows for `model_type` "deepseek_v41".
    Returns whether a registration happened (False when no config class is known yet). Safe to call repeatedly.
    """
    from transformers import AutoImageProcessor, AutoProcessor
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if config_class is None:
        if MODEL_TYPE not in CONFIG_MAPPING:
            return False
        config_class = CONFIG_MAPPING[MODEL_TYPE]
    AutoImageProcessor.register(config_class, image_processor_classes={"pil": DeepseekV41ImageProcessor}, exist_ok=True)
    AutoProcessor.register(config_class, DeepseekV41Processor, exist_ok=True)
    return True


register_processing()

__all__ = [
    "DEFAULT_CHAT_TEMPLATE",
    "IMAGE_PLACEHOLDER",
    "TOKEN_TYPE_IMAGE",
    "TOKEN_TYPE_IMAGE_END",
    "TOKEN_TYPE_IMAGE_NEWLINE",
    "TOKEN_TYPE_IMAGE_START",
    "TOKEN_TYPE_TEXT",
    "DeepseekV41ImageProcessor",
    "DeepseekV41ImageProcessorKwargs",
    "DeepseekV41Processor",
    "DeepseekV41ProcessorKwargs",
    "ImagePlan",
    "plan_image",
    "register_processing",
    "span_length",
    "span_token_types",
]

"""DeepSeek-V4.1-Flash for Hugging Face Transformers. Importing this package registers it with the Auto classes."""

from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from .config.configuration_deepseek_v41 import DeepseekV41Config, DeepseekV41TextConfig, DeepseekV41VisionConfig
from .config.layer_plan import LayerPlan, LayerSpec
from .model.causal_lm import DeepseekV41ForCausalLM
from .model.pretrained import DeepseekV41PreTrainedModel


def _register() -> None:
    for config_class in (DeepseekV41Config, DeepseekV41TextConfig, DeepseekV41VisionConfig):
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    AutoModelForCausalLM.register(DeepseekV41Config, DeepseekV41ForCausalLM, exist_ok=True)
    AutoModelForImageTextToText.register(DeepseekV41Config, DeepseekV41ForCausalLM, exist_ok=True)
    try:  # the processors live in the sibling `processing` package, absent from a remote-code checkpoint
        from processing import register_processing
    except ImportError:
        return
    register_processing(DeepseekV41Config)


_register()

__all__ = [
    "DeepseekV41Config",
    "DeepseekV41TextConfig",
    "DeepseekV41VisionConfig",
    "DeepseekV41ForCausalLM",
    "DeepseekV41PreTrainedModel",
    "LayerPlan",
    "LayerSpec",
]

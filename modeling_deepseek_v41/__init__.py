"""DeepSeek-V4.1-Flash for Hugging Face Transformers. Importing this package registers it with the Auto classes."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText

from .config.configuration_deepseek_v41 import DeepseekV41Config, DeepseekV41TextConfig, DeepseekV41VisionConfig
from .config.layer_plan import CSA2Role, LayerPlan, LayerSpec
from .loading.checkpoint_layout import check_local_paths_first
from .loading.loader import register_hub_names
from .model.backbone import DeepseekV41Model, DeepseekV41ModelOutput
from .model.causal_lm import DeepseekV41ForCausalLM
from .model.pretrained import DeepseekV41PreTrainedModel


def _register() -> None:
    for config_class in (DeepseekV41Config, DeepseekV41TextConfig, DeepseekV41VisionConfig):
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    AutoModel.register(DeepseekV41Config, DeepseekV41Model, exist_ok=True)
    AutoModelForCausalLM.register(DeepseekV41Config, DeepseekV41ForCausalLM, exist_ok=True)
    register_hub_names(DeepseekV41ForCausalLM.__name__)  # the released checkpoint's flat tensor names load
    AutoModelForImageTextToText.register(DeepseekV41Config, DeepseekV41ForCausalLM, exist_ok=True)
    for auto_class in (AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText):
        check_local_paths_first(auto_class)  # a missing folder or a file is named so, not as a bad repo id
    try:  # the processors live in the sibling `processing` package, absent from a remote-code checkpoint
        from processing import register_processing
    except ImportError:
        return
    register_processing(DeepseekV41Config)


_register()

__all__ = [
    "CSA2Role",
    "DeepseekV41Config",
    "DeepseekV41TextConfig",
    "DeepseekV41VisionConfig",
    "DeepseekV41ForCausalLM",
    "DeepseekV41Model",
    "DeepseekV41ModelOutput",
    "DeepseekV41PreTrainedModel",
    "LayerPlan",
    "LayerSpec",
]

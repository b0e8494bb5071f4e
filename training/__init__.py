"""Training DeepSeek-V4.1 with Transformers: data generators, collators, the DSpark drafter objective, LoRA
helpers, and the scripts that build the embedded default checkpoint (`examples/default-checkpoint`)."""

from .collator import DeepseekV41TrainingCollator
from .data import COLOURS, MAIN_QUESTION, SHAPES, ShapeSample, draw_shape, python_doc_text, shape_qa_examples, \
    text_examples
from .drafter import DSparkDrafterTrainer, dspark_loss, dspark_training_logits, freeze_all_but_drafter
from .lm import DeepseekV41Trainer, moe_balance_loss

__all__ = [
    "COLOURS", "MAIN_QUESTION", "SHAPES", "ShapeSample", "draw_shape", "python_doc_text", "shape_qa_examples",
    "text_examples", "DeepseekV41TrainingCollator", "DSparkDrafterTrainer", "dspark_loss", "dspark_training_logits",
    "freeze_all_but_drafter", "DeepseekV41Trainer", "moe_balance_loss",
]

"""transformers 5.24.0's common model and config test mixins (`ModelTesterMixin`, `ConfigTester`), fetched from its
source distribution by `transformers_tests.py`, run against a tiny random DeepSeek-V4.1: two layers (a ratio-2 pool
in the encoder half, a ratio-1 pool with candidate blocks in the decoder half) and no drafter, once without Engram
layers (so that `inputs_embeds` alone applies) and once with an Engram layer, the models built by the mixins
themselves (`model_class(config)`). Tests that do not apply are listed, each with its reason, in
`transformers_tests.SKIPPED["ModelTesterMixin"]` (and `["ModelTesterMixin with Engram"]`); the mixins skip others by
their own conditions (accelerator, flash/SDPA kernels, DeepSpeed, attention maps), with the reason `pytest -rs`
prints."""

from __future__ import annotations

import unittest
from unittest import mock

import torch
from transformers.models.auto import modeling_auto

from model_factory import schedule_config, tiny_config
from modeling_deepseek_v41 import DeepseekV41Config, DeepseekV41ForCausalLM, DeepseekV41Model
from modeling_deepseek_v41.config.configuration_deepseek_v41 import config_without_dspark
from transformers_tests import load_transformers_tests, skip_inapplicable

modeling_common = load_transformers_tests("test_modeling_common")
configuration_common = load_transformers_tests("test_configuration_common")


class DeepseekV41ModelTester:
    """The tiny config and inputs the mixin tests build models from."""

    def __init__(self, parent, batch_size: int = 2, seq_length: int = 7) -> None:
        self.parent = parent
        self.batch_size, self.seq_length = batch_size, seq_length
        config = self.get_config()
        text = config.text_config
        self.vocab_size, self.hidden_size = text.vocab_size, text.hidden_size
        self.num_hidden_layers, self.num_attention_heads = text.num_hidden_layers, text.num_attention_heads
        self.is_training = True

    def get_config(self) -> DeepseekV41Config:
        # two layers (the mixins' limit): a ratio-2 pool in the encoder half, a ratio-1 pool with candidate blocks in
        # the decoder half; under the mixins' 1M parameters
        return config_without_dspark(tiny_config(
            num_hidden_layers=2, compress_ratios=[2, 1], kv_source_layer_ids=[0, 1], index_source_layer_ids=[0, 1],
            candidate_source_layer_id=1, engram_layer_ids=[], engram_num_embeddings=[], dspark_target_layer_ids=[],
            num_nextn_predict_layers=0, n_routed_experts=4))

    def prepare_config_and_inputs_for_common(self):
        config = self.get_config()
        input_ids = torch.randint(3, self.vocab_size, (self.batch_size, self.seq_length))
        attention_mask = torch.ones_like(input_ids)
        return config, {"input_ids": input_ids, "attention_mask": attention_mask}


@skip_inapplicable("ModelTesterMixin")
class DeepseekV41ModelTest(modeling_common.ModelTesterMixin, unittest.TestCase):
    all_model_classes = (DeepseekV41Model, DeepseekV41ForCausalLM)
    has_attentions = False  # the sparse attention never materialises attention maps
    test_resize_embeddings = True
    test_all_params_have_gradient = False  # the MoE routing biases are not trained by gradient

    @classmethod
    def setUpClass(cls) -> None:
        # what being in-tree means to the mixins: they find the base and causal-LM classes by name in these tables
        cls._auto_names = [
            mock.patch.dict(modeling_auto.MODEL_MAPPING_NAMES, {"deepseek_v41": "DeepseekV41Model"}),
            mock.patch.dict(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, {"deepseek_v41": "DeepseekV41ForCausalLM"}),
        ]
        for patch in cls._auto_names:
            patch.start()

    @classmethod
    def tearDownClass(cls) -> None:
        for patch in cls._auto_names:
            patch.stop()

    def setUp(self) -> None:
        self.model_tester = DeepseekV41ModelTester(self)
        self.config_tester = configuration_common.ConfigTester(self, config_class=DeepseekV41Config,
                                                               has_text_modality=False)

    def test_config(self) -> None:
        self.config_tester.run_common_tests()


class DeepseekV41EngramModelTester(DeepseekV41ModelTester):
    """The same two-layer schedule with an Engram layer (hashed n-gram tables gated into the streams)."""

    def get_config(self) -> DeepseekV41Config:
        return config_without_dspark(schedule_config(dict(
            num_hidden_layers=2, compress_ratios=[2, 1], kv_source_layer_ids=[0, 1], index_source_layer_ids=[0, 1],
            candidate_source_layer_id=1, engram_layer_ids=[1], dspark_target_layer_ids=[],
            num_nextn_predict_layers=0, n_routed_experts=4,
            engram_compressed_vocab_size=16)))  # ConfigTester reloads the config with vocab_size=20


@skip_inapplicable("ModelTesterMixin")
@skip_inapplicable("ModelTesterMixin with Engram")
class DeepseekV41EngramModelTest(DeepseekV41ModelTest):
    """ModelTesterMixin on an Engram config: models built by the mixins as `model_class(config)`."""

    def setUp(self) -> None:
        super().setUp()
        self.model_tester = DeepseekV41EngramModelTester(self)

"""DeepSeek-V4.1-Flash for causal language modelling: the base model (`model`) and its output head (`lm_head`)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_outputs import MoeCausalLMOutputWithPast
from transformers.utils.generic import can_return_tuple

from ..cache.cache import DeepseekV41Cache
from ..config.configuration_deepseek_v41 import DeepseekV41Config
from ..layers.dspark import DeepseekV41DSpark
from ..layers.linear import DeepseekV41Linear
from ..loading.loader import accept_hub_names
from .backbone import DeepseekV41Model
from .generation import DeepseekV41GenerationMixin
from .pretrained import DeepseekV41PreTrainedModel


@dataclass
class DeepseekV41CausalLMOutput(MoeCausalLMOutputWithPast):
    """MoE causal-LM output plus the DSpark tap (mean over streams of each target layer's input, concatenated)
    and the experts every layer chose. `hidden_states` and `hc_streams` are the base model's (see
    `DeepseekV41ModelOutput`)."""

    hc_streams: tuple[torch.Tensor, ...] | None = None
    dspark_hidden: torch.Tensor | None = None
    router_experts: tuple[torch.Tensor, ...] | None = None


class DeepseekV41ForCausalLM(DeepseekV41GenerationMixin, DeepseekV41PreTrainedModel):
    """`DeepseekV41Model` (`model`: embeddings, blocks, norm, DSpark drafter blocks, vision tower) and the output
    head (`lm_head`). The released checkpoint names its tensors flat (`embed.weight`, `layers.N...`, `head.weight`,
    `mtp.N...`): the checkpoint conversion mapping registered for this class renames them on load, and
    `save_pretrained(save_original_format=True)` writes them so; by default `save_pretrained` writes the module
    names of `state_dict()`."""

    _tp_plan = {"lm_head": "deepseek_v41_vocab_rows"}

    def __init__(self, config: DeepseekV41Config) -> None:
        super().__init__(config)
        text = config.text_config
        self.model = DeepseekV41Model(config)
        self.lm_head = DeepseekV41Linear(text.hidden_size, text.vocab_size, dtype=torch.float32)
        self.register_load_state_dict_pre_hook(accept_hub_names)  # the released files' names load too
        self.post_init()

    @property
    def plan(self):
        """The base model's LayerPlan (the CSA2 schedule)."""
        return self.model.plan

    @property
    def quantized(self) -> bool:
        return self.model.quantized

    @property
    def dspark(self) -> DeepseekV41DSpark:
        """The DSpark drafter (the base model's `mtp`, the checkpoint's name; empty without drafter weights): what
        drafting and drafter training run, with this model's embedding and head."""
        return self.model.mtp

    @property
    def mtp(self) -> nn.ModuleList:
        """Deprecated (removed in the next release): the DSpark drafter is `model.dspark`, `model.model.mtp`."""
        warnings.warn("DeepseekV41ForCausalLM.mtp is deprecated and will be removed in the next release: the DSpark "
                      "drafter is model.dspark, which lives in the base model as model.model.mtp.", FutureWarning,
                      stacklevel=2)
        return self.model.mtp

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.embed = value

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_output_embeddings(self, new_embeddings: nn.Module) -> None:
        self.lm_head = new_embeddings

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True) -> nn.Embedding:
        """The base model's resizing (embedding, head, Engram token map), and of the DSpark drafter's Markov
        tables."""
        embeddings = super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
        vocab = embeddings.weight.shape[0]
        if self.has_dspark:  # the drafter's bigram bias is indexed by the previous token and scores every token
            markov = self.dspark[-1].markov_head
            markov.embed = self._get_resized_embeddings(markov.embed, vocab, mean_resizing=mean_resizing)
            markov.head = self._get_resized_lm_head(markov.head, vocab, mean_resizing=mean_resizing)
        return embeddings

    def _get_resized_lm_head(self, old_lm_head: DeepseekV41Linear, new_num_tokens: int | None = None,
                             transposed: bool = False, mean_resizing: bool = True) -> DeepseekV41Linear:
        """The head with `new_num_tokens` rows: kept rows copied, added rows initialised as transformers does
        (the old rows' mean and covariance with `mean_resizing`, else the init distribution)."""
        old_rows = old_lm_head.out_features
        if new_num_tokens is None or new_num_tokens == old_rows:
            return old_lm_head
        weight = old_lm_head.weight
        new_lm_head = DeepseekV41Linear(old_lm_head.in_features, new_num_tokens, dtype=weight.dtype).to(weight.device)
        kept = min(old_rows, new_num_tokens)
        with torch.no_grad():
            if new_num_tokens > old_rows and mean_resizing:
                self._init_added_lm_head_weights_with_mean(old_lm_head, new_lm_head, old_lm_head.in_features,
                                                           old_rows, new_num_tokens - old_rows, transposed)
            elif new_num_tokens > old_rows:
                self._init_weights(new_lm_head)
            new_lm_head.weight[:kept] = weight[:kept]
        new_lm_head._is_hf_initialized = True  # a later post_init() must keep the copied rows
        return new_lm_head

    def build_engram_token_map(self, tokenizer) -> None:
        """Build the Engram compressed token map from `tokenizer` (it is saved with the model afterwards)."""
        self.model.build_engram_token_map(tokenizer)

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        past_key_values=None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_router_logits: bool | None = None,
        output_attentions: bool | None = None,
        token_types: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grids: torch.Tensor | None = None,
        prefill_mode: str | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> DeepseekV41CausalLMOutput:
        """Logits for every position (or the last `logits_to_keep`), a shifted cross-entropy loss with `labels`,
        and router logits with `output_router_logits`. `token_types` (-1 text, >= 0 image span) marks image spans."""
        cache = cache if cache is not None else past_key_values
        run = cache.generation_run if isinstance(cache, DeepseekV41Cache) else None
        graphs = run.graphs if run is not None else None
        if graphs is not None and graphs.handles(cache, input_ids, pixel_values) and labels is None:
            return DeepseekV41CausalLMOutput(logits=graphs.step(input_ids), cache=cache)
        outputs = self.model(
            input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
            inputs_embeds=inputs_embeds, use_cache=use_cache, output_hidden_states=output_hidden_states,
            output_router_logits=output_router_logits, output_attentions=output_attentions, token_types=token_types,
            pixel_values=pixel_values, image_grids=image_grids, prefill_mode=prefill_mode, return_dict=True,
        )
        kept = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(outputs.last_hidden_state[:, kept])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.config.text_config.vocab_size, **kwargs)
        return DeepseekV41CausalLMOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, hc_streams=outputs.hc_streams,
            cache=outputs.cache,
            router_logits=outputs.router_logits, dspark_hidden=outputs.dspark_hidden,
            router_experts=outputs.router_experts,
        )

"""Aten ops per module in one static decode step with the GPU formulations (Triton interpreter), released schedule."""
import collections, json, os, sys
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, "tests"); sys.path.insert(0, ".")
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from reference_cases import FIXTURES
from model_factory import random_model
from modeling_deepseek_v41 import DeepseekV41Config
from modeling_deepseek_v41.cache import DeepseekV41Cache

raw = json.loads((FIXTURES / "spec" / "official_config.json").read_text())
text = raw["text_config"]
text.update(hidden_size=256, num_attention_heads=4, q_lora_rank=64, o_groups=2, o_lora_rank=32, index_n_heads=2,
            index_topk=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, vocab_size=1024,
            engram_vocab_size=4000, engram_n_heads=2, engram_head_dim=32, engram_compressed_vocab_size=500,
            candidate_topk_blocks=8, dspark_n_routed_experts=8, dspark_num_experts_per_tok=2, dspark_markov_rank=16,
            max_position_embeddings=4096, dspark_noise_token_id=1000)
from types import SimpleNamespace
from modeling_deepseek_v41.layers.engram_hashing import engram_table_rows
text["engram_num_embeddings"] = engram_table_rows(SimpleNamespace(**text))
text["engram_pad_token_id"] = 2
cfg = DeepseekV41Config(text_config=text, quantization_config=raw["quantization_config"], weight_mode="quantized")
from modeling_deepseek_v41 import DeepseekV41ForCausalLM
torch.manual_seed(0)
model = DeepseekV41ForCausalLM(cfg).eval()
with torch.no_grad():
    for name, p in model.named_parameters():
        if p.dtype == torch.float8_e4m3fn:
            p.copy_((torch.randn(p.shape) * 8).to(torch.float8_e4m3fn))
        elif p.dtype == torch.float8_e8m0fnu:
            p.view(torch.uint8).fill_(118)
        elif p.dtype == torch.int8:
            p.copy_(torch.randint(-128, 128, p.shape, dtype=torch.int8))
        elif p.dim() >= 2:
            p.normal_(0, p.shape[-1] ** -0.5)
    model.model.engram_token_map.copy_(torch.arange(text["vocab_size"]) % text["engram_compressed_vocab_size"])
model = model.to(torch.bfloat16) if False else model
ids = torch.randint(3, 1000, (1, 300))
stack = []
for name, mod in model.named_modules():
    mod.register_forward_pre_hook(lambda m, a, n=name: (stack.append(n), None)[1])
    mod.register_forward_hook(lambda m, a, o: (stack.pop(), None)[1])
counts = collections.Counter()
ops = collections.Counter()


import triton.runtime.interpreter as _interp
_inside = [0]
_orig = _interp.GridExecutor.__call__


def _launch(self, *a, **k):
    if not _inside[0]:
        where = stack[-1] if stack else "-"
        where = ".".join(p for p in where.split(".") if not p.isdigit())
        counts[where] += 1
        ops[(where, "triton:" + self.fn.__name__)] += 1
    _inside[0] += 1
    try:
        return _orig(self, *a, **k)
    finally:
        _inside[0] -= 1


_interp.GridExecutor.__call__ = _launch


class Count(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _inside[0] or func.overloadpacket.__name__ in ("view", "_unsafe_view", "as_strided", "empty", "new_empty", "detach", "alias", "t", "transpose", "unsqueeze", "squeeze", "expand", "permute", "slice", "select", "unflatten", "reshape", "_reshape_alias", "split", "unbind", "empty_strided", "lift_fresh"):
            return func(*args, **(kwargs or {}))
        where = stack[-1] if stack else "-"
        where = ".".join(p for p in where.split(".") if not p.isdigit())
        counts[where] += 1
        ops[(where, str(func.overloadpacket.__name__))] += 1
        return func(*args, **(kwargs or {}))


with torch.no_grad():
    cache = DeepseekV41Cache(model.config)
    model(ids[:, :299], cache=cache)
    cache.make_static(310)
    for name in ("kernels.mhc", "kernels.sparse_attention", "kernels.expert_ops", "kernels.linear", "cache.kv_access"):
        setattr(sys.modules[f"modeling_deepseek_v41.{name}"], "kernel_path",
                lambda x: not torch.is_grad_enabled() and x.numel() > 0)
    model(ids[:, 299:300], cache=cache)
    with Count():
        model(ids[:, 299:300] * 0 + 5, cache=cache)
print("total aten ops", sum(counts.values()))
for k, v in counts.most_common(40):
    print(f"{v:6d}  {k}")
print()
for k, v in ops.most_common(60):
    print(f"{v:6d}  {k}")

"""Where the model's CUDA calls go (issue 16), checked on the CPU: the kernels' predicate is patched to accept CPU
tensors and the Triton kernels run in the interpreter (TRITON_INTERPRET=1) on the tiny-text fixture.

- every FP8/FP4/dense linear, the routed experts and the attention's grouped wo_a reach their kernel, and the
  emulation's whole-weight dequantization is not called;
- the fixture's logits through the kernels stay within the fixtures' loose (GPU) bounds of the reference;
- a k-token forward equals k one-token steps bit for bit through the kernels (batch invariance, what DSpark's
  verify step relies on).
"""

from __future__ import annotations

import copy
import os
import sys
from collections import Counter

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel is defined, so before the kernel modules load

from modeling_deepseek_v41.kernels import gpu_linear, numerics  # noqa: E402
from reference_cases import load_case, load_model, model_case_dirs  # noqa: E402

TEXT_CASE = next((c for c in model_case_dirs() if c.name == "tiny-text"), None)
pytestmark = [
    pytest.mark.skipif(TEXT_CASE is None, reason="the tiny-text fixture is not present"),
    # the kernels run on CPU tensors only in the interpreter; on a GPU tests/gpu/test_cuda.py checks the same on CUDA
    pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter dispatch check (CPU tensors); see tests/gpu"),
]
KERNELS = ("fp8_linear", "fp4_linear", "dense_linear", "grouped_linear", "grouped_moe", "fp8_dequantize",
           "fp4_dequantize", "linear_pair", "fp4_rows", "fp32_linear")
# FP4 experts: inside grouped_moe; wq_a with wkv and the shared expert's w1 with w3: linear_pair; the index
# queries' QDQ and the pool's packing: fp4_rows; the router's fp32 logits: fp32_linear
MODEL_KERNELS = {"fp8_linear", "dense_linear", "grouped_linear", "grouped_moe", "linear_pair", "fp4_rows",
                 "fp32_linear"}


@pytest.fixture
def kernel_calls(monkeypatch):
    """The kernels' predicate accepts CPU tensors (no-grad, not float64); returns a Counter of kernel calls."""
    def on_any_device(x: torch.Tensor) -> bool:
        return x.dtype != torch.float64 and not torch.is_grad_enabled() and x.numel() > 0

    for name, module in list(sys.modules.items()):
        if name.startswith("modeling_deepseek_v41") and hasattr(module, "kernel_path"):
            monkeypatch.setattr(module, "kernel_path", on_any_device)
    from modeling_deepseek_v41.kernels import triton as kernels

    calls = Counter()

    def counted(name):
        function = getattr(kernels, name)

        def call(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)
        return call

    spies = type("Kernels", (), {name: staticmethod(counted(name)) for name in KERNELS})
    monkeypatch.setattr(gpu_linear, "triton_kernels", lambda: spies)

    def no_whole_weight(*args, **kwargs):
        raise AssertionError("the kernel path dequantized a whole weight")

    for name, module in list(sys.modules.items()):
        if name.startswith("modeling_deepseek_v41"):
            for helper in ("dequantize_fp8_weight", "dequantize_fp4_weight"):
                if hasattr(module, helper) and module is not numerics:
                    monkeypatch.setattr(module, helper, no_whole_weight)
    return calls


def _model():
    return copy.deepcopy(load_model(str(TEXT_CASE)))


def test_two_plain_linears_of_one_input_are_one_kernel_call(kernel_calls):
    """linear_pair: the attention's wq_a and wkv in one launch, each output its linear's; a module that wraps one
    of them (an adapter) is called as it is, and so is a pair that records gradients."""
    from modeling_deepseek_v41.layers.linear import linear_pair

    attn = _model().model.layers[0].attn
    x = torch.randn(1, 3, attn.wq_a.in_features, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.no_grad():
        q, kv = linear_pair(x, attn.wq_a, attn.wkv)
        assert kernel_calls == Counter(linear_pair=1)
        torch.testing.assert_close(q, attn.wq_a(x), rtol=0, atol=0.02)
        torch.testing.assert_close(kv, attn.wkv(x), rtol=0, atol=0.02)

        class Doubled(torch.nn.Module):
            def forward(self, t):
                return 2 * attn.wkv(t)

        kernel_calls.clear()
        linear_pair(x, attn.wq_a, Doubled())
        assert kernel_calls == Counter(fp8_linear=2)
        handle = attn.wkv.register_forward_hook(lambda module, args, out: None)  # accelerate's offload hooks too
        kernel_calls.clear()
        linear_pair(x, attn.wq_a, attn.wkv)
        handle.remove()
        assert kernel_calls == Counter(fp8_linear=2)
    kernel_calls.clear()
    linear_pair(x.requires_grad_(), attn.wq_a, attn.wkv)
    assert "linear_pair" not in kernel_calls


@pytest.mark.slow  # the interpreter runs every kernel program in numpy: minutes on 2 busy cores
def test_fixture_logits_through_the_kernels(kernel_calls):
    case = load_case(str(TEXT_CASE))
    model = _model()
    length = 32
    inputs = {k: v[:1] for k, v in case.model_inputs(length).items()}
    with torch.no_grad():
        logits = model(**inputs).logits
    assert set(kernel_calls) == MODEL_KERNELS, kernel_calls
    config = model.config.text_config
    assert kernel_calls["grouped_moe"] == config.num_hidden_layers  # one grouped call per MoE layer
    for row in range(logits.shape[0]):
        clean = min(length, int(case.expected["clean_prefix"][row]))
        expected = case.expected["logits"][row, :clean]
        rel = ((logits[row, :clean].float() - expected).norm(dim=-1) / expected.norm(dim=-1)).median()
        top1 = (logits[row, :clean].argmax(-1) == expected.argmax(-1)).float().mean()
        assert rel <= 0.2 and top1 >= 0.7, (row, float(rel), float(top1))


@pytest.mark.slow  # as above; the same check runs compiled in tests/gpu/test_cuda.py
def test_k_token_forward_equals_k_single_steps_through_the_kernels(kernel_calls):
    from modeling_deepseek_v41.cache import DeepseekV41Cache

    case = load_case(str(TEXT_CASE))
    model = _model()
    ids = case.inputs["input_ids"][:1, :24]
    prompt, k = 20, 4
    with torch.no_grad():
        cache = DeepseekV41Cache(model.config)
        model(input_ids=ids[:, :prompt], cache=cache)
        stepped = copy.deepcopy(cache)
        together = model(input_ids=ids[:, prompt:prompt + k], cache=cache).logits[0]
        single = torch.cat([model(input_ids=ids[:, t:t + 1], cache=stepped).logits[0]
                            for t in range(prompt, prompt + k)])
    assert kernel_calls["grouped_moe"] > 0
    assert torch.equal(together, single), (together - single).abs().max()


def test_grad_enabled_dense_calls_keep_the_emulation(kernel_calls):
    """A trainable dense weight needs its own gradient, which the kernels do not give: torch's linear."""
    from modeling_deepseek_v41.layers.linear import DeepseekV41Linear

    layer = DeepseekV41Linear(64, 32, storage="dense", dtype=torch.float32)
    torch.nn.init.normal_(layer.weight)
    x = torch.randn(3, 64)
    with torch.enable_grad():
        layer(x).sum().backward()
    assert layer.weight.grad is not None and not kernel_calls
    with torch.no_grad():
        out = layer(x)
    assert kernel_calls["dense_linear"] == 1
    torch.testing.assert_close(out, x @ layer.weight.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("storage", ["fp8", "fp4"])
def test_adapter_training_runs_both_directions_on_the_kernels(kernel_calls, storage):
    """A frozen FP8/FP4 linear under autograd (LoRA on the shipped weights): the forward takes the linear kernel
    and the input gradient the dequantize kernel plus one GEMM, never the emulation's whole-weight fp32 copy; both
    agree with the emulation."""
    from modeling_deepseek_v41.layers.linear import DeepseekV41Linear

    layer = DeepseekV41Linear(128, 64, storage=storage)
    quantize = numerics.quantize_fp8_weight if storage == "fp8" else numerics.quantize_fp4_weight
    weight, scale = quantize(torch.randn(64, 128, generator=torch.Generator().manual_seed(1)) * 0.05)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.scale.copy_(scale)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(2)).requires_grad_()
    grad_out = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    out = layer(x)
    out.backward(grad_out)
    assert kernel_calls[f"{storage}_linear"] == 1 and kernel_calls[f"{storage}_dequantize"] == 1, kernel_calls
    dense = (numerics.dequantize_fp8_weight if storage == "fp8" else numerics.dequantize_fp4_weight)(
        weight, scale, torch.float32)
    expected = (numerics.fp8_act_qdq(x.detach()) @ dense.T)
    torch.testing.assert_close(out.detach(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, grad_out @ dense, rtol=1e-5, atol=1e-5)
    assert layer.weight.grad is None and layer.scale.grad is None
    with torch.enable_grad():  # an input that needs no gradient (before the first adapter) takes the kernel too
        frozen = layer(x.detach())
    assert kernel_calls[f"{storage}_linear"] == 2 and not frozen.requires_grad
    torch.testing.assert_close(frozen, expected, rtol=1e-5, atol=1e-5)

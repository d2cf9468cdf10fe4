"""Test support: a block-FP8 matmul vLLM's CPU build can run here. Its own block-FP8 kernels need
AMX tiles (Sapphire Rapids or newer), which CI machines lack, so an FP8 model cannot even be
built. Importing this module appends a plain-torch kernel to vLLM's CPU list: it dequantizes the
weight (values times their block's scale) and multiplies in float32. Everything else is vLLM's
own: the checkpoint loader, the weight loaders' tensor-parallel sharding of values and scales,
`process_weights_after_loading` (the generic block-FP8 one, which keeps values and scales as
loaded), and the layerwise reload.

Block-FP8 experts likewise: vLLM's CPU build has no FP8 MoE backend at all (its oracle picks
`Fp8MoeBackend.NONE`, and processing the loaded experts then raises). Where it picks none, the FP8
MoE method here keeps the experts' values and scales as loaded (the checkpoint's layout, per
expert) and runs them dequantized in plain torch, expert by expert (SiLU-gated, as Qwen3-MoE).
The weight loaders that place each expert's values and scales stay vLLM's.

vLLM's worker processes import it through `worker_extension_cls="fp8_cpu_kernel.Ext"` (this folder
on PYTHONPATH)."""

import torch
from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend
from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod
from vllm.model_executor.kernels.linear import _POSSIBLE_FP8_BLOCK_KERNELS
from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import Fp8BlockScaledMMLinearKernel
from vllm.platforms import PlatformEnum


class DequantizingFp8BlockKernel(Fp8BlockScaledMMLinearKernel):
    apply_input_quant = False

    @classmethod
    def is_supported(cls, compute_capability=None):
        return True, None

    def apply_block_scaled_mm(self, A, B, As, Bs):
        bn, bk = self.weight_group_shape.row, self.weight_group_shape.col
        s = Bs.repeat_interleave(bn, 0)[: B.shape[0]].repeat_interleave(bk, 1)[:, : B.shape[1]]
        return (A.float() @ (B.float() * s).t()).to(A.dtype)


if DequantizingFp8BlockKernel not in _POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU]:
    _POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU].append(DequantizingFp8BlockKernel)


def dequantize(values: torch.Tensor, scales: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """Stacked experts' FP8 values times their blocks' scales, float32."""
    s = scales.repeat_interleave(block[0], -2)[..., : values.shape[-2], :]
    return values.float() * s.repeat_interleave(block[1], -1)[..., : values.shape[-1]]


_process, _apply = Fp8MoEMethod.process_weights_after_loading, Fp8MoEMethod.apply
_monolithic = Fp8MoEMethod.is_monolithic


def _cpu(method) -> bool:
    return method.fp8_backend == Fp8MoeBackend.NONE and method.block_quant


def process_weights_after_loading(self, layer):
    if not _cpu(self):
        return _process(self, layer)
    self.moe_kernel = None  # values and scales stay as loaded; apply dequantizes them


def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
    if not _cpu(self):
        return _apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)
    w13 = dequantize(layer.w13_weight, layer.w13_weight_scale_inv)
    w2 = dequantize(layer.w2_weight, layer.w2_weight_scale_inv)
    emap = layer.expert_map
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32)
    for k in range(topk_ids.shape[1]):
        ids = topk_ids[:, k].long()
        local = emap[ids].long() if emap is not None else ids
        for e in local.unique().tolist():
            if e < 0:
                continue
            rows = local == e
            gate, up = (x[rows].float() @ w13[e].t()).chunk(2, dim=-1)
            out[rows] += topk_weights[rows, k, None].float() * ((torch.nn.functional.silu(gate) * up) @ w2[e].t())
    return out.to(x.dtype)


if not getattr(Fp8MoEMethod, "_dequantizing_on_cpu", False):  # once per process
    Fp8MoEMethod._dequantizing_on_cpu = True
    Fp8MoEMethod.process_weights_after_loading = process_weights_after_loading
    Fp8MoEMethod.apply = apply
    Fp8MoEMethod.is_monolithic = property(lambda self: False if _cpu(self) else _monolithic.fget(self))


class Ext:
    """vLLM's worker extension hook: importing this module is all it is for."""

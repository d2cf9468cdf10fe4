"""Test support: a block-FP8 matmul vLLM's CPU build can run here. Its own block-FP8 kernels need
AMX tiles (Sapphire Rapids or newer), which CI machines lack, so an FP8 model cannot even be
built. Importing this module appends a plain-torch kernel to vLLM's CPU list: it dequantizes the
weight (values times their block's scale) and multiplies in float32. Everything else is vLLM's
own: the checkpoint loader, the weight loaders' tensor-parallel sharding of values and scales,
`process_weights_after_loading` (the generic block-FP8 one, which keeps values and scales as
loaded), and the layerwise reload. vLLM's worker processes import it through
`worker_extension_cls="fp8_cpu_kernel.Ext"` (this folder on PYTHONPATH)."""

import torch
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


class Ext:
    """vLLM's worker extension hook: importing this module is all it is for."""

"""The gradient-accumulation dtype of a group (DeepSpeed's ``data_types.grad_accum_dtype``).

By default a group's gradients live in the parameters' (compute) dtype: ``param.grad`` is a view
of the group's flat gradient and autograd adds each micro-batch into it in place. With bf16 or
fp16 parameters that sum is rounded to 8 (bf16) or 11 (fp16) significant bits after every
micro-batch, so small micro-batch gradients are lost against a large running sum.

With a wider ``grad_dtype`` (fp32) the flat gradient, the stage >= 2 ``shard_grad`` and the
cross-rank reduction are fp32: autograd still produces each micro-batch's gradient in the compute
dtype (a fresh tensor, since ``param.grad`` is left ``None``), the group's post-accumulate hook
adds it into the fp32 buffer and drops it. The reduction runs in fp32 too (DeepSpeed reduces in
its communication dtype): twice the bytes of a 16-bit reduction, but the master receives the
fp32 sum with no round trip through the compute dtype. ``param.grad`` is therefore ``None``
after backward (as with DeepSpeed's bf16 optimizer); ``shardwise.utils.safe_get_full_grad``
reads the accumulated gradient.
"""

from __future__ import annotations

import torch


def accumulation_dtype(param_dtype: torch.dtype, requested: torch.dtype | None, name: str) -> torch.dtype:
    """The dtype a group of ``param_dtype`` parameters accumulates gradients in.

    ``requested`` None (or ``param_dtype``) keeps today's behaviour. Only a wider floating dtype is
    accepted: accumulating in a narrower one would round every micro-batch's gradient, and a group of
    fp32 parameters in a 16-bit model already accumulates in fp32, so fp32 requested of it is a no-op.
    """
    if requested is None or requested == param_dtype:
        return param_dtype
    if not (requested.is_floating_point and requested.itemsize > param_dtype.itemsize):
        raise ValueError(f"{name!r}: gradients of {param_dtype} parameters cannot accumulate in {requested} "
                         "(data_types.grad_accum_dtype: use the compute dtype or fp32)")
    return requested

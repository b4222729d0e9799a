"""Which dtype a model computes in on a device: fp32 unless bf16 runs natively and pays there."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def native_bf16(device) -> bool:
    """Whether ``device`` multiplies bf16 natively: a CUDA GPU that supports it, or a CPU where oneDNN
    has bf16 kernels (AVX512-BF16 or AMX). Elsewhere bf16 is emulated and slower than fp32."""
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return kind == "cpu" and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def cpu_has_amx() -> bool:
    """AMX tiles (Sapphire Rapids and later) as the kernel exposes them; hypervisors may hide them."""
    try:
        with open("/proc/cpuinfo") as f:
            return " amx_bf16" in f.read()
    except OSError:
        return False


def bf16_pays(device) -> bool:
    """Where a model of this kind runs faster in bf16 than in fp32: a GPU with bf16, or a CPU with AMX.

    A CPU with AVX512-BF16 but no AMX multiplies bf16 natively, yet on this project's machine plain
    decoding of the fixture ran at 0.85x the fp32 speed and head training at 0.57x (docs/engine.md,
    "Precision", ``benchmarks/precision.py``).
    """
    kind = torch.device(device).type
    return native_bf16(device) and (kind == "cuda" or cpu_has_amx())


def exact_bf16(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` in bf16 where bf16 holds every value exactly (a checkpoint shipped in bf16 and
    loaded in wider floats), else None: widened back, each value is the one it was."""
    narrow = weight.detach().to(torch.bfloat16)
    return narrow if torch.equal(narrow.to(weight.dtype), weight) else None


def resolve_dtype(dtype, device) -> torch.dtype:
    """``"auto"`` = bf16 where it pays (``bf16_pays``), fp32 elsewhere; names or torch dtypes pass."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if bf16_pays(device) else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected 'auto' or one of {list(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]

"""The engine's native kernels for a batched step (``kernels.cpp``), built once per machine with its
C++ compiler and loaded as ``torch.ops.ace_engine.*``; a batched step uses them where they run
(fp32 on a CPU: ``Rows.native``).

Why: decoding rows attend over their own cache rows, one query per head. As two batched products
that ran at about a quarter of the memory's speed here (a 16-row step of the fixture: 4.6-6.5 ms
of attention on one core, where reading those keys and values takes about 1.5); the kernel reads
each row as far as its own length and each key once for the query heads that share it. And a
layer's small steps (its norms, RoPE and the cache writes, the MLP's gate) were some 40 torch
operations, each a dispatch and a pass over memory: four passes here.

What it costs: a C++ compiler (``g++``, or ``CXX``; the compiled decoding step needs one too) and
about 15 s the first time on a machine; the library is cached under ``ACE_MW_CACHE`` (default
``~/.cache/ace_mw``), keyed by its source, torch's version and the CPU's vector width. Where it
cannot be built (no compiler, a CPU without AVX2) or ``ACE_ENGINE_NATIVE=0``, batched steps run
torch's operations, with a warning saying why. Figures: docs/engine.md.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shlex
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.cpp")
# What ATen's vectors are compiled for, by the CPU capability torch dispatches its own kernels to.
VECTOR_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma", "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-DCPU_CAPABILITY_AVX2"],
}
BUILD_TIMEOUT_S = 600


def cache_dir() -> Path:
    """Beside the engine's measured costs (``planning/cost.py``)."""
    return Path(os.environ.get("ACE_MW_CACHE") or Path.home() / ".cache" / "ace_mw") / "kernels"


def runs_on(weight: Tensor) -> bool:
    """Whether a batched step of a model with weights like ``weight`` runs the kernels."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and loaded()


def loaded() -> bool:
    """Build (once per machine) and load the kernels; False, with a warning, where they cannot be."""
    return bool(library_name())


@functools.cache
def library_name() -> str:
    """The loaded kernels' library (its name says which source and flags built it), for keys of
    timings measured on them; "" where they are not loaded."""
    if os.environ.get("ACE_ENGINE_NATIVE", "1") == "0":
        return ""
    try:
        library = _library()
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        logger.warning("batched steps run torch's operations only: no native kernels here (%s)", reason)
        return ""
    return library.name


def decode_attention(q: Tensor, cache_k: Tensor, cache_v: Tensor, rows: Tensor, lengths: Tensor) -> Tensor:
    """Query ``i`` of ``q`` [n, heads, d] over the first ``lengths[i]`` slots of cache row ``rows[i]``."""
    scale = q.shape[-1] ** -0.5
    return torch.ops.ace_engine.decode_attention(q.contiguous(), cache_k, cache_v, rows, lengths, scale)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``F.rms_norm(x, weight.shape, weight, eps)`` in one pass a row."""
    return torch.ops.ace_engine.rms_norm(x.contiguous(), weight, eps)


def rope_write(
    qkv: Tensor,
    rope: tuple[Tensor, Tensor],
    positions: Tensor,
    cache_k: Tensor,
    cache_v: Tensor,
    rows: Tensor,
    slots: Tensor,
    heads: int,
) -> Tensor:
    """The queries [n, heads, d] of a fused q/k/v projection ``qkv`` [..., n, (heads + 2 kv) d], RoPE'd
    at ``positions`` with the tables ``rope`` (cos, sin [max_len, d]); its keys, RoPE'd, and values
    written to cache row ``rows[t]``, slot ``slots[t]`` for token t."""
    cos, sin = rope
    return torch.ops.ace_engine.rope_write(qkv.contiguous(), cos, sin, positions, cache_k, cache_v, rows, slots, heads)


def silu_mul(gate_up: Tensor) -> Tensor:
    """``silu(gate) * up`` of the fused gate/up projection [..., 2 i]."""
    return torch.ops.ace_engine.silu_mul(gate_up.contiguous())


PANEL = 16  # output columns per panel of ``panel_linear``'s weights


def has_panels() -> bool:
    """Whether ``panel_linear`` runs here (the kernels built for AVX-512)."""
    return loaded() and hasattr(torch.ops.ace_engine, "panel_linear")


def panel_linear(x: Tensor, panels: Tensor) -> Tensor:
    """``x`` [n, in] fp32 times a weight held as bf16 ``panels`` [out / PANEL, in, PANEL]
    (``packed.panels``) -> [n, out] fp32."""
    return torch.ops.ace_engine.panel_linear(x.contiguous(), panels)


def _library() -> Path:
    """The built library, compiled here if the cache does not hold it (one process at a time)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in VECTOR_FLAGS:
        raise RuntimeError(f"no vector kernel for this CPU ({capability})")
    command = _compile_command(capability)
    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() + " ".join(command[1:]).encode())
    target = cache_dir() / f"kernels-{key.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process (a test worker, a replica) may be building it
        if target.is_file():
            return target
        logger.info("building the engine's native kernels once (cached in %s)", target.parent)
        with tempfile.TemporaryDirectory(dir=target.parent) as work:
            built = Path(work) / target.name
            done = subprocess.run(
                [*command, "-o", str(built)], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False
            )
            if done.returncode != 0:
                errors = [line for line in done.stderr.splitlines() if "error" in line] or [done.stderr.strip()]
                raise RuntimeError(f"{shlex.join(command[:1])} failed: {errors[0][-500:]}")
            os.replace(built, target)
    return target


def _compile_command(capability: str) -> list[str]:
    root = Path(torch.__file__).parent
    return [
        os.environ.get("CXX", "g++"),
        str(SOURCE),
        "-O3",
        "-std=c++20",
        "-shared",
        "-fPIC",
        "-fopenmp",  # torch's own OpenMP runtime, loaded already: at::parallel_for splits as torch's kernels do
        f"-DCPU_CAPABILITY={capability}",
        *VECTOR_FLAGS[capability],
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
        f"-I{root / 'include'}",
        f"-L{root / 'lib'}",
        "-ltorch_cpu",
        "-lc10",
        f"-Wl,-rpath,{root / 'lib'}",
    ]

"""The native kernels (engine/model/kernels.cpp, built by native.py): decoding attention gives what
scaled-dot-product attention gives for each row over its own first slots, for every head layout
the kernel specialises and the generic one; the norm, RoPE with the cache writes, and the gated
activation give what torch's operations give; a batched forward on them keeps each token's solo
logits; and where they cannot be built, nothing uses them (batched steps run torch's operations).

Tolerance (fp32): the kernels sum in another order than torch's; outputs differ by about 1e-7 here.
"""

import os
import subprocess
import sys

import pytest
import torch
from support.paths import MODELS
from support.unlike_rows import decoding_step

from ace_mw.engine.model import native
from ace_mw.engine.model.rows import Decoding, Rows, Span
from ace_mw.engine.model.step import Step
from ace_mw.engine.model.transformer import ModelConfig, RMSNorm, Transformer, apply_rope, rope_tables

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not native.loaded(), reason="the native kernel cannot be built here")


def reference(q, cache_k, cache_v, rows, lengths):
    """Each query row alone through SDPA over its row's first slots (query heads sharing a KV head)."""
    per_kv = q.shape[1] // cache_k.shape[1]
    out = []
    for i, (row, length) in enumerate(zip(rows.tolist(), lengths.tolist(), strict=True)):
        keys = cache_k[row, :, :length].repeat_interleave(per_kv, 0)
        values = cache_v[row, :, :length].repeat_interleave(per_kv, 0)
        out.append(torch.nn.functional.scaled_dot_product_attention(q[i][:, None], keys, values)[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(8, 2, 64), (4, 4, 64), (16, 4, 128), (6, 3, 40)],  # specialised (the first three) and generic
)
def test_each_row_attends_over_its_own_first_slots_as_sdpa_does(heads, kv_heads, head_dim):
    generator = torch.Generator().manual_seed(heads * head_dim)
    slots = 300
    cache_k = torch.randn(5, kv_heads, slots, head_dim, generator=generator)
    cache_v = torch.randn(5, kv_heads, slots, head_dim, generator=generator)
    rows = torch.tensor([3, 0, 4, 1])  # any order, not every row
    lengths = torch.tensor([1, slots, 17, 129])  # one slot, the whole row, lengths off the vector width
    q = torch.randn(4, heads, head_dim, generator=generator)
    got = native.decode_attention(q, cache_k, cache_v, rows, lengths)
    assert got.shape == q.shape
    assert torch.allclose(got, reference(q, cache_k, cache_v, rows, lengths), atol=1e-5)


def test_it_reads_a_cache_through_its_strides_and_queries_that_are_not_contiguous():
    """A model's step hands it views: queries transposed out of the projections, a cache sliced."""
    generator = torch.Generator().manual_seed(7)
    full_k, full_v = (torch.randn(3, 2, 64, 64, generator=generator) for _ in range(2))
    cache_k, cache_v = full_k[:, :, :50], full_v[:, :, :50]  # a slot stride of 64 rows' worth, 50 slots
    q = torch.randn(8, 2, 64, generator=generator).transpose(0, 1)  # [2, 8, 64], not contiguous
    rows, lengths = torch.tensor([2, 0]), torch.tensor([50, 9])
    got = native.decode_attention(q, cache_k, cache_v, rows, lengths)
    assert torch.allclose(got, reference(q, cache_k, cache_v, rows, lengths), atol=1e-5)


@pytest.mark.parametrize(
    ("rows", "lengths", "message"),
    [([5], [3], "outside the cache"), ([0], [0], "outside the cache"), ([0], [11], "outside the cache")],
)
def test_a_row_or_length_outside_the_cache_is_refused(rows, lengths, message):
    cache = torch.zeros(2, 1, 10, 16)
    with pytest.raises(RuntimeError, match=message):
        native.decode_attention(torch.zeros(1, 2, 16), cache, cache, torch.tensor(rows), torch.tensor(lengths))


def test_another_dtype_is_refused():
    cache = torch.zeros(2, 1, 10, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="fp32"):
        native.decode_attention(torch.zeros(1, 2, 16), cache, cache, torch.tensor([0]), torch.tensor([1]))


def test_the_norm_is_torchs_rms_norm():
    generator = torch.Generator().manual_seed(3)
    norm = RMSNorm(72, 1e-6)  # a width off the vector size
    norm.weight.data = torch.rand(72, generator=generator) + 0.5
    x = torch.randn(1, 33, 72, generator=generator) * 4
    with torch.inference_mode():
        assert torch.allclose(native.rms_norm(x, norm.weight, norm.eps), norm(x), rtol=1e-5, atol=1e-6)


def test_rope_write_rotates_the_queries_and_writes_the_rotated_keys_and_the_values_to_their_slots():
    generator = torch.Generator().manual_seed(5)
    heads, kv_heads, d, n = 4, 2, 16, 5
    cos, sin = rope_tables(ModelConfig(100, heads * d, 64, 1, heads, kv_heads, d), 64)
    qkv = torch.randn(1, n, (heads + 2 * kv_heads) * d, generator=generator)
    cache_k, cache_v = torch.zeros(3, kv_heads, 40, d), torch.zeros(3, kv_heads, 40, d)
    positions, rows = torch.tensor([0, 7, 8, 30, 63]), torch.tensor([2, 0, 0, 1, 2])
    slots = torch.tensor([0, 7, 8, 9, 39])
    q = native.rope_write(qkv, (cos, sin), positions, cache_k, cache_v, rows, slots, heads)
    x = qkv[0].view(n, heads + 2 * kv_heads, d)
    c, s = cos[positions][:, None], sin[positions][:, None]
    assert torch.allclose(q, apply_rope(x[:, :heads], c, s), atol=1e-6)
    assert torch.allclose(cache_k[rows, :, slots], apply_rope(x[:, heads : heads + kv_heads], c, s), atol=1e-6)
    assert torch.equal(cache_v[rows, :, slots], x[:, heads + kv_heads :])
    written = torch.zeros(3, 40, dtype=torch.bool)
    written[rows, slots] = True
    untouched = ~written  # [rows, slots]: every other slot of every head stays as it was
    assert not cache_k.transpose(1, 2)[untouched].any() and not cache_v.transpose(1, 2)[untouched].any()
    with pytest.raises(RuntimeError, match="outside the tables"):
        native.rope_write(qkv, (cos, sin), positions, cache_k, cache_v, rows, torch.tensor([0, 7, 8, 9, 40]), heads)


def test_silu_mul_is_the_gated_activation_of_the_fused_projection():
    gate_up = torch.randn(3, 7, 2 * 45, generator=torch.Generator().manual_seed(6)) * 6
    gate, up = gate_up.chunk(2, dim=-1)
    got = native.silu_mul(gate_up)
    assert got.shape == (3, 7, 45)
    assert torch.allclose(got, torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-6)


def test_decoding_rows_attend_in_one_native_call_and_keep_their_solo_logits(one_torch_thread):
    """In a batched forward: every row that decodes one token, and every row that verifies a chain,
    joins one call of the kernel, one query a token, however unlike their lengths; a tree and a
    prompt chunk keep their groups. Each token's logits, with every layer on the native kernels,
    stay what it gets alone."""
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    spans = [Span(3, 600, 1), Span(0, 8, 1), Span(1, 30, 4), Span(5, 620, 1), Span(2, 0, 40)]
    spans.append(Span(4, 50, 3, torch.tensor([0, 1, 1]), tree))
    groups = Rows.build(spans, CPU, native=True).groups
    decoding = [g for g in groups if isinstance(g, Decoding)]
    assert len(groups) == 3 and len(decoding) == 1
    assert decoding[0].rows.tolist() == [3, 0, 1, 1, 1, 1, 5]
    assert decoding[0].lengths.tolist() == [601, 9, 31, 32, 33, 34, 621]  # row 1's chain: each up to itself
    assert decoding[0].tokens.tolist() == [0, 1, 2, 3, 4, 5, 6]  # the step's tokens, in order
    assert not any(isinstance(g, Decoding) for g in Rows.build(spans, CPU).groups)

    model = Transformer.from_pretrained(MODELS / "ace-tiny-chat")
    model.setup_cache(640)
    step, logits, solo = decoding_step(model, native=True)
    assert step.native and sum(isinstance(g, Decoding) for g in step.groups) == 1
    assert torch.allclose(logits, solo, atol=1e-4)


def test_chains_verified_on_the_native_kernel_keep_their_solo_logits(one_torch_thread):
    """Rows verifying chains of drafts beside decoding rows, one query a token on the native
    kernel: every token's logits are what the row's whole sequence gets alone at that position,
    and what the masked groups of torch's path give (within fp32's reordering)."""
    model = Transformer.from_pretrained(MODELS / "ace-tiny-chat")
    model.setup_cache(640)
    torch.manual_seed(3)
    runs = {0: (300, 1), 1: (40, 5), 2: (9, 3), 3: (500, 1), 4: (120, 16)}  # row: (length, tokens run last)
    seqs = {r: torch.randint(0, model.config.vocab_size, (n,)) for r, (n, _) in runs.items()}
    with torch.inference_mode():
        solo = {r: model(s[None], Step.span(0, s.numel(), CPU))[0][0] for r, s in seqs.items()}
        for native in (True, False):
            caches = model.batch_caches(len(runs), 640)
            for r, (n, q) in runs.items():
                prompt = Rows.build([Span(r, 0, n - q)], CPU, native)
                model.forward_rows(seqs[r][: n - q], prompt, caches, torch.zeros(1).long())
            spans = [Span(r, n - q, q) for r, (n, q) in runs.items()]
            step = Rows.build(spans, CPU, native)
            assert sum(isinstance(g, Decoding) for g in step.groups) == (1 if native else 0)
            tokens = torch.cat([seqs[r][n - q :] for r, (n, q) in runs.items()])
            logits, _ = model.forward_rows(tokens, step, caches, torch.arange(tokens.numel()))
            expected = torch.cat([solo[r][n - q :] for r, (n, q) in runs.items()])
            assert torch.allclose(logits, expected, atol=1e-4)


def _load_in_a_fresh_process(tmp_path, **env) -> subprocess.CompletedProcess:
    code = "import logging; logging.basicConfig(); from ace_mw.engine.model import native; print(native.loaded())"
    environment = {**os.environ, "ACE_MW_CACHE": str(tmp_path), **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=300)


def test_without_a_compiler_decoding_falls_back_and_says_why(tmp_path):
    done = _load_in_a_fresh_process(tmp_path, CXX="/nonexistent/g++")
    assert done.returncode == 0 and done.stdout.strip() == "False"
    assert "no native kernels here" in done.stderr and "g++" in done.stderr


def test_it_can_be_turned_off(tmp_path):
    done = _load_in_a_fresh_process(tmp_path, ACE_ENGINE_NATIVE="0")
    assert done.returncode == 0 and done.stdout.strip() == "False"
    assert not list(tmp_path.rglob("*.so"))


def test_it_is_built_once_and_then_loaded_from_the_cache(tmp_path):
    first = _load_in_a_fresh_process(tmp_path)
    built = list(tmp_path.rglob("kernels-*.so"))
    second = _load_in_a_fresh_process(tmp_path, CXX="/nonexistent/g++")  # no compiler needed the second time
    assert first.stdout.strip() == second.stdout.strip() == "True"
    assert len(built) == 1 and list(tmp_path.rglob("kernels-*.so")) == built

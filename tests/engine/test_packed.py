"""The target's projections on oneDNN's packed weights and bf16 panels (engine/model/packed.py), on
the real fixture: the same model as the dense one up to summation order, and what an engine runs on
a CPU in fp32."""

import pytest
import torch
from support.engine_costs import ALTERNATING
from support.paths import MODELS

from ace_mw.engine import Engine
from ace_mw.engine.model import native
from ace_mw.engine.model.packed import (
    PANEL_ROWS,
    PIECE,
    PackedLinear,
    linear,
    packs,
    padded_total,
    panels,
    pieces,
    reorder,
    run_counts,
)
from ace_mw.engine.model.step import Step
from ace_mw.engine.model.transformer import Transformer

CPU = torch.device("cpu")
PACKED = "onednn+panels" if native.has_panels() else "onednn"  # bf16 panels where the kernel runs (AVX-512)
pytestmark = pytest.mark.skipif(not packs(torch.zeros(1)), reason="no oneDNN in this torch build")


@pytest.fixture(scope="module")
def models(one_torch_thread):
    """The fixture twice: dense (as loaded) and packed."""
    dense, packed = (Transformer.from_pretrained(MODELS / "ace-tiny-chat") for _ in range(2))
    assert packed.pack() and not packed.pack()  # packs once; a second call has nothing to do
    for model in (dense, packed):
        model.setup_cache(256)
    return dense, packed


def test_a_packed_model_computes_what_the_dense_one_does(models):
    dense, packed = models
    assert (dense.kernels, packed.kernels) == ("dense", PACKED)
    assert isinstance(packed.lm_head, PackedLinear) and not hasattr(packed.layers[0].self_attn, "q_proj")
    ids = torch.randint(0, dense.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want, _ = dense(ids, Step.span(0, 40, CPU))
        got, _ = packed(ids, Step.span(0, 40, CPU))
    assert torch.allclose(got, want, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_an_engine_packs_the_models_it_runs_eagerly_on_a_cpu(one_torch_thread):
    target = Transformer.from_pretrained(MODELS / "ace-tiny-chat")
    draft = Transformer.from_pretrained(MODELS / "ace-tiny-chat-draft")
    Engine(target, None, draft=draft, costs=ALTERNATING)
    assert (target.kernels, draft.kernels) == (PACKED, PACKED)


def test_packed_products_run_at_a_fixed_set_of_row_counts_whatever_the_input():
    """oneDNN keeps a kernel, and memory, per row count: inputs of any length run in pieces padded
    to one of 19 counts (none under 4: oneDNN's fewer-row kernels are slower; a prompt chunk of up
    to 256 in one piece), padded by at most 15 rows, and give what the dense product gives."""
    assert run_counts() == [*range(4, 17), 32, 48, 64, 128, 192, 256]
    for n in range(1, 3 * PIECE):
        assert sum(pieces(n)) == n and 0 <= padded_total(n) - n <= max(0, 4 - n) + 15
    weight = torch.randn(96, 32, generator=torch.Generator().manual_seed(4))
    packed = reorder(weight)
    for n in (1, 7, 16, 17, 64, 65, 200, 300, 600):
        x = torch.randn(2, n, 32)
        assert torch.allclose(linear(x, packed), torch.nn.functional.linear(x, weight), atol=1e-5)


needs_panels = pytest.mark.skipif(not native.has_panels(), reason="no panel kernel here (AVX-512 builds only)")


@needs_panels
def test_decoding_rows_read_bf16_panels_that_give_the_fp32_product():
    """A weight bf16 holds exactly: up to PANEL_ROWS rows read its bf16 panels, with fp32 products and
    sums (within fp32's rounding of the exact product, as oneDNN's are; a row's the same bits
    whatever rows share its product), more rows oneDNN's packed weight; a weight bf16 does not
    hold, or with rows that are no whole panels, gets none."""
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(96, 40, generator=g).to(torch.bfloat16).float()
    assert panels(torch.randn(96, 40, generator=g)) is None  # not exact in bf16
    assert panels(weight[:90]) is None  # 90 rows: no whole panels of 16
    held, packed, bias = panels(weight), reorder(weight), torch.randn(96, generator=g)
    assert held is not None and held.dtype == torch.bfloat16 and held.shape == (6, 40, 16)
    for n in (1, 3, 8, 9, 16, 17, 40):
        x = torch.randn(n, 40, generator=g)
        exact = x.double() @ weight.double().T + bias.double()
        got = linear(x, packed, bias, held)
        assert got.dtype == torch.float32 and got.shape == (n, 96)
        assert (got.double() - exact).abs().max() <= 1e-5 * exact.abs().max()
    x = torch.randn(PANEL_ROWS, 40, generator=g)
    step = linear(x, packed, None, held)
    for n in range(1, PANEL_ROWS + 1):  # each output summed in one order, whatever rows share the step
        assert torch.equal(linear(x[:n], packed, None, held), step[:n])
        assert torch.equal(linear(x[n - 1 : n], packed, None, held), step[n - 1 : n])
    called = []
    kernel = native.panel_linear
    try:
        native.panel_linear = lambda x, p: called.append(x.shape[0]) or kernel(x, p)
        for n in (1, PANEL_ROWS, PANEL_ROWS + 1):
            linear(torch.randn(n, 40), packed, None, held)
    finally:
        native.panel_linear = kernel
    assert called == [1, PANEL_ROWS]


@needs_panels
def test_the_fixture_packs_every_projection_with_panels(models):
    """The fixture ships in bf16: each projection of the packed model holds panels equal to its
    weights, and a step of 8 decoding rows gives what the dense model gives."""
    dense, packed = models
    for layer, weights in zip(packed.layers, dense.layers, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        for held, weight in (
            (attn.qkv_panels, weights.self_attn.qkv),
            (attn.o_proj.panels, weights.self_attn.o_proj.weight),
            (mlp.gate_up_panels, weights.mlp.gate_up),
            (mlp.down_proj.panels, weights.mlp.down_proj.weight),
        ):
            assert held is not None and weight is not None
            assert torch.equal(held.transpose(1, 2).reshape(weight.shape).float(), weight)
    x = torch.randn(8, dense.config.hidden_size, generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        want = dense.lm_head(x)
        got = packed.lm_head(x)
    assert packed.lm_head.panels is not None
    assert torch.allclose(got, want, atol=1e-4) and torch.equal(got.argmax(-1), want.argmax(-1))

"""The target's projections on oneDNN's packed weights (engine/model/packed.py), on the real fixture:
the same model as the dense one up to summation order, and what an engine runs on a CPU in fp32."""

import pytest
import torch
from support.engine_costs import ALTERNATING
from support.paths import MODELS

from ace_mw.engine import Engine
from ace_mw.engine.model.packed import PIECE, PackedLinear, linear, packs, padded_total, pieces, reorder, run_counts
from ace_mw.engine.model.step import Step
from ace_mw.engine.model.transformer import Transformer

CPU = torch.device("cpu")
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
    assert (dense.kernels, packed.kernels) == ("dense", "onednn")
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
    assert (target.kernels, draft.kernels) == ("onednn", "onednn")


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

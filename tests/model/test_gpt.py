import pytest
import torch

from foldtrain.config import build_config
from foldtrain.model import GPT, PRESETS, GPTShape, analytic_param_count


@pytest.mark.parametrize("preset", list(PRESETS))
def test_param_count_matches_analytic(preset):
    m = build_config(["--model.preset", preset]).model
    with torch.device("meta"):  # the big presets need no memory on the meta device
        model = GPT(GPTShape.from_config(m))
    assert model.num_params() == analytic_param_count(m.n_layer, m.d_model, m.context, m.vocab_size)


def test_known_sizes():
    def count(p):
        m = build_config(["--model.preset", p]).model
        return analytic_param_count(m.n_layer, m.d_model, m.context, m.vocab_size)

    assert count("gpt2-small") == 124_439_808  # GPT-2 small, as released
    assert 0.9e6 < count("tiny") < 1.5e6
    assert 100e6 < count("bai2022") < 110e6  # the study's ~106M model
    assert 170e9 < count("gpt3-175b") < 180e9


def test_shapes_parts_and_tying():
    s = GPTShape(n_layer=3, n_head=2, d_model=16, context=32, vocab_size=50)
    model = GPT(s)
    assert len(model.parts) == 3 + 2  # embedding, blocks, head
    assert model.head.lm_head.weight is model.embedding.wte.weight
    idx = torch.randint(0, 50, (4, 10))
    assert model(idx).shape == (4, 10, 50)
    assert model.parts[0](idx).shape == (4, 10, 16)
    loss = model(idx, idx)
    assert loss.shape == () and abs(loss.item() - torch.log(torch.tensor(50.0)).item()) < 0.5


def test_causal():
    torch.manual_seed(0)
    model = GPT(GPTShape(2, 2, 16, 32, 50)).eval()
    a = torch.randint(0, 50, (1, 12))
    b = a.clone()
    b[0, 8:] = (b[0, 8:] + 1) % 50  # changing the future must not change the past
    torch.testing.assert_close(model(a)[:, :8], model(b)[:, :8])

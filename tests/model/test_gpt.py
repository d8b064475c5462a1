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


def _stock_embeddings(model):
    """``model`` with its embeddings' stock ``nn.Embedding`` backward (a dense table a micro-batch)."""
    for m in model.modules():
        if isinstance(m, torch.nn.Embedding):
            m.forward = torch.nn.Embedding.forward.__get__(m)
    return model


def test_row_embedding_gradient_is_the_stock_one():
    """The row lookup's gradient, accumulated over micro-batches into the tied weight (the head's dense part
    and the rows of repeated tokens too), is nn.Embedding's; ``.grad`` stays one dense tensor and the
    post-accumulate hooks data-parallel strategies wait on fire once a micro-batch."""
    torch.manual_seed(0)
    ours = GPT(GPTShape(2, 2, 16, 32, 50))
    stock = _stock_embeddings(GPT(GPTShape(2, 2, 16, 32, 50)))
    stock.load_state_dict(ours.state_dict())
    batches = [torch.randint(0, 50, (2, 9)) for _ in range(3)]
    batches[1][0, :4] = 7  # one token read four times
    wte = ours.embedding.wte.weight
    fired = []
    wte.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad.layout))
    grads = []
    for model in (ours, stock):
        for b in batches:
            model(b[:, :-1], b[:, 1:]).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert fired == [torch.strided] * len(batches)
    for name, g in grads[0].items():
        assert g.layout == torch.strided
        torch.testing.assert_close(g, grads[1][name], rtol=1e-6, atol=1e-7)
    assert type(ours.embedding.wte.weight.grad) is torch.Tensor and not ours.embedding.wte.weight.grad.is_sparse


def test_row_embedding_adds_rows_only_once_grad_exists():
    """After the first micro-batch the weight's gradient is the looked-up rows (what makes the backward cheap),
    before it a dense tensor (``.grad`` must be dense for the optimizer, clipping and reductions)."""
    emb = GPT(GPTShape(1, 2, 16, 32, 50)).embedding.wte
    seen = []
    emb.weight.register_hook(lambda g: seen.append(g.layout))
    idx = torch.tensor([[3, 4, 3]])
    emb(idx).sum().backward()
    emb(idx).sum().backward()
    assert seen == [torch.strided, torch.sparse_coo]
    expected = torch.zeros(50, 16)
    expected[3], expected[4] = 4.0, 2.0
    torch.testing.assert_close(emb.weight.grad, expected)


def test_row_embedding_untied_rows_carry_their_own_gradients():
    """An untied embedding (a pipeline's segment 0) over micro-batches of repeated tokens and random incoming
    gradients: the rows added to ``.grad`` are the stock backward's, row for row."""
    torch.manual_seed(1)
    ours = GPT(GPTShape(1, 2, 16, 32, 50)).embedding
    stock = _stock_embeddings(GPT(GPTShape(1, 2, 16, 32, 50)).embedding)
    stock.load_state_dict(ours.state_dict())
    for _ in range(4):
        idx = torch.randint(0, 12, (3, 8))  # few rows, each read several times
        g = torch.randn(3, 8, 16)
        ours(idx).backward(g)
        stock(idx).backward(g)
    for a, b in zip(ours.parameters(), stock.parameters()):
        assert a.grad.layout == torch.strided
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6)


def test_half_precision_weights_keep_the_stock_backward():
    """bf16 weights (``bf16-master``) sum a micro-batch's rows before adding them to ``.grad``: added one token at a
    time to a large bf16 gradient most of each would round away."""
    emb = GPT(GPTShape(1, 2, 16, 32, 50)).embedding.wte.to(torch.bfloat16)
    seen = []
    emb.weight.register_hook(lambda g: seen.append(g.layout))
    idx = torch.full((1, 300), 3)
    for _ in range(8):
        emb(idx).backward(torch.full((1, 300, 16), 1e-3, dtype=torch.bfloat16))
    assert seen == [torch.strided] * 8
    # 8 x 300 x 1e-3 = 2.4: the stock backward's bf16 sums make 2.72, one row at a time would make 0.5
    assert abs(emb.weight.grad[3, 0].item() - 2.4) < 0.4

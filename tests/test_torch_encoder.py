"""nn.TransformerEncoder in inference (eval, no_grad, batch first), where
PyTorch runs each layer as one fused op, aten._transformer_encoder_layer_fwd:
compiled through its steps, with zero fallbacks, equal to eager."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import polyjit  # noqa: E402


@pytest.mark.parametrize("activation,norm_first", [("relu", False), ("gelu", True)])
def test_encoder_inference_fast_path_compiles(activation, norm_first):
    torch._dynamo.reset()
    polyjit.frontends.torch.stats(reset=True)
    torch.manual_seed(int.from_bytes(np.random.default_rng().bytes(4), "little"))
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, activation=activation, batch_first=True,
                                             norm_first=norm_first)
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(2, 10, 32)
    compiled = torch.compile(model, backend="polyjit", options={"strict": True})
    with torch.no_grad():
        want = model(x)
        got = compiled(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    stats = polyjit.frontends.torch.stats()
    assert stats["fallbacks"] == 0 and stats["kernels"] > 0


@pytest.mark.parametrize("masks", ["key_padding", "attention"])
def test_encoder_fast_path_with_masks(masks):
    """The fused layer's masks, a key padding mask (batch, keys) or an
    attention mask (queries, keys), added to the attention scores."""
    torch._dynamo.reset()
    polyjit.frontends.torch.stats(reset=True)
    torch.manual_seed(int.from_bytes(np.random.default_rng().bytes(4), "little"))
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(3, 10, 32)
    padding = torch.zeros(3, 10, dtype=torch.bool)
    padding[0, 7:], padding[2, 4:] = True, True
    kw = {"key_padding": {"src_key_padding_mask": padding},
          "attention": {"mask": torch.nn.Transformer.generate_square_subsequent_mask(10)}}[masks]
    compiled = torch.compile(model, backend="polyjit", options={"strict": True})
    with torch.no_grad():
        want = model(x, **kw)
        got = compiled(x, **kw)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert polyjit.frontends.torch.stats()["fallbacks"] == 0


def test_encoder_fast_path_with_dynamic_shapes():
    """The fused layer's rule at symbolic batch and length (its reshapes of
    the heads and of a key padding mask): one graph for every size."""
    torch._dynamo.reset()
    polyjit.frontends.torch.stats(reset=True)
    torch.manual_seed(int.from_bytes(np.random.default_rng().bytes(4), "little"))
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    compiled = torch.compile(model, backend="polyjit", dynamic=True, options={"strict": True})
    with torch.no_grad():
        for b, t in ((2, 10), (3, 7), (5, 12)):
            x = torch.randn(b, t, 32)
            padding = torch.zeros(b, t, dtype=torch.bool)
            padding[0, t - 2:] = True
            torch.testing.assert_close(compiled(x, src_key_padding_mask=padding),
                                       model(x, src_key_padding_mask=padding), rtol=1e-5, atol=1e-5)
    stats = polyjit.frontends.torch.stats()
    assert stats["graphs"] == 1 and stats["fallbacks"] == 0

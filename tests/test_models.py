"""Real models as users bring them: transformers' GPT-2 and BERT (configs of
tens of thousands of parameters, random weights) through
``torch.compile(model, backend="polyjit")``, forward and backward against
eager, with zero fallbacks."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import polyjit  # noqa: E402

transformers.logging.set_verbosity_error()


def _gpt2():
    cfg = transformers.GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=300, n_positions=32,
                                  bos_token_id=0, eos_token_id=0, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    return transformers.GPT2LMHeadModel(cfg), lambda out: out.logits


def _bert():
    cfg = transformers.BertConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128,
                                  vocab_size=300, max_position_embeddings=32, hidden_dropout_prob=0,
                                  attention_probs_dropout_prob=0)
    return transformers.BertModel(cfg), lambda out: out.last_hidden_state


@pytest.mark.parametrize("make", [_gpt2, _bert], ids=["gpt2", "bert"])
def test_transformers_model_forward_and_backward(make):
    torch._dynamo.reset()
    polyjit.frontends.torch.stats(reset=True)
    torch.manual_seed(int.from_bytes(np.random.default_rng().bytes(4), "little"))
    model, result = make()
    model.train()  # dropout probabilities are 0: the results are deterministic
    ids = torch.randint(0, 300, (2, 12))
    compiled = torch.compile(model, backend="polyjit", options={"strict": True})
    out, want = result(compiled(ids)), result(model(ids))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    r = torch.randn_like(want)  # gradients through a random projection of the output
    params = [p for p in model.parameters() if p.requires_grad]
    got = torch.autograd.grad((out * r).sum(), params, allow_unused=True)
    ref = torch.autograd.grad((want * r).sum(), params, allow_unused=True)
    for g, h in zip(got, ref):  # sums of many terms in another order: float32 rounding at the gradient's scale
        if h is not None:
            torch.testing.assert_close(g, h, rtol=1e-4, atol=1e-5 * max(1.0, h.abs().max().item()))
            assert (g - h).norm() <= 1e-5 * h.norm() + 1e-6
    stats = polyjit.frontends.torch.stats()
    assert stats["fallbacks"] == 0 and stats["graphs"] == 2 and stats["kernels"] > 0

"""mha.nn.MultiheadAttention inside PyTorch's own models: from_torch (sharing the parameters),
replace_attention over Transformer encoders and decoders, the attributes PyTorch's module reads at
each call, and merge_masks (the encoder layer's inference fast path). Ours in float32 against the
same model with PyTorch's module, also in float32: tolerance 1e-5 of the largest value for outputs
and 1e-4 for gradients (as in the parity suites: both sides round, through a few layers)."""

import copy

import numpy as np
import pytest
import torch

import mha


@pytest.fixture
def rng(parity_seed):
    return np.random.default_rng([parity_seed, 31])


def _rel(a, b):
    return (a.double() - b.double()).abs().max().item() / max(b.abs().max().item(), 1e-30)


def _no_dropout(model):
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(m, (torch.nn.MultiheadAttention, mha.nn.MultiheadAttention)):
            m.dropout = 0.0  # read at each call, by both modules
    return model


def test_from_torch_shares_the_parameters(rng):
    torch.manual_seed(int(rng.integers(2**31)))
    for options in (dict(), dict(kdim=5, vdim=7, add_bias_kv=True), dict(bias=False, batch_first=True)):
        theirs = torch.nn.MultiheadAttention(12, 3, **options).eval()
        ours = mha.nn.MultiheadAttention.from_torch(theirs)
        assert not ours.training
        assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
        assert all(a is b for a, b in zip(ours.parameters(), theirs.parameters()))
        # An optimizer over PyTorch's module trains ours too.
        optimizer = torch.optim.SGD(theirs.parameters(), lr=0.1)
        q = torch.from_numpy(rng.standard_normal((4, 2, 12))).float()
        kv = [torch.from_numpy(rng.standard_normal((6, 2, options.get(d, 12)))).float() for d in ("kdim", "vdim")]
        if options.get("batch_first"):
            q, kv = q.transpose(0, 1), [t.transpose(0, 1) for t in kv]
        theirs(q, *kv)[0].sum().backward()
        optimizer.step()
        out, theirs_out = ours(q, *kv)[0], theirs(q, *kv)[0]
        assert _rel(out, theirs_out) <= 1e-5
    with pytest.raises(TypeError, match="module"):
        mha.nn.MultiheadAttention.from_torch(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_replaced_transformer_trains_and_infers_as_pytorchs(rng, kind, dtype):
    """Every attention of a Transformer encoder or decoder replaced: training outputs and every
    gradient, and inference with PyTorch's fast path on (the encoder layer's fused kernel then
    runs on the shared parameters, through merge_masks) and off (our module runs). A float64
    model (as gradient checks use) computes in float64 on both sides: 1e-12."""
    out_tol, grad_tol = (1e-12, 1e-12) if dtype == torch.float64 else (1e-5, 1e-4)
    torch.manual_seed(int(rng.integers(2**31)))
    E, H, N, L, S = 16, 4, 3, 7, 5
    if kind == "encoder":
        theirs = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(E, H, dim_feedforward=32,
                                                                              batch_first=True), 2)
    else:
        theirs = torch.nn.TransformerDecoder(torch.nn.TransformerDecoderLayer(E, H, dim_feedforward=32,
                                                                              batch_first=True), 2)
    theirs = theirs.to(dtype)
    ours = mha.nn.replace_attention(copy.deepcopy(theirs))
    replaced = [m for m in ours.modules() if isinstance(m, mha.nn.MultiheadAttention)]
    assert len(replaced) == (2 if kind == "encoder" else 4)
    assert not any(type(m) is torch.nn.MultiheadAttention for m in ours.modules())
    _no_dropout(theirs), _no_dropout(ours)

    x = torch.from_numpy(rng.standard_normal((N, L, E))).to(dtype).requires_grad_()
    memory = torch.from_numpy(rng.standard_normal((N, S, E))).to(dtype)
    kpm = torch.zeros(N, L, dtype=torch.bool)
    kpm[1, L - 2:] = True  # left-aligned padding: the encoder's nested-tensor path may take it
    causal = torch.nn.Transformer.generate_square_subsequent_mask(L)

    def run(model, x):
        if kind == "encoder":
            return model(x, src_key_padding_mask=kpm)
        return model(x, memory, tgt_mask=causal, tgt_key_padding_mask=kpm)

    for model in (theirs, ours):
        model.train()
    out, ref = run(ours, x), run(theirs, x)
    assert out.dtype == dtype and _rel(out, ref) <= out_tol
    g = torch.from_numpy(rng.standard_normal(out.shape)).to(dtype)
    params = [x] + list(theirs.parameters())
    ours_params = [x] + list(ours.parameters())
    for name, a, b in zip(["x"] + [n for n, _ in theirs.named_parameters()],
                          torch.autograd.grad((out * g).sum(), ours_params),
                          torch.autograd.grad((ref * g).sum(), params)):
        assert _rel(a, b) <= grad_tol, name

    for model in (theirs, ours):
        model.eval()
    with torch.no_grad():
        for fast in (True, False):
            torch.backends.mha.set_fastpath_enabled(fast)
            try:
                out, ref = run(ours, x), run(theirs, x)
            finally:
                torch.backends.mha.set_fastpath_enabled(True)
            assert _rel(out.to_padded_tensor(0.0) if out.is_nested else out,
                        ref.to_padded_tensor(0.0) if ref.is_nested else ref) <= out_tol, fast


def test_attributes_read_at_each_call(rng):
    """dropout, batch_first and add_zero_attn changed after construction take effect, as in
    PyTorch's module (which reads them in forward)."""
    torch.manual_seed(int(rng.integers(2**31)))
    theirs = torch.nn.MultiheadAttention(8, 2, dropout=0.5)
    ours = mha.nn.MultiheadAttention.from_torch(theirs)
    x = torch.from_numpy(rng.standard_normal((5, 2, 8))).float()
    for m in (theirs, ours):
        m.dropout, m.add_zero_attn = 0.0, True  # training mode: only the dropout made calls differ
    assert _rel(ours(x, x, x)[0], theirs(x, x, x)[0]) <= 1e-5
    for m in (theirs, ours):
        m.batch_first = True
    assert _rel(ours(x, x, x)[0], theirs(x, x, x)[0]) <= 1e-5


def test_merge_masks_matches_pytorchs(rng):
    theirs = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    ours = mha.nn.MultiheadAttention.from_torch(theirs)
    q = torch.zeros(3, 5, 8)
    kpm = torch.from_numpy(rng.random((3, 5)) < 0.3)
    for attn_mask in (None, torch.from_numpy(rng.standard_normal((5, 5))).float(),
                      torch.from_numpy(rng.standard_normal((6, 5, 5))).float()):
        for key_padding_mask in (None, kpm, torch.where(kpm, -1e9, 0.0)):
            if attn_mask is not None and key_padding_mask is not None and key_padding_mask.dtype == torch.bool:
                continue  # (PyTorch adds the two: a float mask and a bool one do not mix there)
            a, a_type = ours.merge_masks(attn_mask, key_padding_mask, q)
            b, b_type = theirs.merge_masks(attn_mask, key_padding_mask, q)
            assert a_type == b_type and (a is None) == (b is None) and (a is None or torch.equal(a, b))


def test_tensors_it_cannot_read_are_clear_errors(rng):
    m = mha.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.from_numpy(rng.standard_normal((2, 3, 8))).float()
    nested = torch.nested.nested_tensor([x[0], x[1, :2]])
    with pytest.raises(ValueError, match="query: nested"):
        m(nested, nested, nested)
    with pytest.raises(ValueError, match="key: expected a CPU tensor"):
        m(x, x.to("meta"), x)
    with pytest.raises(ValueError, match="attn_mask: expected a dense"):
        m(x, x, x, attn_mask=torch.zeros(3, 3).to_sparse())
    with pytest.raises(ValueError, match="out_proj.weight: expected a CPU tensor"):
        m.out_proj.to("meta")
        m(x, x, x)


@pytest.mark.parametrize("case", ["2-D mask", "3-D mask", "bias_kv and zero_attn", "unbatched",
                                  "unbatched 3-D", "weights", "sequence-first", "bfloat16"])
def test_float_masks_get_their_gradients_as_in_pytorch(rng, case):
    """A float attn_mask and key_padding_mask that require grad (learned biases) get PyTorch's
    gradients: dS summed over the batch and heads ([L, S]), per batch entry and head
    ([N * H, L, S]), over the heads and queries (key_padding_mask [N, S]), without the appended
    bias_k / zero columns. Within float32 rounding (1e-5 of the largest); in bfloat16 against
    PyTorch's module in float64 on the same values (its bfloat16 module rounds every intermediate
    to 8 bits and is itself a few percent off at times), within 2e-2."""
    E, H, L, S, N = 16, 2, 5, 7, 2
    dtype = torch.bfloat16 if case == "bfloat16" else torch.float32
    batched = not case.startswith("unbatched")
    extra = case == "bias_kv and zero_attn"
    first = case != "sequence-first"
    theirs = torch.nn.MultiheadAttention(E, H, batch_first=first, add_bias_kv=extra, add_zero_attn=extra).to(dtype)
    ours = mha.nn.MultiheadAttention.from_torch(theirs)

    def t(*shape):
        return torch.from_numpy(rng.standard_normal(shape)).to(dtype)

    def seq(n):  # an input of n rows in the module's layout
        return (t(N, n, E) if first else t(n, N, E)) if batched else t(n, E)

    x, y = seq(L), seq(S)
    heads = N * H if batched else H
    mask = (t(heads, L, S) if "3-D" in case else t(L, S)).requires_grad_()
    padding = (t(N, S) if batched else t(S)).requires_grad_()
    grads = []
    for module in (theirs, ours):
        out, _ = module(x, y, y, attn_mask=mask, key_padding_mask=padding, need_weights=case == "weights")
        grads.append(torch.autograd.grad(out, (mask, padding), torch.ones_like(out)))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    wanted = grads[0]
    if dtype == torch.bfloat16:  # the same module and values in float64
        exact = copy.deepcopy(theirs).double()
        mask64, padding64 = (m.detach().double().requires_grad_() for m in (mask, padding))
        out, _ = exact(x.double(), y.double(), y.double(), attn_mask=mask64, key_padding_mask=padding64,
                       need_weights=case == "weights")
        wanted = torch.autograd.grad(out, (mask64, padding64), torch.ones_like(out))
    for got, theirs_grad, want in zip(grads[1], grads[0], wanted):
        assert got.shape == theirs_grad.shape and got.dtype == theirs_grad.dtype
        assert (got.double() - want.double()).abs().max().item() <= tol * want.double().abs().max().item()


def test_backward_through_a_retained_graph_and_activations_freed_after(rng):
    """As with PyTorch's module: backward(retain_graph=True) leaves the graph for another backward
    (gradients accumulate, as gradcheck and multi-loss training rely on), a backward past the last
    retained one is autograd's own error, and a plain backward frees the saved activations at once
    (not when the output is dropped, which in a training loop is after the next forward)."""
    torch.manual_seed(int(rng.integers(2**31)))
    theirs = torch.nn.MultiheadAttention(16, 4, kdim=6, vdim=6)
    ours = mha.nn.MultiheadAttention.from_torch(copy.deepcopy(theirs))
    q = torch.from_numpy(rng.standard_normal((5, 2, 16))).float()
    kv = torch.from_numpy(rng.standard_normal((7, 2, 6))).float()
    g = torch.from_numpy(rng.standard_normal((5, 2, 16))).float()
    grads = []
    for model in (theirs, ours):
        x = q.clone().requires_grad_()
        out, _ = model(x, kv, kv)
        (out * g).sum().backward(retain_graph=True)
        (2 * out * g).sum().backward()
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            out.sum().backward()
        grads.append([x.grad] + [p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        assert _rel(a, b) <= 1e-5
    out, _ = ours(q.clone().requires_grad_(), kv, kv)
    token = out.grad_fn.saved_tensors[0].data_ptr()  # (the address of what keeps the C++ context)
    assert token in mha.autograd._keepers
    out.sum().backward()
    assert token not in mha.autograd._keepers and out is not None


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_gives_the_plain_gradients(rng, reentrant):
    """torch.utils.checkpoint drops the forward's saved state and runs the forward again in the
    backward: the gradients (dropout included: the seed comes from torch's generator, which
    checkpointing restores) are those of the plain call, bit for bit."""
    ours = mha.nn.MultiheadAttention(16, 4, dropout=0.25, batch_first=True)
    q = torch.from_numpy(rng.standard_normal((2, 5, 16))).float()
    seed = int(rng.integers(2**31))
    grads = []
    for checkpointed in (False, True):
        x = q.clone().requires_grad_()
        torch.manual_seed(seed)
        run = lambda x: ours(x, x, x)[0]  # noqa: E731
        out = torch.utils.checkpoint.checkpoint(run, x, use_reentrant=reentrant) if checkpointed else run(x)
        out.square().sum().backward()
        grads.append([x.grad] + [p.grad.clone() for p in ours.parameters()])
        ours.zero_grad()
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_attention_weights_are_differentiable_as_in_pytorch(rng, dtype):
    """The returned weights carry gradients, as PyTorch's module's do (attention supervision,
    distillation): a loss of the output and the weights, and of the weights alone, averaged over the
    heads or per head, with dropout off and masks on, gives PyTorch's gradients for the inputs and
    every parameter (1e-4 of the largest in float32, 1e-12 in float64, 2e-2 in bfloat16, whose
    weights and gradients are rounded to 8 bits on both sides)."""
    tol = {torch.float32: 1e-4, torch.float64: 1e-12, torch.bfloat16: 2e-2}[dtype]
    torch.manual_seed(int(rng.integers(2**31)))
    for average in (True, False):
        theirs = torch.nn.MultiheadAttention(16, 4, add_bias_kv=True, kdim=6, vdim=5, dtype=dtype)
        ours = mha.nn.MultiheadAttention.from_torch(copy.deepcopy(theirs))
        q = torch.from_numpy(rng.standard_normal((5, 2, 16))).to(dtype)
        k = torch.from_numpy(rng.standard_normal((7, 2, 6))).to(dtype)
        v = torch.from_numpy(rng.standard_normal((7, 2, 5))).to(dtype)
        kpm = torch.zeros(2, 7, dtype=torch.bool)
        kpm[1, 5:] = True
        mask = torch.from_numpy(rng.standard_normal((5, 7))).to(dtype)
        g = torch.from_numpy(rng.standard_normal((5, 2, 16))).to(dtype)
        gw = torch.from_numpy(rng.standard_normal((2, 5, 8) if average else (2, 4, 5, 8))).to(dtype)
        for with_output in (True, False):
            grads = []
            for model in (theirs, ours):
                x = q.clone().requires_grad_()
                out, weights = model(x, k, v, key_padding_mask=kpm, attn_mask=mask, average_attn_weights=average)
                assert weights.requires_grad
                loss = (weights.float() * gw.float()).sum() + ((out.float() * g.float()).sum() if with_output else 0)
                wrt = [x, *model.parameters()]
                # (a loss of the weights alone leaves out_proj and v's projection out of PyTorch's graph)
                found = torch.autograd.grad(loss, wrt, allow_unused=True)
                grads.append([torch.zeros_like(t) if d is None else d for d, t in zip(found, wrt)])
            scale = max(float(b.abs().max()) for b in grads[0])
            for a, b in zip(*grads):
                assert float((a.double() - b.double()).abs().max()) <= tol * scale, (average, with_output)


def test_second_order_gradients_match_torch(rng):
    """A gradient penalty through the module (the gradient of a gradient, create_graph=True) against
    PyTorch's module, whose need_weights=True path is its differentiable composition (its fused SDPA
    has no second derivative on the CPU); one tensor as query, key and value, a learned float mask,
    bias_k/bias_v. With dropout in training, create_graph is a clear error, not a term left out."""
    theirs = torch.nn.MultiheadAttention(16, 4, add_bias_kv=True, dtype=torch.float64)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.from_numpy(rng.standard_normal(p.shape)))
    ours = mha.nn.MultiheadAttention.from_torch(theirs)
    x = torch.from_numpy(rng.standard_normal((5, 2, 16)))
    bias = torch.from_numpy(rng.standard_normal((5, 5)))

    def penalty(module, need_weights):
        xx, b = x.clone().requires_grad_(), bias.clone().requires_grad_()
        out, _ = module(xx, xx, xx, attn_mask=b, need_weights=need_weights)
        g, = torch.autograd.grad(out.square().sum(), xx, create_graph=True)
        module.zero_grad()
        g.square().sum().backward()
        return [xx.grad, b.grad, *(p.grad for p in module.parameters())]

    want = penalty(theirs, True)
    for need_weights in (False, True):
        for a, b in zip(penalty(ours, need_weights), want):
            assert float((a - b).abs().max()) <= 1e-10 * float(b.abs().max())
    m = mha.nn.MultiheadAttention(16, 4, dropout=0.1)
    x32 = torch.from_numpy(rng.standard_normal((5, 2, 16))).float().requires_grad_()
    out = m(x32, x32, x32)[0]
    with pytest.raises(RuntimeError, match="second derivatives"):
        torch.autograd.grad(out.square().sum(), x32, create_graph=True)
    torch.autograd.grad(m(x32, x32, x32)[0].square().sum(), x32)  # (a first derivative alone is fine)
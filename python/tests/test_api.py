"""The Python API itself: kinds in and out, state dicts, errors, files, threads."""

import os
import threading

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch

import mha


@pytest.fixture
def rng(parity_seed):
    return np.random.default_rng([parity_seed, 3])


def test_numpy_in_numpy_out_torch_in_torch_out(rng):
    m = mha.MultiheadAttention(16, 4, seed=1).eval()
    x = rng.standard_normal((5, 2, 16)).astype(np.float32)
    out, w = m(x, x, x)
    assert isinstance(out, np.ndarray) and isinstance(w, np.ndarray)
    assert out.shape == (5, 2, 16) and w.shape == (2, 5, 5)
    out_t, w_t = m(torch.from_numpy(x), torch.from_numpy(x), torch.from_numpy(x))
    assert isinstance(out_t, torch.Tensor) and isinstance(w_t, torch.Tensor)
    np.testing.assert_array_equal(out_t.numpy(), out)
    out, w = m(x, x, x, need_weights=False)
    assert w is None


def test_broadcast_and_strided_inputs_match_torch(rng):
    # Views with repeated rows (stride 0, from expand() or np.broadcast_to) or rows out of order
    # are read as they are, without copies, and must give what torch gives on their copies.
    ref = torch.nn.MultiheadAttention(8, 2).eval()
    m = mha.MultiheadAttention.from_torch(ref)
    row = rng.standard_normal((1, 3, 8)).astype(np.float32)
    col = rng.standard_normal((5, 1, 8)).astype(np.float32)
    batch_major = rng.standard_normal((3, 5, 8)).astype(np.float32)
    views = [  # (numpy view, torch view of the same values)
        (np.broadcast_to(row, (5, 3, 8)), torch.from_numpy(row).expand(5, 3, 8)),
        (np.broadcast_to(col, (5, 3, 8)), torch.from_numpy(col).expand(5, 3, 8)),
        (np.broadcast_to(row[:, :1], (5, 3, 8)), torch.from_numpy(row[:, :1].copy()).expand(5, 3, 8)),
        (batch_major.transpose(1, 0, 2), torch.from_numpy(batch_major).transpose(0, 1)),
    ]
    for x, t in views:
        assert 0 in t.stride() or not t.is_contiguous()
        dense = torch.from_numpy(np.ascontiguousarray(x))
        with torch.no_grad():
            expected = ref(dense, dense, dense)[0].numpy()
        for given in (x, t):
            out, _ = m(given, given, given)
            np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-6, err_msg=str(t.stride()))


def test_from_torch_and_state_dict_round_trip(rng):
    ref = torch.nn.MultiheadAttention(24, 3, bias=True, add_bias_kv=True, kdim=10, vdim=7, batch_first=True)
    m = mha.MultiheadAttention.from_torch(ref)
    assert m.training == ref.training and m.batch_first and m.kdim == 10 and m.vdim == 7
    sd = m.state_dict()
    assert set(sd) == set(ref.state_dict())
    for name, value in ref.state_dict().items():
        np.testing.assert_array_equal(sd[name], value.numpy())
    # numpy state dict loads too, and a wrong shape names the parameter
    m2 = mha.MultiheadAttention(24, 3, add_bias_kv=True, kdim=10, vdim=7, batch_first=True)
    m2.load_state_dict(sd)
    bad = dict(sd, out_proj_bias=None)
    bad.pop("out_proj_bias")
    bad["out_proj.bias"] = np.zeros(5, dtype=np.float32)
    with pytest.raises(ValueError, match="out_proj.bias"):
        m2.load_state_dict(bad)
    with pytest.raises(ValueError, match="unexpected"):
        m2.load_state_dict(dict(sd, extra=np.zeros(1, dtype=np.float32)))
    m2.load_state_dict(dict(sd, extra=np.zeros(1, dtype=np.float32)), strict=False)


def test_errors_are_python_exceptions():
    with pytest.raises(ValueError, match="divisible"):
        mha.MultiheadAttention(10, 3)
    with pytest.raises(ValueError, match="num_heads"):
        mha.MultiheadAttention(8, 0)
    with pytest.raises(TypeError):
        mha.MultiheadAttention(8.5, 2)
    m = mha.MultiheadAttention(8, 2)
    x = np.zeros((3, 2, 8), dtype=np.float32) + 0.5
    with pytest.raises(ValueError, match="query"):
        m(np.zeros((3, 2, 9), dtype=np.float32), x, x)
    with pytest.raises(ValueError, match="key_padding_mask"):
        m(x, x, x, key_padding_mask=np.zeros((2, 4), dtype=bool))
    with pytest.raises(TypeError, match="attn_mask"):
        m(x, x, x, attn_mask=np.zeros((3, 3), dtype=np.int32))
    with pytest.raises(ValueError, match="attn_mask"):
        m(x, x, x, attn_mask=np.zeros((3, 3), dtype=np.float64))
    with pytest.raises(TypeError):
        m("query", x, x)
    with pytest.raises(ValueError, match="float32"):
        m(x.astype(np.float64), x, x)


def test_safetensors_round_trip_and_bad_files(tmp_path, rng):
    tensors = {"a": rng.standard_normal((3, 4)).astype(np.float32), "mask": rng.random(5) < 0.5,
               "d": rng.standard_normal(2)}
    path = tmp_path / "t.safetensors"
    safetensors.numpy.save_file(tensors, str(path))
    loaded = mha.load_safetensors(path)
    for k, v in tensors.items():
        np.testing.assert_array_equal(loaded[k], v)
    ours = tmp_path / "ours.safetensors"
    mha.save_safetensors(ours, {"t": torch.arange(12.0).reshape(3, 4).t()})
    np.testing.assert_array_equal(safetensors.torch.load_file(str(ours))["t"].numpy(),
                                  np.arange(12.0, dtype=np.float32).reshape(3, 4).T)
    good = path.read_bytes()
    for bad in (good[:7], b"\xff" * 8 + good[8:], good[:8] + b"{not json" + good[17:], good[:-3]):
        p = tmp_path / "bad.safetensors"
        p.write_bytes(bad)
        with pytest.raises(ValueError, match="safetensors"):
            mha.load_safetensors(p)


def test_gil_is_released_during_compute(rng):
    """Two Python threads computing at once finish with the same results as one after the other."""
    q = rng.standard_normal((2, 4, 256, 32)).astype(np.float32)
    expected = mha.scaled_dot_product_attention(q, q, q, num_threads=1)
    results = [None] * 4

    def work(i):
        results[i] = mha.scaled_dot_product_attention(q, q, q, num_threads=1)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        np.testing.assert_array_equal(r, expected)


def test_one_nn_module_in_several_threads(rng):
    """One mha.nn.MultiheadAttention called from four threads at once, forward and backward:
    each gets what a call alone gets (its C++ module holds nothing a call changes)."""
    m = mha.nn.MultiheadAttention(32, 4).eval()
    xs = [torch.from_numpy(rng.standard_normal((20, 2, 32)).astype(np.float32)) for _ in range(4)]

    def call(x):
        x = x.clone().requires_grad_()
        out, _ = m(x, x, x)
        out.square().sum().backward()
        return out.detach(), x.grad

    expected = [call(x) for x in xs]
    m.zero_grad()
    results = [None] * 4
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, call(xs[i]))) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (out, grad), (out_e, grad_e) in zip(results, expected):
        assert torch.equal(out, out_e) and torch.equal(grad, grad_e)


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_nn_module_copies_and_pickles(rng, how):
    """copy.deepcopy (EMA weights, a best-so-far model) and torch.save of a whole model work as
    with PyTorch's module: the copy computes the same outputs and gradients with its own
    parameters, keeps the options, the dtype and the training mode, and trains on its own."""
    import copy
    import io

    m = mha.nn.MultiheadAttention(24, 3, dropout=0.2, kdim=10, vdim=7, batch_first=True, dtype=torch.bfloat16).eval()
    if how == "deepcopy":
        c = copy.deepcopy(m)
    else:
        buffer = io.BytesIO()
        torch.save(m, buffer)
        buffer.seek(0)
        c = torch.load(buffer, weights_only=False)
    assert not c.training and c.batch_first and (c.kdim, c.vdim, c.dropout) == (10, 7, 0.2)
    q = torch.from_numpy(rng.standard_normal((2, 5, 24))).to(torch.bfloat16)
    k = torch.from_numpy(rng.standard_normal((2, 6, 10))).to(torch.bfloat16)
    v = torch.from_numpy(rng.standard_normal((2, 6, 7))).to(torch.bfloat16)
    for module in (m, c):
        out, w = module(q, k, v)
        out.float().square().sum().backward()
    assert torch.equal(m(q, k, v)[0], c(q, k, v)[0])
    for (name, p), (_, pc) in zip(m.named_parameters(), c.named_parameters()):
        assert p.data_ptr() != pc.data_ptr() and torch.equal(p.grad, pc.grad), name
    with torch.no_grad():
        c.q_proj_weight.add_(1.0)
    assert not torch.equal(m(q, k, v)[0], c(q, k, v)[0])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_numpy_level_module_copies_and_pickles(rng, dtype):
    """mha.MultiheadAttention (parameters held in C++): copy.deepcopy and pickle keep the options,
    the dtype, the training mode and the parameters' exact values; the copy is independent."""
    import copy
    import pickle

    m = mha.MultiheadAttention(16, 2, kdim=5, vdim=7, add_bias_kv=True, batch_first=True, dtype=dtype).eval()
    tdtype = getattr(torch, dtype)
    q = torch.from_numpy(rng.standard_normal((2, 3, 16))).to(tdtype)
    k = torch.from_numpy(rng.standard_normal((2, 4, 5))).to(tdtype)
    v = torch.from_numpy(rng.standard_normal((2, 4, 7))).to(tdtype)
    for c in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert repr(c) == repr(m) and not c.training
        assert torch.equal(c(q, k, v)[0], m(q, k, v)[0])
        state = c.state_dict()
        state["bias_k"] = state["bias_k"] + 1
        c.load_state_dict(state)
        assert not torch.equal(c(q, k, v)[0], m(q, k, v)[0])


def test_dropout_is_reproducible_by_seed(rng):
    q = rng.standard_normal((1, 2, 9, 8)).astype(np.float32)
    a = mha.scaled_dot_product_attention(q, q, q, dropout_p=0.5, dropout_seed=3)
    b = mha.scaled_dot_product_attention(q, q, q, dropout_p=0.5, dropout_seed=3)
    c = mha.scaled_dot_product_attention(q, q, q, dropout_p=0.5, dropout_seed=4)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    m = mha.MultiheadAttention(8, 2, dropout=0.5, seed=0)
    x = q[0, 0][:, None, :]
    o1, _ = m(x, x, x, dropout_seed=11)
    o2, _ = m(x, x, x, dropout_seed=11)
    np.testing.assert_array_equal(o1, o2)
    m.eval()
    e1, _ = m(x, x, x)
    e2, _ = m(x, x, x)
    np.testing.assert_array_equal(e1, e2)


def test_low_precision_inputs_keep_their_dtype(rng):
    q = torch.from_numpy(rng.standard_normal((2, 3, 20, 16)).astype(np.float32))
    for dtype, tol in ((torch.bfloat16, 1e-2), (torch.float16, 2e-3)):
        x = q.to(dtype)
        out = mha.scaled_dot_product_attention(x, x, x, is_causal=True)
        assert out.dtype == dtype
        exact = torch.nn.functional.scaled_dot_product_attention(*(x.double(),) * 3, is_causal=True)
        assert (out.double() - exact).abs().max() / exact.abs().max() < tol
    half = q.numpy().astype(np.float16)
    out = mha.scaled_dot_product_attention(half, half, half)
    assert out.dtype == np.float16


def test_threading_choices_give_the_same_bits(rng):
    q, k, v = (torch.from_numpy(rng.standard_normal((2, 4, 70, 32)).astype(np.float32)) for _ in range(3))
    m = mha.MultiheadAttention(32, 4, seed=2).eval()
    x = torch.from_numpy(rng.standard_normal((30, 2, 32)).astype(np.float32))
    before = mha.get_threading()
    try:
        results = {}
        for choice in ("pool", "openmp") if mha._mha.openmp_available() else ("pool",):
            mha.set_threading(choice)
            assert mha.get_threading() == choice
            results[choice] = (mha.scaled_dot_product_attention(q, k, v, is_causal=True, num_threads=3),
                               m(x, x, x, num_threads=3)[0])
        for a, b in zip(results["pool"], results.get("openmp", results["pool"])):
            assert torch.equal(a, b)
        with pytest.raises(ValueError, match="threading: expected 'pool' or 'openmp'"):
            mha.set_threading("threads")
    finally:
        mha.set_threading(before)


def test_threading_shares_torchs_openmp_runtime():
    """With torch imported and one OpenMP runtime in the process, the first call moves the parallel
    work onto the OpenMP team; MHA_THREADING overrides that, and an invalid value is an error."""
    import subprocess
    import sys
    code = ("import torch, mha; q = torch.randn(1, 2, 8, 16); mha.scaled_dot_product_attention(q, q, q); "
            "print(mha.get_threading(), len(mha._openmp_runtimes()))")
    env = {k: v for k, v in os.environ.items() if k != "MHA_THREADING"}
    choice, runtimes = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                      check=True).stdout.split()
    expected = "openmp" if mha._mha.openmp_available() and runtimes == "1" else "pool"
    assert choice == expected
    forced = subprocess.run([sys.executable, "-c", code], env={**env, "MHA_THREADING": "pool"}, capture_output=True,
                            text=True, check=True).stdout.split()[0]
    assert forced == "pool"
    bad = subprocess.run([sys.executable, "-c", code], env={**env, "MHA_THREADING": "many"}, capture_output=True,
                         text=True)
    assert bad.returncode != 0 and "MHA_THREADING: expected 'pool' or 'openmp'" in bad.stderr


def test_release_host_cache():
    out = mha.scaled_dot_product_attention(*(torch.randn(1, 4, 512, 128) for _ in range(3)))  # a 1 MiB output
    del out  # its block goes to the cache
    if os.environ.get("MHA_HOST_CACHE_MB") != "0":
        assert mha._mha.host_cache_bytes() >= 1 << 20
    mha.release_host_cache()
    assert mha._mha.host_cache_bytes() == 0


def test_extension_stubs_name_the_extensions_arguments():
    """_mha.pyi (what type checkers and editors read) lists, for every function it declares, the
    arguments the extension takes, in order (nanobind's own signature in each __doc__)."""
    import ast
    import pathlib

    from mha import _mha

    def extension_arguments(fn):
        signature = fn.__doc__.split("\n")[0]
        inside = signature[signature.index("(") + 1:]
        names, depth, start = [], 0, 0
        for at, ch in enumerate(inside):
            if ch in "([{":
                depth += 1
            elif ch in ")]}":
                if depth == 0:
                    names.append(inside[start:at])
                    break
                depth -= 1
            elif ch == "," and depth == 0:
                names.append(inside[start:at])
                start = at + 1
        return [n.split(":")[0].strip() for n in names if n.strip()]

    stubs = ast.parse((pathlib.Path(mha.__file__).parent / "_mha.pyi").read_text())
    checked = 0
    for node in stubs.body:
        if isinstance(node, ast.FunctionDef):
            declared = [a.arg for a in node.args.args]
            assert declared == extension_arguments(getattr(_mha, node.name)), node.name
            checked += 1
    assert checked >= 15

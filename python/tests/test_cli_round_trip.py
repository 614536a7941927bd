"""PyTorch module -> safetensors file -> the C++ command line (`mha run`) -> outputs equal PyTorch's."""

import os
import pathlib
import subprocess

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
CLI = pathlib.Path(os.environ.get("MHA_CLI", ROOT / "build" / "tools" / "mha"))
TOL = 1e-5  # normwise, float32 against PyTorch in float64 (see test_parity_module.py)


@pytest.fixture(scope="module")
def cli():
    if not CLI.exists():
        pytest.fail(f"the mha command line is not built at {CLI}: run `make build` (or set MHA_CLI)")
    return CLI


def rel_err(a, b):
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


@pytest.mark.parametrize("case", range(12))
def test_checkpoint_runs_from_the_command_line(case, cli, tmp_path, parity_seed):
    rng = np.random.default_rng([parity_seed, 4, case])
    H = int(rng.integers(1, 5))
    E = H * int(rng.integers(2, 9))
    cross = bool(rng.random() < 0.5)
    kdim = int(rng.integers(2, 12)) if cross and rng.random() < 0.5 else None
    vdim = int(rng.integers(2, 12)) if cross and rng.random() < 0.5 else None
    batch_first = bool(rng.random() < 0.5)
    add_zero_attn = bool(rng.random() < 0.3)
    torch.manual_seed(int(rng.integers(2**31)))
    ref = torch.nn.MultiheadAttention(E, H, bias=bool(rng.random() < 0.7), add_bias_kv=bool(rng.random() < 0.3),
                                      add_zero_attn=add_zero_attn, kdim=kdim, vdim=vdim,
                                      batch_first=batch_first).eval()
    # A checkpoint as users have them: the module inside a model, saved with safetensors.
    prefix = "encoder.self_attn." if case % 2 else ""
    state = {prefix + k: v.contiguous() for k, v in ref.state_dict().items()}
    ckpt = tmp_path / "attn.safetensors"
    safetensors.torch.save_file(state, str(ckpt), metadata={"num_heads": str(H)} if case % 3 else None)

    N, L = int(rng.integers(1, 4)), int(rng.integers(1, 10))
    S = int(rng.integers(1, 10)) if cross else L
    shape = lambda n, length, w: (n, length, w) if batch_first else (length, n, w)  # noqa: E731
    query = rng.standard_normal(shape(N, L, E)).astype(np.float32)
    key = rng.standard_normal(shape(N, S, kdim or E)).astype(np.float32) if cross else query
    value = rng.standard_normal(shape(N, S, vdim or E)).astype(np.float32) if cross else query
    kpm = rng.random((N, S)) < 0.2
    kpm[:, 0] = False  # keep every row alive: PyTorch's NaN rows are covered by the parity suite
    average = bool(rng.random() < 0.5)

    with torch.no_grad():
        ref64 = ref.double()
        t = lambda x: torch.from_numpy(x).double()  # noqa: E731
        expected, expected_w = ref64(t(query), t(key), t(value), key_padding_mask=torch.from_numpy(kpm),
                                     need_weights=True, average_attn_weights=average)

    args = [str(cli), "run", "--weights", str(ckpt), "--need-weights"]
    if case % 3 == 0:
        args += ["--num-heads", str(H)]
    if prefix:
        args += ["--prefix", prefix]
    if batch_first:
        args.append("--batch-first")
    if add_zero_attn:
        args.append("--add-zero-attn")
    if not average:
        args.append("--no-average")
    if case % 4 < 2:  # inputs as .npy files, outputs as .npy
        for name, array in (("query", query), ("key", key), ("value", value), ("key-padding-mask", kpm)):
            np.save(tmp_path / f"{name}.npy", array)
            args += [f"--{name}", str(tmp_path / f"{name}.npy")]
        args += ["--out", str(tmp_path / "out.npy"), "--weights-out", str(tmp_path / "w.npy")]
        subprocess.run(args, check=True, capture_output=True)
        out, w = np.load(tmp_path / "out.npy"), np.load(tmp_path / "w.npy")
    else:  # one .safetensors file in, one out
        safetensors.numpy.save_file({"query": query, "key": key, "value": value, "key_padding_mask": kpm},
                                    str(tmp_path / "in.safetensors"))
        args += ["--inputs", str(tmp_path / "in.safetensors"), "--out", str(tmp_path / "out.safetensors")]
        subprocess.run(args, check=True, capture_output=True)
        result = safetensors.numpy.load_file(str(tmp_path / "out.safetensors"))
        out, w = result["output"], result["weights"]
    assert out.shape == tuple(expected.shape) and w.shape == tuple(expected_w.shape)
    assert rel_err(out, expected.numpy()) <= TOL
    assert rel_err(w, expected_w.numpy()) <= TOL


# A checkpoint saved in bfloat16, float16 or float64 runs as a module of that dtype on float32 .npy
# inputs (numpy has no bfloat16): against PyTorch in float64 on the checkpoint's weights and the
# inputs rounded to that dtype. bfloat16 / float16: the module rounds its projections' outputs
# to the dtype (2^-9, 2^-12 relative) and computes in float32, so 2e-2 and 3e-3 of the largest
# output; float64: computed in float64 throughout, 1e-12.
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 3e-3), (torch.float64, 1e-12)])
def test_checkpoint_in_another_dtype_runs_as_that_dtype(dtype, tol, cli, tmp_path, parity_seed):
    rng = np.random.default_rng([parity_seed, 5, int(tol * 1e12)])
    torch.manual_seed(int(rng.integers(2**31)))
    E, H, L, N = 32, 4, 9, 2
    ref = torch.nn.MultiheadAttention(E, H).eval()
    state = {k: v.to(dtype).contiguous() for k, v in ref.state_dict().items()}
    ckpt = tmp_path / "attn.safetensors"
    safetensors.torch.save_file(state, str(ckpt), metadata={"num_heads": str(H)})
    query = rng.standard_normal((L, N, E)).astype(np.float32)
    np.save(tmp_path / "q.npy", query)
    subprocess.run([str(cli), "run", "--weights", str(ckpt), "--query", str(tmp_path / "q.npy"), "--out",
                    str(tmp_path / "out.npy")], check=True, capture_output=True)
    out = np.load(tmp_path / "out.npy")
    assert out.dtype == (np.float32 if dtype == torch.bfloat16 else torch.empty(0, dtype=dtype).numpy().dtype)
    with torch.no_grad():
        ref64 = torch.nn.MultiheadAttention(E, H).double().eval()
        ref64.load_state_dict({k: v.double() for k, v in state.items()})
        x = torch.from_numpy(query).to(dtype).double()
        expected = ref64(x, x, x, need_weights=False)[0].numpy()
    assert rel_err(out.astype(np.float64), expected) <= tol


def test_bad_checkpoint_is_a_clear_error(cli, tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    np.save(tmp_path / "q.npy", np.ones((2, 1, 4), dtype=np.float32))
    r = subprocess.run([str(cli), "run", "--weights", str(bad), "--num-heads", "2", "--query", str(tmp_path / "q.npy"),
                        "--out", str(tmp_path / "o.npy")], capture_output=True, text=True)
    assert r.returncode == 2 and "safetensors" in r.stderr

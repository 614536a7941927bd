#!/usr/bin/env python3
"""Writes the seed corpora in fuzz/corpus/ (standard library only; run from anywhere).

safetensors/ and npy/: small valid files in the formats' own layouts (what the `safetensors`
package and numpy.save write), one per dtype and layout the readers accept, plus metadata and
header versions. validation/, differential/ and module_differential/: fixed pseudo-random bytes
(the targets read them as a stream of decisions). The fuzzer's own findings go to build-fuzz/corpus/, not here; a
finding that was a bug is kept beside the seeds as regression-* (this script leaves those alone).
"""
import json
import os
import random
import struct

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")


def write(target, name, data):
    os.makedirs(os.path.join(HERE, target), exist_ok=True)
    with open(os.path.join(HERE, target, name), "wb") as f:
        f.write(data)


def safetensors(tensors, metadata=None):
    """tensors: name -> (dtype, shape, raw bytes). Header padded with spaces to 8 bytes."""
    header, blob = {}, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(blob), len(blob) + len(raw)]}
        blob += raw
    if metadata is not None:
        header["__metadata__"] = metadata
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + blob


def npy(descr, shape, raw, fortran=False, version=(1, 0)):
    shape_str = f"({shape[0]},)" if len(shape) == 1 else "(" + ", ".join(str(s) for s in shape) + ")"
    d = f"{{'descr': '{descr}', 'fortran_order': {fortran}, 'shape': {shape_str}, }}"
    len_size = 2 if version[0] == 1 else 4
    total = 6 + 2 + len_size + len(d) + 1
    d += " " * (-total % 64) + "\n"
    n = struct.pack("<H", len(d)) if len_size == 2 else struct.pack("<I", len(d))
    return b"\x93NUMPY" + bytes(version) + n + d.encode("latin1") + raw


def main():
    rng = random.Random(20261122)
    f32 = lambda n: struct.pack(f"<{n}f", *[rng.uniform(-2, 2) for _ in range(n)])
    f64 = lambda n: struct.pack(f"<{n}d", *[rng.uniform(-2, 2) for _ in range(n)])
    f16 = lambda n: struct.pack(f"<{n}e", *[rng.uniform(-2, 2) for _ in range(n)])
    bf16 = lambda n: b"".join(struct.pack("<f", rng.uniform(-2, 2))[2:] for _ in range(n))
    bools = lambda n: bytes(rng.randrange(2) for _ in range(n))

    write("safetensors", "two_tensors.safetensors",
          safetensors({"in_proj_weight": ("F32", [6, 2], f32(12)), "in_proj_bias": ("F32", [6], f32(6))},
                      {"num_heads": "2"}))
    write("safetensors", "half.safetensors", safetensors({"b": ("F16", [4], f16(4))}))
    write("safetensors", "dtypes.safetensors",
          safetensors({"a": ("BF16", [2, 3], bf16(6)), "m": ("BOOL", [2, 2], bools(4)), "d": ("F64", [2], f64(2)),
                       "s": ("F32", [], f32(1)), "e": ("F32", [0, 3], b"")}))
    write("safetensors", "empty.safetensors", safetensors({}))

    write("npy", "f32_2x3.npy", npy("<f4", (2, 3), f32(6)))
    write("npy", "f64_fortran.npy", npy("<f8", (2, 2), f64(4), fortran=True))
    write("npy", "bool_5.npy", npy("|b1", (5,), bools(5)))
    write("npy", "f16_3d.npy", npy("<f2", (2, 1, 3), f16(6)))
    write("npy", "scalar_v2.npy", npy("<f4", (), f32(1), version=(2, 0)))
    write("npy", "empty_v3.npy", npy("<f4", (0, 4), b"", version=(3, 0)))

    for target in ("validation", "differential", "module_differential", "paged"):
        for i, n in enumerate((64, 128, 192, 256)):
            write(target, f"seed{i}", bytes(rng.randrange(256) for _ in range(n)))


if __name__ == "__main__":
    main()

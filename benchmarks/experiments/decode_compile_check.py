"""Compile the split decode kernel for an H100 (sm_90) on a machine without a GPU.

Triton compiles ahead of time for a named target with the ``ptxas`` its wheel ships, so the
device code's typing and layouts, and its registers and spills, can be checked on CPU. Both
merges (``FUSED_MERGE`` off and on) are compiled with the split tiles (32 tokens, 4 warps, 5
stages) for a few group and head sizes, and over an fp8 cache with its tiles (64 tokens,
2 warps, 6 stages); the fused variant must not add spills.

    python -m benchmarks.experiments.decode_compile_check

Without ``TRITON_INTERPRET`` set (the interpreter replaces the kernels with Python).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mini_paged_attn.ops.decode_kernel import _paged_decode_kernel
from mini_paged_attn.ops.decode_merge import merge_chunk, merge_rows
from mini_paged_attn.ops.decode_tiles import FP8_TILES, DecodeTiles, fp8_v_conversion

SPLIT_TILES = DecodeTiles(block_n=32, num_warps=4, num_stages=5)
# (group size, head size, splits, cache dtype)
CASES = ((4, 128, 32, "bf16"), (1, 128, 16, "bf16"), (5, 80, 7, "bf16"), (8, 256, 64, "bf16"),
         (4, 64, 32, "bf16"), (4, 128, 32, "fp8e4nv"))


def compile_split_kernel(fused: bool, group: int, head: int, splits: int,
                         kv_dtype: str = "bf16", dtype: str = "bf16"):
    """The split decode kernel compiled for sm_90 (``triton.compile``'s result); an fp8 cache
    (``fp8e4nv``) takes its own tiles and fp16 dots, as the planner gives it."""
    fp8 = kv_dtype.startswith("fp8")
    tiles = FP8_TILES if fp8 else SPLIT_TILES
    padded = max(16, triton.next_power_of_2(head))
    constexprs = dict(
        GROUP_SIZE=group, HEAD_SIZE=head, HEAD_SIZE_PADDED=padded,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=tiles.block_n,
        BLOCK_SIZE=16, SPLIT_KV=True, WRITE_LSE=True, DOT_PRECISION="tf32", K_SCALED=fp8,
        V_SCALED=fp8, FP16_DOTS=fp8, FP8_V=fp8_v_conversion(head, padded, True) if fp8 else "cast",
        WINDOW=False,
        SOFTCAP=False, HAS_SINKS=False, ORDERED=False, PDL=True,
        FUSED_MERGE=fused, MERGE_ROWS=merge_rows(group),
        MERGE_CHUNK=merge_chunk(group, padded, splits, tiles.num_warps))
    pointers = dict(key_cache_ptr="*" + kv_dtype, value_cache_ptr="*" + kv_dtype,
                    k_scale_ptr="*fp32", v_scale_ptr="*fp32", block_tables_ptr="*i32",
                    context_lens_ptr="*i32", seq_order_ptr="*i32", out_ptr="*fp32",
                    lse_ptr="*fp32",
                    merged_lse_ptr="*fp32", counters_ptr="*i32")
    names = _paged_decode_kernel.arg_names
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointers.get(name, "*" + dtype)
        elif name in ("scale_log2", "softcap_log2"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    # As the JIT specialises a launch: pointers 16-byte aligned, and the strides of the
    # benchmark's pool, tables and outputs divisible by 16 (all but the unit strides).
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
               if n.endswith("_ptr") or (n.startswith("stride_") and signature[n] == "i32"
                                         and not n.endswith(("_dim", "_scale")))}
    return triton.compile(ASTSource(_paged_decode_kernel, signature, constexprs, aligned),
                          target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=tiles.num_warps,
                                       num_stages=tiles.num_stages))


def resource_usage(kernel) -> str:
    """Registers, stack and local memory (spills) of a compiled kernel, by ``cuobjdump``."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True,
                              text=True).stdout
    return " ".join(re.findall(r"(?:REG|STACK|LOCAL):\d+", text))


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter compiles nothing")
    for group, head, splits, kv_dtype in CASES:
        for fused in (False, True):
            kernel = compile_split_kernel(fused, group, head, splits, kv_dtype)
            ptx = kernel.asm["ptx"]
            atomics = sorted(set(re.findall(r"atom\.[\w.]+", ptx)))
            print(f"{kv_dtype:7} group {group} head {head} splits {splits:3d} fused={fused!s:5}: "
                  f"{resource_usage(kernel)} {' '.join(atomics)}", flush=True)


if __name__ == "__main__":
    main()

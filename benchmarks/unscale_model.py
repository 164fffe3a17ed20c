#!/usr/bin/env python
"""Static throughput model of the CPU unscale loops, for CPUs no machine at hand has.

Reads the hot loop of each unscale kernel out of the built binaries and has llvm-mca simulate it
on a CPU model (cycles per value, no memory traffic: values in L1):

  optamp  unscale_vec<T> of each instruction set (avx2, avx512) in liboptamp.so
  torch   the AVX2 loop of _amp_foreach_non_finite_check_and_unscale_ in libtorch_cpu.so: torch
          registers no AVX-512 variant of that kernel (REGISTER_DISPATCH leaves the AVX512 slot
          empty and DispatchStub falls back to AVX2), so AVX-512 CPUs run this loop too

torch's loop branches (inf/NaN found, inv_scale == 1); the model follows the path a dynamic
scale with finite values takes. This is a prediction to check kernel changes against, not a
measurement: benchmarks/bench_unscale.py times the kernels on the machine it runs on.

    python benchmarks/unscale_model.py [--lib $OPTAMP_BUILD_DIR/csrc/liboptamp.so]
                                       [--mcpu skylake-avx512,icelake-server,znver3] [--show]

Needs objdump and nm (binutils) and llvm-mca (Debian package llvm-<version>).
"""
import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

DTYPES = {"float32": ("float", 4), "float16": ("c10::Half", 2), "bfloat16": ("c10::BFloat16", 2)}
JUMP = re.compile(r"(j[a-z]+)\s+([0-9a-f]+)")
# Vector memory operands: (a) load into / (b) store from an xmm/ymm/zmm register.
VEC_STORE = re.compile(r"^v\S+\s+%([xyz])mm\d+,[^%]*\(")
VEC_LOAD = re.compile(r"^v\S+\s+[^%]*\(%\w+[^)]*\),.*%[xyz]mm")
WIDTH = {"x": 16, "y": 32, "z": 64}


def tool(*names):
    for name in names:
        found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/llvm-*/bin/{name}"))),
                                           None)
        if found:
            return found
    sys.exit(f"unscale_model.py: none of {names} found (Debian: binutils, llvm)")


def symbols(lib):
    """{demangled name: (start, size)} of the functions in lib."""
    out = subprocess.run(["nm", "-S", "-C", lib], capture_output=True, text=True, check=True)
    syms = {}
    for line in out.stdout.splitlines():
        m = re.match(r"([0-9a-f]+) ([0-9a-f]+) [tT] (.*)$", line)
        if m:
            syms[m.group(3)] = (int(m.group(1), 16), int(m.group(2), 16))
    return syms


def find(syms, *needles):
    hits = [name for name in syms if all(n in name for n in needles)]
    if len(hits) != 1:
        sys.exit(f"unscale_model.py: {len(hits)} functions match {needles}")
    return syms[hits[0]]


def disassemble(lib, start, size):
    """[(address, instruction)] of one function, AT&T syntax, comments and symbols dropped."""
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", f"--start-address={start}",
                          f"--stop-address={start + size}", lib],
                         capture_output=True, text=True, check=True).stdout
    code = []
    for line in out.splitlines():
        m = re.match(r"\s*([0-9a-f]+):\s+(.*)$", line)
        if m:
            text = re.sub(r"\s+<[^>]*>", "", m.group(2).split("#")[0]).strip()
            code.append((int(m.group(1), 16), text))
    return code


def loop_heads(code):
    """Targets of backward jumps: where the function's loops start."""
    heads = set()
    for addr, text in code:
        m = JUMP.match(text)
        if m and int(m.group(2), 16) < addr:
            heads.add(int(m.group(2), 16))
    return sorted(heads)


def taken(flags_from, jump, target, head):
    """Whether the hot path takes a conditional jump, from the instruction that set the flags."""
    if flags_from.startswith("cmp"):  # the loop's own bound: keep looping
        return target == head
    if "0x77777777" in flags_from:  # torch's has_inf_nan mask: no inf/NaN on the hot path
        return jump == "je"
    if "ucomiss" in flags_from:  # torch's inv_scale == 1.0 test: a dynamic scale is not 1
        return jump == "jne"
    raise ValueError(f"no rule for {jump} after {flags_from!r}")


def hot_path(code, head):
    """The instructions one iteration executes from `head` back to it, or None."""
    index = {addr: i for i, (addr, _) in enumerate(code)}
    i, path, flags_from = index[head], [], ""
    while len(path) < 500 and i < len(code):
        addr, text = code[i]
        m = JUMP.match(text)
        if m:
            target = int(m.group(2), 16)
            if target < addr and target != head:
                return None  # another loop's back edge: `head` is not an innermost loop
            try:
                jump = m.group(1) == "jmp" or taken(flags_from, m.group(1), target, head)
            except ValueError:
                return None
            path.append(f"{m.group(1)} .Lhead" if m.group(1) != "jmp" else "")
            if jump and target == head:
                return [line for line in path if line]
            if jump:
                i = index.get(target)
                if i is None:
                    return None
                continue
        else:
            path.append(text)
            if re.match(r"(cmp|and|test|v?u?comis|sub|add)", text):
                flags_from = text
        i += 1
        if i < len(code) and code[i][0] == head:
            return [line for line in path if line]
    return None


def values_per_iteration(path, elem_size):
    """Bytes stored (read-only loops: loaded) through vector registers, in values."""
    stores = [WIDTH[m.group(1)] for m in map(VEC_STORE.match, path) if m]
    return sum(stores) // elem_size if stores else 0


def hottest_loop(code, elem_size):
    """The hot path of the loop over contiguous values: the one that loads and stores the most."""
    best = None
    for head in loop_heads(code):
        path = hot_path(code, head)
        if not path or not any("mul" in line for line in path):
            continue
        key = (sum(bool(VEC_LOAD.match(x)) for x in path), values_per_iteration(path, elem_size))
        if key[1] and (best is None or key > best[0]):
            best = (key, path)
    if best is None:
        sys.exit("unscale_model.py: no vector loop found")
    return best[1], best[0][1]


def cycles_per_value(mca, mcpu, path, values):
    with tempfile.NamedTemporaryFile("w", suffix=".s") as f:
        f.write(".Lhead:\n" + "\n".join(path) + "\n")
        f.flush()
        out = subprocess.run([mca, f"-mcpu={mcpu}", "-iterations=1000", f.name],
                             capture_output=True, text=True)
    m = re.search(r"Total Cycles:\s+(\d+)", out.stdout)
    return int(m.group(1)) / 1000 / values if m else None  # None: the CPU lacks an instruction


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    build = os.environ.get("OPTAMP_BUILD_DIR", os.path.join(root, "build"))
    ap.add_argument("--lib", default=os.path.join(build, "csrc", "liboptamp.so"))
    ap.add_argument("--mcpu", default="skylake-avx512,icelake-server,znver3")
    ap.add_argument("--show", action="store_true", help="print each modelled loop")
    args = ap.parse_args()
    mca = tool("llvm-mca", "llvm-mca-14", "llvm-mca-15", "llvm-mca-16")
    import torch

    libtorch = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    ours, theirs = symbols(args.lib), symbols(libtorch)
    loops = {}
    for dtype, (ctype, size) in DTYPES.items():
        start, n = find(theirs, "callback_fn<at::native::AVX2::VectorizedLoop2d<",
                        "_amp_foreach_non_finite_check_and_unscale_cpu_kernel",
                        f"{{lambda({ctype})#1}}")
        loops[dtype, "torch avx2"] = hottest_loop(disassemble(libtorch, start, n), size)
        for isa in ("avx2", "avx512"):
            start, n = find(ours, f"cpu::{isa}::(anonymous namespace)::unscale_vec<{ctype}")
            loops[dtype, f"optamp {isa}"] = hottest_loop(disassemble(args.lib, start, n), size)
    if args.show:
        for (dtype, who), (path, values) in loops.items():
            print(f"## {dtype} {who}: {values} values per iteration\n" + "\n".join(path))
    print(f"torch {torch.__version__}; {os.path.basename(mca)}; cycles per value (L1-resident), "
          "ratio to torch's loop")
    print(f"{'dtype':9s} {'cpu model':15s} {'torch avx2':>10s} {'optamp avx2':>16s} "
          f"{'optamp avx512':>16s}")
    for dtype in DTYPES:
        for mcpu in args.mcpu.split(","):
            cyc = {who: cycles_per_value(mca, mcpu, *loops[dtype, who])
                   for who in ("torch avx2", "optamp avx2", "optamp avx512")}
            base = cyc["torch avx2"]

            def cell(c):
                return "n/a" if c is None or base is None else f"{c:.3f} ({c / base:.2f}x)"

            print(f"{dtype:9s} {mcpu:15s} {base or float('nan'):10.3f} "
                  f"{cell(cyc['optamp avx2']):>16s} {cell(cyc['optamp avx512']):>16s}")


if __name__ == "__main__":
    main()

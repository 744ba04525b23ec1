#!/usr/bin/env python3
"""Registers and spills of each kernel of one CUDA source, against a base commit's: the check that belongs
before a GPU call for any kernel change (a register count is part of a kernel's occupancy: one more field
in a struct a kernel carries once took a backward from 80 registers a thread to 170, one block an SM
instead of three).

Compiles FILE (a path under src/lt2/kernels/cuda/) with ptxas's report (-Xptxas -v), by the build tree's
own compile command (`ninja -t commands lt2_kernels` in BUILD), once from the working tree and, with
--base, once from that commit's src/ (git archive), and prints a Markdown table: each kernel's registers,
spill stores and loads, its shared memory, and base -> new where they differ (a kernel's own line marked
`!` where registers or spills grew). Each compile takes minutes for the large files on 2 cores.

  python3 scripts/kernel_resources.py src/lt2/kernels/cuda/channel_scores.cu --base HEAD~1 [--build build]
  python3 scripts/kernel_resources.py --self-test     # the report's parsing on a made-up log (CTest)
"""
import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile

ENTRY = re.compile(
    r"Function properties for (\S+)\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill "
    r"loads\nptxas info\s*: Used (\d+) registers(?:, used \d+ barriers)?(?:, (\d+) bytes smem)?")


def short_names(mangled):
    """{mangled: the kernel's name and template arguments} by c++filt (the name unchanged without it)."""
    try:
        demangled = subprocess.run(["c++filt"], input="\n".join(mangled), check=True, capture_output=True,
                                   text=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        demangled = mangled
    out = {}
    for m, d in zip(mangled, demangled):
        found = re.search(r"(\w+)(<[^()]*>)?\(", d)
        out[m] = found.group(1) + (found.group(2) or "") if found else d
    return out


def parse(log):
    """{kernel: (registers, spill stores, spill loads, static shared bytes)} from ptxas -v output."""
    entries = list(ENTRY.finditer(log))
    names = short_names([m.group(1) for m in entries])
    return {names[m.group(1)]: (int(m.group(5)), int(m.group(3)), int(m.group(4)), int(m.group(6) or 0))
            for m in entries}


def compile_report(build, source, src_root):
    """ptxas's report for `source` compiled by the build tree's command, headers from src_root."""
    commands = subprocess.run(["ninja", "-C", build, "-t", "commands", "lt2_kernels"], check=True,
                              capture_output=True, text=True).stdout.splitlines()
    name = os.path.basename(source)
    line = next((c for c in commands if c.rstrip().endswith(name) or f"/{name} " in c or f"/{name}\t" in c), None)
    if line is None:
        sys.exit(f"kernel_resources: no compile command for {name} in {build} (is it a kernels source?)")
    args = [a for a in shlex.split(line) if a != "/usr/bin/ccache"]
    if "-E" in args and "env" in args:  # `cmake -E env VAR=.. nvcc ...`: keep from the compiler on
        args = args[next(i for i, a in enumerate(args) if a.endswith("nvcc")):]
    fixed, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in ("-MD", "-MMD"):
            continue
        if a in ("-MT", "-MF", "-o"):
            skip = True
            continue
        if a.startswith("-I") and a.endswith("/src"):
            a = "-I" + os.path.join(src_root, "src")
        if a.endswith(name):
            a = os.path.join(src_root, "src", "lt2", "kernels", "cuda", name)
        fixed.append(a)
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(fixed + ["-o", os.path.join(tmp, "k.o"), "-Xptxas", "-v"], cwd=build,
                              capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"kernel_resources: the compile failed:\n{done.stderr[-3000:]}")
    return done.stdout + done.stderr


def table(new, base):
    rows = ["| kernel | registers | spill stores | spill loads | static smem |", "|---|---:|---:|---:|---:|"]
    base = base or {}
    for k in sorted(set(new) | set(base)):
        n, b = new.get(k), base.get(k)
        if n is None:
            rows.append(f"| {k} | (gone) | | | |")
            continue
        grew = b is not None and (n[0] > b[0] or n[1] > b[1] or n[2] > b[2])
        cells = [f"{b[i]} -> {n[i]}" if b is not None and b[i] != n[i] else str(n[i]) for i in range(4)]
        rows.append(f"| {k}{' !' if grew else ''} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


SAMPLE = """ptxas info    : Compiling entry function '_ZN3lt27kernels12_GLOBAL__N_115row_dots_kernelENS0_13RowDotsParamsE' for 'sm_90'
ptxas info    : Function properties for _ZN3lt27kernels12_GLOBAL__N_115row_dots_kernelENS0_13RowDotsParamsE
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 28 registers, used 0 barriers
ptxas info    : Compiling entry function '_ZN3lt27kernels12_GLOBAL__N_138channel_scores_backward_blocked_kernelIfEEvNS0_27ChannelScoresBackwardParamsE' for 'sm_90'
ptxas info    : Function properties for _ZN3lt27kernels12_GLOBAL__N_138channel_scores_backward_blocked_kernelIfEEvNS0_27ChannelScoresBackwardParamsE
    40 bytes stack frame, 68 bytes spill stores, 48 bytes spill loads
ptxas info    : Used 170 registers, used 1 barriers, 41984 bytes smem
"""


def self_test():
    got = parse(SAMPLE)
    want = {"row_dots_kernel": (28, 0, 0, 0), "channel_scores_backward_blocked_kernel<float>": (170, 68, 48, 41984)}
    assert got == want, got
    base = {"row_dots_kernel": (28, 0, 0, 0), "channel_scores_backward_blocked_kernel<float>": (80, 0, 0, 41984)}
    t = table(got, base)
    assert "channel_scores_backward_blocked_kernel<float> ! | 80 -> 170 | 0 -> 68 | 0 -> 48 | 41984 |" in t, t
    assert "| row_dots_kernel | 28 | 0 | 0 | 0 |" in t, t
    assert "| row_dots_kernel | 28 | 0 | 0 | 0 |" in table(got, None)  # no base: the new figures alone
    print("kernel_resources self-test: ok")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", nargs="?", help="a CUDA source under src/lt2/kernels/cuda/")
    ap.add_argument("--base", help="a commit to compare against (its src/ tree)")
    ap.add_argument("--build", default="build", help="the configured build tree (default: build)")
    ap.add_argument("--self-test", action="store_true", help="check the parsing on a made-up ptxas log")
    a = ap.parse_args()
    if a.self_test:
        return self_test()
    if not a.source:
        ap.error("a CUDA source is needed (or --self-test)")
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], check=True, capture_output=True,
                          text=True).stdout.strip()
    build = os.path.abspath(a.build)
    new = parse(compile_report(build, a.source, root))
    base = None
    if a.base:
        with tempfile.TemporaryDirectory() as tmp:
            archive = subprocess.run(["git", "archive", a.base, "src"], cwd=root, check=True, capture_output=True)
            subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
            base = parse(compile_report(build, a.source, tmp))
    print(f"# {os.path.basename(a.source)}: registers and spills" + (f", {a.base} -> working tree" if a.base else ""))
    print()
    print(table(new, base))


if __name__ == "__main__":
    main()

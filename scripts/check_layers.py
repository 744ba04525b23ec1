#!/usr/bin/env python3
"""Checks that lt2's includes point one way (docs/architecture.md, "Layers").

Every `#include "lt2/<area>/..."` in src/lt2/<area>/ must name the area itself or one the table
below allows; anything else is an upward include, printed with its file and line. Also checks that
no LT2_* environment variable is read outside src/lt2/util/environment.cpp (options are passed
down, not read deep inside). Exit status 1 when either is found.
Usage: scripts/check_layers.py [SOURCE_ROOT]
"""
import pathlib
import re
import sys

# What each area may include besides itself. An area reaches only the areas listed for it (the
# table is written out, not derived, so that adding an edge is a visible decision).
FLOOR = {"util"}
ALLOWED = {
    "util": set(),
    "config": FLOOR,
    "tokenizer": FLOOR,
    "kernels": FLOOR,
    "data": FLOOR | {"tokenizer"},
    "io": FLOOR | {"config"},
    "nn": FLOOR | {"config"},
    "ops": FLOOR | {"config", "nn", "kernels"},
    "mixers": FLOOR | {"config", "nn", "ops", "kernels"},
    "model": FLOOR | {"config", "nn", "ops", "kernels", "mixers", "io"},
}
BELOW_TOP = set(ALLOWED) | {"tokenizer", "data"}
TOP = {
    "train": set(),
    "infer": set(),
    "eval": {"infer"},
    "serve": {"infer"},
    "tasks": {"train"},
    "distill": {"train", "eval", "infer"},
}
for area, extra in TOP.items():
    ALLOWED[area] = BELOW_TOP | extra

INCLUDE = re.compile(r'^\s*#\s*include\s+"lt2/([a-z_0-9]+)/')
GETENV = re.compile(r'getenv\(\s*"LT2_')
ENVIRONMENT_READER = pathlib.Path("src/lt2/util/environment.cpp")
SOURCES = {".h", ".cpp", ".cu", ".cuh", ".inc"}


def main() -> int:
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parent.parent)
    src = root / "src" / "lt2"
    problems = []
    areas = sorted(p.name for p in src.iterdir() if p.is_dir())
    for area in areas:
        if area not in ALLOWED:
            problems.append(f"src/lt2/{area}/: an area the layer table does not know (add it to {__file__})")
            continue
        for path in sorted((src / area).rglob("*")):
            if path.suffix not in SOURCES:
                continue
            for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                m = INCLUDE.match(line)
                if m and m.group(1) != area and m.group(1) not in ALLOWED[area]:
                    problems.append(f"{path.relative_to(root)}:{n}: {area}/ includes {m.group(1)}/ "
                                    f"({area}/ may include: {', '.join(sorted(ALLOWED[area])) or 'nothing'})")
    layer_problems = len(problems)
    for path in sorted([*(root / "src").rglob("*"), *(root / "apps").rglob("*")]):
        if path.suffix in SOURCES and path.relative_to(root) != ENVIRONMENT_READER:
            for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                if GETENV.search(line):
                    problems.append(f"{path.relative_to(root)}:{n}: reads an LT2_* variable (only {ENVIRONMENT_READER} may)")
    for p in problems:
        print(p)
    print(f"layers: {len(areas)} areas checked, {layer_problems} upward include(s), "
          f"{len(problems) - layer_problems} LT2_* read(s) outside {ENVIRONMENT_READER}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

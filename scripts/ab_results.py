#!/usr/bin/env python3
"""The A/B runs of a gpu_batch.sh results folder as one JSON and one Markdown table per step.

Each step's log.txt holds `RESULT {json}` lines (train_bench, mixer_bench), each after the line that
named its arm (the `echo` of scripts/gpu_ab_call.sh: the binary's folder, then what runs). Runs whose
labels differ only in the binary are one case: the baseline (any folder but build-prebuilt/) against
the new tree (build-prebuilt/), each side's median over its repeats, and new / base as the time ratio.

  python3 scripts/ab_results.py RESULTS_DIR --steps prepab gdnauto --base-name 8ffc3ac --new-name 1a2b3c4 \\
      --out bench/results/NAME [--title ...] [--command ...]
writes NAME.json (every run's full RESULT) and NAME.md. `--self-test` checks the parsing on a made-up log
(CTest `ab_results`).
"""
import argparse
import datetime
import json
import os
import statistics
import sys

NEW_DIR = "build-prebuilt"


def step_runs(log_path):
    """[(label, result)] in the log's order; a RESULT takes the last non-RESULT line before it. A RESULT right
    after a Markdown table row is a profiled run's (its per-kernel table printed first): not an arm, left out."""
    runs, label = [], ""
    with open(log_path) as f:
        for line in f:
            line = line.rstrip("\n")
            if line.startswith("RESULT "):
                if not label.startswith("|"):
                    runs.append((label, json.loads(line[len("RESULT "):])))
            elif line.strip():
                label = line.strip()
    return runs


def split_arm(label):
    """(arm, case): 'new' for build-prebuilt (the call's own tree, a relative path), 'base' for another
    binary folder (the baseline's, an absolute path); without a folder, a label ending in a switch
    `name=0` or `name=1` (the same binary with a kernel switch off and on: ceab, gateab) is 'base' or 'new'
    of the case `... name`; None otherwise."""
    first, _, rest = label.partition(" ")
    if first.rstrip("/") == NEW_DIR:
        return "new", rest
    if "/" in first:
        return "base", rest
    head, _, last = label.rpartition(" ")
    name, eq, value = last.partition("=")
    if head and eq and name and value in ("0", "1"):
        return ("base" if value == "0" else "new"), f"{head} {name}"
    return None, label


def time_ms(result):
    for key in ("median_step_ms", "forward_backward_ms"):
        if key in result:
            return result[key]
    raise ValueError(f"a RESULT without a time: {sorted(result)}")


def cases_of(runs):
    """{case: {"base": [ms...], "new": [ms...], None: [ms...]}} in the runs' order."""
    cases = {}
    for label, result in runs:
        arm, case = split_arm(label)
        cases.setdefault(case, {"base": [], "new": [], None: []})[arm].append(time_ms(result))
    return cases


def self_test():
    import tempfile
    log = """/tmp/train_ab_base/build-prebuilt gdn 2048 x 16 auto
RESULT {"median_step_ms": 500.0}
build-prebuilt gdn 2048 x 16 auto
RESULT {"median_step_ms": 490.0}
build-prebuilt gdn 2048 x 16 auto
RESULT {"median_step_ms": 492.0}
/tmp/train_ab_base/build-prebuilt gdn 2048 x 16 auto
RESULT {"median_step_ms": 502.0}
lt-100m 2048 x 16 auto
RESULT {"forward_backward_ms": 250.0}
| kernel | calls/step | us/step | % of busy |
| lt2::kernels::delta_rule_scan_kernel | 48.0 | 20538.6 | 3.0% |
RESULT {"median_step_ms": 710.0}
lt-100m chunk_gate=0
RESULT {"median_step_ms": 300.0}
lt-100m chunk_gate=1
RESULT {"median_step_ms": 280.0}
"""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "log.txt")
        with open(path, "w") as f:
            f.write(log)
        cases = cases_of(step_runs(path))
    assert cases["gdn 2048 x 16 auto"]["base"] == [500.0, 502.0], cases
    assert cases["gdn 2048 x 16 auto"]["new"] == [490.0, 492.0], cases
    assert cases["lt-100m 2048 x 16 auto"][None] == [250.0], cases
    assert not any(case.startswith("|") for case in cases), cases  # the profiled run is no case
    assert cases["lt-100m chunk_gate"]["base"] == [300.0] and cases["lt-100m chunk_gate"]["new"] == [280.0], cases
    print("ab_results: self-test passed")


def main():
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="the unpacked results.tar.gz of scripts/gpu_batch.sh")
    ap.add_argument("--steps", nargs="+", required=True, help="the steps to read, in this order")
    ap.add_argument("--base-name", default="base", help="the baseline's name in the tables (its commit)")
    ap.add_argument("--new-name", default="new", help="the new tree's name in the tables (its commit)")
    ap.add_argument("--out", required=True, help="output path without extension: writes .json and .md")
    ap.add_argument("--title", default="A/B runs", help="the Markdown title")
    ap.add_argument("--command", default="", help="the command that ran them, for the record")
    ap.add_argument("--date", default=datetime.date.today().isoformat(), help="the run's date (default: today)")
    args = ap.parse_args()

    steps = {step: step_runs(os.path.join(args.results, step, "log.txt")) for step in args.steps
             if os.path.exists(os.path.join(args.results, step, "log.txt"))}
    devices = sorted({r.get("device", "") for runs in steps.values() for _, r in runs} - {""})
    record = {"title": args.title, "command": args.command, "date": args.date, "devices": devices,
              "base": args.base_name, "new": args.new_name, "steps": {}}
    md = [f"# {args.title}", "", f"{', '.join(devices) or 'device not recorded'}, {args.date}.", ""]
    if args.command:
        md += ["```", args.command, "```", ""]
    for step in args.steps:
        if step not in steps:
            sys.exit(f"ab_results: {os.path.join(args.results, step, 'log.txt')} is missing (did the step run?)")
        runs = steps[step]
        cases = cases_of(runs)
        # A step whose cases are all switches (off against on in one binary) names its arms so.
        switch = bool(runs) and all("/" not in label.partition(" ")[0] for label, _ in runs)
        base_name, new_name = ("off", "on") if switch else (args.base_name, args.new_name)
        rows = []
        for case, arms in cases.items():
            row = {"case": case}
            for arm in ("base", "new", None):
                if arms[arm]:
                    row[arm or "runs"] = arms[arm]
            if arms["base"] and arms["new"]:
                row["ratio_new_over_base"] = statistics.median(arms["new"]) / statistics.median(arms["base"])
            rows.append(row)
        record["steps"][step] = {"runs": [{"label": l, "result": r} for l, r in runs], "cases": rows}
        md += [f"## {step}", "", f"| case | {base_name} ms | {new_name} ms | {new_name} / {base_name} |",
               "|---|---:|---:|---:|"]
        fmt = lambda xs: " / ".join(f"{x:.2f}" for x in xs) if xs else ""
        for row in rows:
            ratio = f"{row['ratio_new_over_base']:.3f}" if "ratio_new_over_base" in row else ""
            new = row.get("new", row.get("runs", []))
            md.append(f"| {row['case']} | {fmt(row.get('base', []))} | {fmt(new)} | {ratio} |")
        md.append("")
    for ext, text in ((".json", json.dumps(record, indent=1) + "\n"), (".md", "\n".join(md))):
        tmp = args.out + ext + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, args.out + ext)


if __name__ == "__main__":
    main()

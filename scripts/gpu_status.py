#!/usr/bin/env python3
"""The record of the last GPU test run, and whether the kernels changed since.

The GPU scripts (scripts/gpu_infer.sh, scripts/gpu.sh) run `test_gpu` with GoogleTest's JSON report
and turn it into a record with `--record`: the commit, a hash of the contents of src/lt2/kernels and
src/lt2/ops, pass / fail / skip per test, the totals, the date and the device. Copied into
bench/results/gpu_tests.json, the record is what this script reads:

  scripts/gpu_status.py                  one line: the newest record, and whether kernels/ops changed since
  scripts/gpu_status.py --check          the same after checking every record's fields; warns when README's
                                         status line is stale (exit 1 only for a missing or malformed record,
                                         or, with --strict, a stale README line)
  scripts/gpu_status.py --update-readme  rewrites the line between <!-- gpu-status --> and <!-- /gpu-status -->
  scripts/gpu_status.py --hash [--at COMMIT]   the kernels/ops hash of the working tree (or of a commit)
  scripts/gpu_status.py --record --gtest-json F [--log F] [--rc N] [--device D] [--commit C]
                         [--source-hash H] [--filter F] [--command C] --out FILE

The kernels/ops hash: for every file under src/lt2/kernels and src/lt2/ops (hidden files, editor
backups and __pycache__ left out), the line "<sha256 of its contents>  <path from the repo root>";
the lines sorted by path (bytewise), then the sha256 of their concatenation. It reads the files, not
git, so uncommitted changes count and a copy of the tree without .git hashes the same. The shell
equivalent, from the repository root:

  find src/lt2/kernels src/lt2/ops -type f ! -name '.*' ! -name '*~' ! -path '*/__pycache__/*' \\
    ! -path '*/.*/*' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum

Python 3 standard library only.
"""
import argparse
import datetime
import glob
import hashlib
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HASHED_DIRS = ("src/lt2/kernels", "src/lt2/ops")
RESULTS = os.path.join(ROOT, "bench", "results")
README = os.path.join(ROOT, "README.md")
BEGIN, END = "<!-- gpu-status -->", "<!-- /gpu-status -->"
STATUSES = ("passed", "failed", "skipped", "crashed")
REQUIRED = ("schema", "date", "device", "commit", "kernels_ops_hash", "totals", "tests")


# ----------------------------------------------------------------------------------------------
# The kernels/ops hash.

def _hashed(path):
    parts = path.split("/")
    return not any(p.startswith(".") or p == "__pycache__" for p in parts) and not path.endswith("~")


def _digest(entries):
    """entries: (path, contents bytes). The sha256 of the sorted 'hash  path' manifest."""
    lines = sorted((p.encode(), hashlib.sha256(data).hexdigest()) for p, data in entries)
    manifest = b"".join(h.encode() + b"  " + p + b"\n" for p, h in lines)
    return hashlib.sha256(manifest).hexdigest()


def tree_hash(root=ROOT):
    entries = []
    for d in HASHED_DIRS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, d)):
            dirnames[:] = [n for n in dirnames if not n.startswith(".") and n != "__pycache__"]
            for name in filenames:
                rel = os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/")
                if _hashed(rel) and os.path.isfile(os.path.join(root, rel)):
                    with open(os.path.join(root, rel), "rb") as f:
                        entries.append((rel, f.read()))
    return _digest(entries)


def commit_hash(commit, root=ROOT):
    """The same hash over the files of a commit (git needed)."""
    out = subprocess.run(["git", "-C", root, "ls-tree", "-r", "-z", commit, "--", *HASHED_DIRS],
                         check=True, capture_output=True).stdout
    entries = []
    for item in filter(None, out.split(b"\0")):
        meta, path = item.split(b"\t", 1)
        path = path.decode()
        if meta.split()[1] == b"blob" and _hashed(path):
            blob = meta.split()[2].decode()
            data = subprocess.run(["git", "-C", root, "cat-file", "blob", blob], check=True,
                                  capture_output=True).stdout
            entries.append((path, data))
    return _digest(entries)


# ----------------------------------------------------------------------------------------------
# Making a record from a test run.

def _from_gtest_json(report):
    tests = {}
    for suite in report.get("testsuites", []):
        for t in suite.get("testsuite", []):
            name = f"{suite['name']}.{t['name']}"
            if t.get("failures"):
                tests[name] = "failed"
            elif t.get("result") == "SKIPPED" or t.get("status") == "NOTRUN":
                tests[name] = "skipped"
            else:
                tests[name] = "passed"
    return tests


def _from_log(text):
    """A GoogleTest console log (the fallback when the program died before writing its report)."""
    tests, running = {}, None
    for line in text.splitlines():
        m = re.match(r"\[ +(RUN|OK|FAILED|SKIPPED) +\] (\S+\.\S+?)(?: \(|$)", line)
        if not m:
            continue
        kind, name = m.groups()
        if kind == "RUN":
            running = name
        else:
            tests[name] = {"OK": "passed", "FAILED": "failed", "SKIPPED": "skipped"}[kind]
            running = None if running == name else running
    if running is not None and running not in tests:
        tests[running] = "crashed"
    return tests


def _failure_messages(report, limit=2000):
    out = {}
    for suite in report.get("testsuites", []):
        for t in suite.get("testsuite", []):
            if t.get("failures"):
                msg = "\n".join(f.get("failure", "") for f in t["failures"])
                out[f"{suite['name']}.{t['name']}"] = msg[:limit]
    return out


def totals_of(tests):
    counts = {s: sum(1 for v in tests.values() if v == s) for s in STATUSES}
    counts["tests"] = len(tests)
    return counts


def _device_name():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
        return out[0].strip() if out else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _commit():
    try:
        out = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=30)
        if out.returncode != 0:
            return "unknown", None
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--", *HASHED_DIRS],
                               capture_output=True, text=True, timeout=30).stdout.strip() != ""
        return out.stdout.strip(), dirty
    except (OSError, subprocess.SubprocessError):
        return "unknown", None


def make_record(gtest_json=None, log=None, rc=None, device=None, commit=None, source_hash=None,
                filter_="*", command=None):
    report, tests, messages = None, {}, {}
    if gtest_json and os.path.isfile(gtest_json):
        with open(gtest_json) as f:
            report = json.load(f)
        tests, messages = _from_gtest_json(report), _failure_messages(report)
    log_text = ""
    if log and os.path.isfile(log):
        with open(log, errors="replace") as f:
            log_text = f.read()
    if report is None and log_text:
        tests = _from_log(log_text)
    tree_changes = None
    if commit is None:
        commit, tree_changes = _commit()
    record = {
        "schema": 1,
        "what": "test_gpu, the GPU-labelled GoogleTest program, on a GPU",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": device or _device_name(),
        "commit": commit,
        "kernels_ops_hash": source_hash or tree_hash(),
        "hash_method": "scripts/gpu_status.py --hash (sha256 of the sorted sha256sum lines of src/lt2/kernels and src/lt2/ops)",
        "filter": filter_ or "*",
        "command": command,
        "exit_code": rc,
        "totals": totals_of(tests),
        "tests": dict(sorted(tests.items())),
    }
    if tree_changes is not None:
        record["tree_changes"] = tree_changes
    if messages:
        record["failure_messages"] = messages
    if report is None:
        record["note"] = ("the program wrote no JSON report (it died, or did not start): results from its log"
                          if tests else "no report and no test results in the log")
        record["log_tail"] = log_text.splitlines()[-60:]
    return record


def merge_records(parts):
    """One record from the records of one suite run in parts (GTEST_FILTER, e.g. split over calls):
    the same commit, kernels/ops hash and device, disjoint tests; the filters joined, the newest date."""
    first = parts[0]
    for key in ("commit", "kernels_ops_hash", "device"):
        values = {r[key] for r in parts}
        if len(values) != 1:
            raise ValueError(f"the parts differ in {key}: {sorted(values)}")
    tests, messages = {}, {}
    for r in parts:
        overlap = set(tests) & set(r["tests"])
        if overlap:
            raise ValueError(f"the parts share tests: {sorted(overlap)[:5]}")
        tests.update(r["tests"])
        messages.update(r.get("failure_messages", {}))
    filters = [r.get("filter", "*") for r in parts]
    # A filter and its negation (gpu_ab_call.sh's two parts) are the whole suite.
    whole = len(filters) == 2 and (filters[0] == "-" + filters[1] or filters[1] == "-" + filters[0])
    record = dict(first)
    record.update(date=max(r["date"] for r in parts), filter="*" if whole else " + ".join(filters),
                  command=" ; ".join(str(r.get("command")) for r in parts),
                  exit_code=max((r.get("exit_code") or 0) for r in parts), totals=totals_of(tests),
                  tests=dict(sorted(tests.items())))
    record.pop("failure_messages", None)
    if messages:
        record["failure_messages"] = messages
    return record


# ----------------------------------------------------------------------------------------------
# Reading records and saying where things stand.

def record_problems(rec):
    problems = [f"no field '{k}'" for k in REQUIRED if k not in rec]
    if problems:
        return problems
    if not isinstance(rec["tests"], dict):
        return ["'tests' is not an object"]
    bad = sorted({v for v in rec["tests"].values() if v not in STATUSES})
    if bad:
        problems.append(f"unknown test status {bad}")
    t = rec["totals"]
    want = totals_of(rec["tests"]) if rec["tests"] else None
    if want is not None:
        for k in ("tests",) + STATUSES:
            if t.get(k, 0) != want[k]:
                problems.append(f"totals.{k} = {t.get(k)} but the tests list has {want[k]}")
    elif not isinstance(t.get("tests"), int) or t.get("passed", 0) + t.get("failed", 0) + \
            t.get("skipped", 0) + t.get("crashed", 0) != t["tests"]:
        problems.append("totals do not add up")
    h = rec["kernels_ops_hash"]
    if h is not None and not re.fullmatch(r"[0-9a-f]{64}", str(h)):
        problems.append("kernels_ops_hash is neither null nor a sha256 hex digest")
    return problems


def load_records():
    recs = []
    for path in sorted(glob.glob(os.path.join(RESULTS, "gpu_tests*.json"))):
        try:
            with open(path) as f:
                rec = json.load(f)
        except (OSError, ValueError) as e:
            recs.append((path, None, [f"unreadable: {e}"]))
            continue
        recs.append((path, rec, record_problems(rec) if isinstance(rec, dict) else ["not an object"]))
    return recs


def newest(recs):
    good = [(p, r) for p, r, problems in recs if r is not None and not problems]
    return max(good, key=lambda pr: (str(pr[1]["date"]), pr[0])) if good else (None, None)


def status_line(path, rec, current_hash, link=False):
    if rec is None:
        return "GPU suite: no recorded run (bench/results/gpu_tests.json)."
    t = rec["totals"]
    scope = "GPU suite" if rec.get("filter", "*") in ("*", "", None) else f"GPU suite (filter {rec['filter']})"
    counts = f"{t['passed']}/{t['tests']} passed"
    extra = [f"{t[k]} {k}" for k in ("failed", "crashed", "skipped") if t.get(k)]
    failing = sorted(n for n, s in rec["tests"].items() if s in ("failed", "crashed"))
    if failing:  # named, so that a reader can tell whether a later change addressed them
        more = f" and {len(failing) - 3} more" if len(failing) > 3 else ""
        extra[-1] += "; failing: " + ", ".join(f"`{n}`" for n in failing[:3]) + more
    if extra:
        counts += " (" + ", ".join(extra) + ")"
    if rec.get("note") and not t["tests"]:
        counts = "no test results (" + rec["note"] + ")"
    date = str(rec["date"])[:10]
    where = f"on {rec['device']} at {rec['commit']} ({date})"
    if rec["kernels_ops_hash"] is None:
        since = "the kernels/ops hash of that run is unknown, so whether they changed since cannot be told"
    elif rec["kernels_ops_hash"] == current_hash:
        since = "kernels and ops unchanged since"
    else:
        since = "kernels/ops changed since the last GPU run: not yet run on a GPU"
    line = f"{scope}: {counts} {where}; {since}."
    if link and path:
        rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
        line += f" Record: [{os.path.basename(path)}]({rel})."
    return line


def readme_block(line):
    return f"{BEGIN}\n{line}\n{END}"


def readme_current(text):
    m = re.search(re.escape(BEGIN) + r"\n?(.*?)\n?" + re.escape(END), text, flags=re.S)
    return None if m is None else m.group(1).strip()


def update_readme(line):
    with open(README, encoding="utf-8") as f:
        text = f.read()
    if readme_current(text) is None:
        sys.exit(f"{README}: no {BEGIN} ... {END} markers")
    new = re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda m: readme_block(line), text, count=1, flags=re.S)
    if new != text:
        with open(README, "w", encoding="utf-8") as f:
            f.write(new)
    return new != text


def _self_test():
    """The record maker on a small GoogleTest report and on the log of a run that died."""
    report = {"testsuites": [{"name": "A", "testsuite": [
        {"name": "x", "status": "RUN", "result": "COMPLETED"},
        {"name": "y", "status": "RUN", "result": "COMPLETED", "failures": [{"failure": "boom"}]},
        {"name": "z", "status": "RUN", "result": "SKIPPED"}]}]}
    tests = _from_gtest_json(report)
    assert tests == {"A.x": "passed", "A.y": "failed", "A.z": "skipped"}, tests
    assert totals_of(tests) == {"tests": 3, "passed": 1, "failed": 1, "skipped": 1, "crashed": 0}
    log = ("[ RUN      ] A.x\n[       OK ] A.x (1 ms)\n[ RUN      ] A.y\n[  FAILED  ] A.y (2 ms)\n"
           "[ RUN      ] A.z\nCUDA error: an illegal memory access was encountered\n")
    assert _from_log(log) == {"A.x": "passed", "A.y": "failed", "A.z": "crashed"}, _from_log(log)
    rec = {"schema": 1, "date": "2026-01-01", "device": "d", "commit": "c", "kernels_ops_hash": "0" * 64,
           "totals": totals_of(tests), "tests": tests}
    assert record_problems(rec) == [], record_problems(rec)
    assert "1/3 passed (1 failed, 1 skipped; failing: `A.y`)" in status_line(None, rec, "1" * 64)
    assert "not yet run on a GPU" in status_line(None, rec, "1" * 64)
    assert "unchanged since" in status_line(None, rec, "0" * 64)
    other = dict(rec, tests={"B.w": "passed"}, totals=totals_of({"B.w": "passed"}), filter="B.*")
    merged = merge_records([dict(rec, filter="A.*"), other])
    assert merged["totals"] == {"tests": 4, "passed": 2, "failed": 1, "skipped": 1, "crashed": 0}, merged
    assert merged["filter"] == "A.* + B.*" and record_problems(merged) == []
    assert merge_records([dict(rec, filter="-B.*"), other])["filter"] == "*"
    try:
        merge_records([rec, dict(rec, commit="d")])
        raise AssertionError("parts of different commits merged")
    except ValueError:
        pass


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="check the records' fields, then print the status")
    ap.add_argument("--strict", action="store_true", help="with --check: a stale README status line is an error")
    ap.add_argument("--update-readme", action="store_true", help="rewrite README.md's status line")
    ap.add_argument("--hash", action="store_true", help="print the kernels/ops hash")
    ap.add_argument("--at", metavar="COMMIT", help="with --hash: of this commit's files (git)")
    ap.add_argument("--record", action="store_true", help="write a record from a test run")
    ap.add_argument("--merge", nargs="+", metavar="RECORD",
                    help="with --out: one record from the records of a suite run in parts (same commit and device)")
    ap.add_argument("--gtest-json"), ap.add_argument("--log"), ap.add_argument("--rc", type=int)
    ap.add_argument("--device"), ap.add_argument("--commit"), ap.add_argument("--source-hash")
    ap.add_argument("--filter", default="*"), ap.add_argument("--command"), ap.add_argument("--out")
    a = ap.parse_args()

    if a.hash:
        print(commit_hash(a.at) if a.at else tree_hash())
        return 0
    if a.record:
        if not a.out:
            ap.error("--record needs --out")
        rec = make_record(a.gtest_json, a.log, a.rc, a.device, a.commit, a.source_hash, a.filter, a.command)
        with open(a.out, "w") as f:
            json.dump(rec, f, indent=1)
            f.write("\n")
        print(status_line(a.out, rec, rec["kernels_ops_hash"]).split(";")[0] + f" -> {a.out}")
        return 0

    if a.merge:
        if not a.out:
            ap.error("--merge needs --out")
        parts = []
        for path in a.merge:
            with open(path) as f:
                parts.append(json.load(f))
        rec = merge_records(parts)
        with open(a.out, "w") as f:
            json.dump(rec, f, indent=1)
            f.write("\n")
        print(status_line(a.out, rec, rec["kernels_ops_hash"]).split(";")[0] + f" -> {a.out}")
        return 0

    recs = load_records()
    path, rec = newest(recs)
    current = tree_hash()
    line = status_line(path, rec, current)
    if a.update_readme:
        changed = update_readme(status_line(path, rec, current, link=True))
        print(line)
        print("README.md: status line " + ("rewritten" if changed else "already current"))
        return 0
    if a.check:
        _self_test()
        rc = 0
        for p, r, problems in recs:
            for problem in problems:
                print(f"{os.path.relpath(p, ROOT)}: {problem}", file=sys.stderr)
                rc = 1
        if rec is None:
            print("no valid GPU test record under bench/results/ (gpu_tests*.json)", file=sys.stderr)
            rc = 1
        print(line)
        try:
            with open(README, encoding="utf-8") as f:
                shown = readme_current(f.read())
        except OSError:
            shown = None
        if shown != status_line(path, rec, current, link=True):
            print("warning: README.md's GPU status line is not current: run scripts/gpu_status.py --update-readme",
                  file=sys.stderr)
            if a.strict:
                rc = 1
        return rc
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

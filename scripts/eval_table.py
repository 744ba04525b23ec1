#!/usr/bin/env python3
"""One results table from a folder of `lt2 eval ... --json` outputs, one model per file prefix.

A model M contributes any of these files (scripts/gpu_eval_trained.sh writes them):
  M.train.jsonl         the run's metrics.jsonl (`lt2 train`): its last step and last validation loss
  M.ppl.json            `lt2 eval ppl --json` with all loops
  M.ppl_loops<T>.json   the same with only the first T loops
  M.mc.json             `lt2 eval mc --tasks ... --json`
  M.niah.json           `lt2 eval niah --json`
Writes the merged JSON and a Markdown table: one row per model, one column per metric.

  scripts/eval_table.py DIR --out-json F --out-md F [--command C --commit C --device D --note TEXT]
"""
import argparse
import datetime
import glob
import json
import os


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def final_exit(result):
    return result["exits"][-1]


def load_metrics(path):
    """metrics.jsonl folded into one dict: every field's last value (step lines, then validation lines)."""
    merged = {}
    try:
        with open(path) as f:
            for line in f:
                if line.strip():
                    merged.update(json.loads(line))
    except (OSError, json.JSONDecodeError):
        return None
    return merged or None


def collect(folder):
    models = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.json")) + glob.glob(os.path.join(folder, "*.train.jsonl"))):
        name = os.path.basename(path).rsplit(".", 1)[0]
        model, _, kind = name.rpartition(".")
        data = load_metrics(path) if path.endswith(".jsonl") else load(path)
        if model and data is not None:
            models.setdefault(model, {})[kind] = data
    return models


def row(model, runs):
    cells = {"model": model}
    train = runs.get("train")
    if train:
        cells["steps"] = train.get("step")
        cells["train loss"] = train.get("loss")
        if "val_loss" in train:
            cells["val loss"] = train["val_loss"]
        cells["train tok/s"] = train.get("tokens_per_s")
    ppl = runs.get("ppl")
    if ppl:
        e = final_exit(ppl)
        cells[f"word ppl ({os.path.basename(ppl['data'])})"] = e["word_perplexity"]
        cells["token ppl"] = e["token_perplexity"]
        cells["bits/byte"] = e["bits_per_byte"]
    for kind in sorted(k for k in runs if k.startswith("ppl_loops")):
        loops = kind[len("ppl_loops"):]
        cells[f"word ppl, {loops} loop{'s' if loops != '1' else ''}"] = final_exit(runs[kind])["word_perplexity"]
    mc = runs.get("mc")
    if mc:
        for task in mc["tasks"]:
            metrics = task["exits"][-1]["metrics"]
            cells[f"{task['task']} ({task['primary']}, n={task['items']})"] = metrics[task["primary"]]
        cells["zero-shot average"] = mc["average"][-1]
    niah = runs.get("niah")
    if niah:
        scores = final_exit(niah)["scores"]
        for length, line in zip(niah["lengths"], scores):
            cells[f"{niah['task']} @{length}"] = sum(line) / len(line)
    return cells


def fmt(value):
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3f}" if abs(value) < 10 else f"{value:.2f}"
    return str(value)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder")
    ap.add_argument("--out-json", required=True)
    ap.add_argument("--out-md", required=True)
    ap.add_argument("--command", default="")
    ap.add_argument("--commit", default="")
    ap.add_argument("--device", default="")
    ap.add_argument("--note", default="")
    a = ap.parse_args()
    models = collect(a.folder)
    if not models:
        raise SystemExit(f"eval_table: no '<model>.<kind>.json' files in {a.folder}")
    date = datetime.date.today().isoformat()
    rows = [row(m, runs) for m, runs in models.items()]
    columns = []
    for r in rows:
        columns += [c for c in r if c not in columns]
    md = [f"`{a.command}` at {a.commit} on {a.device}, {date}" if a.command else f"{a.commit} on {a.device}, {date}", ""]
    if a.note:
        md += [a.note, ""]
    # One metric a line: the table is read down a model's column.
    names = [r["model"] for r in rows]
    md += ["| metric | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for c in columns[1:]:
        md.append(f"| {c} | " + " | ".join(fmt(r.get(c)) for r in rows) + " |")
    tmp_json, tmp_md = a.out_json + ".tmp", a.out_md + ".tmp"
    with open(tmp_json, "w") as f:
        json.dump({"command": a.command, "commit": a.commit, "device": a.device, "date": date, "note": a.note,
                   "table": rows, "runs": models}, f, indent=1)
    with open(tmp_md, "w") as f:
        f.write("\n".join(md) + "\n")
    os.replace(tmp_json, a.out_json)
    os.replace(tmp_md, a.out_md)


if __name__ == "__main__":
    main()

"""Ratio table of one throughput run: print it and write results/throughput.md and .csv.

    python -m benchmarks.experiments.summarize [RUN.json] [--out results/throughput] [--update-docs]

RUN.json is a pytest-benchmark JSON of `python -m pytest benchmarks/ --benchmark-only` (default:
the newest file in results/runs/throughput/). Every figure comes from that one run: per case the
median (and the minimum) seconds of one call over pytest-benchmark's rounds, divided by the
call's batch size -> seconds per prompt; throughput = 1 / that. A ratio "A / B" is A's throughput
over B's at the same N, dtype and device (> 1: A is faster). The goals (docs/throughput.md):
    scaling       every solver (and the transformer forward): t(N=4000) / t(N=1000) <= 4.5
    ln/numpy      ln-closed-form / numpy-ols, float32: >= 0.5 at N=1000, >= 0.4 at N=100
    ln/quadratic  ln-closed-form >= 10x quadratic-attention at N=1000 float32
    fused/eager   every transformer solver >= 5x its eager forward ("<name> [eager]") at N=1000
    threads       fused kernels on two threads >= 1.8x one thread ("<name> [2 threads]"; a case whose
                  batch was too small to split is "not split", outside the count)
    ols/numpy     ols >= 2x numpy-ols at every N; ols / torch-lstsq reported (on every device)
    gpu           on cuda, N=100 float32: ols >= 1e8 prompts/s, every transformer solver >= 1e7
--update-docs also rewrites the marked blocks of README.md and docs/throughput.md.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

import pandas as pd

from icl_bench.report.docblock import replace_block

ROOT = Path(__file__).resolve().parents[2]  # the repository root
RUNS = ROOT / "results" / "runs" / "throughput"
GOAL_SCALING, GOAL_LN_VS_QUADRATIC, GOAL_OLS_VS_NUMPY = 4.5, 10.0, 2.0
GOAL_LN_VS_NUMPY, GOAL_LN_VS_NUMPY_SMALL = 0.5, 0.4  # N = 1000, N = 100 (float32)
GOAL_FUSED_VS_EAGER, GOAL_THREADS = 5.0, 1.8
GOAL_GPU_OLS, GOAL_GPU_TRANSFORMER = 1e8, 1e7  # prompts/s on cuda at N = 100, float32 (an H200-class GPU)


def load(path: Path) -> tuple[pd.DataFrame, dict]:
    """One row per benchmark: kind, name, N, dtype, device, batch_size, seconds per prompt."""
    run = json.loads(path.read_text())
    if not run.get("benchmarks"):  # every case skipped (a GPU run without CUDA), or a run cut short
        raise SystemExit(f"{path}: no benchmark in this run (every case skipped or none finished): nothing to summarize")
    rows = []
    for b in run["benchmarks"]:
        e, s = b["extra_info"], b["stats"]
        rows.append({**{k: e[k] for k in ("kind", "name", "N", "dtype", "device", "batch_size")},
                     "median_s": s["median"], "min_s": s["min"], "rounds": s["rounds"],
                     "s_per_prompt": s["median"] / e["batch_size"], "best_s_per_prompt": s["min"] / e["batch_size"],
                     "extra": e})
    table = pd.DataFrame(rows)
    table["base"] = table.name  # the solver a case times; eager / threads cases get a distinct name
    table.loc[table.kind == "eager", "name"] = table.base + " [eager]"
    threads = table.extra.map(lambda e: e.get("threads"))
    table.loc[table.kind == "threads", "name"] = table.base + " [" + threads.map(lambda n: "" if n is None else f"{n:.0f}") + " threads]"
    table["prompts_per_s"] = 1.0 / table.s_per_prompt
    table["best_prompts_per_s"] = 1.0 / table.best_s_per_prompt
    return table, run


def with_ratios(t: pd.DataFrame) -> pd.DataFrame:
    """Add ratio_vs_<reference> = throughput / the reference's throughput (same N, dtype, device)."""
    t = t.copy()
    key = ["N", "dtype", "device"]
    for ref in ("numpy-ols", "quadratic-attention"):
        base = t[t.name == ref].set_index(key).s_per_prompt
        if t.device.ne("cpu").any() and ref == "numpy-ols":  # numpy runs on the CPU: compare there
            base = pd.concat([base, base.rename(index={"cpu": "cuda"}, level="device")])
        t[f"vs_{ref}"] = [base.get(tuple(r[k] for k in key), math.nan) / r.s_per_prompt for _, r in t.iterrows()]
    eager = t[t.kind == "eager"].set_index(["base"] + key).s_per_prompt  # a solver / its eager forward
    t["vs_eager"] = [eager.get((r["base"], *(r[k] for k in key)), math.nan) / r.s_per_prompt
                     if r["kind"] in ("solver", "threads") else math.nan for _, r in t.iterrows()]
    return t


def fmt(x: float, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if abs(x) >= 1e5 or abs(x) < 1e-2:
        return f"{x:.2e}"
    return f"{x:.{digits}g}"


def md_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def pivot(t: pd.DataFrame, value: str, cols: list[tuple], digits: int = 3, show_batch: bool = False) -> str:
    order = t.assign(k=t.kind.map({"solver": 0, "eager": 0, "threads": 0, "reference": 1})).sort_values(["k", "name"])
    names = list(dict.fromkeys(order.name))
    rows = []
    for name in names:
        sub = t[t.name == name].set_index(["N", "dtype", "device"])
        row = [f"`{name}`", sub.kind.iloc[0]]
        for c in cols:
            if c in sub.index:
                cell = fmt(sub.loc[c, value], digits)
                row.append(f"{cell} ({sub.loc[c, 'batch_size']})" if show_batch else cell)
            else:
                row.append("–")
        rows.append(row)
    return md_table(["case", "kind"] + [f"N={n} {d}" + ("" if dev == "cpu" else f" {dev}") for n, d, dev in cols], rows)


def scaling(t: pd.DataFrame) -> pd.DataFrame:
    """t(N=4000) / t(N=1000) per prompt, per case, dtype and device (median and min based)."""
    out = []
    for (name, kind, dtype, device), g in t[t.kind != "agreement"].groupby(["name", "kind", "dtype", "device"]):
        g = g.set_index("N")
        if 1000 in g.index and 4000 in g.index:
            out.append({"name": name, "kind": kind, "dtype": dtype, "device": device,
                        "median": g.s_per_prompt[4000] / g.s_per_prompt[1000],
                        "min": g.best_s_per_prompt[4000] / g.best_s_per_prompt[1000]})
    return pd.DataFrame(out, columns=["name", "kind", "dtype", "device", "median", "min"])


def ratio(t: pd.DataFrame, a: str, b: str, N: int, dtype: str, device: str = "cpu") -> tuple[float, float]:
    """(median-based, min-based) throughput ratio a / b at one point; NaN if either is missing."""
    pick = lambda n: t[(t.name == n) & (t.N == N) & (t.dtype == dtype) & (t.device == device)]  # noqa: E731
    ra, rb = pick(a), pick(b)
    if ra.empty or rb.empty:
        return math.nan, math.nan
    return (rb.s_per_prompt.iloc[0] / ra.s_per_prompt.iloc[0], rb.best_s_per_prompt.iloc[0] / ra.best_s_per_prompt.iloc[0])


def verdict(value: float, goal: float, at_most: bool = False) -> str:
    if math.isnan(value):
        return "not measured"
    if goal is None:
        return "reported"
    ok = value <= goal if at_most else value >= goal
    return "met" if ok else "**short**"


def goals(t: pd.DataFrame) -> tuple[str, list[dict]]:
    """Markdown table of the throughput goals (docs/throughput.md) and the same as records."""
    recs = []

    def add(goal, what, v, target, goal_value, at_most=False):
        recs.append({"goal": goal, "what": what, "value": v[0], "min_based": v[1], "target": target,
                     "verdict": verdict(v[0], goal_value, at_most)})

    def rate(name, N, dtype, device):  # (median, min) prompts/s of one case; NaN if it is missing
        r = t[(t.name == name) & (t.N == N) & (t.dtype == dtype) & (t.device == device)]
        return (r.prompts_per_s.iloc[0], r.best_prompts_per_s.iloc[0]) if len(r) else (math.nan, math.nan)

    devices = sorted(t.device.unique())
    cpu = "cpu" in devices
    sc = scaling(t)
    for _, r in sc[sc.kind.isin(["solver", "eager"]) | sc.name.isin(["transformer-forward", "transformer-eager"])].iterrows():
        add("scaling", f"{r['name']} {r['dtype']} {r['device']}: t(4000)/t(1000)", (r["median"], r["min"]),
            f"<= {GOAL_SCALING}", GOAL_SCALING, at_most=True)
    if cpu:
        for N, goal in ((1000, GOAL_LN_VS_NUMPY), (100, GOAL_LN_VS_NUMPY_SMALL)):
            add("ln/numpy", f"ln-closed-form / numpy-ols, N={N} float32", ratio(t, "ln-closed-form", "numpy-ols", N, "float32"),
                f">= {goal}", goal)
    for device in devices:
        add("ln/quadratic", "ln-closed-form / quadratic-attention, N=1000 float32" + ("" if device == "cpu" else f" {device}"),
            ratio(t, "ln-closed-form", "quadratic-attention", 1000, "float32", device), f">= {GOAL_LN_VS_QUADRATIC}",
            GOAL_LN_VS_QUADRATIC)
    if cpu:  # goals of the CPU kernels (a cuda-only run, gpu_run.sh, has none of these cases)
        for _, r in t[(t.kind == "solver") & (t.N == 1000) & (t.device == "cpu") & t.vs_eager.notna()].sort_values(["base", "dtype"]).iterrows():
            add("fused/eager", f"{r['base']} / its eager forward, N=1000 {r['dtype']}",
                ratio(t, r["base"], f"{r['base']} [eager]", 1000, r["dtype"]), f">= {GOAL_FUSED_VS_EAGER}", GOAL_FUSED_VS_EAGER)
        add("fused/eager", "transformer-forward / transformer-eager, N=1000 float32",
            ratio(t, "transformer-forward", "transformer-eager", 1000, "float32"), f">= {GOAL_FUSED_VS_EAGER}", GOAL_FUSED_VS_EAGER)
        for _, r in t[t.kind == "threads"].sort_values(["base", "N", "dtype"]).iterrows():
            if r["N"] == 1000 or r["base"] == "ln-closed-form":
                add("threads", f"{r['name']} / 1 thread, N={r['N']} {r['dtype']}",
                    ratio(t, r["name"], r["base"], int(r["N"]), r["dtype"]), f">= {GOAL_THREADS}", GOAL_THREADS)
                used, asked = r["extra"].get("threads_used"), r["extra"].get("threads")
                if used is not None and asked is not None and used < asked:  # the batch was too small to split
                    recs[-1]["verdict"] = f"not split ({used} thread used)"
        for N in sorted(t.N.unique()):
            for dtype in sorted(t.dtype.unique()):
                add("ols/numpy", f"ols / numpy-ols, N={N} {dtype}", ratio(t, "ols", "numpy-ols", int(N), dtype),
                    f">= {GOAL_OLS_VS_NUMPY}", GOAL_OLS_VS_NUMPY)
    for device in devices:
        for N in sorted(t.N.unique()):
            for dtype in sorted(t.dtype.unique()):
                add("ols/lstsq", f"ols / torch-lstsq, N={N} {dtype}" + ("" if device == "cpu" else f" {device}"),
                    ratio(t, "ols", "torch-lstsq", int(N), dtype, device), "reported", None)
    if "cuda" in devices:
        add("gpu", "ols prompts/s, N=100 float32 cuda", rate("ols", 100, "float32", "cuda"), f">= {GOAL_GPU_OLS:.0e}",
            GOAL_GPU_OLS)
        weighted = t[(t.kind == "solver") & (t.device == "cuda") & t.extra.map(lambda e: bool(e.get("transformer")))]
        for name in sorted(weighted.name.unique()):
            add("gpu", f"{name} prompts/s, N=100 float32 cuda", rate(name, 100, "float32", "cuda"),
                f">= {GOAL_GPU_TRANSFORMER:.0e}", GOAL_GPU_TRANSFORMER)
    rows = [[r["goal"], r["what"], fmt(r["value"]), fmt(r["min_based"]), r["target"], r["verdict"]] for r in recs]
    return md_table(["goal", "measured", "ratio (median)", "ratio (min)", "target", "verdict"], rows), recs


def compact(recs: list[dict]) -> str:
    """One line per goal: the range of its median ratios, how many cases meet it, the short ones."""
    labels = {"scaling": "time per prompt t(N=4000) / t(N=1000), every solver and the transformer forward",
              "ln/numpy": "ln-closed-form / numpy-ols, float32 (N=1000: >= 0.5; N=100: >= 0.4)",
              "ln/quadratic": "ln-closed-form / quadratic-attention, N=1000 float32",
              "fused/eager": "transformer solvers: fused / eager forward, N=1000",
              "threads": "two threads / one thread",
              "ols/numpy": "ols / numpy-ols, every N and dtype",
              "ols/lstsq": "ols / batched torch.linalg.lstsq (reported)",
              "gpu": "prompts/s on cuda, N=100 float32 (ols >= 1e8, transformer solvers >= 1e7)"}
    rows = []
    for key, label in labels.items():
        rs = [r for r in recs if r["goal"] == key and not math.isnan(r["value"])]
        if not rs:
            rows.append([label, "–", "not measured"])
            continue
        vals = [r["value"] for r in rs]
        span = fmt(vals[0]) if len(vals) == 1 else f"{fmt(min(vals))} – {fmt(max(vals))}"
        if key == "ols/lstsq":
            rows.append([label, span, "reported"])
            continue
        unsplit = [r for r in rs if r["verdict"].startswith("not split")]
        rs = [r for r in rs if r not in unsplit]
        met = sum(r["verdict"] == "met" for r in rs)
        short = [f"{r['what'].split(':')[0]} {fmt(r['value'])}" for r in rs if r["verdict"] != "met"]
        v = "met" if met == len(rs) else f"{met} of {len(rs)} met; **short**: {', '.join(short)}"
        if unsplit:
            v += f" ({len(unsplit)} case(s) not split: their batch was too small for a second thread)"
        rows.append([label, span, v])
    return md_table(["goal", "measured (median ratios)", "verdict"], rows)


def agreement(t: pd.DataFrame) -> str:
    a = t[t.kind == "agreement"]
    if a.empty:
        return "(the runner-agreement benchmarks were not part of this run)"
    rows = []
    for _, r in a.sort_values(["N", "dtype"]).iterrows():
        e = r["extra"]
        ok = 0.5 <= e["runner_over_benchmark"] <= 2.0
        rows.append([r["N"], r["dtype"], r["batch_size"], fmt(e["runner_prompts_per_s"]), fmt(e["benchmark_prompts_per_s"]),
                     fmt(e["runner_over_benchmark"]), "within 2x" if ok else "**outside 2x**"])
    return md_table(["N", "dtype", "batch", "runner prompts/s", "pytest-benchmark prompts/s", "runner / benchmark", "check"], rows)


def machine(run: dict) -> str:
    m = run.get("icl_bench", {})
    la0, la1 = m.get("loadavg_start", [math.nan] * 3), m.get("loadavg_end", [math.nan] * 3)
    gpu = m.get("cuda_device") or m.get("cuda_note", "unknown")
    return "\n".join([
        f"- run: {m.get('started_at', run.get('datetime'))} → {m.get('finished_at', '?')}, git {_commit(m.get('git_commit', '?'))}",
        f"- CPU: {m.get('cpu_model', '?')}" + (f" ({m['cpu_arch']})" if m.get("cpu_arch") else "")
        + f", {m.get('usable_cpus', '?')} usable of {m.get('logical_cpus', '?')} logical CPUs; "
        f"load average (1/5/15 min) {', '.join(f'{x:.2f}' for x in la0)} at the start, {', '.join(f'{x:.2f}' for x in la1)} at the end",
        f"- Python {m.get('python', '?')}, torch {m.get('torch', '?')} ({m.get('torch_threads', '?')} thread(s)), "
        f"numpy {m.get('numpy', '?')}, scipy {m.get('scipy', '?')}; pytest-benchmark {run.get('version', '?')}",
        f"- GPU: {gpu}",
        f"- options: {json.dumps(m.get('options', {}))}",
    ])


def _commit(commit: str) -> str:
    """The commit's first 12 digits, with its "-dirty" mark kept (uncommitted changes when it ran)."""
    head, dirty = (commit[:-6], True) if commit.endswith("-dirty") else (commit, False)
    return head[:12] + (" (uncommitted changes)" if dirty else "")


def skipped(run: dict) -> str:
    groups = defaultdict(list)
    for s in run.get("icl_bench", {}).get("skipped", []):
        groups[s["reason"]].append(s["test"].split("::")[-1])
    if not groups:
        return "(none)"
    return "\n".join(f"- {len(v)} case(s): {reason}" + (f" (e.g. `{v[0]}`)" if v else "") for reason, v in groups.items())


def report(t: pd.DataFrame, run: dict, source: str) -> tuple[str, str]:
    """(full markdown, short README block)."""
    cols = [(n, d, dev) for dev in sorted(t.device.unique()) for n in sorted(t.N.unique()) for d in sorted(t.dtype.unique())]
    cases = t[t.kind != "agreement"]
    goal_md, recs = goals(cases)
    sc = scaling(cases)
    sc_rows = [[f"`{r['name']}`", r["kind"], r["dtype"], r["device"], fmt(r["median"]), fmt(r["min"])] for _, r in sc.iterrows()]
    full = "\n\n".join([
        f"Source: `{source}` (one pytest-benchmark run; every ratio below compares figures of that run).",
        "### Machine\n\n" + machine(run),
        "### Goals\n\n" + goal_md,
        "### Throughput, prompts/s (median; batch size in parentheses)\n\n" + pivot(cases, "prompts_per_s", cols, show_batch=True),
        "### Throughput relative to numpy-ols (same N and dtype; > 1 = faster)\n\n" + pivot(cases, "vs_numpy-ols", cols),
        "### Throughput relative to quadratic-attention (same N and dtype)\n\n" + pivot(cases, "vs_quadratic-attention", cols),
        "### Fused forward relative to the eager forward (transformer solvers; same N and dtype)\n\n"
        + pivot(cases[cases.vs_eager.notna()], "vs_eager", cols),
        "### Scaling: time per prompt at N=4000 over N=1000 (linear = 4)\n\n"
        + md_table(["case", "kind", "dtype", "device", "median-based", "min-based"], sc_rows),
        "### Runner vs pytest-benchmark (`ols`, same N, dtype, batch)\n\n" + agreement(t),
        "### Skipped cases\n\n" + skipped(run),
    ])
    short = "\n\n".join([f"Measured in one run (`{source}`, median ratios; machine, min-based ratios and all "
                         "tables in [results/throughput.md](results/throughput.md)):", compact(recs)])
    return full, short


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", nargs="?", type=Path, help="pytest-benchmark JSON (default: newest in results/runs/throughput/)")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "throughput", help="output stem: writes STEM.md and STEM.csv")
    ap.add_argument("--update-docs", action="store_true", help="rewrite the marked blocks of README.md and docs/throughput.md")
    args = ap.parse_args(argv)
    path = args.run or max((p for p in RUNS.glob("*.json") if p.stat().st_size), key=lambda p: p.stat().st_mtime, default=None)
    if path is None:
        raise SystemExit("no run given and none in results/runs/throughput/; run: python -m pytest benchmarks/ --benchmark-only")
    t, run = load(path)
    t = with_ratios(t)
    try:
        source = str(path.resolve().relative_to(ROOT))
    except ValueError:
        source = str(path)
    full, short = report(t, run, source)
    print(full)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text("# Throughput\n\n" + full + "\n")
    cols = ["kind", "name", "N", "dtype", "device", "batch_size", "rounds", "median_s", "min_s", "s_per_prompt",
            "prompts_per_s", "best_prompts_per_s", "vs_numpy-ols", "vs_quadratic-attention", "vs_eager"]
    t[t.kind != "agreement"][cols].to_csv(args.out.with_suffix(".csv"), index=False)
    if args.update_docs:
        replace_block(ROOT / "README.md", "throughput", short)
        replace_block(ROOT / "docs" / "throughput.md", "throughput", full)
    return 0


if __name__ == "__main__":
    sys.exit(main())

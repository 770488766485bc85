"""`icl-bench publish RUN_DIR... --out DIR`: run folders -> tables, plots and a static web page.

Writes into DIR (nothing else, nothing typed by hand):
    index.html       the page (jinja2 template templates/index.html.j2): headline tables, what was
                     left out, scaling laws, mechanism, every plot, failed / skipped cells, metadata
    report.md        the same in markdown (headline, plots, failures, sparsity, notes)
    headline.md      the README tables (mean MSE vs OLS by solver x N, and the median squared error)
                     and the command that made them
    summary.csv/.md  report.aggregate: one row per cell key, mean MSE with 95 % CI, median |error|,
                     throughput
    failures.csv/.md every error / skipped cell (csv), grouped by message (md)
    sparsity.csv/.md weight sparsity and L1 of the solvers with weights
    scaling.csv      every scaling-law fit (icl_bench/report/scaling.py)
    mechanism.csv    relative error under x shift / scale and the verdict (when the runs have OOD rows)
    results.csv      every input row, stacked, with its run folder
    plots/*.png      mse_vs_n, mse_vs_r, gd_steps, throughput, weights, probes (each when possible)
    publish.json     inputs, the representative setting, notes (skipped plots and why), versions,
                     and the files written (so a later --force deletes nothing else)
Everything is first written to a hidden temporary folder beside DIR (`.DIR.<pid>-<random>.tmp`)
and moved into place at the end, so DIR never holds a half-written report; such a folder left by
a killed publish is removed by the next publish into DIR. A non-empty DIR is refused unless
force=True, and even then unless an earlier publish wrote it and it holds nothing else; a
--checkpoint inside DIR is refused (both: outdir.py).
Folders are made 0o755 and files 0o644 (mkdtemp's 0o700 would make the report private).
"""
from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from icl_bench.report import aggregate as report
from icl_bench.report import coverage, mechanism, outdir, scaling
from icl_bench.report.load import shared_timing_notes, unfinished_notes
from icl_bench.report.series import same_setting_notes
from icl_bench.report.sources import has_csv, lone_source_label

PLOT_TITLES = dict(zip(outdir.PLOTS, (
    "Error vs context length N",
    "Error vs embedding constant R (one panel per dtype)",
    "GD steps vs error, beside the closed forms",
    "Throughput per solver, device and dtype",
    "Weights of the transformer solvers and of the LayerNorm construction",
    "LayerNorm probes",
)))

MEDIAN_NOTE = ("A typical prompt's error: where errors are heavy-tailed a few prompts carry most of the mean above "
               "(docs/report.md, `icl-bench docs report`), and the median does not move with them; with several seeds, the "
               "median of their medians.")

CI_NOTE = ("the 95 % CI (over the prompts, on the log scale: [m / f, m · f], f = exp(t · se / m), not m ± t · se) "
           "under-covers these heavy-tailed errors, as measured and described in docs/report.md (`icl-bench docs report`).")

TARGET_NOTE = ("CSV prompts have no clean truth: this is the held-out prediction error (mse_vs_target, the pooled mean "
               "over the prompts, no interval); the tables above say how close each solver is to OLS, not how well it "
               "predicts, and a solver can predict the query better than OLS does.")


def _figures(table, drawn, setting, checkpoints):
    """(name -> Figure, notes) for every plot that has data; the others become notes. drawn: the
    summary with report.with_failed_points' rows (a failed point breaks its line)."""
    from icl_bench.report import model_plots, plots

    figs, notes = {}, []
    makers = {
        "mse_vs_n": lambda: plots.mse_vs_n(drawn, setting),
        "mse_vs_r": lambda: plots.mse_vs_r(drawn, setting),
        "gd_steps": lambda: plots.gd_steps(drawn, setting),
        "throughput": lambda: plots.throughput(table, setting),
    }
    for name, make in makers.items():
        try:
            figs[name] = make()
        except plots.PlotSkipped as exc:
            notes.append(f"{name}.png not drawn: {exc}")
    models, model_notes = model_plots.collect_models(table, setting, checkpoints)
    notes += model_notes
    for name, make in (("weights", model_plots.weight_heatmaps), ("probes", lambda m: model_plots.probe_scatter(m, notes))):
        if not models:  # (d > 1: collect_models' note says why)
            break
        try:
            figs[name] = make(models)
        except plots.PlotSkipped as exc:
            notes.append(f"{name}.png not drawn: {exc}")
    return figs, notes


def _html_table(df: pd.DataFrame) -> str:
    if df.empty:
        return "<p>(none)</p>"
    return report.display_keys(df).to_html(index=False, float_format=lambda v: f"{v:.3g}", na_rep="NaN", border=0,
                                           classes="t")  # (to_html escapes the text)


def _setting_text(setting: dict, varied=()) -> str:
    def fmt(v):
        return ("n/a" if math.isnan(v) else f"{v:g}") if isinstance(v, float) else str(v)

    # d = 1 and ood = none are named only when the runs hold other values of them (`varied`)
    return report.setting_text(setting, None, fmt, varied)


def _index_html(ctx: dict) -> str:
    """index.html from the package template templates/index.html.j2 (jinja2, autoescaped)."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.PackageLoader("icl_bench.report", "templates"),
                             autoescape=jinja2.select_autoescape(["html", "j2"]), undefined=jinja2.StrictUndefined)
    env.filters["code"] = _inline_code
    runs = []
    for run, meta in ctx["runs"].items():
        r = {"path": run, "meta": meta}
        if meta is not None:
            r["facts"] = json.dumps(_run_facts(meta), indent=1, ensure_ascii=False)  # é, not \u00e9 (escaped by jinja2)
            r["details"] = [(k, json.dumps(meta.get(k), indent=1, ensure_ascii=False))  # (sessions: every run /
                            for k in ("device", "packages", "config", "sessions") if k in meta]  # --resume there)
        runs.append(r)
    mech = ctx["mechanism"]
    return env.get_template("index.html.j2").render(
        generated_at=ctx["generated_at"], command=ctx["command"], forced=ctx["forced"],
        headline_at=ctx["at_text"], headline=_html_table(ctx["headline"]), left_out=ctx["left_out"],
        typical=_html_table(ctx["typical"]), median_note=MEDIAN_NOTE, ci_note=CI_NOTE,
        target=_html_table(ctx["target"]) if not ctx["target"].empty else "", target_note=TARGET_NOTE,
        scaling=_html_table(ctx["scaling_at"]), scaling_at_r=_scaling_at(ctx, "N"), scaling_at_n=_scaling_at(ctx, "R"),
        floors={d: f"{scaling.float_floor(d):.1e}" for d in ("float32", "float64")},
        mechanism={"status": mech["status"], "source": mech["source"],
                   "html": _html_table(mech["table"]) if not mech["table"].empty else ""},
        plots=[{"name": n, "title": PLOT_TITLES[n]} for n in ctx["plots"]], notes=ctx["notes"],
        failures=_html_table(ctx["failures"]), sparsity=_html_table(ctx["sparsity"]),
        summary=_html_table(ctx["summary_shown"]), runs=runs)


def _inline_code(text: str):
    """A note's markdown `code` spans as <code> (the text escaped first): notes are written once,
    for report.md and index.html alike."""
    import markupsafe

    parts = str(markupsafe.escape(text)).split("`")
    if len(parts) % 2 == 0:  # an unpaired backtick: left as it is
        return markupsafe.Markup("`".join(parts))
    return markupsafe.Markup("".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts)))


def _run_facts(meta: dict) -> dict:
    """The facts of a run's metadata.json shown for every run (the page also folds out device,
    packages and config)."""
    keys = ("command", "git_commit", "seed", "started_at", "finished_at", "n_cells", "status_counts")
    return {k: meta.get(k) for k in keys if k != "command" or "command" in meta}  # (runs before it: none)


def _scaling_at(ctx: dict, fixed: str) -> str:
    """The setting a scaling fit holds fixed: N for the fit against R, R for the fit against N."""
    return _setting_text({k: ctx["setting"][k] for k in (fixed, "noise", "device", "d", "ood")}, ctx["varied"])


def _report_md(ctx: dict) -> str:
    lines = ["# icl-bench results", "", f"Generated {ctx['generated_at']} by:", "", "```bash", ctx["command"], "```", "",
             ctx["headline_md"]]
    if ctx["left_out"]:
        lines += ["Left out:", ""] + [f"- {report.md_cell(n)}" for n in ctx["left_out"]] + [""]
    lines += ["## Scaling laws (exponent p of MSE vs OLS ∝ R^p, N^p; 95 % CI, conservative)", "",
              f"Against R at {_scaling_at(ctx, 'N')}; against N at {_scaling_at(ctx, 'R')}; every setting: "
              "[scaling.csv](scaling.csv).", "", report.to_markdown(ctx["scaling_at"]),
              "## Mechanism", "", ctx["mechanism"]["status"], ""]
    if not ctx["mechanism"]["table"].empty:
        lines += [report.to_markdown(ctx["mechanism"]["table"]), f"Verdict: {ctx['mechanism']['source']}.", ""]
    lines += ["## Plots", ""] + [f"[![{PLOT_TITLES[n]}](plots/{n}.png)](plots/{n}.png)" for n in ctx["plots"]]
    lines += [""] + (["## Notes", ""] + [f"- {report.md_cell(n)}" for n in ctx["notes"]] + [""] if ctx["notes"] else [])  # no empty heading
    lines += ["## Failed and skipped cells", "", report.to_markdown(ctx["failures"]),
              "## Weight sparsity", "", report.to_markdown(ctx["sparsity"]),
              f"All cells: [summary.csv](summary.csv) ({len(ctx['summary'])} rows).", "", "## Runs", ""]
    for run, meta in ctx["runs"].items():  # as on the page; its device, packages and config: metadata.json
        facts = "no metadata.json in this run folder" if meta is None else ", ".join(
            f"{k} {json.dumps(v, ensure_ascii=False)}" for k, v in _run_facts(meta).items())
        lines += [f"- `{run}`: {facts}"]
    return "\n".join(lines + [""])


def command_line(run_dirs, out, at: dict | None, checkpoints, force: bool = False, readme=None) -> str:
    """The `icl-bench publish` command as given (--force and --readme only when they were passed)."""
    args = ["icl-bench", "publish", *map(str, run_dirs), "--out", str(out)]
    for k, v in (at or {}).items():
        args += ["--at", f"{k}={v}"]
    for c in checkpoints:
        args += ["--checkpoint", str(c)]
    args += ["--readme", str(readme)] if readme else []
    return shlex.join(args + (["--force"] if force else []))


def publish(run_dirs, out, *, force: bool = False, at: dict[str, str] | None = None, checkpoints=(),
            readme=None) -> dict:
    """Aggregate run folders and write the report into `out` (see the module docstring).

    Args:
        run_dirs: folders written by `icl-bench run` (one or more; aggregated together).
        out: the output folder; must be absent or empty unless force.
        force: replace a non-empty `out` (only after the new report is complete).
        at: representative setting overrides, axis -> value text (report.representative).
        checkpoints: trained-model checkpoint paths to draw beside the construction.
        readme: the README whose headline block the caller then updates (named in the command;
            refused inside `out`, which --force would delete first).
    Returns:
        {"out": Path, "files": [relative paths], "notes": [str], "setting": dict}.
    Raises:
        ConfigError: bad run folders, --at values or --out (nothing is written then).
    """
    runs, out = [Path(r) for r in run_dirs], Path(out)
    table, metas = report.load_runs(runs)  # read-only: bad run folders and --at values first
    setting = report.representative(table, at)
    outdir.check_out(out, runs, force, checkpoints, readme)
    given, out = out, Path(os.path.realpath(out)) if out.is_symlink() else out  # a link: its target is
    out.parent.mkdir(parents=True, exist_ok=True)  # replaced, the link kept (renaming over it replaced the link)
    outdir.remove_stale_temps(out)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.{os.getpid()}-", suffix=".tmp", dir=out.parent))
    except OSError as exc:  # named as --out, not as the hidden folder beside it (a read-only or full disk)
        raise OSError(exc.errno, exc.strerror, str(out)) from None
    figs = {}
    try:
        summary = report.aggregate(table)
        head = report.headline(summary, setting, table)
        typical = report.headline(summary, setting, table, stat="median")
        headline_at = {k: v for k, v in setting.items() if k != "N"}
        varied = coverage.varied_axes(table)  # d / ood are named when the runs hold more than one value
        at_rows = report.select(table, setting, [a for a in headline_at if a in table])
        source = lone_source_label(at_rows["prompts"].fillna("").astype(str)) if "prompts" in at_rows else ""
        at_text = _setting_text(headline_at, varied) + (f", prompts = {source}" if source else "")
        real = "prompts" in at_rows and has_csv(at_rows["prompts"].fillna(""))
        target = report.headline(summary, setting, table, stat="target") if real else pd.DataFrame()
        target_md = ["#### Mean squared error vs the query row's observed y by solver and N (same setting)", "",
                     report.to_markdown(target), TARGET_NOTE, ""] if real else []
        command = command_line(runs, given, at, checkpoints, force, readme)
        gaps = coverage.left_out(table, setting)
        silent = report.no_answer_notes(table)  # NaN in the table must come with its reason (the notes: every cell)
        silent_at = report.no_answer_notes(at_rows)  # the headline's: its setting only (another run's solver is not in it)
        ill = report.ill_posed_note(summary, setting) + coverage.prompt_sets_note(table, setting)
        headline_md = "\n".join([
            f"### Mean MSE vs OLS [95 % CI] by solver and N ({at_text})", "",
            report.to_markdown(head), *[f"Warning: {report.md_cell(n)}." for n in silent_at],  # (names escaped:
            *[f"Note: {report.md_cell(n)}." for n in ill],  # a plugin's "<!-- x -->" hid itself)
            *([f"Left out: {report.md_cell('; '.join(gaps))}.", ""] if gaps else []),
            f"Made by `{command}`{'' if force else ' (add --force to regenerate into the same folder)'}; {CI_NOTE}", "",
            "#### Median squared error vs OLS, (median |prediction − OLS|)², by solver and N (same setting)", "",
            report.to_markdown(typical), MEDIAN_NOTE, "", *target_md])
        drawn = report.with_failed_points(summary, table)  # for the plots and the scaling fits
        figs, notes = _figures(table, drawn, setting, checkpoints)
        notes = (unfinished_notes(metas) + silent + ill + shared_timing_notes(table) + same_setting_notes(table)
                 + notes)  # an unfinished run first
        ctx = {"generated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": command,
               "headline": head, "typical": typical, "target": target, "headline_md": headline_md, "headline_at": headline_at,
               "at_text": at_text, "plots": list(figs),
               "notes": notes, "failures": report.failure_summary(table), "sparsity": report.sparsity(table),
               "summary": summary.drop(columns=["series_rank"], errors="ignore"), "runs": metas, "forced": force,
               "left_out": gaps, "setting": setting, "varied": varied, "mechanism": mechanism.section(table)}
        fits = scaling.scaling_table(drawn)  # (failed points: counted)
        ctx["scaling_at"] = scaling.scaling_at(fits, setting, report.series_order(summary))
        one_source = summary["prompts"].nunique() <= 1  # then the long prompt-source JSON says nothing
        ctx["summary_shown"] = ctx["summary"].drop(columns=["prompts"] if one_source else [])
        (tmp / "plots").mkdir()
        for name, fig in figs.items():
            fig.savefig(tmp / "plots" / f"{name}.png", dpi=110)
        frames = {"summary": ctx["summary"], "failures": report.failures(table), "sparsity": ctx["sparsity"],
                  "scaling": fits}
        if not ctx["mechanism"]["table"].empty:
            frames["mechanism"] = ctx["mechanism"]["table"]
        for name, df in frames.items():
            df.to_csv(tmp / f"{name}.csv", index=False)
        table.drop(columns=["series_rank"]).to_csv(tmp / "results.csv", index=False)
        (tmp / "summary.md").write_text(report.to_markdown(ctx["summary_shown"]), encoding="utf-8")
        (tmp / "failures.md").write_text(report.to_markdown(ctx["failures"]), encoding="utf-8")
        (tmp / "sparsity.md").write_text(report.to_markdown(ctx["sparsity"]), encoding="utf-8")
        (tmp / "headline.md").write_text(headline_md, encoding="utf-8")
        (tmp / "report.md").write_text(_report_md(ctx), encoding="utf-8")
        (tmp / "index.html").write_text(_index_html(ctx), encoding="utf-8")
        info = {"command": command, "runs": [str(r) for r in runs], "setting": setting, "notes": notes, "left_out": gaps,
                "generated_at": ctx["generated_at"], "ci": "95 % delta-method log interval (icl_bench/report/aggregate.py)",
                "files": sorted([p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file()] + ["publish.json"])}
        from icl_bench.provenance import package_versions

        info["packages"] = package_versions()
        info["sha256"] = outdir.digests(tmp, [f for f in info["files"] if f != "publish.json"])  # --force keeps edits
        (tmp / "publish.json").write_text(json.dumps(info, indent=2, default=_json_default), encoding="utf-8")
        _share(tmp)
        outdir.move_into(tmp, out, force, lambda: outdir.check_out(given, runs, force, checkpoints, readme))  # (as typed)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        _close(figs)
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    return {"out": given, "files": files, "notes": notes, "setting": setting}


def _share(root: Path) -> None:
    """Folders 0o755, files 0o644: tempfile.mkdtemp creates the folder 0o700 (private), which would
    make the published report unreadable to a web server or another user."""
    root.chmod(0o755)
    for p in root.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)


def _json_default(v):
    if isinstance(v, float) and math.isnan(v):
        return None
    return v.item() if hasattr(v, "item") else str(v)


def _close(figs: dict) -> None:
    for fig in figs.values():  # Figures made with plt (none here) would also need plt.close
        fig.clf()

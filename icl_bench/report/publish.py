"""`icl-bench publish RUN_DIR... --out DIR`: run folders -> tables, plots and a static web page.

Writes into DIR (nothing else, nothing typed by hand):
    index.html       the page (jinja2 template templates/index.html.j2): headline table, what was
                     left out, scaling laws, mechanism, every plot, failed / skipped cells, metadata
    report.md        the same in markdown (headline, plots, failures, sparsity, notes)
    headline.md      the README table (mean MSE vs OLS by solver x N) and the command that made it
    summary.csv/.md  report.aggregate: one row per cell key, mean MSE with 95 % CI, throughput
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
a killed publish is removed by the next publish into DIR (`_remove_stale_temps`). A non-empty DIR is refused unless force=True, and
even then unless an earlier publish wrote it and it holds nothing else; a --checkpoint inside DIR
is refused.
Folders are made 0o755 and files 0o644 (mkdtemp's 0o700 would make the report private).
"""
from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from icl_bench.report import aggregate as report
from icl_bench.report import coverage, mechanism, scaling
from icl_bench.report.load import shared_timing_notes, unfinished_notes
from icl_bench.errors import ConfigError
from icl_bench.files import refuse_link_loop

PLOT_TITLES = {
    "mse_vs_n": "Error vs context length N",
    "mse_vs_r": "Error vs embedding constant R (float32 vs float64)",
    "gd_steps": "GD steps vs error, beside the closed forms",
    "throughput": "Throughput per solver, device and dtype",
    "weights": "Weights of the transformer solvers beside the construction",
    "probes": "LayerNorm probes",
}


# What publish writes (relative to --out), for a publish.json of before it listed its "files".
OWN_FILES = {"index.html", "report.md", "headline.md", "summary.csv", "summary.md", "failures.csv", "failures.md",
             "sparsity.csv", "sparsity.md", "scaling.csv", "mechanism.csv", "results.csv", "publish.json",
             *(f"plots/{name}.png" for name in PLOT_TITLES)}


def _not_published(out: Path) -> str | None:
    """The first path under `out` (relative, in sorted order) that the publish which wrote `out`
    did not write (publish.json's "files"; OWN_FILES when it has none), or None. Links are never its."""
    try:
        files = json.loads((out / "publish.json").read_text()).get("files")
    except (OSError, ValueError, AttributeError, RecursionError):  # RecursionError: nested too deeply
        files = None
    own = set(files) if isinstance(files, list) and all(isinstance(f, str) for f in files) else OWN_FILES
    dirs = {"plots"} | {str(Path(f).parent) for f in own}
    for root, subdirs, names in os.walk(out):  # links to folders are listed, not followed
        subdirs.sort()
        rel = Path(root).relative_to(out)
        for name in sorted(names) + subdirs:
            path = (rel / name).as_posix()
            is_dir = name in subdirs and not (Path(root) / name).is_symlink()
            if (path not in dirs) if is_dir else (path not in own or (Path(root) / name).is_symlink()):
                return path
    return None


STALE_S = 3600  # a temp folder of publish older than this is stale, whatever its pid says (reused, another host)


def _remove_stale_temps(out: Path) -> None:
    """Delete the temporary folders a killed publish into `out` left beside it: named as publish
    names them (`.OUT.<pid>-<random>.tmp`; `.OUT.<random>.tmp` before the pid was in the name),
    holding only files publish writes (_not_published), and whose process is gone or that are
    older than STALE_S. Nothing else is touched (a `.OUT.*.old` folder may hold the only copy
    of the previous report: a publish killed between its two renames)."""
    own = re.compile(rf"\.{re.escape(out.name)}\.(?:(\d+)-)?[a-z0-9_]{{8}}\.tmp")  # mkdtemp: 8 of [a-z0-9_]
    try:  # best effort: a folder that vanishes meanwhile (another publish cleaning) is no error
        for p in out.parent.iterdir():
            m = own.fullmatch(p.name)
            if m is None or p.is_symlink() or not p.is_dir() or _not_published(p) is not None:
                continue
            if time.time() - p.stat().st_mtime > STALE_S or (m.group(1) and not _alive(int(m.group(1)))):
                shutil.rmtree(p, ignore_errors=True)
    except OSError:
        pass


def _alive(pid: int) -> bool:
    """Whether process `pid` may still be running a publish (this process's folder is made later)."""
    if pid == os.getpid():  # made before this publish began: a reused pid, not ours
        return False
    if os.name != "posix":  # os.kill would end the process there: its age alone decides
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. another user's process
        pass
    return True


def _inside(path, out: Path) -> bool:
    """Whether `path` lies inside `out`, each as typed or with its links followed."""
    spellings = lambda p: (Path(os.path.abspath(p)), Path(p).resolve())  # noqa: E731
    return any(o in p.parents for o in spellings(out) for p in spellings(path))


def _check_out(out: Path, runs: list[Path], force: bool, checkpoints=(), readme=None) -> None:
    from icl_bench.solvers.checkpoint import checkpoint_path, stem_of

    refuse_link_loop(out, "--out")  # (resolve, below, raises RuntimeError for it)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out: {out} exists and is not a folder")
    for run in runs:
        r, o = run.resolve(), out.resolve()
        if r == o or o in r.parents or r in o.parents:
            raise ConfigError(f"--out: {out} overlaps the run folder {run}; choose a folder outside it")
    if readme and _inside(readme, out):  # --force would delete it before its block is rewritten
        raise ConfigError(f"--readme: {readme} is inside --out {out}, which publish replaces; keep it outside")
    for name in checkpoints:  # --force would delete it with the old report
        try:
            stem = stem_of(checkpoint_path(str(name), "--checkpoint"))
        except ConfigError:
            continue  # not a checkpoint: a note (the command line refuses it before publish)
        if any(_inside(f, out) for f in (stem, f"{stem}.safetensors", f"{stem}.json")):
            raise ConfigError(f"--checkpoint: {name} is inside --out {out}, which publish replaces; keep it outside")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ConfigError(f"--out: {out} is not empty; pass --force to replace it")
        if not (out / "publish.json").is_file():  # --force never deletes a folder publish did not write
            raise ConfigError(f"--out: {out} is not a folder written by icl-bench publish (no publish.json); "
                              "--force only replaces such a folder")
        other = _not_published(out)
        if other is not None:  # nor what was put there after it (a run folder, a model, notes)
            raise ConfigError(f"--out: {out} holds {other}, which icl-bench publish did not write there; --force would "
                              "delete it: move it out or choose another folder")
    if out.resolve() == Path.cwd().resolve():
        raise ConfigError(f"--out: {out} is the current folder; choose a subfolder")


def _figures(table, summary, setting, checkpoints):
    """(name -> Figure, notes) for every plot that has data; the others become notes."""
    from icl_bench.report import model_plots, plots

    figs, notes = {}, []
    makers = {
        "mse_vs_n": lambda: plots.mse_vs_n(summary, setting),
        "mse_vs_r": lambda: plots.mse_vs_r(summary, setting),
        "gd_steps": lambda: plots.gd_steps(summary, setting),
        "throughput": lambda: plots.throughput(table),
    }
    for name, make in makers.items():
        try:
            figs[name] = make()
        except plots.PlotSkipped as exc:
            notes.append(f"{name}.png not drawn: {exc}")
    models, model_notes = model_plots.collect_models(table, setting, checkpoints)
    notes += model_notes
    for name, make in (("weights", model_plots.weight_heatmaps), ("probes", lambda m: model_plots.probe_scatter(m, notes))):
        try:
            figs[name] = make(models)
        except plots.PlotSkipped as exc:
            notes.append(f"{name}.png not drawn: {exc}")
    return figs, notes


def _html_table(df: pd.DataFrame) -> str:
    if df.empty:
        return "<p>(none)</p>"
    return df.to_html(index=False, float_format=lambda v: f"{v:.3g}", na_rep="NaN", border=0, classes="t")


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
            r["facts"] = json.dumps(_run_facts(meta), indent=1)
            r["details"] = [(k, json.dumps(meta.get(k), indent=1)) for k in ("device", "packages", "config")]
        runs.append(r)
    mech = ctx["mechanism"]
    return env.get_template("index.html.j2").render(
        generated_at=ctx["generated_at"], command=ctx["command"], forced=ctx["forced"],
        headline_at=_setting_text(ctx["headline_at"], ctx["varied"]), headline=_html_table(ctx["headline"]), left_out=ctx["left_out"],
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
        lines += ["Left out:", ""] + [f"- {n}" for n in ctx["left_out"]] + [""]
    lines += ["## Scaling laws (exponent p of MSE vs OLS ∝ R^p, N^p; 95 % CI)", "",
              f"Against R at {_scaling_at(ctx, 'N')}; against N at {_scaling_at(ctx, 'R')}; every setting: "
              "[scaling.csv](scaling.csv).", "", report.to_markdown(ctx["scaling_at"]),
              "## Mechanism", "", ctx["mechanism"]["status"], ""]
    if not ctx["mechanism"]["table"].empty:
        lines += [report.to_markdown(ctx["mechanism"]["table"]), f"Verdict: {ctx['mechanism']['source']}.", ""]
    lines += ["## Plots", ""] + [f"[![{PLOT_TITLES[n]}](plots/{n}.png)](plots/{n}.png)" for n in ctx["plots"]]
    lines += [""] + (["## Notes", ""] + [f"- {n}" for n in ctx["notes"]] + [""] if ctx["notes"] else [])  # no empty heading
    lines += ["## Failed and skipped cells", "", report.to_markdown(ctx["failures"]),
              "## Weight sparsity", "", report.to_markdown(ctx["sparsity"]),
              f"All cells: [summary.csv](summary.csv) ({len(ctx['summary'])} rows).", "", "## Runs", ""]
    for run, meta in ctx["runs"].items():  # as on the page; its device, packages and config: metadata.json
        facts = "no metadata.json in this run folder" if meta is None else ", ".join(
            f"{k} {json.dumps(v)}" for k, v in _run_facts(meta).items())
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
    _check_out(out, runs, force, checkpoints, readme)
    summary = report.aggregate(table)
    head = report.headline(summary, setting, table)
    headline_at = {k: v for k, v in setting.items() if k != "N"}
    varied = coverage.varied_axes(table)  # d / ood are named when the runs hold more than one value
    command = command_line(runs, out, at, checkpoints, force, readme)
    gaps = coverage.left_out(table, setting)
    silent = report.no_answer_notes(table)  # NaN in the table must come with its reason
    ill = report.ill_posed_note(summary, setting)
    headline_md = "\n".join([
        f"### Mean MSE vs OLS [95 % CI] by solver and N ({_setting_text(headline_at, varied)})", "",
        report.to_markdown(head), *[f"Warning: {n}." for n in silent], *[f"Note: {n}." for n in ill],
        *([f"Left out: {'; '.join(gaps)}.", ""] if gaps else []),
        f"Made by `{command}`{'' if force else ' (add --force to regenerate into the same folder)'}; "
        "the 95 % CI (over the prompts; normal theory) is described in icl_bench/report/aggregate.py: "
        "it under-covers these heavy-tailed errors (results/ci_coverage.md).", ""])
    figs, notes = _figures(table, summary, setting, checkpoints)
    notes = unfinished_notes(metas) + silent + ill + shared_timing_notes(table) + notes  # an unfinished run first
    ctx = {"generated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": command,
           "headline": head, "headline_md": headline_md, "headline_at": headline_at, "plots": list(figs),
           "notes": notes, "failures": report.failure_summary(table), "sparsity": report.sparsity(table),
           "summary": summary.drop(columns=["series_rank"], errors="ignore"), "runs": metas, "forced": force,
           "left_out": gaps, "setting": setting, "varied": varied, "mechanism": mechanism.section(table)}
    fits = scaling.scaling_table(summary)
    ctx["scaling_at"] = scaling.scaling_at(fits, setting, report.series_order(summary))
    one_source = summary["prompts"].nunique() <= 1  # then the long prompt-source JSON says nothing
    ctx["summary_shown"] = ctx["summary"].drop(columns=["prompts"] if one_source else [])
    given, out = out, Path(os.path.realpath(out)) if out.is_symlink() else out  # a link: its target is
    out.parent.mkdir(parents=True, exist_ok=True)  # replaced, the link kept (renaming over it replaced the link)
    _remove_stale_temps(out)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.{os.getpid()}-", suffix=".tmp", dir=out.parent))
    except OSError as exc:  # named as --out, not as the hidden folder beside it (a read-only or full disk)
        raise OSError(exc.errno, exc.strerror, str(out)) from None
    try:
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
        (tmp / "summary.md").write_text(report.to_markdown(ctx["summary_shown"]))
        (tmp / "failures.md").write_text(report.to_markdown(ctx["failures"]))
        (tmp / "sparsity.md").write_text(report.to_markdown(ctx["sparsity"]))
        (tmp / "headline.md").write_text(headline_md)
        (tmp / "report.md").write_text(_report_md(ctx))
        (tmp / "index.html").write_text(_index_html(ctx))
        info = {"command": command, "runs": [str(r) for r in runs], "setting": setting, "notes": notes, "left_out": gaps,
                "generated_at": ctx["generated_at"], "ci": "95 % delta-method log interval (icl_bench/report/aggregate.py)",
                "files": sorted([p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file()] + ["publish.json"])}
        from icl_bench.provenance import package_versions

        info["packages"] = package_versions()
        (tmp / "publish.json").write_text(json.dumps(info, indent=2, default=_json_default))
        _share(tmp)
        old = None
        if out.exists():  # empty, or force: move it aside, move the new report in, then delete it
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
            try:
                out.rename(old / "previous")
            except BaseException:  # --out a mount point, or spelled with '..': nothing moved, nothing left
                old.rmdir()
                raise
        try:
            tmp.rename(out)
        except BaseException:
            if old is not None:
                (old / "previous").rename(out)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
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

"""Model plots: weight heat-maps of transformer solvers beside the LayerNorm construction, and the
LayerNorm probe scatter (what a model's stream holds vs the closed form's statistics).

The models come from code and checkpoint files only (`collect_models`): the construction
(solvers/ln_closed_form.py, docs/ln-closed-form.md), the checkpoints the run's trained-* cells used
and those given with --checkpoint. No solver is re-run; the numbers of the report's tables come
from the stored results alone.

Heat-maps show the symmetry-reduced maps of docs/design.md ("Symmetries"), not the raw factors: per layer l and
head k, QK = W_Q^T W_K (the bilinear score form) and OV = W_O W_V (the value-to-output map), since
only these change predictions; plus the embedding, the LayerNorm gain and bias and the readout.
They are shown as they are, without aligning the residual coordinates (a trained model may use
a permuted, rescaled basis); each panel is coloured on its own scale, centred at 0.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import seaborn as sns
import torch
from matplotlib.figure import Figure

from icl_bench import resources
from icl_bench.analysis.probes import mechanism_probes
from icl_bench.errors import ConfigError
from icl_bench.prompts.generator import PromptSpec, sample_prompts
from icl_bench.prompts.ols import ols_fit
from icl_bench.report.aggregate import select
from icl_bench.report import style
from icl_bench.report.plots import PlotSkipped
from icl_bench.report.sources import has_csv
from icl_bench.solvers.checkpoint import checkpoint_path, load_checkpoint, shadows_shipped, stem_of
from icl_bench.solvers.gd_lsa import GDLSA
from icl_bench.solvers.ln_closed_form import LNClosedForm, build_construction
from icl_bench.solvers.registry import UnknownSolverError, get_solver_class

MAX_POINTS = 1500  # points per scatter panel (a random subset when there are more)
LN_KEY = re.compile(r"blocks\.(\d+)\.ln\.weight$")


def has_layernorm(weights: dict) -> bool:
    """True for Transformer weight dicts whose blocks have LayerNorm (comparable with the construction)."""
    return any(LN_KEY.match(k) for k in weights)


def reduced_maps(weights: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Symmetry-reduced matrices of `Transformer.weight_matrices()` (see the module docstring).

    Returns: ordered name -> 2-D float64 array: "embed" (d_model, 3), "L{l}H{k} QK" and
        "L{l}H{k} OV" (d_model, d_model), "L{l} LN γ/β" (2, d_model), "readout" (1, width).
    Raises:
        PlotSkipped: the dict lacks embed.weight / blocks.*.attn.W_Q (not a transformer's weights).
    """
    w = {k: v.detach().double().cpu().numpy() for k, v in weights.items()}
    if "embed.weight" not in w or "blocks.0.attn.W_Q" not in w:
        raise PlotSkipped(f"weights have no embed.weight / blocks.0.attn.W_Q (names: {', '.join(list(w)[:6])})")
    out = {"embed": w["embed.weight"]}
    with np.errstate(over="ignore", invalid="ignore"):  # e.g. the construction at R = 1e-300: inf, drawn as such
        _reduce(w, out)
    if "readout.weight" in w:
        out["readout"] = w["readout.weight"]
    return out


def _reduce(w: dict[str, np.ndarray], out: dict[str, np.ndarray]) -> None:
    """Add each layer's QK, OV and LayerNorm maps of the weights `w` to `out` (reduced_maps)."""
    layer = 0
    while f"blocks.{layer}.attn.W_Q" in w:
        p = f"blocks.{layer}."
        for k in range(w[p + "attn.W_Q"].shape[0]):
            out[f"L{layer + 1}H{k + 1} QK"] = w[p + "attn.W_Q"][k].T @ w[p + "attn.W_K"][k]
            out[f"L{layer + 1}H{k + 1} OV"] = w[p + "attn.W_O"][k] @ w[p + "attn.W_V"][k]
        if p + "ln.weight" in w:
            out[f"L{layer + 1} LN γ/β"] = np.stack([w[p + "ln.weight"], w.get(p + "ln.bias", 0 * w[p + "ln.weight"])])
        layer += 1


def _fitting_checkpoint(solver: str, params: str, R: float, N: int) -> Path | None:
    """The checkpoint file a trained-* solver serves (R, N) with (its models_dir or the shipped
    one), or None for solvers that are not checkpoint-backed or have none."""
    from icl_bench.solvers.trained import TrainedSolver, checkpoint_fits, find_checkpoints

    cls = get_solver_class(solver)
    if not issubclass(cls, TrainedSolver):
        return None
    models_dir = json.loads(params or "{}").get("models_dir") or resources.models_dir()
    fits = [p for p, meta in find_checkpoints(models_dir, solver) if checkpoint_fits(meta, R, N)]
    return fits[0] if fits else None


NO_LAYERNORM = "no LayerNorm weights, not drawn beside the LayerNorm construction"  # a model's note (collect_models)
PROBE_TOKENS = 2**18  # tokens of the probe prompts at most: n_prompts shrinks at large N (a trace holds every stream)


def collect_models(table: pd.DataFrame, setting: dict, checkpoints=(), n_prompts: int = 512, seed: int = 0):
    """The transformers to draw, from code and checkpoint files only (no solver is re-run): the
    LayerNorm construction at the setting's R, the checkpoint each trained-* solver with ok cells
    at `setting` used (its models_dir, or the shipped models), and the checkpoints given; a
    checkpoint file reached twice (trained-l1-R100 and trained-l1-R100.json) is drawn once.

    The probe traces are the models' forward passes on `n_prompts` prompts drawn at the setting
    (N, noise, R; standard-normal x, slope, intercept; float64) with `seed`; fewer where
    n_prompts (N + 1) would exceed PROBE_TOKENS (at least 2 prompts; a note says how many), so a
    run at N = 100 000 publishes in bounded memory.

    The construction drawn alone (no ln-closed-form with ok cells at the setting, no checkpoint
    drawn: a run of ols and a plugin) is a reference, not a result of the runs: its entry has
    "reference": True (the figures say so in its title) and a note says why it is there.

    Returns:
        (models, notes): models = label -> {"weights": dict, "trace": dict, "reference": bool}
        (trace: the model's probe() intermediates plus "tokens"); notes = what was left out and why.
    """
    notes, models = [], {}
    d = setting.get("d", 1)
    multi = isinstance(d, (int, float)) and d == d and int(d) > 1  # the 1-D network was drawn as if it had run there
    if multi:  # (a review); a --checkpoint given is still drawn: its weights are the same at any d
        one = "d" in table and bool(((table["status"] == "ok") & (table["d"] == 1)).any())
        advice = " (publish with --at d=1 to draw them)" if one else ""
        drawn = "; the --checkpoint models are drawn, probed on d = 1 prompts" if checkpoints else ""
        notes.append(f"weights.png and probes.png leave out the construction and the runs' trained solvers at "
                     f"d = {int(d)}: they are d = 1 networks, probed on d = 1 prompts{advice}{drawn}")
        if not checkpoints:
            return {}, notes
    R, N = float(setting["R"]), int(setting["N"])
    noise = float(setting["noise"]) if np.isfinite(float(setting["noise"])) else 0.0
    if n_prompts * (N + 1) > PROBE_TOKENS:
        n_prompts = max(2, PROBE_TOKENS // (N + 1))
        notes.append(f"probes at N={N} drawn from {n_prompts} prompts (at most {PROBE_TOKENS} tokens)")
    tokens = sample_prompts(PromptSpec(N=N, noise=noise, R=R), n_prompts, seed=seed, dtype="float64").tokens
    probed_on = f"{n_prompts} prompts at N = {N}, noise = {noise:g}, R = {R:g} (float64, seed {seed})"  # probes.png says so

    def add(label: str, model) -> None:
        model = model.to(torch.float64).eval()
        if model.cfg.readout == "flatten" and model.cfg.N != N:  # its weights need no prompts (it was left out
            notes.append(f"{label}: its flatten readout fixes N = {model.cfg.N}, so probes.png leaves it out (the "
                         f"report's N = {N}); weights.png draws it")  # of both figures: a review)
            models[label] = {"weights": model.weight_matrices(), "trace": None, "reference": False}
            return
        with torch.no_grad():
            models[label] = {"weights": model.weight_matrices(), "trace": {"tokens": tokens, **model.probe(tokens)},
                             "reference": False, "probed_on": probed_on}

    at = select(table[table["status"] == "ok"], setting, ("N", "noise", "R", "d"))
    if multi:
        at = at.iloc[:0]  # (none of the runs' solvers is drawn at d > 1)
    if "prompts" in at and has_csv(at["prompts"].fillna("")):
        notes.append(f"probes.png probes on {n_prompts} generated prompts (standard-normal x and slope, at N = {N}, "
                     f"R = {R:g}), not on the CSV rows of the runs")
    construction = f"construction (R={R:g})"
    if not multi:
        add(construction, build_construction(R))
    drawn = {}  # weights file reached (_file_key) -> its label: one model is drawn once, however it was named
    for (solver, params), g in at.groupby(["solver", "solver_params"]):
        label = (g["series"].iloc[0].split(" · ")[0] if "series" in g else  # the error plots' label, less its prompt
                 f"{solver} {params}" if params not in ("", "{}") else solver)  # source: the model is probed on its own
        try:
            path = _fitting_checkpoint(solver, params, R, N)
        except UnknownSolverError:  # a plugin of the run not installed here: its weights, if any, are unknown
            notes.append(f"weights.png, probes.png: {label} not drawn (solver {solver!r} is not installed here)")
            continue
        except Exception as exc:  # a broken solver: a note, not the end of the report
            notes.append(f"weights.png, probes.png: {label} not drawn ({type(exc).__name__}: {exc})")
            continue
        if path is None:  # not checkpoint-backed: its weights are a construction drawn from code
            if issubclass(get_solver_class(solver), GDLSA):  # (left out without a word: a review)
                notes.append(f"{label}: {NO_LAYERNORM}")
            continue
        model, _ = load_checkpoint(path)
        if not model.cfg.layernorm:
            notes.append(f"{label}: {NO_LAYERNORM}")
            continue
        if _file_key(path) in drawn:  # two settings of one solver serving the same file
            notes.append(f"{label}: drawn once, as {drawn[_file_key(path)]!r}")
            continue
        drawn[_file_key(path)] = f"{label} ({Path(path).stem})"
        add(f"{label} ({Path(path).stem})", model)
    for path in checkpoints:  # as the user gave them: a path or a shipped model's name
        try:
            resolved = checkpoint_path(str(path), "--checkpoint")
            if _file_key(resolved) in drawn:  # e.g. trained-l1-R100 and trained-l1-R100.json, or links to it
                notes.append(f"--checkpoint {path}: drawn once, as {drawn[_file_key(resolved)]!r}")
                continue
            model, meta = load_checkpoint(resolved)
            if not model.cfg.layernorm:  # as for a run's solver above: its probes' "LayerNorm output" is not one
                notes.append(f"--checkpoint {path}: {NO_LAYERNORM}")
                continue
            if shadows_shipped(str(path), resolved):
                notes.append(f"--checkpoint {path}: the pair in this folder ({Path(resolved).resolve().parent}), not "
                             "the shipped model of that name")
            drawn[_file_key(resolved)] = f"checkpoint {path}"
            add(f"checkpoint {path}", model)
            probed = models[f"checkpoint {path}"]["trace"] is not None  # (a flatten readout at another N: not probed)
            if probed and isinstance(meta.get("R"), (int, float)) and float(meta["R"]) != R:  # its probes at another R
                own = float(meta["R"]) in set(table.loc[table["status"] == "ok", "R"].astype(float))
                notes.append(f"--checkpoint {path}: trained at R = {meta['R']:g}, probed at the report's R = {R:g}"
                             + (f" (--at R={meta['R']:g} probes it at its own)" if own else ""))
        except Exception as exc:
            notes.append(f"--checkpoint {path}: not drawn ({type(exc).__name__}: {exc})")
    if not multi and len(models) == 1 and not any(_is_construction(s) for s in set(at["solver"])):
        models[construction]["reference"] = True  # the construction alone, and no solver of the runs
        notes.append(f"weights.png and probes.png draw the LayerNorm construction (R = {R:g}) for reference only: no "
                     "transformer solver with LayerNorm weights (ln-closed-form, a trained-* checkpoint) has ok cells "
                     "at the setting, and no --checkpoint with LayerNorm weights was given")
    return models, notes


REFERENCE = "reference only: no transformer solver with LayerNorm weights in the runs"  # the title of a model collect_models marks so


def _is_construction(solver: str) -> bool:
    """True for ln-closed-form (or a solver built on it): its weights are the construction drawn."""
    try:
        return issubclass(get_solver_class(solver), LNClosedForm)
    except Exception:  # a plugin not installed where the report is made
        return False


def _file_key(path) -> Path:
    """What makes two checkpoint names one model: the weights file they reach, links followed."""
    return Path(f"{stem_of(path)}.safetensors").resolve()


def _short(v: float) -> str:
    """Cell annotation: 2 significant digits without the leading zero (-0.093 -> -.093, 2.9e-05 -> 3e-5)."""
    if v == 0:
        return "0"
    if abs(v) < 1e-3:
        return f"{v:.0e}".replace("e-0", "e-")
    return f"{v:.2g}".replace("0.", ".", 1) if abs(v) < 1 else f"{v:.2g}"


def _layout(names: list[str]) -> list[list[str]]:
    """Panel rows of one model: [embed, readout], then per layer its heads' QK, OV and its LN."""
    rows = [[n for n in names if not n.startswith("L")]]
    layers = sorted({int(re.match(r"L(\d+)", n).group(1)) for n in names if re.match(r"L\d+", n)})
    for layer in layers:
        rows.append([n for n in names if re.match(rf"L{layer}[ H]", n)])
    return [r for r in rows if r]


def weight_heatmaps(models: dict[str, dict]) -> Figure:
    """Per model a block of heat-maps (a row for the embedding and readout, then one row per
    layer: each head's QK and OV, the LayerNorm gain / bias), annotated with values when small.

    Args: models: label -> {"weights": Transformer weight dict, ...} (collect_models).
    Raises: PlotSkipped when no model has transformer weights.
    """
    maps = {}
    for label, m in models.items():
        try:
            maps[label] = reduced_maps(m["weights"])
        except PlotSkipped:
            continue
    if not maps:
        raise PlotSkipped("weight heat-maps: no transformer weights (construction or solver) to draw")
    sns.set_theme(style="white", context="paper")
    layouts = {label: _layout(list(mm)) for label, mm in maps.items()}
    ncols = max(len(r) for lay in layouts.values() for r in lay)
    nrows = [len(lay) for lay in layouts.values()]
    panel = 2.0  # inches per panel
    blocks = [n * panel + 0.45 for n in nrows]
    width, height = ncols * panel + 0.6, sum(blocks) + 0.35
    fig = Figure(figsize=(width, height))
    header, *subs = fig.subfigures(len(maps) + 1, 1, height_ratios=[0.35, *blocks], squeeze=False)[:, 0]
    for sub, (label, mm) in zip(subs, maps.items()):
        ref = f"  ({REFERENCE})" if models[label].get("reference") else ""
        sub.suptitle(style.wrap_note(label + ref, width - 0.3, fontsize=10)[0], fontsize=9, x=0.02, ha="left",
                     fontweight="bold", parse_math=False)  # (bold 9 pt: wrapped as 10 pt; a label is text, never mathtext)
        lay = layouts[label]
        axes = sub.subplots(len(lay), ncols, squeeze=False)
        for i, row in enumerate(lay):
            for j in range(ncols):
                ax = axes[i, j]
                if j >= len(row):
                    ax.axis("off")
                    continue
                name, a = row[j], mm[row[j]]
                if a.shape[0] == 1 and a.shape[1] > 8:  # a flatten readout: one row per token
                    a = a.reshape(-1, mm["embed"].shape[0])
                bad = int((~np.isfinite(a)).sum())  # inf / NaN entries: grey, named in the title
                top = float(np.abs(a[np.isfinite(a)]).max(initial=0.0))  # the title's |max| (0 for an all-zero map)
                vmax = top or 1.0
                cmap = sns.mpl.colormaps["RdBu_r"].with_extremes(bad="0.7")
                ax.imshow(np.ma.masked_invalid(a), cmap=cmap, vmin=-vmax, vmax=vmax, interpolation="nearest")
                if a.size <= 16:  # annotate small maps; text colour follows the cell's darkness
                    for (r, c), v in np.ndenumerate(a):
                        ax.text(c, r, _short(v), ha="center", va="center", fontsize=5.5,
                                color="white" if abs(v) > 0.6 * vmax else "black")
                ax.set_xticks(range(a.shape[1]))
                ln = name.endswith("LN γ/β")  # rows gain and bias of each slot, not a map between slots
                ax.set_yticks(range(a.shape[0]), ["γ", "β"] if ln else range(a.shape[0]))
                ax.grid(False)
                ax.set_title(f"{name}  (|max| {top:.2g}{f'; {bad} not finite, grey' if bad else ''})", fontsize=7,
                             parse_math=False)
                qk = name.endswith(" QK")  # rows: the query token's slots, columns: the key token's
                ax.set_xlabel("slot" if ln else "key slot" if qk else "input slot", fontsize=6)
                ax.set_ylabel("" if ln or (j and not qk) else "query slot" if qk else "output slot", fontsize=6)
                ax.tick_params(labelsize=6)
        sub.subplots_adjust(left=0.5 / width, right=1 - 0.1 / width, bottom=0.1, top=0.88, wspace=0.25, hspace=0.45)
    header.suptitle("Weights (QK = W_Qᵀ W_K, OV = W_O W_V; each panel on its own colour scale centred at 0; "
                    "unaligned)", fontsize=9, va="center", y=0.5)
    return fig


# the probes' stream names (0-based, as analyze's JSON has them) in the words of docs/design.md §5
PROBE_PLACES = {"layer0.resid[context]": "stream after layer 1, context tokens",
                "layer1.ln[query]": "layer-2 LayerNorm output, query token"}


def probe_scatter(models: dict[str, dict], notes: list[str] | None = None) -> Figure:
    """Per model (rows): scatter of the residual slot that best tracks each closed-form statistic
    against that statistic (x - x_bar and y - y_bar after layer 1 at the context tokens; b_hat
    (u - x_bar) in the query's layer-2 LayerNorm output), with the fitted line and R^2.

    A model whose trace has too few finite rows to fit (e.g. at R = 1e300 the stream overflows)
    is left out, and a fit that dropped non-finite rows is named with its row count, in `notes`.

    Raises: PlotSkipped when no model has a 2-layer trace that can be fitted (the reasons named).
    """
    fits, left_out = {}, []
    for label, m in models.items():
        t = m.get("trace")
        if t and "layer0.resid" in t and "layer1.ln" in t:
            try:
                fits[label] = (t, mechanism_probes(t, t["tokens"]))
            except ConfigError as exc:  # a probe_fit that cannot fit: not the end of the report
                left_out.append(f"{label}: {exc}")
    if not fits:
        raise PlotSkipped("probe scatter: " + ("; ".join(left_out) if left_out else
                                               "no model with a LayerNorm trace (layer0.resid, layer1.ln)"))
    if left_out and notes is not None:
        notes.append(f"probes.png leaves out {'; '.join(left_out)}")
    partial, undefined = [], []  # fits that dropped non-finite rows (e.g. a stream that overflows
    for label, (t, fit) in fits.items():  # on some prompts); fits with no R² (a constant slot)
        B, T = t["tokens"].shape[:2]
        rows = {"centering.x": B * (T - 1), "centering.y": B * (T - 1), "division": B}
        partial += [f"{label} {k}: {f.n} of {rows[k]} rows finite" for k, f in fit.items() if f.n < rows.get(k, f.n)]
        undefined += [f"{label} {k}" for k, f in fit.items() if not np.isfinite(f.r2)]
    if partial and notes is not None:
        notes.append(f"probes.png fits only the finite rows: {'; '.join(partial)}")
    if undefined and notes is not None:
        notes.append(f"probes.png has no R² (nan: the statistic or every stream slot is constant over the rows, "
                     f"e.g. a LayerNorm whose input has underflowed): {'; '.join(undefined)}")
    sns.set_theme(style="whitegrid", context="paper")
    fig = Figure(figsize=(10, 2.9 * len(fits) + 0.6))
    axes = fig.subplots(len(fits), 3, squeeze=False)
    rng = np.random.default_rng(0)
    for i, (label, (t, fit)) in enumerate(fits.items()):
        tok = t["tokens"].double()
        x, y, u = tok[:, :-1, 0], tok[:, :-1, 1], tok[:, -1, 0]  # (B, N), (B, N), (B,)
        x_bar, y_bar, b_hat, _ = ols_fit(x, y)
        targets = {"centering.x": ((x - x_bar[:, None]).reshape(-1), t["layer0.resid"][:, :-1]),
                   "centering.y": ((y - y_bar[:, None]).reshape(-1), t["layer0.resid"][:, :-1]),
                   "division": (b_hat * (u - x_bar), t["layer1.ln"][:, -1])}
        for j, (key, (target, stream)) in enumerate(targets.items()):
            f = fit[key]
            slot = stream.reshape(-1, stream.shape[-1])[:, f.slot].double()
            tx, sy = target.numpy(), slot.numpy()
            keep = rng.permutation(tx.size)[:MAX_POINTS]
            ax = axes[i, j]
            ax.scatter(tx[keep], sy[keep], s=4, alpha=0.5)
            line = np.linspace(np.nanmin(tx), np.nanmax(tx), 2)
            ax.plot(line, f.slope * line + f.intercept, color="k", lw=0.8, label=f"slope {f.slope:.3g}")
            n_rows = f" ({f.n} of {tx.size} rows finite)" if f.n < tx.size else ""
            where = PROBE_PLACES.get(f.source, f.source)
            ref = f" ({REFERENCE.split(':')[0]})" if models[label].get("reference") else ""
            head = style.wrap_note(f"{label}{ref}", 2.5, fontsize=7)[0]  # a panel's width: a long label ran into the next
            ax.set_title(f"{head}\n{where}\nslot {f.slot}, R² = {f.r2:.4f}{n_rows}", fontsize=7, parse_math=False)
            ax.set_xlabel(f"closed form {f.target} ({'x' if key == 'centering.x' else 'y'} units)", fontsize=7)
            ax.set_ylabel(f"stream slot {f.slot} (model units)", fontsize=7)
            ax.legend(fontsize=6)
    refs = [label for label in fits if models[label].get("reference")]
    on = sorted({models[label].get("probed_on", "") for label in fits} - {""})  # (a figure used alone said not on what)
    fig.suptitle("LayerNorm probes: stream slot vs the closed form's statistic (the division column is passed by "
                 "any accurate model: not a mechanism test; icl-bench analyze's ln.state is)"
                 + (f"\nprobed on {'; '.join(on)}" if on else "")
                 + "".join(f"\n{label}: {REFERENCE}" for label in refs), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig

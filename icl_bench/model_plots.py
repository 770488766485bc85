"""Model plots: weight heat-maps of transformer solvers beside the LayerNorm construction, and the
LayerNorm probe scatter (what a model's stream holds vs the closed form's statistics).

Both figures use code that other parts of the suite provide, imported when present:
    icl_bench.ln_closed_form.build_construction(R)   the construction (shared DESIGN.md section 5)
    icl_bench.probes.mechanism_probes(trace, tokens) which residual slot holds x - x_bar, y - y_bar
                                                     and b_hat (u - x_bar) (slot, slope, R^2)
    icl_bench.checkpoint.load_checkpoint(path)       a trained model from --checkpoint
When one is missing, `collect_models` records a note and the figure is drawn without it (or
skipped with `PlotSkipped` when nothing is left to draw).

Heat-maps show the symmetry-reduced maps of DESIGN section 7, not the raw factors: per layer l and
head k, QK = W_Q^T W_K (the bilinear score form) and OV = W_O W_V (the value-to-output map), since
only these change predictions; plus the embedding, the LayerNorm gain and bias and the readout.
They are shown as they are, without aligning the residual coordinates (a trained model may use
a permuted, rescaled basis); each panel is coloured on its own scale, centred at 0.
"""
from __future__ import annotations

import importlib
import json
import re

import numpy as np
import pandas as pd
import seaborn as sns
import torch
from matplotlib.figure import Figure

from icl_bench.plots import PlotSkipped

MAX_POINTS = 1500  # points per scatter panel (a random subset when there are more)
LN_KEY = re.compile(r"blocks\.(\d+)\.ln\.weight$")


def _optional(module: str, attr: str):
    """module.attr if that module exists and defines it, else None (never raises ImportError)."""
    try:
        return getattr(importlib.import_module(module), attr, None)
    except ImportError:
        return None


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
    layer = 0
    while f"blocks.{layer}.attn.W_Q" in w:
        p = f"blocks.{layer}."
        for k in range(w[p + "attn.W_Q"].shape[0]):
            out[f"L{layer + 1}H{k + 1} QK"] = w[p + "attn.W_Q"][k].T @ w[p + "attn.W_K"][k]
            out[f"L{layer + 1}H{k + 1} OV"] = w[p + "attn.W_O"][k] @ w[p + "attn.W_V"][k]
        if p + "ln.weight" in w:
            out[f"L{layer + 1} LN γ/β"] = np.stack([w[p + "ln.weight"], w.get(p + "ln.bias", 0 * w[p + "ln.weight"])])
        layer += 1
    if "readout.weight" in w:
        out["readout"] = w["readout.weight"]
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].shape == b[k].shape and torch.allclose(a[k].double().cpu(), b[k].double().cpu())
                                        for k in a)


def _model_of(solver: str, params: str, R: float, N: int):
    """(model, where from) for a solver of the runs, without running it: the checkpoint that the
    solver would load for (R, N) (`checkpoint_for`, trained-*), or the model it builds from code
    (`model(R)`: ln-closed-form, gd-lsa). (None, reason) for a solver that has neither."""
    from icl_bench.registry import get_solver

    s = get_solver(solver, **json.loads(params or "{}"))  # instantiation only: nothing is predicted
    if hasattr(s, "checkpoint_for"):
        from icl_bench.checkpoint import load_checkpoint

        path = s.checkpoint_for(float(R), int(N))
        return load_checkpoint(path)[0].double().eval(), f"checkpoint {path.name}"
    if callable(getattr(s, "model", None)):
        return s.model(float(R)).double().eval(), "built from code"
    return None, "neither a checkpoint nor a model built from code (the report never re-runs solvers)"


def _probe_prompts(table: pd.DataFrame, setting: dict, n_prompts: int, seed: int):
    """Fresh float64 prompts at the setting's N, noise, R from the public generator, with the
    run's prompt distributions (None, reason for CSV data or a setting without ok cells)."""
    from icl_bench import PromptSpec, sample_prompts
    from icl_bench.prompts import Dist
    from icl_bench.report import select

    at = select(table[table["status"] == "ok"], setting, ("N", "noise", "R"))
    if at.empty:
        return None, "no ok cell at the setting's N, noise, R"
    spec = json.loads(at.iloc[0]["prompts"] or "{}")
    if "csv" in spec:
        return None, "prompts come from CSV data: the probe scatter uses generator prompts only"
    r = at.iloc[0]
    ps = PromptSpec(N=int(r["N"]), noise=float(r["noise"]), R=float(r["R"]), **{k: Dist(**v) for k, v in spec.items()})
    return sample_prompts(ps, n_prompts, seed=seed, dtype="float64"), ""


def collect_models(table: pd.DataFrame, setting: dict, checkpoints=(), n_prompts: int = 512, seed: int = 0):
    """The transformers to draw: the construction (built from code at the setting's R), the runs'
    solvers with weights at the setting's N, noise, R (their checkpoints or code-built models,
    `_model_of`; never run through the benchmark), and the checkpoints given. Probe traces are
    the models' `probe()` on `n_prompts` fresh generator prompts (`_probe_prompts`, seed `seed`).

    Returns:
        (models, notes): models = label -> {"weights": dict, "trace": dict or None} (trace: the
        model's probe() intermediates plus "tokens"); notes = what was left out and why.
    """
    from icl_bench.report import select

    notes, models = [], {}
    batch, why = _probe_prompts(table, setting, n_prompts, seed)
    if batch is None:
        notes.append(f"probes: {why}")

    def trace(model):
        if batch is None:
            return None
        with torch.no_grad():
            return {"tokens": batch.tokens, **model.probe(batch.tokens)}

    build = _optional("icl_bench.ln_closed_form", "build_construction")
    construction = None
    if build is None:
        notes.append("construction: icl_bench.ln_closed_form.build_construction is not available")
    else:
        model = build(float(setting["R"]))
        construction = model.weight_matrices()
        models[f"construction (R={setting['R']:g})"] = {"weights": construction, "trace": trace(model)}
    at = select(table[table["status"] == "ok"], setting, ("N", "noise", "R"))
    weighted = at[np.isfinite(at["weight_sparsity"].astype(float))]
    for _, (solver, params, series) in weighted.sort_values("series_rank")[["solver", "solver_params", "series"]] \
            .drop_duplicates().iterrows():
        try:
            model, source = _model_of(solver, params, setting["R"], setting["N"])
            if model is None:
                notes.append(f"{series}: weights not drawn: {source}")
                continue
            w = model.weight_matrices()
            if not has_layernorm(w):
                notes.append(f"{series}: no LayerNorm weights, not drawn beside the LayerNorm construction")
                continue
            if construction is not None and _same(w, construction):
                notes.append(f"{series}: weights identical to the construction (shown once)")
                continue
            models[f"{series} ({source})"] = {"weights": w, "trace": trace(model)}
        except Exception as exc:  # one solver's failure is a note, not the end of the report
            notes.append(f"{series}: could not be loaded for the model plots ({type(exc).__name__}: {exc})")
    load = _optional("icl_bench.checkpoint", "load_checkpoint") if checkpoints else None
    for path in checkpoints:
        if load is None:
            notes.append(f"--checkpoint {path}: icl_bench.checkpoint.load_checkpoint is not available")
            continue
        try:
            obj = load(path)
            model = next(o for o in (obj if isinstance(obj, (tuple, list)) else (obj,)) if hasattr(o, "weight_matrices"))
            model = model.double().eval()
            models[f"checkpoint {path}"] = {"weights": model.weight_matrices(), "trace": trace(model)}
        except Exception as exc:
            notes.append(f"--checkpoint {path}: not drawn ({type(exc).__name__}: {exc})")
    return models, notes


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
        sub.suptitle(label, fontsize=9, x=0.02, ha="left", fontweight="bold")
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
                vmax = float(np.abs(a).max()) or 1.0
                ax.imshow(a, cmap="RdBu_r", vmin=-vmax, vmax=vmax, interpolation="nearest")
                if a.size <= 16:  # annotate small maps; text colour follows the cell's darkness
                    for (r, c), v in np.ndenumerate(a):
                        ax.text(c, r, _short(v), ha="center", va="center", fontsize=5.5,
                                color="white" if abs(v) > 0.6 * vmax else "black")
                ax.set_xticks(range(a.shape[1]))
                ax.set_yticks(range(a.shape[0]))
                ax.grid(False)
                ax.set_title(f"{name}  (|max| {vmax:.2g})", fontsize=7)
                ax.set_xlabel("input slot", fontsize=6)
                ax.set_ylabel("output slot" if j == 0 else "", fontsize=6)
                ax.tick_params(labelsize=6)
        sub.subplots_adjust(left=0.5 / width, right=1 - 0.1 / width, bottom=0.1, top=0.88, wspace=0.25, hspace=0.45)
    header.suptitle("Weights (QK = W_Qᵀ W_K, OV = W_O W_V; each panel on its own colour scale centred at 0; "
                    "unaligned)", fontsize=9, va="center", y=0.5)
    return fig


def probe_scatter(models: dict[str, dict]) -> Figure:
    """Per model (rows): scatter of the residual slot that best tracks each closed-form statistic
    against that statistic (x - x_bar and y - y_bar after layer 1 at the context tokens; b_hat
    (u - x_bar) in the query's layer-2 LayerNorm output), with the fitted line and R^2.

    Raises: PlotSkipped when icl_bench.probes is absent or no model has a 2-layer trace.
    """
    probes = _optional("icl_bench.probes", "mechanism_probes")
    if probes is None:
        raise PlotSkipped("probe scatter: icl_bench.probes.mechanism_probes is not available")
    from icl_bench.ols import ols_fit

    fits = {}
    for label, m in models.items():
        t = m.get("trace")
        if t and "layer0.resid" in t and "layer1.ln" in t:
            fits[label] = (t, probes(t, t["tokens"]))
    if not fits:
        raise PlotSkipped("probe scatter: no model with a LayerNorm trace (layer0.resid, layer1.ln)")
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
            ax.set_title(f"{label}\n{f.source}: slot {f.slot}, R² = {f.r2:.4f}", fontsize=7)
            ax.set_xlabel(f"closed form {f.target} (y or x units)", fontsize=7)
            ax.set_ylabel(f"stream slot {f.slot} (model units)", fontsize=7)
            ax.legend(fontsize=6)
    fig.suptitle("LayerNorm probes: stream slot vs the closed form's statistic", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    return fig

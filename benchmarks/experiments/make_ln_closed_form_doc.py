"""Regenerate the measured parts of docs/ln-closed-form.md (weights, tables, probes).

    python -m benchmarks.experiments.make_ln_closed_form_doc          # rewrite the page in place
    python -m benchmarks.experiments.make_ln_closed_form_doc --check  # exit 1 if the page is stale

The page's prose is hand-written; every number lives between `<!-- BEGIN name -->` and
`<!-- END name -->` markers and is produced here by the suite's own code (sample_prompts,
get_solver("ln-closed-form"), mechanism_probes), seeded, so a rerun gives the same page.
Takes about half a minute on one CPU core.
"""
from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path

import torch

from icl_bench import Dist, PromptSpec, get_solver, sample_prompts
from icl_bench.solvers.ln_closed_form import build_construction, predicted_error
from icl_bench.analysis.probes import mechanism_probes

PAGE = Path(__file__).resolve().parents[2] / "docs" / "ln-closed-form.md"
SEED, B, NOISE = 0, 2000, 0.1
RS = [1.0, 10.0, 100.0, 1e3, 1e4, 1e5, 1e6]
NS = [10, 30, 100, 300, 1000]
COLS = [(v, dt) for v in ("masked", "query-in-context") for dt in ("float64", "float32")]


def mse(R: float, N: int, variant: str, dtype: str, spec_kw=None, **solver) -> float:
    batch = sample_prompts(PromptSpec(N=N, noise=NOISE, R=R, **(spec_kw or {})), B, seed=SEED, dtype=dtype)
    pred = get_solver("ln-closed-form", variant=variant, **solver).predict(batch).double()
    return float(((pred - batch.ols_prediction) ** 2).mean())


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def fmt_R(R: float) -> str:
    return f"{R:g}"


def weights_block() -> str:
    R = 100.0
    out = [f"R = {R:g} (entries 1/R = {1 / R:g} and R/sqrt2 = {R / 2 ** 0.5:.4f} scale with R; the rest do not).",
           "Each matrix acts as h -> W h on the slots (s0, s1, s2, s3); unlisted heads and LN biases are 0.", "```"]
    torch.set_printoptions(precision=4, sci_mode=False, linewidth=100)
    for name, w in build_construction(R).weight_matrices().items():
        if name.endswith("ln.bias"):
            continue
        if w.ndim == 3:  # (heads, d, d)
            for k in range(w.shape[0]):
                if w[k].abs().sum() > 0:
                    out.append(f"{name}[head {k}] =\n{w[k].numpy()}")
        else:
            out.append(f"{name} =\n{w.numpy()}")
    return "\n".join(out + ["```"])


def r_block() -> str:
    rows = [[fmt_R(R)] + [f"{mse(R, 100, v, dt):.1e}" for v, dt in COLS]
            + [f"{mse(R, 100, 'masked', 'float32', standardize=True):.1e}"] for R in RS]
    head = f"N = 100, B = {B} prompts, x, a, b ~ N(0, 1), noise = {NOISE}, seed = {SEED}; MSE vs OLS."
    cols = ["R"] + [f"{v} {dt}" for v, dt in COLS] + ["masked float32 standardize"]
    return head + "\n\n" + table(cols, rows) + "\n\n" + rounding_table()


def rounding_table() -> str:
    """Where float32 loses accuracy: the same tokens through the float32 and float64 modules."""
    rows, eps = [], torch.finfo(torch.float32).eps
    for R in RS[2:]:
        tokens = sample_prompts(PromptSpec(N=100, noise=NOISE, R=R), B, seed=SEED, dtype="float32").tokens
        t32, t64 = build_construction(R, dtype=torch.float32).probe(tokens), build_construction(R).probe(tokens.double())
        rms = lambda k, s: float((t32[k][:, -1, s].double() - t64[k][:, -1, s]).pow(2).mean().sqrt())  # noqa: E731
        rows.append([fmt_R(R), f"{R * eps:.1e}", f"{rms('layer0.attn', 2):.1e}", f"{rms('layer0.ln', 0):.1e}",
                     f"{rms('layer1.ln', 3):.1e}"])
    return ("float32 minus float64 module on the same float32 tokens (masked, N = 100), rms over the "
            "queries:\n\n" + table(["R", "R * eps32", "layer 1 attn, slot 2 (R + m)",
                                     "layer 1 LN, slot 0 (-x_bar)", "layer 2 LN, slot 3 (b_hat x~)"], rows))


def n_block() -> str:
    parts = []
    for R in (1e3, 1e4):
        rows = [[str(N)] + [f"{mse(R, N, v, dt):.1e}" for v, dt in COLS] for N in NS]
        parts.append(f"R = {fmt_R(R)}, B = {B}, noise = {NOISE}, seed = {SEED}; MSE vs OLS.\n\n"
                     + table(["N"] + [f"{v} {dt}" for v, dt in COLS], rows))
    return "\n\n".join(parts)


def scale_block() -> str:
    kw = dict(x=Dist("normal", 300.0, 100.0), slope=Dist("normal", 2.0, 0.0), intercept=Dist("normal", 5.0, 0.0))
    rows = []
    for R in (1e3, 1e4, 1e5, 1e6):
        row = [fmt_R(R)]
        for st in (True, False):
            for dt in ("float64", "float32"):
                batch = sample_prompts(PromptSpec(N=50, noise=NOISE, R=R, **kw), B, seed=SEED, dtype=dt)
                pred = get_solver("ln-closed-form", standardize=st).predict(batch).double()
                row.append(f"{float((pred - batch.ols_prediction).norm() / batch.ols_prediction.norm()):.1e}")
        rows.append(row)
    head = (f"x, u ~ N(300, 100^2), y = 2x + 5 + N(0, {NOISE}^2), N = 50, B = {B}, masked; "
            "relative RMSE ||pred - OLS|| / ||OLS||.")
    return head + "\n\n" + table(["R", "standardize f64", "standardize f32", "raw f64", "raw f32"], rows)


def eps_block() -> str:
    """LayerNorm eps at small data scale: measured error vs OLS and the predicted_error formula."""
    rows = []
    for s in (1.0, 1e-1, 1e-2, 1e-3):
        kw = dict(x=Dist("normal", 0.0, s), slope=Dist("normal", 0.0, 1.0), intercept=Dist("normal", 0.0, s))
        batch = sample_prompts(PromptSpec(N=20, noise=NOISE * s, R=100.0, **kw), B, seed=SEED, dtype="float64")
        row = [f"{s:g}"]
        for A in (1.0, 2.0**20):
            pred = get_solver("ln-closed-form", ln_input_scale=A).predict(batch).double()
            err = pred - batch.ols_prediction
            formula = predicted_error(batch.x, batch.y, batch.x_query, 100.0, ln_input_scale=A)
            row += [f"{float(err.norm() / batch.ols_prediction.norm()):.2e}",
                    f"{float(formula.norm() / batch.ols_prediction.norm()):.2e}"]
        rows.append(row)
    head = (f"x, u ~ N(0, s^2), y = a s + b x + N(0, ({NOISE} s)^2), a, b ~ N(0, 1), N = 20, R = 100, B = {B}, "
            "float64, masked; relative RMSE ||pred - OLS|| / ||OLS||, measured and by `predicted_error`.")
    return head + "\n\n" + table(["data scale s", "A = 1 measured", "A = 1 formula",
                                   "A = 2^20 measured", "A = 2^20 formula"], rows)


def probe_block() -> str:
    rows = []
    for v in ("masked", "query-in-context"):
        batch = sample_prompts(PromptSpec(N=50, noise=NOISE, R=1000.0), B, seed=SEED, dtype="float64")
        trace = get_solver("ln-closed-form", variant=v).probe(batch)
        for name, f in mechanism_probes(trace, trace["tokens"]).items():
            rows.append([v, name, f.source, str(f.slot), f"{f.r2:.9f}", f"{f.slope:.6f}", f"{f.r2_stream:.9f}"])
    head = f"R = 1000, N = 50, B = {B}, float64, noise = {NOISE}, seed = {SEED}."
    return head + "\n\n" + table(["variant", "probe", "activations", "slot", "R^2 (slot)", "slope", "R^2 (stream)"], rows)


BLOCKS = {"weights": weights_block, "mse-vs-R": r_block, "mse-vs-N": n_block,
          "standardize": scale_block, "eps": eps_block, "probes": probe_block}


def render(text: str) -> str:
    torch.set_num_threads(1)
    for name, make in BLOCKS.items():
        pat = re.compile(rf"(<!-- BEGIN {name} -->\n).*?(<!-- END {name} -->)", re.S)
        if not pat.search(text):
            sys.exit(f"{PAGE}: missing markers for block {name!r}")
        text = pat.sub(lambda m: m.group(1) + make() + "\n" + m.group(2), text)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="do not write; exit 1 if the page would change")
    args = ap.parse_args()
    old = PAGE.read_text()
    new = render(old)
    if args.check:
        if new != old:  # the lines that differ: a last float32 digit from another CPU reads differently from a stale page
            sys.stderr.writelines(line for line in difflib.unified_diff(old.splitlines(True), new.splitlines(True), "page",
                                                                        "rerun", n=0) if not line.startswith("@@"))
        sys.exit(0 if new == old else f"{PAGE} is stale: rerun python -m benchmarks.experiments.make_ln_closed_form_doc")
    PAGE.write_text(new)
    print(f"wrote {PAGE}")


if __name__ == "__main__":
    main()

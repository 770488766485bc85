"""Solvers backed by trained checkpoints: trained-l1, trained-nol1 and trained-lsa.

    trained-l1    LSA + LayerNorm, the mechanism recipe: affine augmentation of x and proximal l1
                  (docs/training.md, docs/mechanism.md); it learned the layer-2 LayerNorm division
    trained-l1-noaug  the earlier trained-l1, the reference paper's recipe (subgradient l1 1e-4,
                  no augmentation), kept for comparison
    trained-nol1  the same as trained-l1-noaug with lambda = 0 (does l1 matter?)
    trained-lsa   no LayerNorm, lambda = 0 (expected to learn something like gd-lsa)

Each solver looks in a models directory (default: the checkpoints shipped inside the package,
icl_bench/models/, made by `icl-bench train --config train`, see docs/training.md and the model
card icl_bench/models/README.md) for the checkpoint whose
JSON says `"solver": <its name>` and whose R equals the cell's R (and, for a flatten readout, whose N
equals the cell's N). No fitting checkpoint -> `SkipCell` naming what exists, or an error if the
folder holds a damaged checkpoint file (it may be the one that fits). The model runs
in the cell's dtype and device (a float32 checkpoint is cast for float64 cells).
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from icl_bench import resources
from icl_bench.errors import ConfigError
from icl_bench.solvers.checkpoint import load_checkpoint
from icl_bench.solvers.multivariate import check_regressors
from icl_bench.prompts.generator import PromptBatch
from icl_bench.solvers.registry import register_solver
from icl_bench.solvers.base import Param, SkipCell, Solver, nan_if_ill_posed, r_lost
from icl_bench.solvers.transformer import Transformer



_FOUND: dict[tuple, tuple[tuple, tuple]] = {}  # (folder, solver) -> (listing signature, (found, damaged))

# The architecture each solver's name and description promise: whether its model has LayerNorm.
# A training run for the solver defaults to it and refuses the other (training/config.py), and the
# solver refuses a checkpoint that contradicts it (TrainedSolver.checkpoint_for).
SOLVER_LAYERNORM = {"trained-l1": True, "trained-nol1": True, "trained-lsa": False, "trained-l1-noaug": True}


def layernorm_name(layernorm: bool) -> str:
    """How a model's architecture is named in messages: "LSA + LayerNorm" or "LSA without LayerNorm"."""
    return "LSA + LayerNorm" if layernorm else "LSA without LayerNorm"


def find_checkpoints(models_dir: str | Path, solver: str) -> list[tuple[Path, dict]]:
    """(json path, meta) of every checkpoint in `models_dir` made for `solver`, sorted by name.

    Files that cannot be this folder's checkpoints are collected by `damaged_checkpoints`. The
    result is kept while the folder (its device and inode, through links) and its files' names,
    sizes and modification times stay (a stat, an os.scandir and a stat per file instead of reading
    and parsing every file on each predict call; pathlib's glob took ~0.3 ms of a trained solver's
    ~0.7 ms call on 16 small prompts)."""
    return list(_scan(models_dir, solver)[0])


def damaged_checkpoints(models_dir: str | Path, solver: str) -> list[str]:
    """'<file>: <what is wrong>' for each file in `models_dir` that looks like half of a checkpoint
    and cannot be read as one: a .json beside a .safetensors that is not a JSON object
    (truncated, a list, ...), a .json of `solver` whose R is not a positive number, a .safetensors
    without its .json. Any of them
    may be the checkpoint a cell needed, so the cell is an error row, not a silent skip."""
    return list(_scan(models_dir, solver)[1])


def _scan(models_dir: str | Path, solver: str) -> tuple[list, list]:
    folder = os.fspath(models_dir) or "."  # Path("") is the working folder
    try:  # the folder's identity first (a link moved to another folder of same-named, same-dated
        st = os.stat(folder)  # copies changes it; moved during the listing, the next call reads again)
        with os.scandir(folder) as found:
            entries = sorted((e for e in found if e.name.endswith((".json", ".safetensors"))), key=lambda e: e.name)
    except OSError:  # no such folder, or not a folder: no checkpoints
        st, entries = None, []
    try:
        signature = ((st.st_dev, st.st_ino) if st else None,
                     tuple((e.name, s.st_size, s.st_mtime_ns) for e in entries for s in (e.stat(),)))
    except OSError:  # a file vanished between the listing and its stat: read afresh, keep nothing
        signature = None
    # the paths are returned as the caller spelled the folder; abspath, not realpath (an lstat per
    # path component, ~50 us a call after a large kernel): two spellings through links get two
    # entries, and a link moved to another folder changes the signature's (st_dev, st_ino)
    key = (os.path.abspath(folder), folder, solver)
    cached = _FOUND.get(key)
    if signature is not None and cached is not None and cached[0] == signature:
        return cached[1]
    names = {e.name for e in entries}
    out, damaged = [], []
    for e in entries:
        path = Path(folder, e.name)  # (only now: ~10 us a Path)
        if e.name.endswith(".safetensors"):
            if e.name.removesuffix(".safetensors") + ".json" not in names:
                damaged.append(f"{path}: no {path.with_suffix('.json').name} beside it")
            continue
        try:
            meta = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError) as exc:  # truncated, binary, unreadable
            meta = f"not readable as JSON ({type(exc).__name__})"
        if not isinstance(meta, dict):
            if e.name.removesuffix(".json") + ".safetensors" not in names:
                continue  # some other JSON file: not a checkpoint's metadata
            damaged.append(f"{path}: {meta if isinstance(meta, str) else 'a JSON ' + type(meta).__name__ + ', not an object'}")
        elif meta.get("solver") == solver:
            r, cfg = meta.get("R"), meta.get("model_config", {})
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r < math.inf:
                damaged.append(f"{path}: R = {r!r} is not a positive number")
            elif not isinstance(cfg, dict):  # (null, a list: every cell was an AttributeError row; a review)
                damaged.append(f"{path}: model_config = {json.dumps(cfg)[:40]} is not an object of the model's settings")
            else:
                out.append((path, meta))
    if signature is not None:
        _FOUND[key] = (signature, (out, damaged))
    return out, damaged


def checkpoint_fits(meta: dict, R: float, N: int) -> bool:
    """True when a checkpoint's metadata serves a cell at (R, N): same R, and the same N for a
    flatten readout (a query readout serves every N)."""
    r = meta.get("R")
    if not isinstance(r, (int, float)) or not math.isclose(float(r), R, rel_tol=1e-9):
        return False
    cfg = meta.get("model_config", {})
    return cfg.get("readout") != "flatten" or cfg.get("N") == N


class TrainedSolver(Solver):
    """Base for the checkpoint-backed solvers (subclasses only set the registered name)."""

    params = {
        "models_dir": Param("", "directory of checkpoints, relative to the current folder (empty: the shipped checkpoints, icl_bench/models)",
                            same=lambda p: os.path.realpath(p or resources.models_dir())),  # "/x" = "/x/"
    }

    def __init__(self, **values):
        super().__init__(**values)
        if self.values["models_dir"] and not self.models_dir.is_dir():  # a typo must not read as "no model"
            where = "" if os.path.isabs(self.values["models_dir"]) else f" (relative to the current folder, {os.getcwd()})"
            raise ConfigError(f"solvers.{self.name}.models_dir: no such folder {self.values['models_dir']!r}{where}")
        self._cache: dict[tuple, Transformer] = {}  # (json path, dtype, device) -> model
        self._last: Transformer | None = None

    @property
    def models_dir(self) -> Path:
        return Path(self.values["models_dir"]) if self.values["models_dir"] else resources.models_dir()

    def checkpoint_for(self, R: float, N: int) -> Path:
        """The JSON path of the checkpoint that fits a cell; SkipCell with the reason if none.

        Raises:
            ValueError: none fits and models_dir holds damaged checkpoint files (damaged_checkpoints):
                one of them may be the one the cell needed.
            ValueError: more than one checkpoint of this solver in models_dir fits (the cell is an
                error row naming them: which one answered would otherwise be a silent choice), or
                the one that fits contradicts the solver's architecture (SOLVER_LAYERNORM).
        """
        found = find_checkpoints(self.models_dir, self.name)
        fits = [(p, meta) for p, meta in found if checkpoint_fits(meta, R, N)]
        if len(fits) > 1:
            raise ValueError(f"{self.name}: {len(fits)} checkpoints in {self.models_dir} fit R={R:g}, N={N} "
                             f"({', '.join(p.name for p, _ in fits)}); keep one per R (and N, for a flatten readout) in "
                             "models_dir, or give each model a folder of its own")
        if fits:
            path, meta = fits[0]
            cfg = meta.get("model_config")
            has_ln = cfg.get("layernorm", True) if isinstance(cfg, dict) else True  # TransformerConfig's default
            if SOLVER_LAYERNORM.get(self.name, has_ln) != has_ln:  # (a plugin subclass promises nothing here)
                others = ", ".join(n for n, ln in SOLVER_LAYERNORM.items() if ln == has_ln)
                raise ValueError(f"{self.name}: checkpoint {path} is {layernorm_name(has_ln)}, but {self.name} is "
                                 f"{layernorm_name(not has_ln)}; retrain it with layernorm = {str(not has_ln).lower()}, "
                                 f"or with solver = one of {others}")
            return path
        damaged = damaged_checkpoints(self.models_dir, self.name)
        if damaged:  # one of them may be this cell's checkpoint: not a skip
            raise ValueError(f"{self.name}: no readable checkpoint for R={R:g}, N={N} in {self.models_dir}, and "
                             f"{len(damaged)} damaged checkpoint file(s) there: {'; '.join(damaged[:3])}"
                             f"{' ...' if len(damaged) > 3 else ''}; repair or remove them")
        have = ", ".join(sorted({f"R={m.get('R')}" + (f",N={m['model_config'].get('N')}" if m.get("model_config", {}).get("readout") == "flatten" else "")
                                 for _, m in found})) or "none"
        flatten = any(m.get("model_config", {}).get("readout") == "flatten" for _, m in found)
        at = f"R={R:g}" + (f", N={N}" if flatten else "")  # a query readout serves every N: one reason per R
        raise SkipCell(f"{self.name}: no checkpoint for {at} in {self.models_dir} (available: {have}); "
                       "train one with `icl-bench train --out DIR` and set models_dir = DIR (docs/training.md)")

    def input_files(self) -> list[Path]:
        """Every checkpoint file (.json and .safetensors) in models_dir made for this solver: a
        replaced, added or removed checkpoint changes the cell key (see Solver.input_files)."""
        files = []
        for path, _ in find_checkpoints(self.models_dir, self.name):
            files += [path, path.with_suffix(".safetensors")]
        return [p for p in files if p.is_file()]

    def check_batch(self, batch: PromptBatch) -> None:
        check_regressors(self, batch)
        self.checkpoint_for(batch.R, batch.N)

    def model_for(self, batch: PromptBatch) -> Transformer:
        """The checkpoint's model in the batch's dtype and device (cached).
        Raises SkipCell: d > 1 regressors (the checkpoints read one x; a direct predict() call
        raised torch's shape error) or no checkpoint for the batch's R and N."""
        check_regressors(self, batch)
        path = self.checkpoint_for(batch.R, batch.N)
        key = (str(path), batch.dtype, str(batch.device))
        if key not in self._cache:
            model, _ = load_checkpoint(path)
            self._cache[key] = model.to(device=batch.device, dtype=batch.dtype).eval()
        self._last = self._cache[key]
        return self._last

    @torch.no_grad()
    def predict(self, batch: PromptBatch) -> torch.Tensor:
        """(B,) predictions in batch.dtype; NaN for ill-posed prompts (all x equal, NaN / inf) and
        for prompts so large that R vanishes in rounding beside them (see icl_bench.solvers.base)."""
        pred, extremes = self.model_for(batch).forward_extremes(batch.tokens)  # (B,), (B, 4) or None
        if batch.d > 1:
            pred = pred.masked_fill(r_lost(batch.tokens, batch.R), float("nan"))
        return nan_if_ill_posed(pred, batch, r_lost=batch.d == 1, extremes=extremes)

    def weights(self) -> dict[str, torch.Tensor] | None:
        """weight_matrices() of the last model used by predict/probe (None before any)."""
        return None if self._last is None else self._last.weight_matrices()

    def probe(self, batch: PromptBatch) -> dict[str, torch.Tensor]:
        """Transformer.probe of the fitting checkpoint: embed, layer{i}.attn / .ln / .resid."""
        return self.model_for(batch).probe(batch.tokens)


@register_solver("trained-l1")
class TrainedL1(TrainedSolver):
    """Trained LSA + LayerNorm transformer: x augmentation + proximal l1, the mechanism recipe (docs/mechanism.md)."""


@register_solver("trained-nol1")
class TrainedNoL1(TrainedSolver):
    """Trained LSA + LayerNorm transformer, trained-l1-noaug's recipe without the l1 penalty (control)."""


@register_solver("trained-lsa")
class TrainedLSA(TrainedSolver):
    """Trained LSA transformer without LayerNorm, no l1 penalty (control; cf. gd-lsa)."""


@register_solver("trained-l1-noaug")
class TrainedL1NoAug(TrainedSolver):
    """Trained LSA + LayerNorm transformer, the earlier trained-l1: the paper's recipe (subgradient l1 1e-4, no augmentation)."""

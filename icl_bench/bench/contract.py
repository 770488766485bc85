"""What the runner checks of a solver in every cell (docs/design.md §3.2, "Solver"; the plugin
author's view: docs/plugins.md).

A solver's own failures become its row's status and message, never another cell's numbers: its
batch must come back untouched, its answers are checked for the ill-posed prompts, its
`input_files()` must name the files its cell key hashes, its `weights()` must be named tensors,
and torch's process-wide defaults it changes are put back after the cell (one plugin's
`torch.set_default_dtype(torch.float64)` made a later plugin's cells fail: a review).
"""
from __future__ import annotations

import hashlib
import math
import os
import traceback
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path

import torch

from icl_bench.errors import cell_message
from icl_bench.solvers.base import SkipCell
from icl_bench.solvers.sparsity import check_weights, weight_l1, weight_sparsity

NO_ANSWER = "no finite prediction"  # the start of the message of a cell whose solver never answered
NO_PROMPT = "no well-posed prompt"  # the start of the message of a cell skipped for having nothing to answer
ILL_ANSWERED, WEIGHTS_BROKE = "finite on ill-posed prompts", "weights(): "  # message parts: a broken contract
DEFAULTS_CHANGED = "changed torch's default"  # message part: a solver changed a process-wide torch default


def no_answer_message(pred: torch.Tensor, batch) -> str:
    """"" or what an "ok" cell's answers break, "; "-joined: NaN / inf on every well-posed prompt
    (there being at least one; its metrics are NaN and would otherwise read as "ok" with no
    explanation), and finite answers on ill-posed prompts, where every solver answers NaN
    (docs/accuracy.md; a plugin that made up a number there passed silently: a review)."""
    well_posed = torch.isfinite(batch.ols_prediction).cpu()  # (B,)
    finite = torch.isfinite(pred.detach()).cpu()
    parts = []
    if well_posed.any() and not (finite & well_posed).any():
        parts.append(f"{NO_ANSWER}: NaN/inf on all {int(well_posed.sum())} well-posed prompts")
    made_up = int((finite & ~well_posed).sum())
    if made_up:
        parts.append(f"{ILL_ANSWERED}: {made_up} of {int((~well_posed).sum())} answered where every solver answers "
                     "NaN (docs/accuracy.md)")
    return "; ".join(parts)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN equal to NaN (torch.equal first: one call where no NaN is involved, the
    common case; five tensor operations per field had cost 0.2 ms of a trivial cell)."""
    return a.shape == b.shape and (torch.equal(a, b) or bool(((a == b) | (a.isnan() & b.isnan())).all()))


def check_untouched(batch, pristine) -> None:
    """Solvers must never modify their batch (docs/design.md, "Solver"): name the fields that changed."""
    changed = [k for k, v in batch.tensors().items() if not _same(v, getattr(pristine, k))]
    if changed:
        raise RuntimeError(f"predict modified the prompt batch in place ({', '.join(changed)})")


def check_well_posed(cell, batch) -> None:
    """Raise SkipCell when no prompt of the batch has a least-squares answer (its OLS reference is
    NaN everywhere: N < d + 1 examples for d slopes and an intercept, or data that are constant or
    not finite): such a cell has nothing to measure, and an "ok" row of NaN would hide why.
    `cell` needs N and d (a bench.cells.Cell)."""
    if batch.B == 0 or bool(torch.isfinite(batch.ols_prediction).any()):
        return
    why = f"N={cell.N} examples for d={cell.d} slopes and an intercept, at least {cell.d + 1} needed" \
        if cell.N < cell.d + 1 else "constant x or non-finite values in every prompt"
    raise SkipCell(f"{NO_PROMPT} (every OLS reference is NaN): {why}")


class InputFilesError(RuntimeError):
    """A solver's input_files() raised or gave something other than paths (its message says which)."""


def where(exc: BaseException) -> str:
    """" (file.py:line)" of the innermost frame `exc` passed through ("" without a traceback)."""
    frames = traceback.extract_tb(exc.__traceback__)
    return f" ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""


def input_files(solver) -> list[Path]:
    """solver.input_files() as the cell key reads it: the paths, sorted.
    Raises InputFilesError when input_files() raises (its exception and where it was raised are
    in the text), gives anything but an iterable of str / os.PathLike (a mapping too: its keys
    would be taken for the paths) or names a folder (whose files would go unhashed). The runner
    makes either the cell's error: an input_files() that raised used to leave the key without the
    files, so --resume and --cache served numbers made from files since changed (a review)."""
    try:
        files = solver.input_files()
        if isinstance(files, (str, bytes, os.PathLike, Mapping)) or not hasattr(files, "__iter__"):
            raise InputFilesError(f"input_files() returned {type(files).__name__}; expected a list of paths "
                                  "(str or os.PathLike)")
        files = list(files)
        odd = next((f for f in files if not isinstance(f, (str, os.PathLike))), None)
        if odd is not None:
            raise InputFilesError(f"input_files() gave a {type(odd).__name__} ({odd!r:.60}); expected paths "
                                  "(str or os.PathLike)")
        paths = sorted(Path(f) for f in files)
    except (KeyboardInterrupt, InputFilesError):
        raise
    except BaseException as exc:  # GeneratorExit from a plugin too; a path-like whose __fspath__ fails
        text = cell_message(exc)
        raise InputFilesError(f"input_files() raised {type(exc).__name__}{': ' + text if text else ''}"
                              f"{where(exc)}") from exc
    folder = next((p for p in paths if p.is_dir()), None)
    if folder is not None:
        raise InputFilesError(f"input_files() gave a folder ({str(folder)!r:.80}); name the files in it that the "
                              "solver reads")
    return paths


def files_digest(paths: list[Path]) -> str:
    """sha256 over the names and bytes of `paths` (input_files' answer, in its order); "" for none.
    A file that cannot be read enters as the reason (a missing checkpoint is part of the key)."""
    if not paths:
        return ""
    h = hashlib.sha256()
    for path in paths:
        h.update(path.name.encode() + b"\0")
        try:
            h.update(path.read_bytes())
        except OSError as exc:
            h.update(f"unreadable: {exc}".encode())
    return h.hexdigest()


def weight_columns(solver) -> tuple[float, float, str]:
    """(weight_sparsity, weight_l1, note) of a solver's weights(): the note ("" or starting with
    WEIGHTS_BROKE) says why the two are NaN when weights() broke its contract (raised, or gave no
    dict of real tensors: solvers/sparsity.py check_weights), gave tensors the two cannot be
    computed on (sparse, meta) or holds NaN / inf entries, where no threshold, and so no sparsity,
    is defined. Raises only what is no Exception (SystemExit, KeyboardInterrupt: the runner's)."""
    try:
        w = check_weights(solver.weights())
        bad = sum(int((~torch.isfinite(t.detach())).sum()) for t in (w or {}).values() if t.is_floating_point())
        if bad:
            total = sum(t.numel() for t in w.values())
            return math.nan, math.nan, f"{WEIGHTS_BROKE}{bad} of {total} entries are NaN / inf (no sparsity is defined)"
        return weight_sparsity(w), weight_l1(w), ""
    except Exception as exc:  # noqa: BLE001 - named in the row's message
        return math.nan, math.nan, cell_message(exc, prefix=f"{WEIGHTS_BROKE}{type(exc).__name__}: ")


_DEVICE_CONTEXT = getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None)  # (thread-local) where set_default_device keeps it


def _device_state() -> tuple[object, torch.device | str]:
    """(the device context torch.set_default_device installed, or None; the device a new tensor
    gets, or "<device> (unusable here)" when torch cannot make one there: "cuda" without CUDA).
    A new empty tensor's device rather than torch.get_default_device(): 0.7 against 2.5 us, and
    this runs six times a cell."""
    installed = getattr(_DEVICE_CONTEXT, "device_context", None)
    try:
        return installed, torch.empty(0).device
    except Exception:  # noqa: BLE001 - a default device this machine cannot make tensors on
        return installed, f"{getattr(installed, 'device', 'a device')} (unusable here)"


@contextmanager
def torch_defaults_kept(notes: list[str]):
    """Put torch's default dtype and default device back as they were when the block began, whatever
    it did (an exception included), and append to `notes` one line per default it changed. Wrap
    each stretch of a solver's own code in it, so that the runner's code between them (prompts,
    metrics) runs with the defaults too. A device set explicitly to the one in use
    (`torch.set_default_device("cpu")`) is undone too: it routes every later torch call through
    a device context, which slowed other cells' timing (a review). The defaults are the process's:
    cells run side by side in threads of one process (a Dask worker with --nthreads > 1, which
    docs/scale-out.md advises against) see each other's changes, and the note may name the wrong
    cell."""
    dtype, (context, device) = torch.get_default_dtype(), _device_state()
    try:
        yield notes
    finally:
        if torch.get_default_dtype() != dtype:
            notes.append(f"the solver {DEFAULTS_CHANGED} dtype to {torch.get_default_dtype()} (put back to {dtype} "
                         "after its call)")
            torch.set_default_dtype(dtype)
        context_now, now = _device_state()
        if context_now is not context or now != device:
            torch.set_default_device(getattr(context, "device", None))
            back = _device_state()[1] == device
            notes.append(f"the solver {DEFAULTS_CHANGED} device to {now}" + (f" (put back to {device} after its call)"
                         if back else f" and it could not be put back to {device}: later cells may fail"))

"""Checkpoints of trained transformers: weights in safetensors, everything else in JSON.

A checkpoint is a pair of files with one stem:

    <stem>.safetensors   the state_dict of a `Transformer` (tensors only; safetensors format)
    <stem>.json          {"format": "icl-bench-checkpoint", "version": 1,
                          "model_config": TransformerConfig as a dict, "R": ..., "N": [...],
                          "seed": ..., "train_config": {...}, "metrics": {...},
                          "git_commit": ..., "created": ISO time, "weights_sha256": ...,
                          ...caller's fields}

Loading never unpickles anything (safetensors holds raw tensors and a JSON header; the
metadata is JSON), so a checkpoint cannot run code. Every problem with the pair (missing
file, truncated or corrupt data, a pickle renamed to .safetensors, tensors whose names or
shapes do not fit the config) is a one-line `ConfigError`. safetensors has no checksum of its
own: `weights_sha256` (`weights_digest`) ties the weights to their JSON, so a damaged tensor byte or
a .safetensors copied beside another run's .json is refused when the field is there (checkpoints
saved before it was added are loaded unchecked).

Saving replaces a pair without ever mixing two: both files are written under temporary names
beside it and fsynced, then the old .json is removed, the .safetensors renamed into place and the
.json last. The .json is the pair's completeness mark: a failure while writing (a full disk)
leaves the old pair as it was and no temporary file; a crash between the renames leaves weights
without their .json, which every reader refuses as "metadata file ... is missing", never new
weights beside old metadata. The renames run under an exclusive flock of the folder and loading
under a shared one (`icl_bench.files.folder_lock`), so two processes saving one stem at once leave
one of their pairs, never one's weights beside the other's metadata, and a reader never loads such
a mix either. `checkpoint_path` turns what a user
typed (a path, or a shipped model's name such as trained-l1-R100) into the pair to load.
"""
from __future__ import annotations

import datetime as _dt
import errno
import hashlib
import json
import os
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from icl_bench import provenance, resources
from icl_bench.errors import ConfigError
from icl_bench.files import (blocking_file, cannot_create, discard, dumps, folder_lock, fsync_dir, fsync_file, name_too_long,
                             temp_path, write_temp)
from icl_bench.solvers.transformer import Transformer, TransformerConfig

FORMAT = "icl-bench-checkpoint"
VERSION = 1


def stem_of(path: str | Path) -> Path:
    """`a/b.safetensors`, `a/b.json` or `a/b` -> Path("a/b")."""
    p = Path(path)
    return p.with_suffix("") if p.suffix in (".safetensors", ".json") else p


def beside(stem: str | Path, k: int = 0) -> Path:
    """`<stem>-pid<PID>` (k > 0: `<stem>-pid<PID>-<k>`, for when that is taken too, e.g. by an earlier
    process of the same PID): where this process saves a checkpoint whose own name another process
    took while it trained (train_and_save without --force)."""
    stem = stem_of(stem)
    return stem.with_name(f"{stem.name}-pid{os.getpid()}" + (f"-{k}" if k else ""))


def weights_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 (hex) over each tensor's name, dtype, shape and bytes, in name order: the weights a
    checkpoint's JSON records (`weights_sha256`), whatever the file layout that holds them."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")  # (-1: a 0-dim tensor too)
    return h.hexdigest()


def save_checkpoint(model: Transformer, path_stem: str | Path, meta: dict | None = None, *,
                    replace: bool = True) -> Path:
    """Write `<stem>.safetensors` and `<stem>.json`; returns the stem.

    Args:
        model: the Transformer; its weights are saved as contiguous CPU tensors in their dtype.
        path_stem: file stem (a .safetensors/.json suffix is dropped); parent dirs are created.
        meta: JSON-serialisable fields to store beside the config (e.g. train_config, metrics,
            seed, R, N). "format", "version", "model_config", "weights_sha256" and "created" are set here, and
            "git_commit" unless given. Non-finite floats are stored as null.
        replace: whether a pair already at `path_stem` is replaced; False: FileExistsError instead
            (checked under the folder's lock, so a pair saved by another process after the caller
            looked is never overwritten).
    Raises:
        TypeError: meta is not JSON-serialisable.
        FileExistsError: replace is False and either file of the pair exists (nothing written).
        OSError: a file could not be written (e.g. the disk is full; safetensors' own error is
            turned into one naming the .safetensors file): the pair that was there is kept intact
            (see the module docstring).
    """
    stem = stem_of(path_stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    doc = {"git_commit": provenance.git_commit(ignore=(stem.parent,)), **(meta or {})}  # (its own folder's
    # files are outputs: a sweep rewriting results/l1_sweep_models read "-dirty" from its second run on)
    doc.update(format=FORMAT, version=VERSION, model_config=model.cfg.to_dict(), weights_sha256=weights_digest(tensors),
               created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    text = dumps(doc, indent=2, sort_keys=True)
    spath, jpath = Path(f"{stem}.safetensors"), Path(f"{stem}.json")
    stmp, jtmp = temp_path(spath), None
    try:
        try:
            save_file(tensors, str(stmp), metadata={"format": FORMAT})
        except SafetensorError as exc:  # e.g. "I/O error: No space left on device (os error 28)"
            code = int(m.group(1)) if (m := re.search(r"os error (\d+)", str(exc))) else errno.EIO
            raise OSError(code, os.strerror(code) if m else str(exc).splitlines()[0], str(spath)) from None
        os.chmod(stmp, 0o644)  # safetensors writes 0o600: a shared model must be readable
        fsync_file(stmp)
        jtmp = write_temp(jpath, (text + "\n").encode())
        with folder_lock(stem.parent):  # another process saving this stem waits: never its weights, our .json
            taken = [p for p in (spath, jpath) if p.exists() or p.is_symlink()]
            if taken and not replace:  # written since the caller checked (another train of this name)
                raise FileExistsError(errno.EEXIST, "written by another process while this one ran", str(taken[0]))
            jpath.unlink(missing_ok=True)  # from here the pair is incomplete until its .json is renamed in
            fsync_dir(stem.parent)
            os.replace(stmp, spath)
            os.replace(jtmp, jpath)  # last: the completeness mark
    except BaseException:
        discard(stmp, jtmp)
        raise
    fsync_dir(stem.parent)
    return stem


def check_writable(stem: str | Path, key: str = "--out") -> None:
    """Before training: both files of the pair `stem` can be written as files (a .safetensors /
    .json suffix is dropped, as save_checkpoint drops it).

    Raises:
        ConfigError (naming `key`): the name is too long for the folder (with the temporary and
            `-pid<PID>` names saving adds; `icl_bench.files.name_too_long`), `<stem>.safetensors` or
            `<stem>.json` exists and is not a regular file (a folder of that name made training fail only after it had run, and
            left half a pair), is a symbolic link (dangling or not), a parent of `stem` is a file,
            or the folder takes no new files (read-only; `icl_bench.files.cannot_create`).
    """
    stem = stem_of(stem)
    blocked = blocking_file(stem)
    if blocked is not None:
        raise ConfigError(f"{key}: {blocked} is a file, so {stem}.safetensors cannot be written; give another folder")
    for suffix in (".safetensors", ".json"):
        p = Path(f"{stem}{suffix}")
        if p.is_symlink():  # a dangling one fails after training; a live one would be written through
            raise ConfigError(f"{key}: {p} is a symbolic link, so the checkpoint would not be saved in place; remove it")
        if p.exists() and not p.is_file():
            raise ConfigError(f"{key}: {p} exists and is not a file, so the checkpoint cannot be saved there; remove it")
    why = name_too_long(temp_path(f"{stem}.safetensors"), temp_path(f"{beside(stem, 99)}.safetensors"))
    if why is not None:
        raise ConfigError(f"{key}: the checkpoint name {stem.name[:40]}... is too long to save ({why}); give a shorter name")
    why = cannot_create(f"{stem}.safetensors")
    if why is not None:  # a read-only folder: refused before training, not after it
        raise ConfigError(f"{key}: cannot write {stem}.safetensors ({why}); give another folder")


def read_meta(path: str | Path) -> dict:
    """The JSON half of a checkpoint (either file of the pair may be named). ConfigError if bad,
    or if `path` is a folder without a pair of that stem beside it."""
    stem = stem_of(path)
    jpath = Path(str(stem) + ".json")
    if not jpath.is_file():
        if Path(path).is_dir():  # e.g. `--checkpoint .`: not "metadata file ..json is missing"
            raise ConfigError(f"checkpoint: {path} is a folder; a checkpoint is the file pair <stem>.safetensors + "
                              "<stem>.json: give its stem or either file")
        if jpath.is_symlink():  # a dangling link: say where it points
            raise ConfigError(f"checkpoint: metadata file {jpath} is a link to {os.readlink(jpath)}, which is missing")
        spath = Path(str(stem) + ".safetensors")
        if spath.is_symlink() and not spath.exists():  # the half that was put here is a dangling link
            raise ConfigError(f"checkpoint: metadata file {jpath} is missing, and weights file {spath} is a link to "
                              f"{os.readlink(spath)}, which is missing")
        raise ConfigError(f"checkpoint: metadata file {jpath} is missing; a checkpoint is <stem>.safetensors + <stem>.json")
    try:
        meta = json.loads(jpath.read_text())
    except OSError as exc:  # (a PermissionError read "is not valid JSON": a review)
        raise ConfigError(f"checkpoint: cannot read {jpath} ({exc.strerror or type(exc).__name__})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"checkpoint: {jpath} is not valid JSON ({type(exc).__name__})") from None
    except RecursionError:  # json recurses once per nested array / object
        raise ConfigError(f"checkpoint: {jpath} is not valid JSON (nested too deeply to read)") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("model_config"), dict):
        raise ConfigError(f"checkpoint: {jpath} is not an icl-bench checkpoint (needs format={FORMAT!r} and model_config)")
    version = meta.get("version", VERSION)  # (every checkpoint written so far has version 1)
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= VERSION:
        raise ConfigError(f"checkpoint: {jpath} has version {version!r}; this icl-bench reads version {VERSION} "
                          "(a newer icl-bench may have written it: upgrade, or retrain with this one)")
    return meta


def load_checkpoint(path: str | Path, *, device: str = "cpu") -> tuple[Transformer, dict]:
    """Load a checkpoint pair without unpickling anything.

    Args:
        path: `<stem>.safetensors`, `<stem>.json` or the bare stem.
        device: where to put the model.
    Returns:
        (model in eval mode, in the dtype the weights were saved in, meta dict from the JSON).
    Raises:
        ConfigError: (one line) either file missing, JSON invalid or not a checkpoint, a model
            config the Transformer rejects, a safetensors file that is truncated, corrupt or
            not safetensors at all (e.g. a pickle), or tensors with missing/extra names or
            shapes that do not match the config, or weights whose digest differs from the
            `weights_sha256` the JSON records (a damaged byte, or another checkpoint's file).
    """
    stem = stem_of(path)
    with folder_lock(stem.parent, shared=True):  # not while a save_checkpoint renames a new pair in
        meta = read_meta(stem)
        spath = Path(str(stem) + ".safetensors")
        if not spath.is_file():
            link = f" (a link to {os.readlink(spath)}, which is missing)" if spath.is_symlink() else ""
            raise ConfigError(f"checkpoint: weights file {spath} is missing{link}")
        try:
            cfg = TransformerConfig(**meta["model_config"])
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"checkpoint: {stem}.json has a bad model_config: {exc}".replace("\n", " ")) from None
        if not os.access(spath, os.R_OK):  # safetensors says "No such file or directory" (a review)
            raise ConfigError(f"checkpoint: cannot read {spath} (Permission denied)")
        try:
            tensors = load_file(str(spath), device="cpu")
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ConfigError(f"checkpoint: {spath} is not a readable safetensors file ({msg})") from None
    with torch.device("meta"):  # shapes only: a config naming a huge model allocates nothing
        expected = {k: tuple(v.shape) for k, v in Transformer(cfg).state_dict().items()}
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    if set(expected) != set(got):
        diff = sorted(set(expected) ^ set(got))
        raise ConfigError(f"checkpoint: {spath} tensor names do not match the config (first difference: {diff[0]!r})")
    for k, shape in expected.items():
        if got[k] != shape:
            raise ConfigError(f"checkpoint: {spath} tensor {k!r} has shape {got[k]}, the config needs {shape}")
    dtypes = {v.dtype for v in tensors.values()}
    if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
        raise ConfigError(f"checkpoint: {spath} tensors must share one floating dtype (got {sorted(map(str, dtypes))})")
    if "weights_sha256" in meta:  # (absent: a pair saved before the field, loaded unchecked)
        recorded = meta["weights_sha256"]
        if not (isinstance(recorded, str) and re.fullmatch(r"[0-9a-f]{64}", recorded)):
            raise ConfigError(f"checkpoint: {stem}.json: weights_sha256 must be 64 lowercase hexadecimal characters "
                              f"(got {recorded!r:.80})")
        if recorded != weights_digest(tensors):
            raise ConfigError(f"checkpoint: {spath} does not hold the weights {stem}.json records (weights_sha256 "
                              "differs): the file is damaged, or the pair mixes two checkpoints; train or copy the pair again")
    model = Transformer(cfg).to(next(iter(dtypes)))  # no bigger than the file it matches
    model.load_state_dict(tensors)
    return model.to(device).eval(), meta


def checkpoint_path(name: str, key: str = "CHECKPOINT") -> str:
    """A checkpoint as the user gave it, or a shipped model found by name.

    A name with a folder in it as typed ("./m", "runs/m") is a path. A bare name ("m", "m.json",
    "m.safetensors") is a local checkpoint when m.safetensors is a file in the current folder, or
    m.json is one and reads as a checkpoint's metadata, or either is a dangling symbolic link
    (load_checkpoint then says where it points, rather than a shipped model standing in); else the shipped model of stem m in
    resources.models_dir() (e.g. trained-l1-R100); else itself when something of that name is here
    (load_checkpoint then says what is wrong with it). So a folder, or another file (e.g. an
    `analyze --out trained-l1-R100.json`), never hides a shipped model.

    Raises:
        ConfigError (naming `key`): an empty name, a name the file system cannot take, or a bare
            name that is neither here nor shipped (lists the shipped checkpoints).
    """
    if not name:
        raise ConfigError(f"{key}: empty name; give a checkpoint's stem or a shipped model's name")
    stem = name.removesuffix(".json").removesuffix(".safetensors")
    try:
        # (asked first for every name: an over-long one raises OSError here, a path's too)
        here = Path(name).exists() or Path(f"{stem}.json").exists() or Path(f"{stem}.safetensors").exists()
        if "/" in name or os.sep in name:
            return name  # a path: load_checkpoint says what is wrong with it
        if Path(f"{stem}.safetensors").is_file() or (Path(f"{stem}.json").is_file() and _reads_as_meta(stem)):
            return name
        if any(Path(p).is_symlink() and not Path(p).exists() for p in (f"{stem}.json", f"{stem}.safetensors")):
            return name  # a dangling link put here on purpose: load_checkpoint says so, not the shipped model
        if Path(f"{resources.models_dir() / stem}.json").is_file():
            return str(resources.models_dir() / stem)
    except OSError as exc:  # e.g. a name longer than the file system allows
        raise ConfigError(f"{key}: cannot use {name[:40]!r}{'...' if len(name) > 40 else ''} ({exc.strerror or exc})") from None
    if here:
        return name
    names = sorted(p.stem for p in resources.models_dir().glob("*.json"))
    raise ConfigError(f"{key}: no checkpoint {name!r} (a file pair's stem, or a shipped one: {', '.join(names)})")


def shadows_shipped(name: str, resolved: str) -> bool:
    """Whether `resolved` (checkpoint_path(name)) is a pair in the current folder that takes the
    name of a different shipped model: `icl-bench analyze trained-l1-R100` run beside one's own
    trained-l1-R100 pair reads that pair, which callers say (a bare name, not a path)."""
    stem = resolved.removesuffix(".json").removesuffix(".safetensors")
    shipped = resources.models_dir() / f"{stem}.json"
    if resolved != name or "/" in name or os.sep in name or not shipped.is_file():
        return False
    here = Path(f"{stem}.json")
    return not (here.is_file() and os.path.samefile(here, shipped))  # run from the package's own folder: the same


def _reads_as_meta(stem: str) -> bool:
    try:
        read_meta(stem)
        return True
    except ConfigError:
        return False

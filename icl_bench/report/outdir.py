"""publish's output folder: what it may replace and the temporary folders it leaves behind.

    check_out(out, runs, force, ...)  refuse an --out that would lose anything publish did not write
    remove_stale_temps(out)           remove the `.OUT.<pid>-<random>.tmp` folders of a killed publish
    move_into(tmp, out, force, recheck)  put the finished report in place of --out
A publish writes into a hidden temporary folder beside --out and moves it into place at the end
(publish.py); OWN_FILES names what it writes, so a later --force deletes nothing else.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from icl_bench.errors import ConfigError
from icl_bench.files import refuse_link_loop

PLOTS = ("mse_vs_n", "mse_vs_r", "gd_steps", "throughput", "weights", "probes")  # plots/<name>.png (publish.PLOT_TITLES)
# What publish writes (relative to --out), for a publish.json of before it listed its "files".
OWN_FILES = {"index.html", "report.md", "headline.md", "summary.csv", "summary.md", "failures.csv", "failures.md",
             "sparsity.csv", "sparsity.md", "scaling.csv", "mechanism.csv", "results.csv", "publish.json",
             *(f"plots/{name}.png" for name in PLOTS)}


def digests(folder: Path, files) -> dict[str, str]:
    """sha256 (hex) of each of `files` (paths relative to `folder`), for publish.json's "sha256"."""
    return {f: hashlib.sha256((folder / f).read_bytes()).hexdigest() for f in files}


def _not_published(out: Path) -> str | None:
    """The first path under `out` (relative, in sorted order) that the publish which wrote `out`
    did not write (publish.json's "files"; OWN_FILES when it has none), or that was edited since
    (publish.json's "sha256", where it has one), as "PATH, which icl-bench publish did not write
    there" / "PATH, edited since icl-bench publish wrote it"; or None. Links are never its."""
    try:
        info = json.loads((out / "publish.json").read_text())
        files, sums = info.get("files"), info.get("sha256")
    except (OSError, ValueError, AttributeError, RecursionError):  # RecursionError: nested too deeply
        files = sums = None
    own = set(files) if isinstance(files, list) and all(isinstance(f, str) for f in files) else OWN_FILES
    sums = sums if isinstance(sums, dict) else {}  # (a publish before it: names only)
    dirs = {"plots"} | {str(Path(f).parent) for f in own}
    for root, subdirs, names in os.walk(out):  # links to folders are listed, not followed
        subdirs.sort()
        rel = Path(root).relative_to(out)
        for name in sorted(names) + subdirs:
            path = (rel / name).as_posix()
            is_dir = name in subdirs and not (Path(root) / name).is_symlink()
            if (path not in dirs) if is_dir else (path not in own or (Path(root) / name).is_symlink()):
                return f"{path}, which icl-bench publish did not write there"
            if not is_dir and path in sums and digests(out, [path])[path] != sums[path]:  # a user's edit of
                return f"{path}, edited since icl-bench publish wrote it"  # report.md: --force lost it (a review)
    return None


STALE_S = 3600  # a temp folder of publish older than this is stale, whatever its pid says (reused, another host)


def remove_stale_temps(out: Path) -> None:
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


def check_out(out: Path, runs: list[Path], force: bool, checkpoints=(), readme=None) -> None:
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
    if out.is_dir() and any(out.iterdir()):  # --force is offered only where it would be accepted (a review)
        if not (out / "publish.json").is_file():  # --force never deletes a folder publish did not write
            raise ConfigError(f"--out: {out} is not empty and icl-bench publish did not write it (no publish.json); "
                              "only an earlier report can be replaced (--force): choose an empty or new folder")
        other = _not_published(out)
        if other is not None:  # nor what was put there after it (a run folder, a model, notes)
            raise ConfigError(f"--out: {out} holds {other}; --force would delete it: move it out or choose another "
                              "folder")
        if not force:
            raise ConfigError(f"--out: {out} holds an earlier report; pass --force to replace it")
    if out.resolve() == Path.cwd().resolve():
        raise ConfigError(f"--out: {out} is the current folder; choose a subfolder")


def move_into(tmp: Path, out: Path, force: bool, recheck) -> None:
    """Move the finished report `tmp` to `out`. `recheck()` (check_out's tests) runs again first:
    a publish takes seconds to minutes after its first check, and what appeared at --out meanwhile
    (another run's cells, a user's file) must not be deleted. Without force, `tmp` is renamed onto
    `out` directly, which POSIX refuses when `out` is a folder that is no longer empty; with force
    the old report is moved aside (and checked once more there: a file written after the recheck
    would be deleted with it), the new one moved in, then the old one deleted.

    Raises:
        ConfigError: --out changed since the first check (it names what is there now).
    """
    try:
        recheck()
    except ConfigError as exc:
        raise ConfigError(f"{exc} (it changed while publish ran; nothing was replaced)") from None
    if not force or not out.exists():
        try:
            tmp.rename(out)
        except OSError:  # ENOTEMPTY / EEXIST: something was written there after the recheck
            if out.is_dir() and any(out.iterdir()):
                raise ConfigError(f"--out: {out} is not empty (it was written to while publish ran; nothing "
                                  "was replaced)") from None
            raise
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
    try:
        out.rename(old / "previous")
    except BaseException:  # --out a mount point, or spelled with '..': nothing moved, nothing left
        old.rmdir()
        raise
    other = _not_published(old / "previous")  # written between the recheck and the move (a review)
    if other is not None:
        (old / "previous").rename(out)
        old.rmdir()
        raise ConfigError(f"--out: {out} holds {other} (while publish ran); nothing was replaced")
    try:
        tmp.rename(out)
    except BaseException:
        (old / "previous").rename(out)
        raise
    shutil.rmtree(old, ignore_errors=True)

"""Prompts from real data: a CSV file with an x and a y column.

Each prompt draws N + 1 distinct rows (seeded): the first N are the context, the last one the
query, whose observed y is the target. Real data has no clean truth, so y_query_clean, slope
and intercept are NaN and the runner reports mse_vs_truth = NaN. Rows with a missing, NaN or
infinite x or y are dropped when the file is read (`data_summary` counts them; `icl-bench run`
prints the count and metadata.json records it as data_rows_dropped): one empty cell must not
turn every prompt that draws its row into a NaN. The file may be compressed (`.gz`, `.bz2`, `.xz`,
`.zst`, or a `.zip` / `.tar[.gz|.bz2|.xz]` holding one file): read by its name's ending, as
`pd.read_csv(path)` does, both when checked and when drawn from.
"""
from __future__ import annotations

import hashlib
import io
import lzma
import os
import tarfile
import warnings
import zipfile
from functools import lru_cache
from pathlib import Path
from typing import Annotated

import numpy as np
import pandas as pd
import torch
from pydantic import BeforeValidator

from icl_bench.config_base import ConfigModel, problem
from icl_bench.errors import ConfigError
from icl_bench.prompts.generator import PromptBatch, make_batch


def _required_text(v) -> str:
    if not isinstance(v, str) or not v:
        raise problem(f"required text value (got {v!r})")
    return v


RequiredText = Annotated[str, BeforeValidator(_required_text)]


class DataSource(ConfigModel):
    """The `[data]` table: a CSV file whose rows are drawn as prompts.

    path: a file path (a relative one is looked up in the current folder, then in the config
    file's folder; found in both as two different files, it is refused), or
    "matplotlib:NAME" for a sample file bundled with matplotlib (e.g. matplotlib:msft.csv); a name
    ending in one of _COMPRESSION's endings is decompressed first.
    """

    path: RequiredText = ""  # the CSV file
    x: RequiredText = ""  # column of inputs
    y: RequiredText = ""  # column of targets

    def resolve(self) -> Path:
        """The file's path on disk."""
        if self.path.startswith("matplotlib:"):
            import matplotlib

            return Path(matplotlib.get_data_path()) / "sample_data" / self.path.split(":", 1)[1]
        return Path(self.path)


def check_source(src: DataSource, Ns: list[int], base_dir: Path | None = None) -> DataSource:
    """`src` with its path resolved against `base_dir` if needed, after checking the file.

    A relative path is the current folder's file if there is one, else `base_dir`'s (the config's
    folder); the path is rewritten only in the second case.
    Raises:
        ConfigError: a relative path that names a file in both folders, two different files; a
            missing or unreadable file, a missing or non-numeric column, or fewer
            than max(Ns) + 1 rows (or rows with finite x and y); a damaged compressed file, a
            .zip / .tar holding several files, or rows with more fields than the header (ragged
            rows, or every row one more: pandas would shift the columns) are unreadable; .zst needs the zstandard package.
    """
    if not src.path:
        raise ConfigError("data.path: not given; the CSV file whose rows are drawn as prompts")
    path = src.resolve()
    if base_dir is not None and not path.is_absolute() and path.is_file() and (base_dir / path).is_file() \
            and not path.samefile(base_dir / path):  # the current folder's would win, silently
        raise ConfigError(f"data.path: {src.path!r} names two different files, {os.path.abspath(path)!r} (from the "
                          f"current folder) and {os.path.abspath(base_dir / path)!r} (beside the config); accepted: "
                          "a path that names one file, e.g. an absolute path")
    if not path.is_file() and base_dir is not None and (base_dir / path).is_file():
        src = DataSource(path=str(base_dir / path), x=src.x, y=src.y)
        path = src.resolve()
    if not path.is_file():
        if path.is_dir():  # was "no such file": it exists, as a folder
            raise ConfigError(f"data.path: {str(path)!r} is a folder; accepted: a CSV file (plain or compressed)")
        if path.exists():  # /dev/null, a FIFO, a socket (it read "no such file"; a review)
            raise ConfigError(f"data.path: {str(path)!r} is not a regular file (a device, pipe or socket); accepted: "
                              "a CSV file (plain or compressed)")
        raise ConfigError(f"data.path: no such file {str(path)!r}")
    try:
        data = path.read_bytes()
    except OSError as exc:  # (unreadable: the handler below read `data`, unset: an UnboundLocalError; a review)
        raise ConfigError(f"data.path: cannot read {str(path)!r} ({exc.strerror or type(exc).__name__}); "
                          "accepted: a readable CSV file") from None
    try:
        frame = _frame(path, data)
    except _READ_ERRORS as exc:
        zst = isinstance(exc, ImportError) and path.name.lower().endswith(".zst")
        several = isinstance(exc, ValueError) and "Multiple files" in str(exc)  # pandas' words for a .zip / .tar
        why = "the zstandard package is not installed" if zst else str(exc) if isinstance(exc, ExtraFields) \
            else "the archive holds several files" if several \
            else f"ParserError: {' '.join(str(exc).split())[:120]}" if isinstance(exc, pd.errors.ParserError) \
            else f"not UTF-8 text{_utf8_error_at(path, data)}" if isinstance(exc, UnicodeDecodeError) \
            else type(exc).__name__  # the parser names the line ("Expected 2 fields in line 32, saw 3")
        raise ConfigError(f"data.path: cannot read {str(path)!r} as CSV ({why}{_first_line_hint(data)}); accepted: UTF-8 CSV text with as many "
                          "fields in every row as in the header, plain or compressed (.gz, .bz2, .xz, .zst, or a .zip / .tar[.gz|.bz2|.xz] holding one file)") from None
    header = _header(path, data)  # as written: pandas renames a repeated name x to x.1
    columns = ", ".join(map(repr, header))  # (quoted: a name with spaces around it shows them)
    other = next((c for c in (";", "\t", "|") if len(header) == 1 and c in header[0]), None)
    hint = f" (one column: is the file separated by {other!r}? accepted: comma-separated values)" if other else ""
    for k, what in (("x", "inputs"), ("y", "targets")):
        col = getattr(src, k)
        if not col:
            raise ConfigError(f"data.{k}: not given; the column of {what}, one of: {columns}{hint}")
        unnamed = {f"Unnamed: {i}" for i, h in enumerate(header) if h == ""}  # pandas' name of an empty one
        if col not in frame.columns or (col not in header and col not in unnamed):  # (x.1, x.2 for a repeated x:
            raise ConfigError(f"data.{k}: no column {col!r} in {path.name}; columns: {columns}{hint}")  # not the file's)
        if header.count(col) > 1:  # pandas would take the first one, silently
            raise ConfigError(f"data.{k}: column {col!r} appears {header.count(col)} times in the header of {path.name}; "
                              "accepted: a column whose name appears once")
        text = ~_missing(frame[col]) & _numbers(frame[col]).isna()  # the cells that are no number
        if text.any():  # (a column of numbers pandas could not type, e.g. 99999999999999999999, is numbers)
            row = int(np.flatnonzero(text.to_numpy())[0])
            cell = str(frame[col].iloc[row])
            raise ConfigError(f"data.{k}: column {col!r} is not numeric (data row {row + 1}: "
                              f"{cell[:40] + ('...' if len(cell) > 40 else '')!r}); accepted: numbers (inf too), "
                              "and cells pandas reads as missing (empty, NaN, nan, NA, null), whose rows are dropped")
    n = max(Ns)
    finite = int((np.isfinite(_numbers(frame[src.x])) & np.isfinite(_numbers(frame[src.y]))).sum())
    if n + 1 > finite:  # rows with NaN / inf are dropped (data_summary): enough must remain
        raise ConfigError(f"grid.N: N={n} needs at least {n + 1} rows with finite x and y; {path.name} has {finite}"
                          + (f" (of {len(frame)} rows)" if finite < len(frame) else ""))
    _CHECKED[str(path)] = _pin(data)  # the bytes that passed these checks are the run's: `snapshot`
    # and the note on dropped rows use them, not a later read
    return src


# file name ending -> pandas' compression, as pandas infers it from a path (first match wins)
_COMPRESSION = {".tar": "tar", ".tar.gz": "tar", ".tar.bz2": "tar", ".tar.xz": "tar", ".gz": "gzip",
                ".bz2": "bz2", ".zip": "zip", ".xz": "xz", ".zst": "zstd"}
# what a damaged, compressed or non-CSV file raises: UnicodeDecodeError, pandas' ParserError /
# EmptyDataError and zip's "several files" are ValueErrors; ImportError: .zst without zstandard
_READ_ERRORS = (ValueError, OSError, EOFError, zipfile.BadZipFile, lzma.LZMAError, tarfile.TarError, ImportError)


# cells read as missing in a column pandas left as text (it does not mark them there: a column with
# an integer beyond 64 bits keeps '' and 'nan' as strings); compared stripped and lower-cased
MISSING = frozenset({"", "nan", "-nan", "na", "n/a", "<na>", "#n/a", "null", "none"})


def _missing(col: pd.Series) -> pd.Series:
    """True where a cell is missing: NaN, or (a text column) one of MISSING; its row is dropped."""
    if pd.api.types.is_numeric_dtype(col):
        return col.isna()
    return col.isna() | col.astype(str).str.strip().str.lower().isin(MISSING)


def _numbers(col: pd.Series) -> pd.Series:
    """The column as float64: NaN where a cell is missing or no number. A column pandas left as
    text or Python ints (an integer beyond 64 bits, e.g. 99999999999999999999) is converted from
    each cell's text, so it reads as the same number written 1e+20 does (10**400: inf). A column
    pandas read as True / False is no number (NaN): pandas counts bool as numeric, as 1 / 0."""
    if pd.api.types.is_numeric_dtype(col) and not pd.api.types.is_bool_dtype(col):
        return col.astype(np.float64)
    return pd.to_numeric(col.astype(str), errors="coerce").astype(np.float64)


class ExtraFields(ValueError):
    """Data rows have more (non-empty) fields than the header: pandas would otherwise take the first
    field as the index and shift every column by one, or drop the extra fields."""


@lru_cache(maxsize=2)
def _frame(path: Path, data: bytes) -> pd.DataFrame:
    """The file's bytes `data` parsed as CSV, decompressed first if `path`'s name ends in one of
    _COMPRESSION (case-insensitive), as `pd.read_csv(path)` would. Cached: the config check and
    the prompts parse the same bytes once (callers only read the frame).

    Raises:
        one of _READ_ERRORS: the bytes are not (compressed) CSV text; ExtraFields (a ValueError):
            data rows with more fields than the header (an empty trailing field is fine).
    """
    name = path.name.lower()
    compression = next((c for ext, c in _COMPRESSION.items() if name.endswith(ext)), None)
    with warnings.catch_warnings():  # index_col=False: a first field is never taken as the rows' index
        warnings.simplefilter("error", pd.errors.ParserWarning)  # pandas would drop the extra fields
        try:
            return pd.read_csv(io.BytesIO(data), compression=compression, index_col=False)
        except pd.errors.ParserWarning:
            raise ExtraFields("data rows with more fields than the header") from None


def _utf8_error_at(path: Path, data: bytes) -> str:
    """Where a plain file stops being UTF-8, as ": invalid start byte at byte 14" ("" for a
    compressed one, whose bytes are not the text; pandas' own position is within its buffer)."""
    if any(path.name.lower().endswith(ext) for ext in _COMPRESSION):
        return ""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f": {exc.reason} at byte {exc.start}"
    return ""


def _first_line_hint(data: bytes) -> str:
    """Why a file's first line may not be a CSV header, for the message of a file that fails to
    parse: a comment line, or another separator (';' with decimal commas) (found by a review)."""
    line = data[:4096].lstrip(b"\xef\xbb\xbf").split(b"\n", 1)[0].strip()
    if line.startswith(b"#"):
        return "; its first line starts with '#': remove comment lines above the header"
    other = next((c for c in (";", "\t", "|") if c.encode() in line and b"," not in line.replace(b'","', b"")), None)
    return f"; is it separated by {other!r}?" if other else ""


@lru_cache(maxsize=2)
def _header(path: Path, data: bytes) -> list[str]:
    """The header line of the CSV bytes `data` (decompressed as _frame does), names as written:
    `_frame`'s columns rename a repeated name ("x", "x" -> "x", "x.1")."""
    name = path.name.lower()
    compression = next((c for ext, c in _COMPRESSION.items() if name.endswith(ext)), None)
    first = pd.read_csv(io.BytesIO(data), compression=compression, header=None, nrows=1, dtype=str,
                        keep_default_na=False, index_col=False)
    return [str(v) for v in first.iloc[0].tolist()] if len(first) else []


# sha256 hex digest -> the bytes it was computed over: the file content a run's cells draw from
# (`snapshot`), so a file edited during the run cannot change them; the last few contents only
_SNAPSHOTS: dict[str, bytes] = {}
_KEEP = 4
_CHECKED: dict[str, str] = {}  # resolved path -> digest of the bytes check_source last accepted there


def _pin(data: bytes, digest: str = "") -> str:
    """Keep `data` (the last _KEEP contents) under its sha256 hex digest (`digest` if already
    computed), which it returns."""
    digest = digest or hashlib.sha256(data).hexdigest()
    _SNAPSHOTS.pop(digest, None)
    _SNAPSHOTS[digest] = data
    while len(_SNAPSHOTS) > _KEEP:
        _SNAPSHOTS.pop(next(iter(_SNAPSHOTS)), None)
    return digest


def snapshot(source: DataSource) -> str:
    """Read the file's bytes once, keep them in this process, and return their sha256 (the
    cells' data_sha256): every later `_read(source, digest)` here draws from exactly these bytes,
    whatever happens to the file meanwhile. The bytes `check_source` accepted, if this process
    checked the file: a file swapped between the check and the run is not read again."""
    checked = _CHECKED.get(str(source.resolve()))
    if checked in _SNAPSHOTS:
        return checked
    return _pin(source.resolve().read_bytes())


def _read(source: DataSource, digest: str = "") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x, y) of the usable rows, and the 1-based data-row numbers of the dropped ones; parsed
    once per file content (an edited file is parsed again, whatever its name or mtime).

    digest: "" reads the file as it is now. Otherwise the content with that sha256: the bytes
    `snapshot` kept in this process, or (in another process, e.g. a Dask worker) the file read
    now, whose hash must equal `digest`; they are then kept, so the process reads them once.
    Raises:
        RuntimeError: the file's bytes no longer hash to `digest` (it was edited since the run
            started); the cell becomes an error row, never a row of other data under that digest.
    """
    data = _SNAPSHOTS.get(digest) if digest else None
    if data is None:
        # another process than the driver's (a Dask worker) reads a relative path from its own folder: said so,
        # where "No such file" or "changed since the run started" (rerun: no help) pointed the wrong way (a review)
        path = source.resolve()  # (a matplotlib: sample resolves to an absolute path)
        relative = bool(digest) and not path.is_absolute()
        why = (f"a relative path is read from each process's own folder, here {os.getcwd()}, which a Dask worker's "
               "is not the driver's: give [data] path (--data) as an absolute path on a file system the workers "
               "share (docs/scale-out.md)")
        try:
            data = path.read_bytes()
        except FileNotFoundError as exc:
            if not relative:
                raise
            raise FileNotFoundError(f"data.path: {source.path}: no such file; {why}") from exc
        now = hashlib.sha256(data).hexdigest()
        if digest and now != digest:
            raise RuntimeError(f"data.path: {source.path} changed since the run started (sha256 {now[:12]}..., "
                               f"the run's cells are keyed by {digest[:12]}...); rerun to use the new content"
                               + (f", or, as {why}" if relative else ""))
        digest = _pin(data, now)
    return _parse(source, digest, data)


@lru_cache(maxsize=4)
def _parse(source: DataSource, digest: str, data: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    frame = _frame(source.resolve(), data)
    x, y = _numbers(frame[source.x]).to_numpy(), _numbers(frame[source.y]).to_numpy()
    ok = np.isfinite(x) & np.isfinite(y)
    return x[ok], y[ok], np.flatnonzero(~ok) + 1


def _columns(source: DataSource, digest: str = "") -> tuple[np.ndarray, np.ndarray]:
    return _read(source, digest)[:2]


def data_summary(source: DataSource, digest: str = "") -> tuple[int, int, str]:
    """(rows in the file, rows dropped for a missing / NaN / inf x or y, one line saying so or "");
    digest: the content read (see `_read`; "" = the file now)."""
    x, _, dropped = _read(source, digest)
    n = len(x) + len(dropped)
    if not len(dropped):
        return n, 0, ""
    rows = ", ".join(map(str, dropped[:10])) + (", ..." if len(dropped) > 10 else "")
    return n, len(dropped), (f"data: dropped {len(dropped)} of {n} rows of {source.path} with a missing, NaN or "
                             f"infinite {source.x} or {source.y} (data rows {rows})")


KEYS_PER_CHUNK = 2**20  # random keys held at once by _draw_rows (8 MiB of float64 + 8 MiB of int64)


def _chunk_rows(n_rows: int) -> int:
    """Prompts per chunk in `_draw_rows`: as many as fit KEYS_PER_CHUNK keys, at least 1."""
    return max(1, KEYS_PER_CHUNK // max(n_rows, 1))


def _draw_rows(rng: np.random.Generator, n_prompts: int, n_rows: int, k: int) -> np.ndarray:
    """(n_prompts, k) int64 row indices, distinct within each row: the first k columns of
    `argsort(rng.random((n_prompts, n_rows)), axis=1)`, i.e. of a uniform random permutation per
    prompt, drawn from `rng` exactly as that formula does (so seeded prompts are unchanged).

    The keys are drawn in chunks of `_chunk_rows(n_rows)` prompts (the generator fills the matrix
    row-major, so the chunks hold the same numbers); per prompt, argpartition picks the k smallest
    keys in O(n_rows) and only those k are sorted. Memory is O(chunk x n_rows), not
    O(n_prompts x n_rows). The result equals argsort's unless two keys tie at or below the k-th
    smallest (probability about k * n_rows / 2**53 per prompt for 53-bit doubles; argsort's own
    order of tied keys is unspecified anyway). Requires 1 <= k <= n_rows.
    """
    out = np.empty((n_prompts, k), dtype=np.int64)
    step = _chunk_rows(n_rows)
    for lo in range(0, n_prompts, step):
        keys = rng.random((min(step, n_prompts - lo), n_rows))  # the next rows of the key matrix
        part = np.argpartition(keys, k - 1, axis=1)[:, :k]  # the k smallest keys, unordered
        order = np.argsort(np.take_along_axis(keys, part, axis=1), axis=1)  # the k, by key
        out[lo:lo + len(keys)] = np.take_along_axis(part, order, axis=1)
    return out


@lru_cache(maxsize=4)
def _rows_of(seed: int, n_prompts: int, n_rows: int, k: int) -> np.ndarray:
    """_draw_rows from a generator seeded with `seed`, cached (read-only): a grid point's cells in
    each dtype and device draw the same rows, and the draw costs O(n_prompts x rows) (30 s for 2048
    prompts from 1e6 rows, found by a review), so it is made once per point, not per dtype."""
    idx = _draw_rows(np.random.default_rng(seed), n_prompts, n_rows, k)
    idx.setflags(write=False)
    return idx


def sample_data_prompts(source: DataSource, N: int, R: float, n_prompts: int, *, seed: int,
                        dtype="float32", device="cpu", data_sha256: str = "") -> PromptBatch:
    """Draw `n_prompts` prompts of N context rows + 1 query row from a CSV file.

    Each prompt's rows are the first N + 1 of a seeded random permutation of the usable rows
    (`_draw_rows`); time O(n_prompts x rows), once per (seed, n_prompts, N) whatever the dtype or
    device (`_rows_of`), memory about max(16 MiB, 16 bytes x rows) beyond the batch itself
    (KEYS_PER_CHUNK keys at a time).

    Returns:
        PromptBatch: x, y (B, N); x_query, y_query (B,) from the held-out row; the OLS reference
        from the context; truth fields NaN.
    data_sha256: draw from the file content with this sha256 (`_read`; "" = the file now).
    Raises:
        ConfigError: the file has fewer than N + 1 rows.
        RuntimeError: the file no longer has the content `data_sha256` names.
    """
    xs, ys = _columns(source, data_sha256)
    if len(xs) < N + 1:
        raise ConfigError(f"grid.N: N={N} needs at least {N + 1} usable rows of data; {source.path} has {len(xs)}")
    idx = _rows_of(seed, n_prompts, len(xs), N + 1)
    x, y = xs[idx], ys[idx]  # (B, N+1)
    return make_batch(torch.from_numpy(x[:, :N]), torch.from_numpy(y[:, :N]), torch.from_numpy(x[:, N]),
                      R=R, dtype=dtype, device=device, y_query=torch.from_numpy(y[:, N]))

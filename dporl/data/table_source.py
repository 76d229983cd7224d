"""Reading a table for ``dporl.data.table.read_table``: column access over a pandas DataFrame, a Parquet file or a
CSV file (plain or gzip), reading only the columns asked for, with every size bounded before anything is read or
inflated (``dporl.utils.archives``); and the import's progress bar.

pandas, pyarrow and tqdm are imported where they are used: a DataFrame-only import never loads pyarrow.
"""

from __future__ import annotations

import csv
import gzip
import os
import zlib
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from dporl.utils import archives
from dporl.utils.validation import ValidationError

Columns = str | Sequence[str]
CSV_BLOCK_BYTES = 1 << 20  # pyarrow's CSV block (its default): a row longer than this is refused by name
PROGRESS_BYTES = 64 << 20  # tables at least this large on disk show the import's phases
PROGRESS_ROWS = 1 << 21  # DataFrames with at least this many rows do


class _Table:
    """Column access over a DataFrame, a Parquet file or a CSV file, reading only the columns asked for."""

    def __init__(self, source: Any):
        self.source = source
        self.kind: str
        if _is_dataframe(source):
            self.kind, self.names = "frame", [str(c) for c in source.columns]
        else:
            if not isinstance(source, (str, os.PathLike)):
                raise ValidationError("source", f"expected a CSV/Parquet path or a pandas DataFrame, got {type(source).__name__}")
            path = Path(source)
            if not path.is_file():
                raise ValidationError("source", f"no file at {path}")
            self.path = path
            if path.suffix.lower() in (".parquet", ".pq"):
                import pyarrow.parquet as pq

                self.kind = "parquet"
                try:
                    self.names = list(pq.read_schema(path).names)
                except Exception as exc:
                    raise ValidationError("source", f"{path} is not a readable Parquet file ({exc})") from exc
            elif path.suffix.lower() in (".csv", ".tsv", ".txt", ".gz"):
                self.kind = "csv"
                self.delimiter = "\t" if ".tsv" in path.suffixes else ","
                _check_csv_size(path)
                self.names = _csv_header(path, self.delimiter)
            else:
                raise ValidationError("source", f"unknown table format {path.suffix!r}: use .csv, .tsv or .parquet")
        self._arrays: dict[str, np.ndarray] = {}

    def load(self, names: Sequence[str]) -> None:
        missing = [n for n in names if n not in self.names]
        if missing:
            raise ValidationError(missing[0], f"no such column (columns: {', '.join(self.names[:20])}"
                                  f"{', ...' if len(self.names) > 20 else ''})")
        names = list(dict.fromkeys(names))
        if self.kind == "frame":
            columns = {str(c): c for c in self.source.columns}
            for name in names:
                series = self.source[columns[name]]
                if series.isna().any() and series.dtype.kind not in "fc":
                    raise ValidationError(name, f"{int(series.isna().sum())} missing value(s)")
                self._arrays[name] = series.to_numpy()
            return
        if self.kind == "parquet":
            import pyarrow.parquet as pq

            _check_parquet_sizes(self.path, names)
            try:
                table = pq.read_table(self.path, columns=names)
            except Exception as exc:
                raise ValidationError("source", f"cannot read {self.path} ({exc})") from exc
        else:
            from pyarrow import csv as pacsv

            try:
                table = pacsv.read_csv(
                    self.path,
                    read_options=pacsv.ReadOptions(block_size=CSV_BLOCK_BYTES),
                    parse_options=pacsv.ParseOptions(delimiter=self.delimiter),
                    convert_options=pacsv.ConvertOptions(include_columns=names),
                )
            except Exception as exc:
                if "straddling" in str(exc):  # one row longer than a block: no table of numbers has such cells
                    raise ValidationError("source", f"{self.path} has a row longer than {CSV_BLOCK_BYTES >> 20} MiB "
                                          "(a cell that large is not a logged number): refused") from None
                raise ValidationError("source", f"cannot parse {self.path} as CSV ({exc})") from None
        # One contiguous chunk per column, in Arrow's memory pool (which keeps its pages between reads: fresh numpy
        # allocations page-fault, and that dominated the import), then zero-copy numpy views where possible.
        table = table.combine_chunks()
        for name in names:
            column = table.column(name)
            if column.null_count and not _arrow_is_float(column.type):
                raise ValidationError(name, f"{column.null_count} missing value(s)")
            self._arrays[name] = _column_array(column)

    def __getitem__(self, name: str) -> np.ndarray:
        return self._arrays[name]

    def select(self, rows: np.ndarray) -> None:
        """Keep only the rows where ``rows`` (a boolean mask) is True, in every loaded column."""
        self._arrays = {name: values[rows] for name, values in self._arrays.items()}


def _column_array(column: Any) -> np.ndarray:
    """A numpy array of an Arrow column: a view of its single chunk when the layout allows (numeric, no nulls)."""
    if column.num_chunks == 1 and column.null_count == 0:
        try:
            return column.chunk(0).to_numpy(zero_copy_only=True)
        except Exception:  # booleans (bit-packed), strings: converted below
            pass
    return column.to_numpy()


def _is_dataframe(value: Any) -> bool:
    try:
        import pandas as pd
    except ImportError:  # pragma: no cover - pandas is a dependency
        return False
    return isinstance(value, pd.DataFrame)


def _arrow_is_float(arrow_type: Any) -> bool:
    import pyarrow as pa

    return pa.types.is_floating(arrow_type)


def _csv_header(path: Path, delimiter: str) -> list[str]:
    opener = gzip.open if path.suffix.lower() == ".gz" else open
    try:
        with opener(path, "rb") as handle:  # bytes up to the first newline, decoded alone: no row is decoded
            line = handle.readline(CSV_BLOCK_BYTES + 1).decode("utf-8")  # bounded: never a whole file in memory
        if len(line) > CSV_BLOCK_BYTES:
            raise ValidationError("source", f"{path} has a header row longer than {CSV_BLOCK_BYTES >> 20} MiB: refused")
        header = next(csv.reader([line], delimiter=delimiter), None)
    except csv.Error as exc:  # e.g. a header cell beyond the csv module's field limit
        raise ValidationError("source", f"{path} has no readable header row ({exc})") from None
    except (OSError, UnicodeDecodeError, EOFError) as exc:
        raise ValidationError("source", f"cannot read {path} as text ({exc})") from None
    if not header:
        raise ValidationError("source", f"{path} has no header row")
    return [name.strip() for name in header]


def _check_csv_size(path: Path) -> None:
    """Bound what a CSV may inflate to before pyarrow reads it: the load budget, and for gzip the compression ratio
    (``dporl.utils.archives``), counted by streaming the file through the decompressor without keeping it."""
    size = path.stat().st_size
    budget = archives.load_budget_bytes()
    if path.suffix.lower() == ".gz":
        limit = min(budget, max(archives.SMALL_MEMBER_BYTES, archives.MAX_COMPRESSION_RATIO * size))
        inflated = 0
        decompressor = zlib.decompressobj(zlib.MAX_WBITS | 32)  # gzip header
        with open(path, "rb") as handle:
            while chunk := handle.read(1 << 20):
                while chunk:
                    try:
                        inflated += len(decompressor.decompress(chunk, 1 << 20))
                    except zlib.error as exc:
                        raise ValidationError("source", f"{path} is not readable gzip ({exc})") from None
                    if inflated > limit:
                        raise ValidationError("source", f"{path} inflates past {limit} bytes from {size} (at most "
                                              f"{archives.MAX_COMPRESSION_RATIO}:1 and {budget} bytes): refused while "
                                              "inflating")
                    chunk = decompressor.unconsumed_tail
                    if decompressor.eof and decompressor.unused_data:  # a multi-member gzip: continue with the next
                        chunk, decompressor = decompressor.unused_data, zlib.decompressobj(zlib.MAX_WBITS | 32)
        size = inflated
    if size > budget:
        raise ValidationError("source", f"{path} holds {size} bytes of text, more than the {budget} this machine may "
                              "load (half its memory)")


def _check_parquet_sizes(path: Path, names: Sequence[str]) -> None:
    """Bound a Parquet read from its footer before any page is decoded: the declared rows times each column's
    width (what the columns take in memory) against the load budget."""
    import pyarrow.parquet as pq


    try:
        metadata = pq.ParquetFile(path).metadata
        schema = metadata.schema.to_arrow_schema()
    except Exception as exc:
        raise ValidationError("source", f"{path} is not a readable Parquet file ({exc})") from None
    rows = metadata.num_rows
    total = 0
    for name in names:
        index = schema.get_field_index(name)
        try:
            total += rows * max(schema.field(index).type.bit_width // 8, 1)
        except (ValueError, AttributeError, KeyError, IndexError):  # variable width (strings): their decoded bytes
            total += rows * 8 + sum(
                metadata.row_group(g).column(c).total_uncompressed_size
                for g in range(metadata.num_row_groups) for c in range(metadata.num_columns)
                if metadata.row_group(g).column(c).path_in_schema == name)
    budget = archives.load_budget_bytes()
    if total > budget:
        raise ValidationError("source", f"{path} declares {rows} rows: its {len(names)} columns would take {total} "
                              f"bytes, more than the {budget} this machine may load (half its memory)")


def _resolve(table: _Table, spec: Columns, field_name: str) -> list[str]:
    """Column names from a list, or from a string that is a column name or else a prefix of columns."""
    if isinstance(spec, str):
        if spec in table.names:
            return [spec]
        matched = [name for name in table.names if name.startswith(spec)]
        if not matched:
            raise ValidationError(field_name, f"no column named {spec!r} or starting with it")
        return matched
    names = list(spec)
    if not names or not all(isinstance(n, str) for n in names):
        raise ValidationError(field_name, f"expected column names or a prefix, got {spec!r}")
    return names



class _Phases:
    """A progress bar over the import's phases (reading, episodes, units, observations); silent when disabled."""

    NAMES = ("read", "episodes", "units", "observations")

    def __init__(self, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=len(self.NAMES), desc="import table: read", unit="phase", dynamic_ncols=True)

    def next(self, name: str) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_description(f"import table: {name}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.update(self.bar.total - self.bar.n)
            self.bar.close()
            self.bar = None


def _phases(table: _Table, progress: bool) -> _Phases:
    if not progress:
        return _Phases(False)
    if table.kind == "frame":
        return _Phases(len(table.source) >= PROGRESS_ROWS)
    return _Phases(table.path.stat().st_size >= PROGRESS_BYTES)

"""Logged decisions from a table (CSV, Parquet or a pandas DataFrame) into a validated ``TrajectoryDataset``.

One row per decision: an episode id, a unit id (the privacy unit: a patient, a clinician, an expert; any grouping
the user chooses), observation columns, the action taken, the reward, and optionally the step index, end flags,
next-state columns and the behaviour policy's propensity of the logged action::

    dataset = read_table("stays.csv", episode="stay_id", unit="patient_id", observations=["hr", "bp", "spo2"],
                         action="treatment", actions=["none", "fluids", "vasopressor"], reward="outcome",
                         step="hour", terminated="discharged")

The action set is declared, never read from the rows: ``actions`` is a count n (the column holds the integers
0..n-1) or a list of labels (the column holds those labels, strings or integers; label i becomes action index i,
and the labels are kept in ``metadata.action_labels`` and in every released policy's action space). The observation
columns' names are kept the same way (``metadata.observation_names``, the released policy's observation space), so a
released policy acts on ``{column: value}`` and answers with a label (``dporl.train.export.GreedyPolicy.act``). A set inferred
from the rows (the largest logged action + 1) would be private: one unit who once logged a rare action changes it,
and with it the shape of every released network. Inferring the logged actions is a curator's inspection
(``logged_action_values``, ``dporl data inspect``), never an input of a run.

What the importer decides, so that no algorithm ever reads an invented state as data:

- Rows of one episode are taken in table order (episodes may interleave). With a ``step`` column, steps inside an
  episode must be consecutive integers in that order: an unsorted, duplicated or skipped step is an error (a gap
  would glue two non-adjacent states into one transition).
- An episode's last row ends it. Without flag columns that end is a termination. With ``terminated`` and/or
  ``truncated`` columns only the last row may carry a flag, and a last row must carry one of them (a missing column
  is the complement of the other).
- A terminal step needs no next state: the layout's observation after it is a zero placeholder that every
  consumer masks (``1 - terminated``; see ``dporl.data.dataset``).
- A truncated last step needs a next state. With ``next_observations`` columns it comes from them; without them the
  step is dropped (its observation becomes the episode's final state) and the import summary counts it. An episode
  left with no step is malformed (an error: give its next state or drop it yourself).
- With ``next_observations`` columns, each non-final row's next state must equal the following row's state.

Values outside a declared set are brought into the run's domain, never refused: an episode holding an action
outside the declared action set is dropped whole (its unit keeps its other episodes; a unit left with none is
absent), and ``metadata.extra["import"]["dropped_out_of_set_episodes"]`` and a labelled stderr line tell the curator.
Dropping depends on each unit's own rows only, so it maps neighbouring datasets (add/remove one unit) to
neighbouring (or equal) datasets and every guarantee downstream holds for the data as given; a refusal would instead
turn one unit's rare action into an error where its neighbour gets a release. (A row cannot be dropped alone: it
would glue two non-adjacent states into one transition.)

Malformed data are refused, each with a ``ValidationError`` naming the column: a missing column, a non-numeric or
missing value, NaN or inf, an action value that is no action at all (a fraction; text where a count is declared),
an unsorted / duplicated / skipped step, an episode split across units, a misplaced end flag, a propensity outside
(0, 1] (or a log-propensity > 0), an episode with no usable step. That refusal is the curator's data validation: it
runs on the curator's machine before any run directory, ledger or release exists and reaches the curator only; a
refused import releases nothing, and the guarantee is stated for the well-formed tables a run accepts. The curator
repairs the table and imports again. What does not happen is a refusal after a run has started, or one against a
value that only a mechanism may see.

The unit column's values become ``metadata.unit_keys`` (strings) and ``metadata.unit_column`` names the column, so
every sampler groups by the user's unit and every split by unit is a function of the user's id
(``dporl.privacy.partition``). ``metadata.extra["import"]`` records what the import did (rows, dropped steps,
placeholders); it counts private rows, so it is curator information: never print it in a release.

All work is vectorised over rows (one stable sort only when episodes interleave), so importing costs a small
multiple of reading the file (``benchmarks/bench_table.py``).
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Sequence

import numpy as np

from dporl.data.dataset import DatasetMetadata, TrajectoryDataset, action_set
from dporl.utils.io import curator_note
from dporl.utils.validation import ValidationError

Columns = str | Sequence[str]
DEFAULT_ENV_ID = "offline-table"  # no simulator: the data's environment is not a registered Gymnasium id
CSV_BLOCK_BYTES = 1 << 20  # pyarrow's CSV block (its default): a row longer than this is refused by name


# ---------------------------------------------------------------------------------------------------- reading
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
    import gzip

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
    from dporl.utils.archives import MAX_COMPRESSION_RATIO, SMALL_MEMBER_BYTES, load_budget_bytes

    size = path.stat().st_size
    budget = load_budget_bytes()
    if path.suffix.lower() == ".gz":
        import zlib

        limit = min(budget, max(SMALL_MEMBER_BYTES, MAX_COMPRESSION_RATIO * size))
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
                                              f"{MAX_COMPRESSION_RATIO}:1 and {budget} bytes): refused while inflating")
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

    from dporl.utils.archives import load_budget_bytes

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
    budget = load_budget_bytes()
    if total > budget:
        raise ValidationError("source", f"{path} declares {rows} rows: its {len(names)} columns would take {total} "
                              f"bytes, more than the {budget} this machine may load (half its memory)")


def table_header(source: str | os.PathLike) -> list[str]:
    """The column names of a CSV / TSV (its first line, bounded) or Parquet file (its schema): never a row."""
    path = Path(source)
    if not path.is_file():
        raise ValidationError("source", f"no file at {path}")
    suffix = path.suffix.lower()
    if suffix in (".parquet", ".pq"):
        import pyarrow.parquet as pq

        try:
            return [str(name) for name in pq.read_schema(path).names]
        except Exception as exc:
            raise ValidationError("source", f"{path} is not a readable Parquet file ({exc})") from None
    if suffix in (".csv", ".tsv", ".txt", ".gz"):
        return _csv_header(path, "\t" if ".tsv" in path.suffixes else ",")
    raise ValidationError("source", f"unknown table format {path.suffix!r}: use .csv, .tsv or .parquet")


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


# ---------------------------------------------------------------------------------------------------- checks
def _numeric(name: str, values: np.ndarray) -> np.ndarray:
    if values.dtype.kind not in "iufb":
        raise ValidationError(name, f"expected numbers, got {values.dtype} values (e.g. {values[:1].tolist()})")
    # A sum is NaN/inf when any term is (or on overflow, which the exact check below then clears): one pass,
    # no temporary array for the common case of clean data.
    if values.dtype.kind == "f" and not np.isfinite(np.sum(values, dtype=np.float64)):
        finite = np.isfinite(values)
        if not finite.all():
            bad = np.flatnonzero(~finite)
            raise ValidationError(name, f"{len(bad)} NaN/inf value(s) (first at row {int(bad[0])})")
    return values


def _integers(name: str, values: np.ndarray) -> np.ndarray:
    values = _numeric(name, values)
    if values.dtype.kind == "f":
        if not np.all(values == np.round(values)):
            bad = int(np.flatnonzero(values != np.round(values))[0])
            raise ValidationError(name, f"expected integers, found {values[bad]!r} (row {bad})")
    return values.astype(np.int64, copy=False)


def _flags(name: str, values: np.ndarray) -> np.ndarray:
    if values.dtype.kind == "b":
        return values
    values = _integers(name, values)
    if values.size and (values.min() < 0 or values.max() > 1):
        raise ValidationError(name, "expected booleans (0/1, true/false)")
    return values.astype(bool)


def _factorize(values: np.ndarray, *, sort: bool) -> tuple[np.ndarray, np.ndarray]:
    import pandas as pd

    codes, uniques = pd.factorize(values, sort=sort)
    if len(codes) and codes.min() < 0:  # pandas codes missing values as -1
        raise ValidationError("id", "missing id values")
    return codes.astype(np.int64, copy=False), np.asarray(uniques)


def _action_indices(name: str, values: np.ndarray, n_actions: int, labels: Optional[tuple]) -> np.ndarray:
    """Every row's action index in the declared set (a count: the integers 0..n-1; labels: label i -> i), -1 for a
    value outside it. A value that is no action at all (NaN, a fraction, text for a count) is refused."""
    import pandas as pd

    if labels is None:
        indices = _integers(name, values)
        return np.where((indices >= 0) & (indices < n_actions), indices, -1)
    if isinstance(labels[0], str):  # text labels; a numeric column is matched by its integers' decimal text
        keys = _integers(name, values).astype(str) if values.dtype.kind in "iufb" else values
        index = pd.Index(list(labels), dtype=object)
    else:
        keys, index = _integers(name, values), pd.Index(list(labels), dtype=np.int64)
    return np.asarray(index.get_indexer(keys), dtype=np.int64)


def _describe_set(n_actions: int, labels: Optional[tuple]) -> str:
    if labels is None:
        return f"0..{n_actions - 1} (actions={n_actions})"
    return f"the labels {list(labels)}" if len(labels) <= 10 else f"{len(labels)} declared labels"


def logged_action_values(source: Any, action: str) -> list:
    """The distinct values of the ``action`` column, sorted: what the rows logged (CURATOR-ONLY).

    This is an inspection of private data (``dporl data inspect``): it may change when one unit is added or removed,
    so it is never an input of a private run. Declare the action set you mean (``read_table(..., actions=...)``).
    """
    import pandas as pd

    table = _Table(source)
    table.load([action])
    values = table[action]
    if values.dtype.kind == "f":
        values = _integers(action, values)
    uniques = pd.unique(values)
    try:
        return sorted(uniques.tolist())
    except TypeError:  # mixed types: sort by their text
        return sorted(uniques.tolist(), key=str)


# ---------------------------------------------------------------------------------------------------- import
def read_table(
    source: Any,
    *,
    episode: str,
    unit: str,
    observations: Columns,
    action: str,
    reward: str,
    actions: Any = None,
    step: Optional[str] = None,
    terminated: Optional[str] = None,
    truncated: Optional[str] = None,
    next_observations: Optional[Columns] = None,
    propensity: Optional[str] = None,
    propensity_kind: Literal["prob", "log_prob"] = "prob",
    env_id: Optional[str] = None,
    extra: Optional[Mapping[str, Any]] = None,
    progress: bool = True,
) -> TrajectoryDataset:
    """A validated ``TrajectoryDataset`` from a table with one row per decision (see the module docstring).

    ``observations`` / ``next_observations``: a list of numeric columns, or a string naming one column or else a
    prefix of columns (in table order). ``propensity``: the behaviour policy's probability of the logged action
    (``propensity_kind="prob"``, in (0, 1]) or its log (``"log_prob"``, <= 0). ``actions`` (required, public): the
    declared action set, a count or a list of labels (module docstring); an episode holding an action outside it is
    dropped (counted in the import summary, curator-only). ``env_id``: the simulator's id if one exists. ``progress``: a bar over
    the import's phases for large tables (over ``PROGRESS_BYTES`` on disk or ``PROGRESS_ROWS`` rows).
    """
    n_actions, action_labels = action_set(actions)  # refused by name before the file is opened
    if propensity_kind not in ("prob", "log_prob"):
        raise ValidationError("propensity_kind", f"expected 'prob' or 'log_prob', got {propensity_kind!r}")
    for name, value in (("episode", episode), ("unit", unit), ("action", action), ("reward", reward)):
        if not isinstance(value, str) or not value:
            raise ValidationError(name, f"name the column, got {value!r}")
    table = _Table(source)
    phases = _phases(table, progress)
    obs_names = _resolve(table, observations, "observations")
    next_names = None if next_observations is None else _resolve(table, next_observations, "next_observations")
    if next_names is not None and len(next_names) != len(obs_names):
        raise ValidationError(
            "next_observations", f"{len(next_names)} column(s) for {len(obs_names)} observation column(s)"
        )
    optional = [c for c in (step, terminated, truncated, propensity) if c is not None]
    table.load([episode, unit, action, reward, *obs_names, *(next_names or []), *optional])
    phases.next("episodes")
    n_rows = len(table[episode])
    if n_rows == 0:
        raise ValidationError("source", "the table has no rows")

    # Episodes: rows of one episode keep their table order (a stable sort by first appearance if interleaved).
    # A numeric id column that never decreases needs no factorisation: its changes are the boundaries.
    ids = table[episode]
    for name in (episode, unit):
        if table[name].dtype.kind == "f":
            _numeric(name, table[name])  # a NaN id would silently start an episode (or a unit) of its own
    # The declared action set: an episode holding an action outside it is dropped whole (module docstring).
    action_codes = _action_indices(action, table[action], n_actions, action_labels)
    n_dropped_episodes = 0
    if np.any(action_codes < 0):
        import pandas as pd

        outside_ids = pd.unique(ids[action_codes < 0])
        keep = pd.Index(outside_ids).get_indexer(ids) < 0
        if not keep.any():
            first = table[action][int(np.argmax(action_codes < 0))]
            raise ValidationError(
                action, f"every episode holds an action outside the declared set {_describe_set(n_actions, action_labels)}"
                f" (e.g. {first.item() if isinstance(first, np.generic) else first!r}): is the set declared right?"
            )
        n_dropped_episodes = len(outside_ids)
        table.select(keep)
        action_codes, ids, n_rows = action_codes[keep], table[episode], int(keep.sum())
    order = None
    if ids.dtype.kind in "iuf" and not np.any(ids[1:] < ids[:-1]):
        episode_codes = ids
    else:
        episode_codes, _ = _factorize(ids, sort=False)
        if np.any(episode_codes[1:] < episode_codes[:-1]):
            order = np.argsort(episode_codes, kind="stable")
            episode_codes = episode_codes[order]

    def column(name: str) -> np.ndarray:
        values = table[name]
        return values if order is None else values[order]

    boundaries = np.flatnonzero(episode_codes[1:] != episode_codes[:-1]) + 1
    starts = np.concatenate([[0], boundaries]).astype(np.int64)
    lengths = np.diff(np.concatenate([starts, [n_rows]])).astype(np.int64)
    lasts = starts + lengths - 1
    n_episodes = len(starts)
    is_last = np.zeros(n_rows, dtype=bool)
    is_last[lasts] = True
    inside = ~is_last[:-1]  # row r and r + 1 belong to the same episode

    steps = None
    if step is not None:
        steps = _integers(step, column(step))
        row = _first_row(lambda a, b: ((steps[a + 1 : b + 1] - steps[a:b]) != 1) & inside[a:b], n_rows - 1)
        if row is not None:
            gap = steps[row + 1] - steps[row]
            kind = "duplicated" if gap == 0 else ("unsorted" if gap < 0 else "skipped")
            raise ValidationError(
                step, f"{kind} step in episode {column(episode)[row]!r}: step {steps[row]} is followed by "
                f"{steps[row + 1]} (steps of an episode must be consecutive integers in row order)"
            )

    # Units: one per episode, constant over the episode's rows.
    phases.next("units")
    unit_values = column(unit)
    unit_of_episode = unit_values[starts]
    row = _first_row(lambda a, b: (unit_values[a + 1 : b + 1] != unit_values[a:b]) & inside[a:b], n_rows - 1)
    if row is not None:
        row += 1
        raise ValidationError(
            unit, f"episode {column(episode)[row]!r} is split across units ({unit_of_episode[np.searchsorted(starts, row, 'right') - 1]!r} "
            f"and {unit_values[row]!r}): a unit must own whole episodes"
        )
    unit_ids, unit_uniques = _factorize(unit_of_episode, sort=True)
    unit_keys = [str(value) for value in unit_uniques.tolist()]
    if len(set(unit_keys)) != len(unit_keys):
        raise ValidationError(unit, "distinct unit values print the same; use ids whose text differs")

    # End flags: only an episode's last row may carry one; every last row carries one.
    term = None if terminated is None else _flags(terminated, column(terminated))
    trunc = None if truncated is None else _flags(truncated, column(truncated))
    for name, flags in ((terminated, term), (truncated, trunc)):
        if flags is not None and np.any(flags & ~is_last):
            row = int(np.flatnonzero(flags & ~is_last)[0])
            raise ValidationError(
                name, f"episode {column(episode)[row]!r} is flagged at a row that is not its last: only an "
                "episode's last row may end it"
            )
    if term is None and trunc is None:
        ends_terminated = np.ones(n_episodes, dtype=bool)
    elif trunc is None:
        ends_terminated = term[lasts]
    elif term is None:
        ends_terminated = ~trunc[lasts]
    else:
        ends_terminated = term[lasts]
        open_ended = ~(term[lasts] | trunc[lasts])
        if np.any(open_ended):
            e = int(np.flatnonzero(open_ended)[0])
            raise ValidationError(
                terminated, f"episode {column(episode)[starts[e]]!r} ends with neither {terminated!r} nor {truncated!r} set"
            )

    # Observations and next states.
    phases.next("observations")
    obs_columns = [_numeric(name, column(name)) for name in obs_names]
    final_next = None
    if next_names is not None:
        next_columns = [column(name) for name in next_names]
        for name, obs_values, next_values in zip(next_names, obs_columns, next_columns):
            if next_values.dtype.kind not in "iuf":
                raise ValidationError(name, f"expected numbers, got {next_values.dtype}")
            needed = ~is_last | ~np.repeat(ends_terminated, lengths)  # terminal next states may be empty (NaN)
            _numeric(name, next_values[needed])
            mismatch = ~is_last[:-1] & (next_values[:-1].astype(np.float32) != obs_values[1:].astype(np.float32))
            if np.any(mismatch):
                row = int(np.flatnonzero(mismatch)[0])
                raise ValidationError(
                    name, f"row {row}'s next state differs from the following row's state in episode "
                    f"{column(episode)[row]!r}: a transition's next state must be the next row's state"
                )
        final_next = np.stack([np.asarray(c[lasts], dtype=np.float32) for c in next_columns], axis=1)

    # Which rows are transitions: all, except a truncated last row with no next state (dropped).
    drop = np.zeros(n_episodes, dtype=bool) if next_names is not None else ~ends_terminated
    if np.any(drop & (lengths == 1)):
        e = int(np.flatnonzero(drop & (lengths == 1))[0])
        raise ValidationError(
            "episode", f"episode {column(episode)[starts[e]]!r} has no usable step: its only row is truncated and "
            "there are no next-state columns (give next_observations, or drop the episode yourself)"
        )
    n_dropped = int(drop.sum())
    transition_lengths = lengths - drop
    kept = None
    if n_dropped:
        kept = np.ones(n_rows, dtype=bool)
        kept[lasts[drop]] = False

    def transitions_of(values: np.ndarray) -> np.ndarray:
        return values if kept is None else values[kept]

    actions = action_codes if order is None else action_codes[order]
    rewards = _numeric(reward, column(reward))

    log_probs = None
    if propensity is not None:
        values = transitions_of(_numeric(propensity, column(propensity)))
        if values.dtype.kind != "f":
            values = values.astype(np.float64)
        if propensity_kind == "prob":
            if values.size and (values.min() <= 0 or values.max() > 1):
                raise ValidationError(propensity, f"probabilities must lie in (0, 1], found [{values.min()}, {values.max()}]")
            # in place when transitions_of already copied (one fresh array instead of two)
            log_probs = np.log(values, out=values) if kept is not None else np.log(values)
        else:
            if values.size and values.max() > 0:
                raise ValidationError(propensity, f"log-probabilities must be <= 0, found {values.max()}")
            log_probs = values

    # Observation layout: the rows' states, plus one final state per episode that kept its last row
    # (the next-state columns' value, or a zero placeholder after a termination).
    full = ~drop
    shift = np.cumsum(full) - full  # extra states inserted before episode e
    n_obs = n_rows + int(full.sum())
    extra_index = lasts[full] + 1 + shift[full]
    is_row = np.ones(n_obs, dtype=bool)
    is_row[extra_index] = False
    obs = _interleave(obs_columns, is_row, extra_index, n_obs)
    if final_next is not None:
        obs[extra_index] = np.where(ends_terminated[full, None], 0.0, final_next[full])
    # else: zeros already (terminal placeholders)

    phases.close()
    if n_dropped_episodes:
        curator_note(f"read_table dropped {n_dropped_episodes} episode(s) holding an action outside the declared set "
                     f"{_describe_set(n_actions, action_labels)} (metadata.extra['import'] counts them)")
    term_out = np.zeros(int(transition_lengths.sum()), dtype=bool)
    trunc_out = np.zeros_like(term_out)
    new_lasts = np.cumsum(transition_lengths) - 1
    term_out[new_lasts] = ends_terminated
    trunc_out[new_lasts] = ~ends_terminated if trunc is None else (trunc[lasts] | ~ends_terminated)
    summary = {
        "rows": int(n_rows),
        "episodes": int(n_episodes),
        "units": len(unit_keys),
        "transitions": int(transition_lengths.sum()),
        "dropped_truncated_steps": n_dropped,
        "dropped_out_of_set_episodes": n_dropped_episodes,
        "terminal_placeholders": int(ends_terminated.sum()),
        "columns": {
            "episode": episode, "unit": unit, "observations": obs_names, "action": action, "reward": reward,
            "step": step, "terminated": terminated, "truncated": truncated, "next_observations": next_names,
            "propensity": propensity, "propensity_kind": propensity_kind if propensity else None,
        },
    }
    metadata = DatasetMetadata(
        env_id=env_id or DEFAULT_ENV_ID,
        n_actions=int(n_actions),
        n_experts=len(unit_keys),
        obs_shape=(len(obs_columns),),
        extra={**dict(extra or {}), "import": summary},
        unit_column=unit,
        unit_keys=tuple(unit_keys),
        action_labels=action_labels,
        observation_names=tuple(obs_names),  # the column mapping (or the header's names): public, never values
    )
    return TrajectoryDataset(
        observations=obs,
        actions=transitions_of(actions),
        rewards=transitions_of(rewards),
        terminations=term_out,
        truncations=trunc_out,
        episode_lengths=transition_lengths,
        expert_ids=unit_ids,
        start_steps=None if steps is None else steps[starts],
        behavior_log_probs=log_probs,
        metadata=metadata,
    )


def to_frame(dataset: TrajectoryDataset, *, next_observations: bool = False, unit: str = "unit"):
    """One row per transition (the inverse of ``read_table``): episode, ``unit`` (the unit key), step, obs_0..,
    action (its declared label when the dataset has labels), reward, terminated, truncated, optionally next_obs_0.. and
    log_propensity. For writing example tables."""
    import pandas as pd

    t = dataset.transitions()
    keys = np.asarray(dataset.metadata.unit_key_strings(), dtype=object)
    frame = {"episode": t.episode_ids, unit: keys[t.expert_ids], "step": t.timesteps}
    obs = t.obs.reshape(len(t), -1)
    frame.update({f"obs_{j}": obs[:, j] for j in range(obs.shape[1])})
    labels = dataset.metadata.action_labels
    actions = t.actions if labels is None else np.asarray(labels)[t.actions]
    frame.update(action=actions, reward=t.rewards, terminated=t.terminated, truncated=t.truncated)
    if next_observations:
        nxt = t.next_obs.reshape(len(t), -1)
        frame.update({f"next_obs_{j}": nxt[:, j] for j in range(nxt.shape[1])})
    if t.behavior_log_probs is not None:
        frame["log_propensity"] = t.behavior_log_probs
    return pd.DataFrame(frame)


PROGRESS_BYTES = 64 << 20  # tables at least this large on disk show the import's phases
PROGRESS_ROWS = 1 << 21  # DataFrames with at least this many rows do


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


_BLOCK = 1 << 18  # rows per block of the blockwise passes: temporaries stay small and are reused, not page-faulted


def _first_row(bad_rows, n: int) -> Optional[int]:
    """The first index in [0, n) where ``bad_rows(a, b)`` (a boolean block for [a, b)) is True, else None."""
    for a in range(0, n, _BLOCK):
        block = bad_rows(a, min(n, a + _BLOCK))
        if block.any():
            return a + int(np.argmax(block))
    return None


def _interleave(columns: list, is_row: np.ndarray, extra_index: np.ndarray, n_obs: int) -> np.ndarray:
    """Observation matrix [n_obs, d]: the columns' rows where ``is_row``, zeros at ``extra_index`` (sorted).

    Block by block: each block's columns are written with contiguous masked 1-D writes into a small column-major
    buffer, then transposed into the output (twice as fast as a row scatter, and no full-size temporary).
    """
    d = len(columns)
    obs = np.empty((n_obs, d), dtype=np.float32)
    buffer = np.zeros((d, _BLOCK), dtype=np.float32)
    for p0 in range(0, n_obs, _BLOCK):
        p1 = min(n_obs, p0 + _BLOCK)
        mask = is_row[p0:p1]
        r0 = p0 - int(np.searchsorted(extra_index, p0))  # input rows before this block
        r1 = r0 + int(mask.sum())
        view = buffer[:, : p1 - p0]
        view[:, ~mask] = 0.0
        for j, values in enumerate(columns):
            view[j][mask] = values[r0:r1]
        obs[p0:p1] = view.T
    return obs


def import_summary(dataset: TrajectoryDataset) -> Optional[dict]:
    """What ``read_table`` did (rows, dropped truncated steps, placeholders, column mapping); curator-only."""
    return dataset.metadata.extra.get("import")


def read_minari(
    source: str | os.PathLike,
    *,
    unit: str | Mapping[int, int],
    root: Optional[str | os.PathLike] = None,
    behavior_log_prob_key: Optional[str] = "behavior_log_prob",
    progress: bool = True,
) -> TrajectoryDataset:
    """A local Minari dataset with the privacy unit named: ``unit`` is the info key holding each episode's unit id
    (constant over the episode), or a mapping Minari episode id -> unit id. Wraps
    ``dporl.data.minari_io.import_minari``; the unit column and keys are recorded as ``read_table`` records them."""
    from dporl.data.minari_io import import_minari

    dataset = import_minari(
        source, expert_id_key=unit, root=root, behavior_log_prob_key=behavior_log_prob_key, progress=progress
    )
    column = unit if isinstance(unit, str) else "minari_episode_unit"
    return with_unit(dataset, column)


def with_unit(dataset: TrajectoryDataset, column: str) -> TrajectoryDataset:
    """The same episodes with units re-indexed densely from their ids and the unit ``column`` recorded."""
    ids, uniques = _factorize(dataset.expert_ids, sort=True)
    meta = dataset.metadata.to_dict()
    meta.update(n_experts=len(uniques), unit_column=column, unit_keys=[str(int(u)) for u in uniques])
    return dataset.replace(expert_ids=ids, metadata=DatasetMetadata.from_dict(meta))


__all__ = ["DEFAULT_ENV_ID", "import_summary", "logged_action_values", "read_minari", "read_table", "table_header",
           "to_frame", "with_unit"]

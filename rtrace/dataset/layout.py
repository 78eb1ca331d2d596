"""Where a run's files live, what they are called, and the storage they are written to.

A run's dataset::

    <RTRACE_PARQUET_PATH>/<run>/trajectories/train/step=12/<writer>-000003.v1.1.parquet
                               /trajectories/train/steps/<writer>-000000-000310.s1-32.v1.1.parquet
                               /trajectories/validate/step=4/...
                               /spans/train/step=12/<writer>-000003.v1.1.parquet

- ``step=N`` is a hive partition (every engine turns it into the ``step`` column it also
  finds in the file, as a BIGINT); a step that is not an int is
  ``step=__HIVE_DEFAULT_PARTITION__`` (NULL). ``train`` / ``validate`` is a plain folder,
  not ``validate=false``: a hive key's value is text to most engines, and DuckDB would
  turn the files' BOOLEAN ``validate`` into VARCHAR.
- ``steps/`` holds a writer's finished steps merged into one file (``.s<first step>-<last
  step>.`` in its name; a row group per step, so a query on one step reads that row group,
  by the step's statistics): the run's file count grows with its steps divided by the steps
  per file, not with its steps. It is a plain folder (no ``key=value``): an engine that
  detects hive partitions finds that the folders disagree and reads ``step`` from the files
  (DuckDB gives a hive value precedence over the file's column, so a many-step file can
  never sit in a ``step=N`` folder).
- ``<writer>`` is 16 random hex digits drawn by each sink when it starts (8 bytes of
  ``os.urandom``): many processes and collectors write into one run with no coordination
  and never pick the same name. ``000003`` counts the writer's files; a compacted file
  covers a range, ``<writer>-000000-000007``, and replaces the files of that writer whose
  numbers it covers, in its folder (a step merged into ``steps/``: the files of the steps
  it names, in their ``step=N`` folders; never another ``steps/`` file). Readers skip a
  covered file if it is still there: the compacted file is renamed into place before its
  inputs are deleted. A trajectory's row
  and its spans' rows have the same file name in the two tables.
- ``.v1.1.`` is the schema's version (:mod:`rtrace.dataset.schema`): a reader refuses a
  newer major version from the name alone, without opening the file, and reads a run whose
  files all have one version without comparing their schemas.
- Files appear whole: on a local or mounted filesystem they are written under a hidden
  temporary name (``.<name>.tmp``, which no engine reads) and renamed; on object storage
  (``s3://``, ``gs://``...) one upload becomes visible when it completes.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from .schema import MAJOR, MINOR, SPANS, TRAJECTORIES

__all__ = ["NULL_STEP", "STEPS_DIR", "FileName", "parse_name", "partition_dir", "parse_partition", "steps_dir",
           "parse_steps_dir", "is_steps_file", "run_name", "Store", "open_store", "is_url"]

#: The hive folder value of a NULL step (Hive's, which DuckDB, polars and Spark read as NULL).
NULL_STEP = "__HIVE_DEFAULT_PARTITION__"
#: the folder (beside the ``step=N`` ones) of the files holding many finished steps
STEPS_DIR = "steps"
_NAME = re.compile(r"^(?P<writer>[0-9a-f]{16})-(?P<first>\d{6,})(?:-(?P<last>\d{6,}))?"
                   r"(?:\.s(?P<lo>\d+)-(?P<hi>\d+))?\.v(?P<major>\d+)\.(?P<minor>\d+)\.parquet$")
_STEP = re.compile(r"^step=(-?\d+|" + NULL_STEP + ")$")


@dataclass(frozen=True)
class FileName:
    """A data file's name: its writer, the range of that writer's file numbers it holds,
    the range of steps it holds when it is a many-step file (in ``steps/``), and the
    schema's version."""

    writer: str
    first: int
    last: int
    major: int = MAJOR
    minor: int = MINOR
    #: (first step, last step) of a file of ``steps/``; None for a file of a ``step=N`` folder
    steps: tuple[int, int] | None = None

    def __str__(self) -> str:
        rng = f"{self.first:06d}" if self.first == self.last else f"{self.first:06d}-{self.last:06d}"
        steps = f".s{self.steps[0]}-{self.steps[1]}" if self.steps is not None else ""
        return f"{self.writer}-{rng}{steps}.v{self.major}.{self.minor}.parquet"

    def covers(self, other: "FileName", other_steps: tuple[int, int] | None = None) -> bool:
        """This (compacted) file holds everything ``other`` holds, and is not it: the same
        writer, a range of numbers that holds ``other``'s; for two files of one ``step=N``
        folder, that is all. A file of ``steps/`` covers only files whose steps
        (``other_steps``: a ``step=N`` file's step, twice; None: unknown, nothing covered) are
        among its own: a writer's numbers are one count over every step, so another step's
        file can have a number in its range. A file of ``steps/`` never covers another one:
        a writer merges step files into ``steps/``, never ``steps/`` files, so two of them
        always hold different rows, however their ranges lie."""
        if self.writer != other.writer or not (self.first <= other.first and other.last <= self.last) \
                or (self.first, self.last) == (other.first, other.last):
            return False
        if self.steps is None:
            return other.steps is None  # (the caller compares files of one folder)
        if other.steps is not None or other_steps is None:
            return False
        return self.steps[0] <= other_steps[0] and other_steps[1] <= self.steps[1]


def parse_name(name: str) -> FileName | None:
    """The :class:`FileName` of a data file's base name; None for anything else."""
    m = _NAME.match(name)
    if m is None:
        return None
    first = int(m["first"])
    steps = (int(m["lo"]), int(m["hi"])) if m["lo"] is not None else None
    if steps is not None and steps[0] > steps[1]:
        return None
    return FileName(m["writer"], first, int(m["last"]) if m["last"] else first, int(m["major"]), int(m["minor"]),
                    steps)


def partition_dir(table: str, validate: bool, step: int | None) -> str:
    """``trajectories/train/step=12`` (relative to the run's folder)."""
    return f"{table}/{'validate' if validate else 'train'}/step={NULL_STEP if step is None else step}"


def parse_partition(rel_dir: str) -> tuple[str, bool, int | None] | None:
    """``(table, validate, step)`` of a partition folder (relative to the run); None if it is not one."""
    parts = rel_dir.strip("/").split("/")
    if len(parts) != 3 or parts[0] not in (TRAJECTORIES, SPANS) or parts[1] not in ("train", "validate"):
        return None
    m = _STEP.match(parts[2])
    if m is None:
        return None
    step = None if m.group(1) == NULL_STEP else int(m.group(1))
    return parts[0], parts[1] == "validate", step


def steps_dir(table: str, validate: bool) -> str:
    """``trajectories/train/steps`` (relative to the run's folder): the many-step files."""
    return f"{table}/{'validate' if validate else 'train'}/{STEPS_DIR}"


def parse_steps_dir(rel_dir: str) -> tuple[str, bool] | None:
    """``(table, validate)`` of a ``steps/`` folder (relative to the run); None if it is not one."""
    parts = rel_dir.strip("/").split("/")
    if len(parts) != 3 or parts[0] not in (TRAJECTORIES, SPANS) or parts[1] not in ("train", "validate") \
            or parts[2] != STEPS_DIR:
        return None
    return parts[0], parts[1] == "validate"


def is_steps_file(path: str) -> bool:
    """A file of a ``steps/`` folder (a path, relative or not, with ``/`` or the OS's separator)."""
    folder = os.path.basename(os.path.dirname(path.replace(os.sep, "/")))
    return folder == STEPS_DIR


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def run_name(experiment: str | None) -> str:
    """The run's folder name: the experiment name with every run of characters other than
    letters, digits, ``.``, ``_`` and ``-`` replaced by ``_``; ``default`` when unset."""
    if not experiment:
        return "default"
    name = _UNSAFE.sub("_", str(experiment)).strip(".")
    return name or "default"


def is_url(path: str) -> bool:
    """``s3://...``, ``gs://...``, ``file://...``: a URL, not a local path (``C:\\`` is a path)."""
    scheme, sep, _ = str(path).partition("://")
    return bool(sep) and len(scheme) > 1 and scheme.replace("+", "").replace("-", "").isalnum()


# ----------------------------------------------------------------------------- storage
#: object stores: an upload appears whole when it completes, and there is no rename
_OBJECT_STORES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "hf", "memory", "oci", "r2", "b2")


class Store:
    """A folder on some filesystem, as the dataset uses it: write a file whole, list,
    read the end of a file, delete. ``root`` is a local path or a URL."""

    #: Sync each local file and its folder before and after the rename. Off by default: the
    #: JSONL sink's durability (a file survives the process's crash, in the OS's cache, not a
    #: power loss), and a sync per file limited a collector to the disk's sync latency (4
    #: syncs per batch). After a power loss a renamed file may come back empty or cut: the
    #: readers skip it as cut short (warned, counted).
    fsync = False

    def __init__(self, root: str) -> None:
        self.root = root
        self.local = not is_url(root) or root.startswith("file://")
        if self.local:
            self.root = os.path.abspath(root[len("file://"):] if root.startswith("file://") else root)
            self.fs: Any = None
            self.base = self.root
        else:
            self.fs, self.base = _filesystem(root)
            self.object_store = root.split("://", 1)[0].lower() in _OBJECT_STORES

    # paths are '/'-separated and relative to the root
    def path(self, rel: str) -> str:
        """The path of ``rel`` on the store's filesystem (an absolute local path, or the
        pyarrow filesystem's path)."""
        return os.path.join(self.root, *rel.split("/")) if self.local else f"{self.base.rstrip('/')}/{rel}"

    def write(self, rel: str, fill: Callable[[Any], None]) -> int:
        """Write a new file whole: ``fill(stream)`` writes it; returns its size in bytes.
        Locally: a hidden temporary file in the same folder, renamed into place (synced
        first with :attr:`fsync`); a failure removes the temporary file. On an object store:
        one upload, visible when it completes; a failure aborts it."""
        if self.local:
            return self._write_local(rel, fill)
        import pyarrow.fs as pafs

        target = self.path(rel)
        parent = target.rsplit("/", 1)[0]
        if not self.object_store:
            self.fs.create_dir(parent, recursive=True)
            tmp = f"{parent}/.{target.rsplit('/', 1)[1]}.tmp"
            try:
                with self.fs.open_output_stream(tmp) as out:
                    fill(out)
                self.fs.move(tmp, target)
            except BaseException:
                try:
                    self.fs.delete_file(tmp)
                except Exception:
                    pass
                raise
        else:
            stream = self.fs.open_output_stream(target)
            try:
                fill(stream)
            except BaseException:
                abort = getattr(stream, "abort", None)  # pyarrow >= 15: no object is created
                if abort is not None:
                    try:
                        abort()
                    except Exception:
                        pass
                raise
            stream.close()
        info = self.fs.get_file_info(target)
        return int(info.size or 0) if info.type == pafs.FileType.File else 0

    def _write_local(self, rel: str, fill: Callable[[Any], None]) -> int:
        target = self.path(rel)
        folder, name = os.path.split(target)
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".{name}.{os.urandom(4).hex()}.tmp")
        try:
            # 0600 less the umask, as the JSONL sink: trajectories hold prompts and answers
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with open(fd, "wb") as f:
                fill(f)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
                size = f.tell()
            os.rename(tmp, target)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        if self.fsync:
            _fsync_dir(folder)
        return size

    def delete(self, rel: str) -> None:
        if self.local:
            try:
                os.unlink(self.path(rel))
            except FileNotFoundError:
                pass
        else:
            self.fs.delete_file(self.path(rel))

    def list(self, rel: str = "") -> Iterator[tuple[str, int]]:
        """``(path relative to the root, size)`` of every file under ``rel``, recursively;
        nothing when ``rel`` does not exist."""
        if self.local:
            yield from _walk(self.path(rel) if rel else self.root, rel.strip("/"))
            return
        import pyarrow.fs as pafs

        selector = pafs.FileSelector(self.path(rel) if rel else self.base, recursive=True, allow_not_found=True)
        prefix = self.base.rstrip("/") + "/"
        for info in sorted(self.fs.get_file_info(selector), key=lambda i: i.path):
            if info.type == pafs.FileType.File and info.path.startswith(prefix):
                yield info.path[len(prefix):], int(info.size or 0)

    def read_range(self, rel: str, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` (negative: from the end)."""
        if self.local:
            with open(self.path(rel), "rb") as f:
                f.seek(offset, os.SEEK_END if offset < 0 else os.SEEK_SET)
                return f.read(length)
        with self.fs.open_input_file(self.path(rel)) as f:
            if offset < 0:
                offset = max(0, f.size() + offset)
            f.seek(offset)
            return f.read(length)

    def read_metadata(self, rel: str) -> Any:
        """The Parquet footer of a file (``pyarrow.parquet.FileMetaData``)."""
        import pyarrow.parquet as pq

        if self.local:
            return pq.read_metadata(self.path(rel))
        with self.fs.open_input_file(self.path(rel)) as f:
            return pq.read_metadata(f)

    def exists(self, rel: str = "") -> bool:
        if self.local:
            return os.path.exists(self.path(rel) if rel else self.root)
        import pyarrow.fs as pafs

        return self.fs.get_file_info(self.path(rel) if rel else self.base).type != pafs.FileType.NotFound

    def arrow_fs(self) -> Any:
        """The pyarrow filesystem (a local one for a local root)."""
        if self.local:
            import pyarrow.fs as pafs

            return pafs.LocalFileSystem()
        return self.fs

    def child(self, name: str) -> "Store":
        """The store of a sub-folder (a run's folder under the root)."""
        if self.local:
            return Store(os.path.join(self.root, name))
        sub = Store.__new__(Store)
        head, sep, query = self.root.partition("?")  # s3://bucket/prefix?endpoint_override=...: options stay last
        sub.root, sub.local, sub.fs = f"{head.rstrip('/')}/{name}{sep}{query}", False, self.fs
        sub.base, sub.object_store = f"{self.base.rstrip('/')}/{name}", self.object_store
        return sub


def _walk(folder: str, rel: str) -> Iterator[tuple[str, int]]:
    """Files under a local folder, depth first, sorted: one scandir per folder (its entries
    carry their sizes: no stat per file)."""
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return
    for entry in entries:
        path = f"{rel}/{entry.name}" if rel else entry.name
        try:
            if entry.is_dir(follow_symlinks=False):
                yield from _walk(entry.path, path)
            elif entry.is_file():
                yield path, entry.stat().st_size
        except FileNotFoundError:  # deleted by a compaction meanwhile
            continue


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a folder; the file itself is synced
    finally:
        os.close(fd)


def _filesystem(url: str) -> tuple[Any, str]:
    """(pyarrow filesystem, path in it) of a URL: pyarrow's own filesystems for the schemes
    it knows (``s3://`` with ``?endpoint_override=...&region=...`` query options, ``gs://``,
    ``hdfs://``...), else any fsspec filesystem (``hf://``, ``memory://``, ``az://`` with
    adlfs...) through pyarrow's FSSpecHandler.

    Raises:
        ValueError: a scheme neither knows (the message says which package adds it).
    """
    import pyarrow.fs as pafs

    try:
        fs, path = pafs.FileSystem.from_uri(url)
        return fs, path
    except (pa_errors() + (ValueError,)) as exc:
        native_error = exc
    try:
        import fsspec
    except ImportError:
        raise ValueError(f"{url!r}: pyarrow cannot open it ({native_error}) and fsspec is not installed "
                         "(pip install fsspec, and the fsspec filesystem of that scheme)") from None
    try:
        fs, path = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as exc:
        raise ValueError(f"{url!r}: no filesystem for it ({exc})") from None
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path


def pa_errors() -> tuple[type[BaseException], ...]:
    import pyarrow as pa

    return (pa.ArrowException,)


def open_store(root: str) -> Store:
    """The :class:`Store` of a local path or URL.

    Raises:
        ValueError: a URL no installed filesystem opens.
    """
    return Store(root)

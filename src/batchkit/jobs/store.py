"""JobStore: the output, the dead-letter file and the journal of one bulk job, written exactly once.

Three files live side by side::

    out.jsonl            one line per item that succeeded: {"<id field>": id, "output": result}
    out.dead.jsonl       one line per item that failed:    {"<id field>": id, "line": n, "error": "..."}
    out.jsonl.journal    a header naming the job, then per commit {"out": bytes, "dead": bytes, ...}
                         with the input line and a digest of the record of each line committed

A commit appends a group of finished lines to the output (one ``write`` and one ``fdatasync``),
then to the dead-letter file, then appends the two new file lengths to the journal and syncs it.
The journal's last complete record is the commit point: bytes of the output or dead-letter file
beyond the length it records were written by a commit that did not finish, and are cut off when
the job restarts (their items are simply done again). A crash at any moment, between any two
system calls, therefore leaves each item either committed once or not at all, and no torn line.

On start, :meth:`JobStore.open` reads the journal, rebuilds the set of finished ids from the files
themselves (with each record's line and digest, for the job to check against its input), and only
then cuts both files back to the committed lengths, so that the job skips what is done.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._errors import JobStateError
from .fingerprint import Committed, Fingerprints, is_id

__all__ = ["JobStateError", "JobStore", "dead_letter_path_for", "journal_path_for"]

try:  # POSIX: one job per output at a time; the lock dies with the process (SIGKILL included)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

JOURNAL_VERSION = 2  # 2: fingerprints of every committed record, and the function that computed them
_sync = getattr(os, "fdatasync", os.fsync)  # file lengths are data: fdatasync flushes them too


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back until the block ends, then act on them as their handlers
    would have: Ctrl-C (or a SIGTERM the job turned into a clean stop) lands between two commits,
    never inside one. Only the main thread can hold signals; elsewhere this does nothing (the
    signals then reach the main thread, not this one)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous: dict[int, Any] = {}
    for held in (signal.SIGINT, signal.SIGTERM):
        previous[held] = signal.signal(held, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        for number in dict.fromkeys(caught):  # each once, in the order they came
            handler = previous[number]
            if callable(handler):
                handler(number, None)  # default_int_handler raises KeyboardInterrupt
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), number)


def journal_path_for(output: Path) -> Path:
    """``out.jsonl`` -> ``out.jsonl.journal``."""
    return output.with_name(output.name + ".journal")


def dead_letter_path_for(output: Path) -> Path:
    """The default dead-letter file: ``out.jsonl`` -> ``out.dead.jsonl``."""
    return output.with_name(f"{output.stem}.dead{output.suffix or '.jsonl'}")


@dataclass(frozen=True, slots=True)
class DoneSet:
    """What earlier runs finished: ids (output and dead letters), the line numbers of dead
    letters that have no usable id (malformed lines, missing ids), and each of those records
    with its input line and digest."""

    ids: set[Any]
    lines: set[int]
    dead_letters: int
    committed: list[Committed]


def _fsync_dir(path: Path) -> None:
    """Make a file's creation or rename durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:  # pragma: no cover - Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some file systems refuse fsync on a directory
        pass
    finally:
        os.close(fd)


def _is_empty_file(fd: int) -> bool:
    """Whether ``fd`` is an empty regular file (never a device such as ``/dev/null``)."""
    st = os.fstat(fd)
    return stat.S_ISREG(st.st_mode) and st.st_size == 0


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _lines(path: Path, length: int) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line) of the first ``length`` bytes of ``path``."""
    if length == 0:
        return
    with path.open("rb") as f:
        remaining = length
        for n, line in enumerate(f, start=1):
            if len(line) > remaining:
                line = line[:remaining]
            remaining -= len(line)
            yield n, line
            if remaining <= 0:
                return


def _describe(key: str, what: str, value: object) -> str:
    """A journal header setting as the user chose it (an id field of None is ``--line-ids``)."""
    if key == "id_field" and value is None:
        return "line numbers as ids (--line-ids)"
    return f"{what} {value!r}"


class JobStore:
    """The files of one job, opened for resuming: :meth:`open` recovers, :meth:`commit` appends.

    Not thread-safe: one thread (the job's) commits. Use as a context manager or call
    :meth:`close`.
    """

    def __init__(
        self,
        output: Path,
        dead_letter: Path,
        journal: Path,
        header: dict[str, Any],
        key_field: str,
        result_field: str = "output",
    ) -> None:
        self.output = output
        self.dead_letter = dead_letter
        self.journal = journal
        self.header = header
        self.key_field = key_field
        self.result_field = result_field
        self.out_bytes = 0
        self.dead_bytes = 0
        self.commits = 0
        self._out_fd = -1
        self._dead_fd = -1
        self._journal_fd = -1
        self._created_dead = False  # this run created the (empty) dead-letter file to lock it
        self._created_out = False  # this run created the output (removed again if the job is refused)
        self._out_fp = Fingerprints()  # of the committed lines, read from the journal at start
        self._dead_fp = Fingerprints()

    # ------------------------------------------------------------------ opening

    @classmethod
    def open(
        cls,
        output: Path,
        dead_letter: Path,
        *,
        source: str | None,
        id_field: str | None,
        fn: str | None = None,
        fn_options: dict[str, Any] | None = None,
        retry_dead_letters: bool = False,
        check: Callable[[DoneSet], None] | None = None,
        result_field: str = "output",
    ) -> tuple[JobStore, DoneSet]:
        """Open (or start) the job writing to ``output``; return the store and what is done.

        ``fn`` and ``fn_options`` name the function and the settings that shape its results (as
        JSON); a resume with others is refused like one with another input. ``check(done)`` runs
        once the files are read and before anything is written: it raises to refuse the resume
        (the job's input no longer holds what ``done`` was computed from). With
        ``retry_dead_letters``, the dead-letter file is emptied (after the journal records that)
        and its records count as not done: the job tries them again. ``result_field``: the field
        every output line holds beside the id field (``"output"``; ``"response"`` for OpenAI
        Batch answers).

        Raises:
            JobStateError: another process runs this job; the journal names another input,
                id field, dead-letter file or function, or was written by an earlier version;
                the output exists without a journal; or a file is shorter than its journal
                says, or holds a line that is not one of this job's. A refused job leaves no
                file it created.
        """
        output = output.resolve()
        dead_letter = dead_letter.resolve()
        journal = journal_path_for(output)
        header = {
            "batchkit_job": JOURNAL_VERSION,
            "source": source,
            "id_field": id_field,
            "dead_letter": str(dead_letter),
            "fn": fn,
            "fn_options": json.loads(json.dumps(fn_options or {}, sort_keys=True, default=repr)),  # as read back
        }
        key_field = id_field if id_field is not None else "line"
        store = cls(output, dead_letter, journal, header, key_field, result_field)
        try:
            done = store._recover(retry_dead_letters, check)
        except BaseException:
            if store._created_out and store._out_fd >= 0 and _is_empty_file(store._out_fd):
                store.output.unlink(missing_ok=True)  # while still locked: no one else writes it
            store.close()
            raise
        return store, done

    def _recover(self, retry_dead_letters: bool, check: Callable[[DoneSet], None] | None) -> DoneSet:
        self._created_out = not self.output.exists()
        self._out_fd = self._open_locked(
            self.output,
            f"another process is running the job that writes {self.output}: wait for it to finish "
            "(or stop it), or choose another output",
        )
        # The dead-letter file is locked too: two jobs (with two outputs) sharing it would cut
        # each other's dead letters on their next start. Created now to hold the lock, it is
        # removed again at close while empty.
        existed = self.dead_letter.exists()
        self._dead_fd = self._open_locked(
            self.dead_letter,
            f"another running job writes {self.dead_letter} (as its output or its dead-letter file): "
            "give each job its own dead-letter file, or wait for the other one to finish",
        )
        self._created_dead = not existed
        committed = self._read_journal()
        if committed is None:  # a new job: the output must be new (or empty) too
            for path in (self.output, self.dead_letter):
                if path.exists() and path.stat().st_size > 0:
                    raise JobStateError(
                        f"{path} exists and has no journal {self.journal.name} beside the output, so it was not "
                        "written by a batchkit job (or its journal was deleted): move it away, or delete it to "
                        "start over"
                    )
            committed = (0, 0)
        self.out_bytes, self.dead_bytes = committed
        self._check_size(self.output, self.out_bytes)
        self._check_size(self.dead_letter, self.dead_bytes)
        if retry_dead_letters:
            self.dead_bytes = 0
            self._dead_fp = Fingerprints()
        # Read before anything is written: a refused resume (check) leaves the files as they were.
        done = self._scan()
        if check is not None:
            check(done)
        # Journal first, then cut: a crash in between leaves files longer than their commit point,
        # which the next start cuts again. The rewrite (header + one record, atomic) also keeps the
        # journal's lines few however many restarts and commits the job sees.
        self._write_journal_atomically()
        self._out_fp, self._dead_fp = Fingerprints(), Fingerprints()  # in done.committed now
        _fsync_dir(self.output)
        self._cut(self._out_fd, self.out_bytes)
        self._cut(self._dead_fd, self.dead_bytes)
        self._journal_fd = os.open(self.journal, os.O_WRONLY | os.O_APPEND)
        return done

    def _read_journal(self) -> tuple[int, int] | None:
        """The committed (output, dead-letter) lengths, or None without a journal; the committed
        lines' fingerprints go to ``_out_fp`` and ``_dead_fp``."""
        try:
            f = self.journal.open("rb")
        except FileNotFoundError:
            return None
        with f:
            # A line without its newline is a torn record: not a commit.
            complete = [raw for raw in f if raw.endswith(b"\n")]
        try:
            header = json.loads(complete[0]) if complete else None
        except ValueError:
            header = None
        version = header.get("batchkit_job") if isinstance(header, dict) else None
        if version == 1:
            raise JobStateError(
                f"{self.journal} was written by an earlier batchkit (journal version 1, which cannot tell whether "
                "the input changed since): finish the job with that version, or delete the journal together with "
                f"{self.output.name} and its dead-letter file to start over"
            )
        if not isinstance(header, dict) or version != JOURNAL_VERSION:
            raise JobStateError(
                f"{self.journal} is not a batchkit job journal (version {JOURNAL_VERSION}): delete it together with "
                f"{self.output.name} to start over, or choose another output"
            )
        for key, what in (
            ("id_field", "id field"),
            ("source", "input"),
            ("dead_letter", "dead-letter file"),
            ("fn", "function"),
            ("fn_options", "function settings"),
        ):
            if header.get(key) != self.header[key]:
                raise JobStateError(
                    f"{self.output} belongs to a job with {_describe(key, what, header.get(key))}, not "
                    f"{_describe(key, what, self.header[key])}: rerun with the same arguments to resume it, or "
                    "choose another output"
                )
        out, dead = 0, 0
        records = complete[1:]
        for i, raw in enumerate(records):
            try:
                rec = json.loads(raw)
                out, dead = int(rec["out"]), int(rec["dead"])
                self._out_fp.extend(Fingerprints.from_json(rec, "out"))
                self._dead_fp.extend(Fingerprints.from_json(rec, "dead"))
            except (ValueError, KeyError, TypeError):
                if i == len(records) - 1:
                    break  # only the record being written at a crash can be damaged
                raise JobStateError(
                    f"{self.journal}:{i + 2} is not a commit record: the journal was changed outside the job; delete "
                    f"it together with {self.output.name} and its dead-letter file to start over"
                ) from None
        return out, dead

    def _check_size(self, path: Path, length: int) -> None:
        size = path.stat().st_size if path.exists() else 0
        if size < length:
            raise JobStateError(
                f"{path} holds {size} bytes but the job's journal committed {length}: it was changed outside "
                "the job; restore it, or delete the output, the dead-letter file and the journal to start over"
            )

    @staticmethod
    def _cut(fd: int, length: int) -> None:
        if os.fstat(fd).st_size > length:  # written by a commit that did not finish: its items are redone
            os.ftruncate(fd, length)
            _sync(fd)

    def _scan(self) -> DoneSet:
        ids: set[Any] = set()
        lines: set[int] = set()
        committed: list[Committed] = []
        key = self.key_field
        keys: list[Any] = []
        for n, raw in _lines(self.output, self.out_bytes):
            rec = self._parse(self.output, n, raw)
            value = rec.get(key)
            if not is_id(value) or self.result_field not in rec:
                raise JobStateError(
                    f"{self.output}:{n} is not an output line of this job (no {key!r} and {self.result_field!r})"
                )
            keys.append(value)
        ids.update(keys)
        self._check_fingerprints(self.output, len(keys), self._out_fp)
        committed.extend(zip(keys, self._out_fp.lines, self._out_fp.digests, strict=True))
        keys = []
        for n, raw in _lines(self.dead_letter, self.dead_bytes):
            rec = self._parse(self.dead_letter, n, raw)
            value = rec.get(key)
            if is_id(value):
                ids.add(value)
            elif isinstance(rec.get("line"), int):
                lines.add(rec["line"])
                value = None
            else:
                raise JobStateError(f"{self.dead_letter}:{n} is not a dead letter of this job (no {key!r} or 'line')")
            keys.append(value)
        self._check_fingerprints(self.dead_letter, len(keys), self._dead_fp)
        committed.extend(zip(keys, self._dead_fp.lines, self._dead_fp.digests, strict=True))
        return DoneSet(ids, lines, len(keys), committed)

    def _check_fingerprints(self, path: Path, n: int, fp: Fingerprints) -> None:
        if n != len(fp):
            raise JobStateError(
                f"{self.journal} fingerprints {len(fp):,} lines of {path.name} but the job committed {n:,}: the files "
                "were changed outside the job; delete the output, the dead-letter file and the journal to start over"
            )

    @staticmethod
    def _parse(path: Path, n: int, raw: bytes) -> dict[str, Any]:
        try:
            rec = json.loads(raw)
        except ValueError:
            rec = None
        if not isinstance(rec, dict) or not raw.endswith(b"\n"):
            raise JobStateError(
                f"{path}:{n} is not a complete JSON object although the journal committed it: the file was "
                "changed outside the job; restore it, or delete it, the other output and the journal to start over"
            )
        return rec

    def _write_journal_atomically(self) -> None:
        tmp = self.journal.with_name(self.journal.name + ".tmp")
        record = {"out": self.out_bytes, "dead": self.dead_bytes, **self._out_fp.to_json("out")}
        record.update(self._dead_fp.to_json("dead"))
        body = json.dumps(self.header) + "\n" + json.dumps(record) + "\n"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, body.encode())
            _sync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.journal)

    @staticmethod
    def _open_locked(path: Path, busy: str) -> int:
        """Open ``path`` for appending (creating it) and hold an exclusive lock on it; raise
        JobStateError(``busy``) if another process holds one. A lock taken on a file that was
        removed or replaced meanwhile (a job that finished and removed its empty dead-letter
        file) is dropped and taken again on the file now at ``path``."""
        for _ in range(100):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
            if fcntl is None or not stat.S_ISREG(os.fstat(fd).st_mode):  # Windows; /dev/null and the like
                return fd
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise JobStateError(busy) from None
            try:
                st = os.stat(path)
            except FileNotFoundError:
                st = None
            held = os.fstat(fd)
            if st is not None and (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino):
                return fd
            os.close(fd)
        raise JobStateError(busy)  # pragma: no cover - the file keeps being replaced

    # ------------------------------------------------------------------ committing

    def commit(self, out: bytes, dead: bytes, out_fp: Fingerprints, dead_fp: Fingerprints) -> None:
        """Append whole lines to the output and the dead-letter file, durably, then record the new
        lengths and the lines' fingerprints (one per line, in order) in the journal. After a
        crash inside this call, the restart cuts both files back to the previous commit, so
        these lines count as never written. Ctrl-C and SIGTERM wait for the commit to finish (in
        the main thread), so an interrupted job leaves no line that its rerun does not count as
        done."""
        with _signals_deferred():
            self._commit(out, dead, out_fp, dead_fp)

    def _commit(self, out: bytes, dead: bytes, out_fp: Fingerprints, dead_fp: Fingerprints) -> None:
        if out:
            _write_all(self._out_fd, out)
            _sync(self._out_fd)
            self.out_bytes += len(out)
        if dead:
            if self._created_dead:
                _fsync_dir(self.dead_letter)  # the file's creation is durable before its lines
                self._created_dead = False
            _write_all(self._dead_fd, dead)
            _sync(self._dead_fd)
            self.dead_bytes += len(dead)
        if out or dead:
            fields = {
                "out": self.out_bytes,
                "dead": self.dead_bytes,
                **out_fp.to_json("out"),
                **dead_fp.to_json("dead"),
            }
            record = json.dumps(fields) + "\n"
            _write_all(self._journal_fd, record.encode())
            _sync(self._journal_fd)
            self.commits += 1

    def close(self) -> None:
        """Close the files (and release the locks); remove the dead-letter file if it is empty
        (it exists only once something failed). Idempotent."""
        if self._dead_fd >= 0 and _is_empty_file(self._dead_fd):
            self.dead_letter.unlink(missing_ok=True)  # while still locked: no one else writes it
        self._created_dead = False
        for name in ("_journal_fd", "_dead_fd", "_out_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)

    def __enter__(self) -> JobStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<JobStore {self.output.name} out_bytes={self.out_bytes} dead_bytes={self.dead_bytes} "
            f"commits={self.commits}>"
        )

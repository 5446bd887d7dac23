"""The document readers of trainer/data/text_inputs.py: formats, globs and directories, the error policy."""
from __future__ import annotations

import base64
import errno
import gzip
import io
import json
import os
import pickle

import pyarrow
import pyarrow.parquet
import pytest
import zstandard

from trainer.data import PrepareOptions, prepare_text_corpus, text_inputs
from trainer.data.text_inputs import (
    TEXT_SUFFIXES,
    DataError,
    is_text_input,
    iter_documents,
    list_text_inputs,
    text_corpus,
)

TEXTS = ["The king is dead.", "", "Long live\nthe queen, señora.", "Thou art a ghost \u2014 speak!"]
NON_EMPTY = [text for text in TEXTS if text]


def jsonl_bytes(texts):
    # A blank line and an empty text: their bytes must still be counted in some piece's size.
    return ("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)) + "\n").encode()


def write_jsonl(path, texts=TEXTS):
    path.write_bytes(jsonl_bytes(texts))
    return path


def write_jsonl_gz(path, texts=TEXTS):
    path.write_bytes(gzip.compress(jsonl_bytes(texts)))
    return path


def write_jsonl_zst(path, texts=TEXTS):
    path.write_bytes(zstandard.ZstdCompressor().compress(jsonl_bytes(texts)))
    return path


def write_parquet(path, texts=TEXTS, row_group_size=None):
    table = pyarrow.table({"id": list(range(len(texts) + 1)), "text": [*texts, None]})  # a null row is skipped
    pyarrow.parquet.write_table(table, path, row_group_size=row_group_size)
    return path


WRITERS = {".jsonl": write_jsonl, ".jsonl.gz": write_jsonl_gz, ".jsonl.zst": write_jsonl_zst, ".parquet": write_parquet}


def document_texts(pieces):
    """The texts of the documents the pieces make up, each the "".join of its pieces."""
    texts, current = [], []
    for piece in pieces:
        current.append(piece.text)
        if piece.ends_document:
            texts.append("".join(current))
            current = []
    assert "".join(current) == ""  # no document is left open at the end
    return texts


def test_the_accepted_suffixes_are_the_readers_and_multi_part_names_match():
    assert TEXT_SUFFIXES == (".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")
    assert set(text_inputs.READERS) == set(TEXT_SUFFIXES)
    assert all(map(is_text_input, ["a.jsonl.gz", "dir/shard.v2.jsonl.zst", "a.txt", "b.parquet"]))
    assert not any(map(is_text_input, ["a.gz", "a.txt.gz", "a.zst", "a.jsonl.bz2", ".jsonl", "a.csv"]))


@pytest.mark.parametrize("suffix", WRITERS)
def test_every_format_yields_the_same_documents_and_pieces_sum_to_the_file_size(tmp_path, suffix):
    path = WRITERS[suffix](tmp_path / f"corpus{suffix}")
    pieces = list(iter_documents([path]))
    assert document_texts(pieces) == NON_EMPTY
    assert len(pieces) == 3 and all(piece.ends_document for piece in pieces)
    assert sum(piece.size for piece in pieces) == path.stat().st_size


def test_a_txt_file_is_one_document_and_its_pieces_sum_to_its_size(tmp_path):
    (tmp_path / "a.txt").write_text("\n\n".join(NON_EMPTY))
    pieces = list(iter_documents([tmp_path / "a.txt"]))
    assert document_texts(pieces) == ["\n\n".join(NON_EMPTY)]
    assert sum(piece.size for piece in pieces) == (tmp_path / "a.txt").stat().st_size


def test_parquet_is_read_in_batches_and_sizes_share_the_file_out(tmp_path, monkeypatch):
    monkeypatch.setattr(text_inputs, "PARQUET_BATCH_ROWS", 7)
    texts = [f"document {i}" if i % 5 else "" for i in range(100)]
    path = write_parquet(tmp_path / "many.parquet", texts, row_group_size=30)
    pieces = list(iter_documents([path]))
    assert [piece.text for piece in pieces] == [text for text in texts if text]
    assert all(piece.size > 0 for piece in pieces) and sum(p.size for p in pieces) == path.stat().st_size


def test_a_corpus_of_mixed_files_counts_every_input_byte(tmp_path):
    paths = [WRITERS[suffix](tmp_path / f"c{suffix}") for suffix in WRITERS]
    corpus = text_corpus(paths, paths)
    assert corpus.total_bytes == sum(path.stat().st_size for path in paths)
    for _ in range(2):  # read() runs once for the BPE and once for the tokens
        pieces = list(corpus.read())
        assert document_texts(pieces) == NON_EMPTY * len(paths)
        assert sum(piece.size for piece in pieces) == corpus.total_bytes


def test_a_file_of_blank_lines_still_accounts_for_its_bytes(tmp_path):
    path = tmp_path / "blank.jsonl"
    path.write_text('\n\n{"text": ""}\n')
    assert list(iter_documents([path])) == [text_inputs.Piece("", path.stat().st_size, False)]


# ---------------------------------------------------------------------------------------------
# Files, directories and globs


@pytest.fixture
def tree(tmp_path):
    """shards/shard_0{0,1,2}.jsonl.gz, shards/notes.md, shards/sub/extra.parquet, shards/sub/z.txt."""
    shards = tmp_path / "shards"
    (shards / "sub").mkdir(parents=True)
    for i in (2, 0, 1):
        write_jsonl_gz(shards / f"shard_{i:02d}.jsonl.gz")
    (shards / "notes.md").write_text("not an input")
    write_parquet(shards / "sub" / "extra.parquet")
    (shards / "sub" / "z.txt").write_text("zed")
    return shards


def test_globs_expand_sorted_to_the_inputs_they_match(tree):
    assert list_text_inputs([tree / "shard_*.jsonl.gz"]) == [tree / f"shard_{i:02d}.jsonl.gz" for i in range(3)]
    assert list_text_inputs([tree / "shard_0[02].jsonl.gz"]) == [tree / "shard_00.jsonl.gz", tree / "shard_02.jsonl.gz"]
    # A matched directory is expanded; a matched file of another kind (notes.md) is left out.
    assert list_text_inputs([tree / "su*"]) == [tree / "sub" / "extra.parquet", tree / "sub" / "z.txt"]
    assert list_text_inputs([tree / "*"]) == list_text_inputs([tree])
    assert list_text_inputs([tree / "**" / "*.parquet"]) == [tree / "sub" / "extra.parquet"]


def test_directories_expand_recursively_and_sorted(tree):
    assert list_text_inputs([tree]) == [*(tree / f"shard_{i:02d}.jsonl.gz" for i in range(3)),
                                        tree / "sub" / "extra.parquet", tree / "sub" / "z.txt"]


def test_a_file_named_twice_is_kept_once_where_it_came_first(tree, monkeypatch):
    monkeypatch.chdir(tree)
    found = list_text_inputs(["sub/z.txt", tree / "shard_01.jsonl.gz", "shard_*.jsonl.gz", "./sub/../sub/z.txt", tree])
    assert found == [text_inputs.Path("sub/z.txt"), tree / "shard_01.jsonl.gz", text_inputs.Path("shard_00.jsonl.gz"),
                     text_inputs.Path("shard_02.jsonl.gz"), tree / "sub" / "extra.parquet"]


def test_a_pattern_matching_nothing_is_refused_naming_it(tree):
    for pattern in (tree / "shard_*.jsonl.zst", tree / "*.md"):
        with pytest.raises(DataError) as error:
            list_text_inputs([tree / "shard_00.jsonl.gz", pattern])
        message = str(error.value)
        assert message.startswith(f"{pattern}: glob pattern matches no .txt/.jsonl/") and "\n" not in message


def test_a_name_with_a_glob_character_that_exists_is_taken_as_it_is(tmp_path):
    (tmp_path / "odd[1].txt").write_text("text")
    (tmp_path / "odd1.txt").write_text("text")
    assert list_text_inputs([tmp_path / "odd[1].txt"]) == [tmp_path / "odd[1].txt"]


def test_paths_that_name_no_input_are_refused_naming_them(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=f"^{tmp_path / 'empty'}: directory holds no .txt/"):
        list_text_inputs([tmp_path / "empty"])
    with pytest.raises(DataError, match=f"^{tmp_path / 'x.csv'}: not a .txt/.jsonl/"):
        list_text_inputs([tmp_path / "x.csv"])
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "missing.txt")):
        list_text_inputs([tmp_path / "missing.txt"])


# ---------------------------------------------------------------------------------------------
# The error policy


def garbage_gz(path):
    path.write_bytes(b"this was never gzip" * 20)
    return path, "not valid gzip data (Not a gzipped file"


def truncated_gz(path):
    data = gzip.compress(jsonl_bytes(NON_EMPTY * 50))
    path.write_bytes(data[: len(data) // 2])
    return path, "not valid gzip data (Compressed file ended before the end-of-stream marker was reached)"


def garbage_zst(path):
    path.write_bytes(b"\x00\x01not zstd at all" * 20)
    return path, "not valid zstandard data (zstd decompressor error: Unknown frame descriptor)"


def parquet_without_text(path):
    pyarrow.parquet.write_table(pyarrow.table({"body": NON_EMPTY}), path)
    return path, "no column named 'text'; expected a parquet file with a string column named 'text'"


def parquet_with_numbers_as_text(path):
    pyarrow.parquet.write_table(pyarrow.table({"text": [1, 2, 3]}), path)
    return path, "column 'text' holds int64, not strings; expected a parquet file with a string column named 'text'"


def not_parquet(path):
    path.write_text("just some text, no parquet footer")
    return path, "not a readable parquet file (Parquet magic bytes not found in footer"


def binary_jsonl(path):
    path.write_bytes(b'{"text": "a"}\n' + bytes(range(256)) * 4)
    return path, "binary data (NUL byte at offset 14), not UTF-8 text; expected UTF-8 .txt files"


def binary_inside_jsonl_zst(path):
    path.write_bytes(zstandard.ZstdCompressor().compress("é".encode("latin-1") * 50))
    return path, "not UTF-8 text (invalid byte at offset 0)"


def directory_named_jsonl(path):
    path.mkdir()
    return path, "cannot be read (Is a directory); expected a readable file"


BAD_FILES = {"corrupt.jsonl.gz": garbage_gz, "cut.jsonl.gz": truncated_gz, "corrupt.jsonl.zst": garbage_zst,
             "body.parquet": parquet_without_text, "numbers.parquet": parquet_with_numbers_as_text,
             "fake.parquet": not_parquet, "binary.jsonl": binary_jsonl, "latin1.jsonl.zst": binary_inside_jsonl_zst,
             "folder.jsonl": directory_named_jsonl}


@pytest.mark.parametrize("name", BAD_FILES)
def test_stop_raises_one_line_naming_the_file(tmp_path, name):
    good = write_jsonl(tmp_path / "good.jsonl")
    bad, reason = BAD_FILES[name](tmp_path / name)
    with pytest.raises(DataError) as error:
        list(iter_documents([good, bad]))
    message = str(error.value)
    assert message.startswith(f"{bad}: {reason}") and "\n" not in message


@pytest.mark.parametrize("name", BAD_FILES)
def test_skip_logs_one_line_records_the_file_and_goes_on(tmp_path, name, capsys):
    first, last = write_jsonl(tmp_path / "first.jsonl"), write_parquet(tmp_path / "last.parquet")
    bad, reason = BAD_FILES[name](tmp_path / name)
    skipped = []
    pieces = list(iter_documents([first, bad, last], on_error="skip", skipped=skipped))
    assert document_texts(pieces) == NON_EMPTY * 2
    assert sum(piece.size for piece in pieces) == sum(p.stat().st_size for p in (first, bad, last))
    assert len(skipped) == 1 and skipped[0][0] == bad and skipped[0][1].startswith(reason)
    assert capsys.readouterr().err == f"[prepare_data] skipping {bad}: {skipped[0][1]}\n"


def test_a_bad_line_names_its_number_and_skip_keeps_the_documents_before_it(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(gzip.compress(b'{"text": "one"}\n\n{"text": "two"}\n{"body": "no text"}\n{"text": "four"}\n'))
    with pytest.raises(DataError) as error:
        list(iter_documents([bad]))
    assert str(error.value) == (f"{bad}:4: no string 'text' field; "
                                "expected one JSON object with a string 'text' field per line")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\n{"text": "cut\n')
    with pytest.raises(DataError) as error:
        list(iter_documents([broken]))
    assert str(error.value).startswith(f"{broken}:2: not valid JSON (Invalid control character at: column 14); ")
    capsys.readouterr()
    skipped = []
    pieces = list(iter_documents([bad, broken], on_error="skip", skipped=skipped))
    assert document_texts(pieces) == ["one", "two", "fine"]
    assert sum(piece.size for piece in pieces) == bad.stat().st_size + broken.stat().st_size
    reason = "line 4: no string 'text' field; expected one JSON object with a string 'text' field per line"
    assert skipped[0] == (bad, reason)
    assert capsys.readouterr().err.splitlines() == [
        f"[prepare_data] skipping the rest of {bad} after 2 documents: {reason}",
        f"[prepare_data] skipping the rest of {broken} after 1 document: {skipped[1][1]}",
    ]


def many_documents(first: int, count: int) -> bytes:
    return b"".join(json.dumps({"text": f"document {i} " * 4}).encode() + b"\n" for i in range(first, first + count))


COMPRESSED_STREAMS = {  # two frames (members, row groups) of 150 documents each
    ".jsonl.zst": lambda: b"".join(zstandard.ZstdCompressor(write_checksum=bool(i)).compress(many_documents(150 * i, 150))
                                   for i in range(2)),
    ".jsonl.gz": lambda: b"".join(gzip.compress(many_documents(150 * i, 150)) for i in range(2)),
    ".parquet": lambda: parquet_bytes([f"document {i}" for i in range(300)], row_group_size=150),
}


def parquet_bytes(texts, row_group_size):
    buffer = io.BytesIO()
    pyarrow.parquet.write_table(pyarrow.table({"text": texts}), buffer, row_group_size=row_group_size)
    return buffer.getvalue()


@pytest.mark.parametrize("suffix", COMPRESSED_STREAMS)
def test_a_compressed_file_cut_anywhere_inside_a_frame_is_unreadable_never_shorter(tmp_path, suffix):
    """zstandard's reader ended quietly at a cut inside a later frame: 150 of 300 documents, no error."""
    data = COMPRESSED_STREAMS[suffix]()
    frame_end = len(zstandard.ZstdCompressor().compress(many_documents(0, 150))) if suffix == ".jsonl.zst" else None
    frame_end = len(gzip.compress(many_documents(0, 150))) if suffix == ".jsonl.gz" else frame_end
    cut = tmp_path / f"cut{suffix}"
    for size in range(1, len(data), 7):
        if size == frame_end:  # a file of the first frame alone is whole
            continue
        cut.write_bytes(data[:size])
        with pytest.raises(DataError) as error:
            list(iter_documents([cut]))
        assert str(error.value).startswith(f"{cut}") and "\n" not in str(error.value), size


def test_a_cut_zst_in_a_directory_stops_or_is_skipped_and_the_skip_is_in_the_manifest(tmp_path, capsys):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    whole = COMPRESSED_STREAMS[".jsonl.zst"]()
    (inputs / "a_whole.jsonl.zst").write_bytes(whole)
    cut = inputs / "b_cut.jsonl.zst"
    cut.write_bytes(whole[: len(whole) - 40])  # inside frame 2
    reason = ("not valid zstandard data (the file ends inside a zstandard frame: it was cut short); "
              "expected a zstandard-compressed .jsonl file")
    with pytest.raises(DataError) as error:
        prepare_text_corpus([inputs], tmp_path / "stopped", 300)
    assert str(error.value) == f"{cut}: {reason}"
    manifest = json.loads((prepare_text_corpus([inputs], tmp_path / "skipped", 300, options=PrepareOptions(
        on_error="skip")) / "manifest.json").read_text())
    assert manifest["source"]["skipped"] == [[str(cut), reason]]
    assert 300 < manifest["documents"] < 600  # the whole file, and the cut file's documents before its cut
    assert f"skipping the rest of {cut} after " in capsys.readouterr().err


class FailingAfter:
    """A binary file whose reads after the first `reads` fail as a disk error would."""

    def __init__(self, path, reads):
        self.file, self.reads_left = io.FileIO(path), reads

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.file.close()

    def read(self, size):
        if self.reads_left == 0:
            raise OSError(errno.EIO, "Input/output error")
        self.reads_left -= 1
        return self.file.read(size)


def test_a_txt_document_cut_short_by_a_read_error_is_ended_and_skipped(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(text_inputs, "TEXT_PIECE_BYTES", 50)
    monkeypatch.setattr(text_inputs, "open", lambda path, mode: FailingAfter(path, reads=2) if path.suffix == ".txt"
                        else io.open(path, mode), raising=False)
    cut = tmp_path / "cut.txt"
    cut.write_text("word " * 3000)
    after = write_jsonl(tmp_path / "after.jsonl")
    pieces = list(iter_documents([cut, after], on_error="skip"))
    texts = document_texts(pieces)  # the cut document is ended: after.jsonl's first text does not join it
    assert texts[1:] == NON_EMPTY and texts[0] == "word " * 1647 + "word"  # the head, one read, cut at a space
    assert sum(piece.size for piece in pieces) == cut.stat().st_size + after.stat().st_size
    assert capsys.readouterr().err == (f"[prepare_data] skipping the rest of {cut} after 1 document: "
                                       "cannot be read (Input/output error); expected a readable file\n")


def test_the_error_survives_pickling_and_a_bad_policy_is_refused(tmp_path):
    bad, _ = binary_jsonl(tmp_path / "b.jsonl")
    with pytest.raises(DataError) as error:
        list(iter_documents([bad]))
    copy = pickle.loads(pickle.dumps(error.value))  # a worker process sends it back this way
    assert (type(copy), str(copy), copy.reason) == (type(error.value), str(error.value), error.value.reason)
    for call in (lambda: iter_documents([bad], on_error="ignore"), lambda: text_corpus([bad], [bad], on_error="warn")):
        with pytest.raises(DataError, match="^on_error='(ignore|warn)': expected one of stop, skip$"):
            call()


# ---------------------------------------------------------------------------------------------
# Streaming


def test_a_large_jsonl_zst_yields_its_first_document_after_reading_a_little_of_it(tmp_path, monkeypatch):
    random_lines = (json.dumps({"text": base64.b64encode(os.urandom(3000)).decode()}) + "\n" for _ in range(1500))
    path = tmp_path / "large.jsonl.zst"
    path.write_bytes(zstandard.ZstdCompressor(level=1).compress("".join(random_lines).encode()))
    size = path.stat().st_size
    assert size > 4_000_000  # base64 of random bytes barely compresses
    read = []

    class CountingFile(io.FileIO):
        def readinto(self, buffer):
            count = super().readinto(buffer)
            read.append(count)
            return count

        def read(self, size=-1):
            data = super().read(size)
            read.append(len(data))
            return data

    monkeypatch.setattr(text_inputs, "open", lambda p, mode: io.BufferedReader(CountingFile(p, mode)), raising=False)
    pieces = iter_documents([path])
    first = next(pieces)
    assert len(first.text) == 4000 and sum(read) < size / 10
    assert sum(1 for _ in pieces) == 1499 and sum(read) >= size

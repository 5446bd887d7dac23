"""scripts.corpus_sources without the network: the Bible's compressed blocks, GCIDE's dictd files and
markup, atomic writing and skipping of sources, and the command line's error for an unknown source."""
import base64
import gzip
import json
import struct

import pytest

import scripts.corpus_sources as corpus_sources
from trainer.data.format import DataPreparationError

BIBLE_TEXT = """\
Holy Bible, Authorized (King James) Version.  Textfile 930105.
Ge1:1 In the beginning God created the heaven and the earth.
Ge1:2 And the earth was without form, and void; and darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters.
Ge1:3 And God said, Let there be light: and there was light.
Ge1:4 And God saw the light, that it was good: and God divided the light from the darkness.
Ge1:5 And God called the light Day, and the darkness he called Night. And the evening and the morning were the first day.
Ge2:1 Thus the heavens and the earth were finished, and all the host of them.
Exo1:1 Now these are the names of the children of Israel, which came into Egypt; every man and his household came with Jacob.
Exo1:2 Reuben, Simeon, Levi, and Judah,
Exo1:3 Issachar, Zebulun, and Benjamin,
Exo1:4 Dan, and Naphtali, Gad, and Asher.
Psa150:6 Let every thing that hath breath praise the LORD. Praise ye the LORD.
Rev22:20 He which testifieth these things saith, Surely I come quickly. Amen. Even so, come, Lord Jesus.
Rev22:21 The grace of our Lord Jesus Christ be with you all. Amen.
"""
BIBLE_BLOCK_SIZE = 1024  # so the text is two blocks, cut inside Rev22:20
# `compress -b 16` (ncompress 4.2.4.6) of BIBLE_TEXT's two blocks: real LZW, whose first block widens its
# codes from 9 to 10 bits. Each starts with compress's 3-byte header, which bible.data holds only once.
BIBLE_BLOCKS_Z = [base64.b64decode("".join(lines.split())) for lines in (
    """H52QSN6wyQNCSBoxbMqwABGkDh00b+Sk0VOGDAgUS9K4OQNCSZg2ZeakAGGljJw5ad64cQECBJUyeOiYSZMQRI4ZMGLAqOFCwZEy
    MXTEAJHEDYiHZUCIKXNGoxuNHI+8sThGTpkwdCoeRZOUaxg7ZYyGcWMRKYirch72/BlUBkOyW5OifQjiTpg5ddM8fOMQhJmIbRaO
    tWjnTRoyO0AMBkEmjJw1bkLitYu3DhyVcf2GGZP0jZnMZMqUgcMyCFyzU+CkkUgHhGcQUi22eQPWomXMZs1s7vzZrN2sJ9cC1THj
    rcXYIOaEObyQSZnWSK0qTcomzRk0dHQoPs1VOmUQ1a/TER6UhnHYU5OHuZM5PPaFD7GC0Fv3Logzb6ZqX4ycTBo7h2lllnutmSHH
    G22A5hhkkpGnQw3nITdGGGwkVBZX4FmHHQhEhJGHYNwl1dhjkc2BF4YTVqiVExqOd55ZZYD11EbbXZjUbHLMyNEdJiWV22pztNZY
    HsLJIJRLaNSBl1leyYjXYjA6RheP0s301BxckQGiRRSykRlEQbrWG1dt9FQEHm8ENZQTb7CH1BxJOeYjhm58FJKYmY2BBk1kWGXU
    a0nMIUcYZbCx0B176gnChCDN5wYdb4BQxBl5wEFHYjGaRFAbY9UIwp4n8gUnRGxQZWdedHk0xhtimIlmWyBIUUYdS7mx0BRpgKRS
    czGmsWVHdTSGBgsKnJkmcUSZuBkaji2kRRli1MFGHbZ6KkRYanykEbHGlsfhWL86EQYc2FHoK2xhaOlpEFia1BMUysVQAww62ACC
    c61lKgdBD0G1lXzM0iWGVVihAQIcg6YBZ2ZMPCEFESxBkfDCecyZVMMP9ySrHTIYKQMMICCRFKJpKJpVkGnM9JzBb84JFV7K6TUs
    CFPUYdVARC2KYFJx1FHyGgO5AA==""",
    """H52QIIK0KePGBYgidgiCmPOGBYgxbwY6ZPJGDhkQSsrMqTPHhQIpZezIkKFDRgwQVNCUAXFGTpgxK9+YAfGmjhwQFC1i1MgRxBA0
    ctLMoQNCzMo7aeigAZGnJogwbNgYFEjQIw==""",
)]
# `compress -b 16` of 100 "a"s: every code after the first is the one being defined (the KwKwK case).
RUN_OF_A_Z = base64.b64decode("H52QYQIKHEiwoMGDCBMqXMgQIQ==")


def write_bible_data(path, blocks_z, block_size):
    """A bible.data in the package's layout: magic and title, block size, count and offsets, then the
    compress header once and each block's codes."""
    table_end = corpus_sources.BIBLE_TABLE_OFFSET + 8 + 4 * (len(blocks_z) + 1)
    offsets = [table_end + 3]
    for block in blocks_z:
        offsets.append(offsets[-1] + len(block) - 3)
    title = b"EC02Compressed Data File".ljust(corpus_sources.BIBLE_TABLE_OFFSET, b"\0")
    table = struct.pack(f">II{len(offsets)}I", block_size, len(blocks_z), *offsets)
    path.write_bytes(title + table + blocks_z[0][:3] + b"".join(block[3:] for block in blocks_z))


def test_decompress_lzw_reads_compress_output():
    assert corpus_sources.decompress_lzw(RUN_OF_A_Z[3:], RUN_OF_A_Z[2] & 0x1F) == b"a" * 100


def test_bible_data_gives_one_document_per_book(tmp_path):
    data = tmp_path / "bible.data"
    write_bible_data(data, BIBLE_BLOCKS_Z, BIBLE_BLOCK_SIZE)
    assert corpus_sources.read_bible_data(data) == BIBLE_TEXT
    books = dict(corpus_sources.bible_kjv_documents(data))
    assert list(books) == ["Genesis", "Exodus", "Psalms", "Revelation"]
    assert books["Genesis"].startswith("Genesis\n\n1:1 In the beginning God created the heaven and the earth.\n1:2 And")
    assert "\n2:1 Thus the heavens" in books["Genesis"]
    assert books["Revelation"] == ("Revelation\n\n22:20 He which testifieth these things saith, Surely I come quickly. "
                                   "Amen. Even so, come, Lord Jesus.\n22:21 The grace of our Lord Jesus Christ be with you all. Amen.\n")


def test_bible_line_that_is_not_a_verse_is_named():
    with pytest.raises(DataPreparationError, match=r"line 3: 'Chapter the second'"):
        list(corpus_sources.bible_books("title\nGe1:1 In the beginning.\nChapter the second\n"))


def dictd_number(value):
    digits = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    text = ""
    while True:
        text = digits[value % 64] + text
        value //= 64
        if not value:
            return text


# Entries in GCIDE's dictd markup, as dict-gcide 0.48.5 has them (shortened).
ABANDON = """\
Abandon \\A*ban"don\\ ([.a]*b[a^]n"d[u^]n), v. t. [imp. & p. p.
   {Abandoned} (-d[u^]nd); p. pr. & vb. n. {Abandoning}.] [OF.
   abandoner, F. abandonner. See {Ban}.]
   1. To cast or drive out; to banish; to expel; to reject.
      [Obs.]
      [1913 Webster]

            That he might . . . abandon them from him. --Udall.
      [1913 Webster]

   2. To give up absolutely; to forsake entirely.
      [1913 Webster]
      -- {A*ban"don*er}, n.
      [PJC]

"""
APPLE = """\
Apple \\Ap"ple\\ ([a^]p"p'l), n. [OE. appel, AS. [ae]ppel; akin to
   Sw. [aum]ple.]
   The fleshy pome or fruit of a rosaceous tree ({Pyrus malus}).
   [1913 Webster] {Apple butter}, a sauce made of apples stewed down in cider.
   [Webster 1913 Suppl. +PJC]

"""
INFO = "00-database-short\n   The Collaborative International Dictionary of English v.0.48\n\n"


def write_dictd(tmp_path, entries, index_order):
    """gcide.index and gcide.dict.dz for `entries` (headwords, text) in data order; the index lists
    (headword, entry number) pairs in `index_order`, as dictd sorts them by headword."""
    data, spans = b"", []
    for _, text in entries:
        spans.append((len(data), len(text.encode())))
        data += text.encode()
    index = tmp_path / "gcide.index"
    index.write_text("".join(f"{word}\t{dictd_number(spans[i][0])}\t{dictd_number(spans[i][1])}\n" for word, i in index_order))
    dict_dz = tmp_path / "gcide.dict.dz"
    dict_dz.write_bytes(gzip.compress(data, mtime=0))  # dictzip is gzip with a chunk table in an extra field
    return index, dict_dz


def test_dictd_number_reads_dictd_base64():
    assert [corpus_sources.dictd_number(text) for text in ("A", "B", "BA", "/", "5I", "Gl8J")] == [0, 1, 64, 63, 57 * 64 + 8, 1728265]
    with pytest.raises(DataPreparationError, match=r"'1\*' is not a base-64 number"):
        corpus_sources.dictd_number("1*")


def test_gcide_gives_one_clean_document_per_entry(tmp_path):
    index, dict_dz = write_dictd(
        tmp_path, [("info", INFO), ("Abandon", ABANDON), ("Apple", APPLE)],
        [("00-database-short", 0), ("Abandon", 1), ("Abandoner", 1), ("Apple", 2), ("Apple butter", 2), ("apple", 2)])
    documents = list(corpus_sources.gcide_documents(index, dict_dz))
    assert documents == [
        ("Abandon", "Abandon, v. t. [imp. & p. p. Abandoned; p. pr. & vb. n. Abandoning.] [OF. abandoner, F. abandonner. "
                    "See Ban.]\n\n1. To cast or drive out; to banish; to expel; to reject. [Obs.]\n\n"
                    "That he might . . . abandon them from him. --Udall.\n\n"
                    "2. To give up absolutely; to forsake entirely.\n\n-- Abandoner, n."),
        ("Apple", "Apple, n. [OE. appel, AS. æppel; akin to Sw. äple.] The fleshy pome or fruit of a rosaceous tree "
                  "(Pyrus malus).\n\nApple butter, a sauce made of apples stewed down in cider."),
    ]


def test_dictd_entry_past_the_data_is_named(tmp_path):
    index, dict_dz = write_dictd(tmp_path, [("Apple", APPLE)], [("Apple", 0)])
    dict_dz.write_bytes(gzip.compress(APPLE.encode()[:10]))
    with pytest.raises(DataPreparationError, match=r"entry 'Apple' ends at byte \d+, past the end of gcide.dict.dz \(10 bytes\)"):
        list(corpus_sources.gcide_documents(index, dict_dz))


class TinySources:
    """A registry of real, tiny sources that count their fetches; 'broken' fails after one document."""

    def __init__(self):
        self.fetches = []

    def tiny(self, work_dir):
        self.fetches.append("tiny")
        return corpus_sources.Fetched({"made": "here"}, [("one", "first document"), ("empty", ""), ("two", "second, naïve")])

    def broken(self, work_dir):
        self.fetches.append("broken")

        def documents():
            yield "one", "a document"
            raise DataPreparationError("apt-get download nope failed (E: Unable to locate package nope)")

        return corpus_sources.Fetched({}, documents())

    def registry(self):
        return {"tiny": self.tiny, "broken": self.broken}


@pytest.fixture
def tiny_sources(monkeypatch):
    sources = TinySources()
    monkeypatch.setattr(corpus_sources, "SOURCES", sources.registry())
    return sources


def test_write_sources_writes_jsonl_and_skips_what_is_written(tmp_path, tiny_sources, capsys):
    out = tmp_path / "out"
    manifest = corpus_sources.write_sources(out, ["tiny"])
    lines = (out / "tiny.jsonl").read_bytes().decode().splitlines()
    assert [json.loads(line) for line in lines] == [{"text": "first document"}, {"text": "second, naïve"}]
    record = manifest["tiny"]
    assert record["documents"] == 2 and record["origin"] == {"made": "here"}
    assert record["text_bytes"] == len("first document".encode()) + len("second, naïve".encode())
    assert json.loads((out / "sources.json").read_text()) == manifest
    assert "tiny: 2 documents, 0.0 MB of text" in capsys.readouterr().err

    assert corpus_sources.write_sources(out, ["tiny"]) == manifest
    assert tiny_sources.fetches == ["tiny"]
    assert "already written, skipped" in capsys.readouterr().err

    (out / "tiny.jsonl").write_text('{"text": "edited"}\n')  # no longer the recorded file: fetched again
    corpus_sources.write_sources(out, ["tiny"])
    assert tiny_sources.fetches == ["tiny", "tiny"]
    assert len((out / "tiny.jsonl").read_text().splitlines()) == 2


def test_failed_source_leaves_no_file_and_keeps_earlier_records(tmp_path, tiny_sources):
    out = tmp_path / "out"
    reason = r"apt-get download nope failed \(E: Unable to locate package nope\)"
    with pytest.raises(DataPreparationError, match=rf"^source broken: {reason}"):
        corpus_sources.write_sources(out, ["tiny", "broken"])
    assert sorted(path.name for path in out.iterdir()) == ["sources.json", "tiny.jsonl"]
    assert list(json.loads((out / "sources.json").read_text())) == ["tiny"]


def test_main_prints_out_dir_and_refuses_an_unknown_source(tmp_path, tiny_sources, capsys):
    out = tmp_path / "out"
    assert corpus_sources.main([f"out={out}", "sources=[tiny,nope]"]) == 2
    captured = capsys.readouterr()
    assert captured.err == "error: unknown source 'nope'; valid sources: tiny, broken\n"
    assert captured.out == "" and not out.exists()

    assert corpus_sources.main([f"out={out}", "sources=tiny"]) == 0
    assert capsys.readouterr().out == f"{out}\n"
    assert corpus_sources.main([f"out={out}", "sources=broken"]) == 1
    assert capsys.readouterr().err.splitlines()[-1].startswith("error: source broken: apt-get download nope failed")

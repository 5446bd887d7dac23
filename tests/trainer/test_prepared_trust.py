"""A prepared dataset is verified as the cache verifies one, its manifest is schema-checked, and preparation
streams its inputs, bounds BPE pre-tokens, clears what killed builds leave and writes through no link (issue 24)."""
import hashlib
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
from contextlib import contextmanager

import numpy as np
import pytest
from tokenizers import Tokenizer, pre_tokenizers

from json_mutations import dumps, mutated_bytes, mutated_documents
from trainer.data import DataError, DatasetCorruptError, open_dataset, prepare_text_corpus, resolve_dataset
from trainer.data import documents, prepare
from trainer.data.documents import Corpus, Piece
from trainer.data.prepare import MAX_PRETOKEN_BYTES, bpe_pre_tokenizer, split_off_val, train_tokenizer

GiB = 1 << 30


def copy_of(dataset, tmp_path):
    return shutil.copytree(dataset, tmp_path / "prepared")


def edit_manifest(dataset_dir, change):
    manifest = json.loads((dataset_dir / "manifest.json").read_text())
    change(manifest)
    (dataset_dir / "manifest.json").write_text(json.dumps(manifest))


def rehash(dataset_dir, name):
    """Make the manifest agree with `name` again: damage a checksum cannot see."""
    digest = hashlib.sha256((dataset_dir / name).read_bytes()).hexdigest()
    edit_manifest(dataset_dir, lambda manifest: manifest["sha256"].update({name: digest}))


# ---------------------------------------------------------------------------------------------
# A prepared directory as data.path is verified as a cached one is


def test_prepared_directory_whose_train_bin_no_longer_matches_its_sha256_is_refused(tiny_dataset, tmp_path):
    dataset = copy_of(tiny_dataset, tmp_path)
    with open(dataset / "train.bin", "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(DatasetCorruptError) as error:
        resolve_dataset(str(dataset), cache_dir=tmp_path / "cache", vocab_size=512)
    assert str(error.value) == (f"{dataset / 'train.bin'}: sha256 does not match manifest.json; "
                                f"delete {dataset} to rebuild it")


def test_token_ids_at_or_above_the_vocab_are_refused_naming_the_first(tiny_dataset, tmp_path):
    dataset = copy_of(tiny_dataset, tmp_path)
    vocab_size = json.loads((dataset / "manifest.json").read_text())["vocab_size"]
    tokens = np.memmap(dataset / "train.bin", dtype=np.uint16, mode="r+")
    tokens[1234] = vocab_size
    tokens.flush()
    del tokens
    rehash(dataset, "train.bin")
    with pytest.raises(DatasetCorruptError) as error:
        resolve_dataset(str(dataset), cache_dir=tmp_path / "cache", vocab_size=512)
    assert str(error.value) == (f"{dataset / 'train.bin'}: token 1234 is id {vocab_size}, not below "
                                f"vocab_size={vocab_size} in manifest.json; delete {dataset} to rebuild it")


# ---------------------------------------------------------------------------------------------
# The manifest's schema: one line naming the file and the key


MANIFEST_DAMAGE = [
    ("tokens.train", lambda m: m["tokens"].update(train="12"), "tokens.train='12' must be an integer >= 1"),
    ("vocab_size", lambda m: m.update(vocab_size=2**45),
     f"vocab_size={2**45} must be an integer in [1, 65536] (uint16 ids)"),
    ("eot_id", lambda m: m.pop("eot_id"), "no eot_id (it must be an integer in [0, vocab_size={vocab_size}))"),
    ("sha256", lambda m: m.update(sha256={}),
     "sha256={{}} must be an object holding exactly train.bin, val.bin, tokenizer.json"),
    ("sha256.val.bin", lambda m: m["sha256"].update({"val.bin": 7}), "sha256.val.bin=7 must be 64 lowercase hex digits"),
    ("dtype", lambda m: m.update(dtype="float32"), "dtype='float32' must be uint16 or uint32"),
    ("tokenizer", lambda m: m.update(tokenizer=[]), "tokenizer=[] must be an object whose kind is bpe or file"),
]


@pytest.mark.parametrize("key, damage, message", MANIFEST_DAMAGE, ids=[case[0] for case in MANIFEST_DAMAGE])
def test_a_mistyped_or_missing_manifest_field_is_one_line_naming_file_and_key(tiny_dataset, tmp_path, key, damage,
                                                                              message):
    dataset = copy_of(tiny_dataset, tmp_path)
    vocab_size = json.loads((dataset / "manifest.json").read_text())["vocab_size"]
    edit_manifest(dataset, damage)
    with pytest.raises(DataError) as error:
        resolve_dataset(str(dataset), cache_dir=tmp_path / "cache", vocab_size=512)
    assert str(error.value) == (f"{dataset / 'manifest.json'}: {message.format(vocab_size=vocab_size)}; "
                                f"delete {dataset} to rebuild it")


# ---------------------------------------------------------------------------------------------
# Preparation streams its inputs


@contextmanager
def address_space_headroom(extra_bytes):
    """Cap this process's address space a little above what it maps now: reading a whole 30 GB file then
    fails at once with MemoryError instead of exhausting the machine."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/status") as status:
        mapped = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (mapped + extra_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def test_a_30_gb_sparse_input_is_refused_from_its_head_without_reading_it(tmp_path):
    big = tmp_path / "big.txt"
    subprocess.run(["truncate", "-s", "30G", str(big)], check=True)
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("the king speaks\n")
    with address_space_headroom(2 * GiB):
        with pytest.raises(DataError) as text_error:
            resolve_dataset(str(big), cache_dir=tmp_path / "cache", vocab_size=300)
        with pytest.raises(DataError) as tokenizer_error:
            resolve_dataset(str(tmp_path / "texts"), cache_dir=tmp_path / "cache", vocab_size=300, tokenizer=str(big))
    assert str(text_error.value).startswith(f"{big}: binary data (NUL byte at offset 0), not UTF-8 text")
    assert str(tokenizer_error.value) == (f"data.tokenizer={big}: {30 * GiB} bytes, more than the {GiB} a "
                                          "tokenizer.json is read up to; expected a tokenizers tokenizer.json")


def test_a_txt_file_is_tokenised_in_pieces_with_the_tokens_of_the_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(documents, "TEXT_PIECE_BYTES", 97)
    words = "the king queen lord crown sword night day love death speak hath".split()
    gaps = [" ", "  ", "\n", ", ", ".\n\n"]
    rng = np.random.default_rng(0)
    text = "".join(rng.choice(words) + rng.choice(gaps) for _ in range(3000))
    runs = "x" * 500 + " " + "y" * 300  # no space for longer than a piece: cut where the read ended
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text(text)
    (tmp_path / "texts" / "b.txt").write_text(runs)
    pieces = list(documents.iter_text_pieces(tmp_path / "texts" / "a.txt"))
    # The first piece holds the sniffed head too; every later one at most what one read adds to a remainder.
    assert len(pieces) > 100 and max(len(piece.text) for piece in pieces[1:]) <= 2 * 97
    assert "".join(piece.text for piece in pieces) == text
    assert sum(piece.size for piece in pieces) == len(text.encode())
    assert [piece.ends_document for piece in pieces].count(True) == 1 and pieces[-1].ends_document

    dataset = prepare_text_corpus([tmp_path / "texts"], tmp_path / "prepared", 300)
    tokenizer = Tokenizer.from_file(str(dataset / "tokenizer.json"))
    stream = np.concatenate([np.fromfile(dataset / f"{split}.bin", dtype=np.uint16) for split in ("train", "val")])
    eot = tokenizer.token_to_id("<|endoftext|>")
    first_end = int(np.flatnonzero(stream == eot)[0])
    assert stream[:first_end].tolist() == tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.decode(stream[first_end + 1 : -1].tolist()) == runs
    assert (stream == eot).sum() == 2 and stream[-1] == eot


# ---------------------------------------------------------------------------------------------
# BPE pre-tokens are bounded


def test_bpe_pre_tokens_of_a_long_run_without_whitespace_are_bounded():
    line = "x" * 200_000  # unbounded, one word this long took seconds to train on, quadratically more when longer
    tokenizer = train_tokenizer([line], 300)
    lengths = [len(piece) for piece, _ in tokenizer.pre_tokenizer.pre_tokenize_str(line)]
    assert max(lengths) == MAX_PRETOKEN_BYTES and sum(lengths) == len(line)
    assert tokenizer.decode(tokenizer.encode(line).ids) == line
    text = "  Odd spacing,\ttabs\nand unicode: café ✓ <|endoftext|> 12345 end's\n\n"
    assert bpe_pre_tokenizer().pre_tokenize_str(text) == (
        pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(text))


# ---------------------------------------------------------------------------------------------
# A killed preparation's build directory is removed by the next one


def test_the_build_directory_of_a_killed_preparation_is_removed_by_the_next(tmp_path):
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("the king speaks to the queen at night\n" * 50)
    out = tmp_path / "out"
    out.mkdir()
    running = out / f".other.building-{socket.gethostname()}-{os.getpid()}-abcd1234"  # a live build: ours
    running.mkdir()
    child = os.fork()
    if child == 0:  # kill -9 in the middle of a build, after its directory is made
        try:
            prepare.TrainedBPE.make = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
            prepare_text_corpus([tmp_path / "texts"], out / "prepared", 300)
        finally:
            os._exit(1)
    _, status = os.waitpid(child, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    left = [p for p in out.iterdir() if p != running]
    assert len(left) == 1 and left[0].name.startswith(".prepared.building-")

    prepare_text_corpus([tmp_path / "texts"], out / "prepared", 300)
    assert sorted(p.name for p in out.iterdir()) == sorted(["prepared", running.name])


# ---------------------------------------------------------------------------------------------
# Prepared files are written through no link; data.tokenizer is read only as a regular file


def small_corpus(text):
    return Corpus("test", len(text), lambda: iter([Piece(text, len(text), True)]))


def test_prepared_files_replace_a_link_or_refuse_it_and_leave_its_target_alone(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    build = tmp_path / "build"
    build.mkdir()
    corpus = small_corpus("the king speaks to the queen " * 20)
    (build / "tokenizer.json").symlink_to(victim)
    tokenizer = prepare.TrainedBPE(300).make(corpus, build)
    assert not (build / "tokenizer.json").is_symlink()
    assert Tokenizer.from_file(str(build / "tokenizer.json")).to_str() == tokenizer.to_str()
    (build / "train.bin").symlink_to(victim)
    with pytest.raises(FileExistsError):
        prepare.write_token_stream(tokenizer, corpus, build / "train.bin", np.dtype(np.uint16))
    (build / "train.bin").unlink()
    _, total = prepare.write_token_stream(tokenizer, corpus, build / "train.bin", np.dtype(np.uint16))
    (build / "val.bin").symlink_to(victim)
    with pytest.raises(FileExistsError):
        split_off_val(build / "train.bin", build / "val.bin", np.dtype(np.uint16), total)
    assert victim.read_text() == "precious"


def test_data_tokenizer_is_read_only_as_a_regular_file(tiny_dataset, tmp_path):
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("the king speaks\n")
    fifo = tmp_path / "tokenizer.fifo"
    os.mkfifo(fifo)
    with pytest.raises(DataError) as error:
        resolve_dataset(str(tmp_path / "texts"), cache_dir=tmp_path / "cache", vocab_size=512, tokenizer=str(fifo))
    assert str(error.value) == f"data.tokenizer={fifo}: not a regular file; expected a tokenizers tokenizer.json"
    # A link the user names is followed: it is only read, and the dataset holds a copy of what it pointed at.
    link = tmp_path / "tokenizer.json"
    link.symlink_to(tiny_dataset / "tokenizer.json")
    prepared = resolve_dataset(str(tmp_path / "texts"), cache_dir=tmp_path / "cache", vocab_size=512,
                               tokenizer=str(link))
    assert not (prepared / "tokenizer.json").is_symlink()
    assert (prepared / "tokenizer.json").read_bytes() == (tiny_dataset / "tokenizer.json").read_bytes()


# ---------------------------------------------------------------------------------------------
# Property: any damage to the manifest is one line or a dataset that still opens


def test_randomly_damaged_manifests_are_one_line_or_a_usable_dataset(tiny_dataset, tmp_path):
    dataset = copy_of(tiny_dataset, tmp_path)
    texts = tiny_dataset.parent / "texts"
    original = (dataset / "manifest.json").read_bytes()
    cases = [*mutated_documents(json.loads(original), seed=24, count=150),
             *((what, data) for what, data in mutated_bytes(original, seed=24, count=50))]
    outcomes = {"refused": 0, "opened": 0}
    for what, document in cases:
        (dataset / "manifest.json").write_bytes(document if isinstance(document, bytes) else dumps(document))
        try:
            resolved = resolve_dataset(str(dataset), cache_dir=tmp_path / "cache", vocab_size=512)
            assert open_dataset(resolved, "train", 512).read(0, 8).shape == (8,), what
            assert prepare_text_corpus([texts], dataset, 512) == dataset, what  # the cache's reuse reads more keys
            outcomes["opened"] += 1
        except DataError as error:
            message = str(error)
            assert "\n" not in message and str(dataset) in message, (what, message)
            outcomes["refused"] += 1
    assert outcomes["refused"] > 100 and outcomes["opened"] > 0, outcomes

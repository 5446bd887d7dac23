"""A prepared dataset is verified as the cache verifies one, its manifest is schema-checked, and preparation
streams its inputs, bounds BPE pre-tokens, continues what a killed preparation left and writes through no link."""
import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, pre_tokenizers

from json_mutations import dumps, mutated_bytes, mutated_documents
from test_lifecycle import tmpfs
from trainer.data import (
    BlendSamples,
    DataError,
    DatasetCorruptError,
    prepare_text_corpus,
    resolve_blend,
    resolve_dataset,
)
from trainer.data import prepare, shards, text_inputs
from trainer.data.prepare import MAX_PRETOKEN_BYTES, bpe_pre_tokenizer, train_tokenizer
from trainer.data.text_inputs import Corpus, Piece

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


def test_prepared_directory_whose_tokens_bin_no_longer_matches_its_sha256_is_refused(tiny_dataset, tmp_path):
    dataset = copy_of(tiny_dataset, tmp_path)
    with open(dataset / "tokens.bin", "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(DatasetCorruptError) as error:
        resolve_dataset(str(dataset), cache_dir=tmp_path / "cache", vocab_size=512)
    assert str(error.value) == (f"{dataset / 'tokens.bin'}: sha256 does not match manifest.json; "
                                f"delete {dataset} to rebuild it")


def test_token_ids_at_or_above_the_vocab_are_refused_naming_the_first(tiny_dataset, tmp_path):
    dataset = copy_of(tiny_dataset, tmp_path)
    vocab_size = json.loads((dataset / "manifest.json").read_text())["vocab_size"]
    tokens = np.memmap(dataset / "tokens.bin", dtype=np.uint16, mode="r+")
    tokens[1234] = vocab_size
    tokens.flush()
    del tokens
    rehash(dataset, "tokens.bin")
    with pytest.raises(DatasetCorruptError) as error:
        resolve_dataset(str(dataset), cache_dir=tmp_path / "cache", vocab_size=512)
    assert str(error.value) == (f"{dataset / 'tokens.bin'}: token 1234 is id {vocab_size}, not in [0, "
                                f"vocab_size={vocab_size}) of manifest.json; delete {dataset} to rebuild it")


# ---------------------------------------------------------------------------------------------
# The manifest's schema: one line naming the file and the key


MANIFEST_DAMAGE = [
    ("tokens", lambda m: m.update(tokens="12"), "tokens='12' must be an integer >= 1"),
    ("idx_bytes", lambda m: m.pop("idx_bytes"), "no idx_bytes (it must be an integer >= 1)"),
    ("vocab_size", lambda m: m.update(vocab_size=2**45),
     f"vocab_size={2**45} must be an integer in [1, 65536] (uint16 ids)"),
    ("eot_id", lambda m: m.pop("eot_id"), "no eot_id (it must be an integer in [0, vocab_size={vocab_size}))"),
    ("sha256", lambda m: m.update(sha256={}),
     "sha256={{}} must be an object holding exactly tokens.bin, tokens.idx, tokenizer.json"),
    ("sha256.tokens.idx", lambda m: m["sha256"].update({"tokens.idx": 7}),
     "sha256.tokens.idx=7 must be 64 lowercase hex digits"),
    ("dtype", lambda m: m.update(dtype="float32"), "dtype='float32' must be uint16 or int32"),
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
    monkeypatch.setattr(text_inputs, "TEXT_PIECE_BYTES", 97)
    words = "the king queen lord crown sword night day love death speak hath".split()
    gaps = [" ", "  ", "\n", ", ", ".\n\n"]
    rng = np.random.default_rng(0)
    text = "".join(rng.choice(words) + rng.choice(gaps) for _ in range(3000))
    runs = "x" * 500 + " " + "y" * 300  # no space for longer than a piece: cut where the read ended
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text(text)
    (tmp_path / "texts" / "b.txt").write_text(runs)
    pieces = list(text_inputs.iter_text_pieces(tmp_path / "texts" / "a.txt"))
    # The first piece holds the sniffed head too; every later one at most what one read adds to a remainder.
    assert len(pieces) > 100 and max(len(piece.text) for piece in pieces[1:]) <= 2 * 97
    assert "".join(piece.text for piece in pieces) == text
    assert sum(piece.size for piece in pieces) == len(text.encode())
    assert [piece.ends_document for piece in pieces].count(True) == 1 and pieces[-1].ends_document

    dataset = prepare_text_corpus([tmp_path / "texts"], tmp_path / "prepared", 300)
    tokenizer = Tokenizer.from_file(str(dataset / "tokenizer.json"))
    stream = np.fromfile(dataset / "tokens.bin", dtype=np.uint16)  # the documents' sequences, in order
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
# kill -9 in the middle of a preparation: the next one continues it


def test_a_preparation_killed_by_sigkill_is_continued_by_the_next(tmp_path):
    (tmp_path / "texts").mkdir()
    for name in ("a", "b", "c"):
        (tmp_path / "texts" / f"{name}.txt").write_text(f"the king speaks to the queen of {name} at night\n" * 50)
    out = tmp_path / "out"
    child = os.fork()
    if child == 0:  # killed while tokenising its second file
        try:
            real, calls = shards.write_shard, []

            def die_on_second(job, *args, **kwargs):
                calls.append(job)
                if len(calls) == 2:
                    os.kill(os.getpid(), signal.SIGKILL)
                return real(job, *args, **kwargs)

            shards.write_shard = die_on_second
            prepare_text_corpus([tmp_path / "texts"], out / "prepared", 300)
        finally:
            os._exit(1)
    _, status = os.waitpid(child, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    partial = out / ".prepared.partial"
    assert sorted(p.name for p in partial.iterdir()) == ["part-00000.bin", "part-00000.idx", "part-00000.json",
                                                         "plan.json", "tokenizer.json"]
    prepare_text_corpus([tmp_path / "texts"], out / "prepared", 300)
    assert sorted(p.name for p in out.iterdir()) == ["prepared"]  # no partial, no lock file left


def children_of(pid):
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def alive(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_workers_die_with_a_killed_preparation_and_the_next_waits_for_them(tiny_dataset, tmp_path):
    """After kill -9 of a preparation, its workers ran on, orphaned, writing into the build directory that the
    next preparation took over. Here each worker blocks opening a FIFO (a file that never comes)."""
    build = tmp_path / ".prepared.partial"
    build.mkdir()
    shutil.copy(tiny_dataset / "tokenizer.json", build / "tokenizer.json")
    jobs = []
    for i in range(2):
        os.mkfifo(tmp_path / f"never{i}.txt")
        jobs.append(shards.ShardJob(shards.Part(f"never{i}.txt", 1, path=tmp_path / f"never{i}.txt"),
                                    build / f"part-{i:05d}", build / "tokenizer.json", "uint16", "stop"))
    preparation = os.fork()
    if preparation == 0:
        try:
            shards.write_shards(jobs, 2, Tokenizer.from_file(str(build / "tokenizer.json")), 2, 0)
        finally:
            os._exit(1)
    started = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (build / shards.WRITERS_LOCK).exists():
            time.sleep(0.05)
        started = children_of(preparation)
        waiter = threading.Thread(target=shards.wait_for_writers, args=(build,))
        waiter.start()
        waiter.join(timeout=1.0)
        assert waiter.is_alive()  # the workers are alive: the next preparation waits
        os.kill(preparation, signal.SIGKILL)
        os.waitpid(preparation, 0)
        waiter.join(timeout=10)
        assert not waiter.is_alive()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(map(alive, started)):
            time.sleep(0.05)
        assert len(started) >= 2 and not any(map(alive, started))
    finally:
        for pid in started:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_full_disk_while_preparing_or_writing_the_index_cache_is_one_line(tiny_dataset, tmp_path):
    with tmpfs(tmp_path / "small", "size=64k") as small:
        with pytest.raises(DataError) as error:
            prepare_text_corpus([tiny_dataset.parent / "texts"], small / "prepared", 512)
        message = str(error.value)
        assert message.startswith(f"no space left on the device of {small} (") and "\n" not in message
        assert message.endswith(f" MiB free) while writing the prepared dataset {small / '.prepared.partial'}; free "
                                "some space and prepare again: it continues from the files tokenised so far")
    with tmpfs(tmp_path / "one_page", "size=4k") as one_page:
        blend = resolve_blend(None, str(tiny_dataset), tmp_path / "cache", 512, None)
        with pytest.raises(DataError) as error:
            BlendSamples(blend, "98,2,0", 16, 0, one_page).build_for_run(steps=1, global_batch=4)
        assert str(error.value).startswith(f"no space left on the device of {one_page / 'indices'} (")
        assert str(error.value).endswith(" MiB free) while writing megatron-core's index cache; free some space or "
                                         "set data.cache_dir elsewhere")


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
    # A shard is written beside its final name and renamed over it: a link there is replaced, never written through.
    for name in ("part.bin", "part.idx", "part.building.bin", "part.building.idx"):
        (build / name).symlink_to(victim)
    job = shards.ShardJob(shards.Part("test", corpus.total_bytes, read=corpus.read), build / "part",
                          build / "tokenizer.json", "uint16", "stop")
    assert shards.write_shard(job, tokenizer)["documents"] == 1
    assert not (build / "part.bin").is_symlink() and not (build / "part.idx").is_symlink()
    assert victim.read_text() == "precious"


def test_links_at_the_preparation_lock_and_the_writers_lock_are_removed_never_followed(tmp_path):
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("the king speaks to the queen at night\n" * 50)
    out, outside = tmp_path / "cache", tmp_path / "outside"
    out.mkdir()
    outside.mkdir()
    (out / ".prepared.lock").symlink_to(outside / "lock")
    prepare_text_corpus([tmp_path / "texts"], out / "prepared", 300)
    build = tmp_path / "build"
    build.mkdir()
    (build / shards.WRITERS_LOCK).symlink_to(outside / "writers")
    shards.wait_for_writers(build)
    assert list(outside.iterdir()) == [] and sorted(p.name for p in out.iterdir()) == ["prepared"]
    assert list(build.iterdir()) == []


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
            blend = resolve_blend(None, str(dataset), tmp_path / "cache", 512, None)
            assert blend.sources[0].prefix == dataset / "tokens", what
            assert prepare_text_corpus([texts], dataset, 512) == dataset, what  # the cache's reuse reads more keys
            outcomes["opened"] += 1
        except DataError as error:
            message = str(error)
            assert "\n" not in message and str(dataset) in message, (what, message)
            outcomes["refused"] += 1
    assert outcomes["refused"] > 100 and outcomes["opened"] > 0, outcomes

"""tokens.idx is checked whenever a dataset is verified, even with a manifest resealed to match it: lengths,
pointers, document boundaries and counts against tokens.bin and the manifest, and the manifest's eot_id and
vocab against tokenizer.json. A Megatron prefix's .idx against its .bin. One line naming the file."""
import hashlib
import json
import shutil

import numpy as np
import pytest

from json_mutations import mutated_arrays, mutated_bytes
from trainer.data import BlendSamples, DataError, DatasetCorruptError, resolve_blend, resolve_dataset
from trainer.data.sequence_index import HEADER


def sealed_copy(tiny_dataset, tmp_path):
    return shutil.copytree(tiny_dataset, tmp_path / "prepared")


def reseal(dataset, change=None):
    """Write the manifest agreeing with every file again (sizes and checksums), after `change` edits it."""
    manifest = json.loads((dataset / "manifest.json").read_text())
    manifest["idx_bytes"] = (dataset / "tokens.idx").stat().st_size
    for name in manifest["sha256"]:
        manifest["sha256"][name] = hashlib.sha256((dataset / name).read_bytes()).hexdigest()
    if change is not None:
        change(manifest)
    (dataset / "manifest.json").write_text(json.dumps(manifest))


def idx_arrays(path):
    """(header fields, lengths, pointers, document boundaries) of a .idx file."""
    data = path.read_bytes()
    header = HEADER.unpack_from(data)
    sequences, boundaries = header[3], header[4]
    lengths = np.frombuffer(data, np.int32, sequences, HEADER.size).copy()
    pointers = np.frombuffer(data, np.int64, sequences, HEADER.size + 4 * sequences).copy()
    bounds = np.frombuffer(data, np.int64, boundaries, HEADER.size + 12 * sequences).copy()
    return header, lengths, pointers, bounds


def write_idx(path, header, lengths, pointers, bounds, sequences=None, boundaries=None):
    magic, version, code, _, _ = header
    counts = (len(lengths) if sequences is None else sequences, len(bounds) if boundaries is None else boundaries)
    path.write_bytes(HEADER.pack(magic, version, code, *counts) + lengths.astype(np.int32).tobytes()
                     + pointers.astype(np.int64).tobytes() + bounds.astype(np.int64).tobytes())


def negative_length(lengths, pointers, bounds):
    # The lengths still sum to the .bin, so only the sign gives it away.
    lengths[3], lengths[4] = -5, lengths[4] + lengths[3] + 5
    return "sequence 3 has length -5"


def pointer_past_the_end(lengths, pointers, bounds):
    pointers[7] = 10 ** 9
    return f"sequence 7 starts at byte {10 ** 9}, not {int(2 * lengths[:7].sum())} where the sequences before it end"


def length_too_long(lengths, pointers, bounds):
    lengths[-1] += 10
    return f"its lengths sum to {int(lengths.sum())} uint16 tokens, but the .bin holds {int(2 * (lengths.sum() - 10))} bytes"


def boundary_out_of_range(lengths, pointers, bounds):
    bounds[5] = 10 ** 6
    return f"its document boundaries do not rise from 0 to its {len(lengths)} sequences"


IDX_DAMAGE = {"negative_length": negative_length, "pointer_past_the_end": pointer_past_the_end,
              "length_too_long": length_too_long, "boundary_out_of_range": boundary_out_of_range}


@pytest.mark.parametrize("damage", IDX_DAMAGE)
def test_a_resealed_idx_that_does_not_describe_the_bin_is_one_line(tiny_dataset, tmp_path, damage):
    dataset = sealed_copy(tiny_dataset, tmp_path)
    header, lengths, pointers, bounds = idx_arrays(dataset / "tokens.idx")
    reason = IDX_DAMAGE[damage](lengths, pointers, bounds)
    write_idx(dataset / "tokens.idx", header, lengths, pointers, bounds)
    reseal(dataset)
    with pytest.raises(DatasetCorruptError) as error:
        resolve_dataset(str(dataset), cache_dir=tmp_path / "cache", vocab_size=512)
    assert str(error.value) == f"{dataset / 'tokens.idx'}: {reason}; delete {dataset} to rebuild it"


def test_a_huge_count_is_refused_from_the_header_and_counts_must_be_the_manifests(tiny_dataset, tmp_path):
    dataset = sealed_copy(tiny_dataset, tmp_path)
    header, lengths, pointers, bounds = idx_arrays(dataset / "tokens.idx")
    size = (dataset / "tokens.idx").stat().st_size
    write_idx(dataset / "tokens.idx", header, lengths, pointers, bounds, sequences=2 ** 62)
    reseal(dataset)
    with pytest.raises(DatasetCorruptError, match=rf"tokens.idx: {size} bytes, but its counts \({2 ** 62} sequences"):
        resolve_dataset(str(dataset), cache_dir=tmp_path / "cache", vocab_size=512)
    # One document boundary fewer: a whole index, but not the manifest's count.
    write_idx(dataset / "tokens.idx", header, lengths, pointers, np.delete(bounds, 1))
    reseal(dataset)
    manifest = json.loads((dataset / "manifest.json").read_text())
    with pytest.raises(DatasetCorruptError) as error:
        resolve_dataset(str(dataset), cache_dir=tmp_path / "cache", vocab_size=512)
    assert str(error.value) == (
        f"{dataset / 'tokens.idx'}: holds {{'dtype': 'uint16', 'sequences': {manifest['sequences']}, 'documents': "
        f"{manifest['documents'] - 1}}}, manifest.json says {{'dtype': 'uint16', 'sequences': {manifest['sequences']}, "
        f"'documents': {manifest['documents']}}}; delete {dataset} to rebuild it")


@pytest.mark.parametrize("key, value", [("eot_id", 7), ("vocab_size", 600)])
def test_a_resealed_eot_id_or_vocab_size_that_is_not_the_tokenizers_is_refused(tiny_dataset, tmp_path, key, value):
    dataset = sealed_copy(tiny_dataset, tmp_path)
    vocab_size = json.loads((dataset / "manifest.json").read_text())["vocab_size"]
    reseal(dataset, lambda manifest: manifest.update({key: value}))
    with pytest.raises(DatasetCorruptError) as error:
        resolve_dataset(str(dataset), cache_dir=tmp_path / "cache", vocab_size=1024)
    message = str(error.value)
    assert message.startswith(f"{dataset / 'manifest.json'}: says {{") and f"'{key}': {value}" in message
    assert message.endswith(f"its tokenizer.json has {{'eot_token': '<|endoftext|>', 'eot_id': 0, "
                            f"'vocab_size': {vocab_size}}}; delete {dataset} to rebuild it")


def test_a_megatron_prefix_whose_idx_does_not_describe_its_bin_is_one_line(tiny_dataset, tmp_path):
    prefix = tmp_path / "corpus"
    shutil.copy(tiny_dataset / "tokens.bin", f"{prefix}.bin")
    header, lengths, pointers, bounds = idx_arrays(tiny_dataset / "tokens.idx")
    reason = negative_length(lengths, pointers, bounds)
    write_idx(tmp_path / "corpus.idx", header, lengths, pointers, bounds)
    with pytest.raises(DataError) as error:
        resolve_dataset(str(prefix), cache_dir=tmp_path / "cache", vocab_size=512)
    assert str(error.value) == f"{prefix}.idx: {reason}; it does not index {prefix}.bin, build the prefix again"


@pytest.mark.slow
def test_randomly_damaged_resealed_idx_files_are_one_line_or_read_whole(tiny_dataset, tmp_path):
    """Every array of tokens.idx edited (mutated_arrays) and its bytes damaged (mutated_bytes), the manifest
    resealed each time: the dataset is refused naming tokens.idx, or every training sample still reads."""
    dataset = sealed_copy(tiny_dataset, tmp_path)
    original = (dataset / "tokens.idx").read_bytes()
    header, *arrays = idx_arrays(dataset / "tokens.idx")
    cases = [(what, data) for what, data in mutated_bytes(original, seed=44, count=30)]
    for which, array in enumerate(arrays):
        for what, mutated in mutated_arrays(array, seed=44 + which, count=15):
            edited = list(arrays)
            edited[which] = mutated.reshape(-1)
            write_idx(dataset / "tokens.idx", header, *edited)
            cases.append((f"array {which}: {what}", (dataset / "tokens.idx").read_bytes()))
    outcomes = {"refused": 0, "read": 0}
    for what, data in cases:
        (dataset / "tokens.idx").write_bytes(data)
        reseal(dataset)
        try:
            blend = resolve_blend(None, str(dataset), tmp_path / "cache", 512, None)
            samples = BlendSamples(blend, "98,2,0", 16, 0, tmp_path / "cache")
            inputs, _ = samples.train_batch(list(range(samples.pass_samples)))
            assert inputs.shape == (samples.pass_samples, 16), what
            outcomes["read"] += 1
        except DatasetCorruptError as error:
            assert str(error).startswith(f"{dataset / 'tokens.idx'}: ") and "\n" not in str(error), (what, str(error))
            outcomes["refused"] += 1
    assert outcomes["refused"] >= 60, outcomes

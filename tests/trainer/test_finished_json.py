"""finished.json that is hostile rather than malformed (issue 55, item 3): nested past the parser, or a
directory, is one line naming the file; a directory is refused at start-up, before anything trains."""
import pytest

from conftest import fast_train_overrides
from parallel.dims import init_distributed
from trainer.config import load_config
from trainer.run_dir.checkpoint import CheckpointError
from trainer.run_dir.finished import FINISHED_FILE, finished_step, record_finished
from trainer.trainer import Trainer


def one_line(refused) -> str:
    message = str(refused.value)
    assert "\n" not in message
    return message


def test_a_finished_json_nested_past_the_parser_is_one_line(tmp_path):
    (tmp_path / FINISHED_FILE).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError) as refused:
        finished_step(tmp_path)
    assert one_line(refused).startswith(f"{tmp_path / FINISHED_FILE} could not be read (maximum recursion depth "
                                        "exceeded")
    assert one_line(refused).endswith('; expected {"step": N}')


def test_a_finished_json_directory_is_refused_at_start_up_before_anything_is_written(tmp_path, tiny_dataset):
    """Read as 'not finished' before, the run trained to its end and then crashed writing finished.json."""
    run = tmp_path / "run"
    (run / FINISHED_FILE).mkdir(parents=True)
    expected = (f"{run / FINISHED_FILE} is a directory, not the file {{\"step\": N}} a finished run leaves; remove it "
                "(the run's checkpoints still tell how far it trained)")
    with pytest.raises(CheckpointError) as refused:
        Trainer(load_config(fast_train_overrides(run, tiny_dataset, steps=2)), init_distributed())
    assert one_line(refused) == expected
    assert sorted(p.name for p in run.iterdir()) == [FINISHED_FILE]  # no checkpoint, log or config, no lock left


def test_a_finished_json_directory_made_during_the_run_is_one_line_at_its_end(tmp_path):
    (tmp_path / FINISHED_FILE).mkdir()
    with pytest.raises(CheckpointError) as refused:
        record_finished(tmp_path, 6)
    assert one_line(refused) == (f"{tmp_path / FINISHED_FILE} could not be written (Is a directory); the run "
                                 f"finished at step 6 and its checkpoints are kept: remove what is at "
                                 f"{tmp_path / FINISHED_FILE} and write {{\"step\": 6}} there before ever deleting them")
    assert list((tmp_path / FINISHED_FILE).iterdir()) == []
    assert [p.name for p in tmp_path.iterdir()] == [FINISHED_FILE]  # its temporary file removed

"""`python -m trainer.check`: the pre-flight that runs before torchrun starts any rank."""
import pytest

from trainer.check import main


def test_valid_layout_passes_and_names_the_data(tiny_dataset, capsys):
    main(["--nproc", "2", "model=xs", "parallel=pp2_vp2", "train.micro_batch=4", "train.seq_len=32",
          f"data.path={tiny_dataset}"])
    assert (f"config ok: model d=96 x 4 blocks, variant=block, data 1 {tiny_dataset} (722 training samples a pass, "
            "24 validation)") in capsys.readouterr().err


@pytest.mark.parametrize("args, fragment", [
    (["--nproc", "3", "parallel=pp2_vp2"], "parallel.dp * parallel.fsdp * parallel.cp * parallel.pp * parallel.tp = 1 * 1 * 1 * 2 * 1 = 2 does not match the 3 processes"),
    (["--nproc", "2", "variant.kernel=relu"], "variant.kernel='relu' is not valid; allowed: softmax | sigmoid"),
    (["--nproc", "1", "train.seq_len=100000"], "train tokens, fewer than one sample of train.seq_len + 1 = 100001"),
])
def test_bad_configs_fail_before_any_rank_starts(tiny_dataset, capsys, args, fragment):
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "model=xs", f"data.path={tiny_dataset}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0]

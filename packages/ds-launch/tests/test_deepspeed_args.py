"""`parse_deepspeed_args`: the command line as DeepSpeed's ``deepspeed.launcher.runner.parse_args`` gives it
(DeepSpeed's names and "not given" values; argparse's SystemExit on bad input), through ds-launch's parser."""

from __future__ import annotations

import sys

import pytest

from ds_launch import parse_deepspeed_args


def test_deepspeeds_names_and_not_given_values():
    args = parse_deepspeed_args(["train.py", "--deepspeed_config", "c.json"])
    assert (args.num_nodes, args.num_gpus, args.node_rank, args.autotuning, args.save_pid) == (-1, -1, -1, "", False)
    assert (args.user_script, args.user_args) == ("train.py", ["--deepspeed_config", "c.json"])
    assert (args.include, args.exclude, args.master_addr, args.master_port, args.launcher_args) == ("", "", "", 29500,
                                                                                                    "")
    assert not hasattr(args, "num_procs")


@pytest.mark.parametrize("mode", ["tune", "run"])
def test_given_values(mode):
    args = parse_deepspeed_args(["--num_nodes", "2", "--num_accelerators", "3", "--node_rank", "1", "--autotuning",
                                 mode, "--save_pid", "--master_port", "1234", "foo.py", "--num_gpus", "9"])
    assert (args.num_nodes, args.num_gpus, args.node_rank, args.autotuning) == (2, 3, 1, mode)
    assert (args.save_pid, args.save_pid_path, args.master_port) == (True, None, 1234)
    assert args.user_args == ["--num_gpus", "9"]  # the script's own arguments are left alone
    assert parse_deepspeed_args(["--save_pid=/tmp/p", "foo.py"]).save_pid_path == "/tmp/p"


@pytest.mark.parametrize("argv, words", [
    (["--autotuning", "--num_nodes", "1", "--num_gpus", "1", "foo.py"], ["--autotuning", "expected one argument"]),
    (["--autotuning", "test", "--num_nodes", "1", "--", "num_gpus", "1", "foo.py"], ["invalid choice", "'test'"]),
    (["--autotuning"], ["--autotuning", "expected one argument"]),
    (["--num_gpus", "0", "foo.py"], ["--num_gpus", "0"]),
    (["--num_gpu", "2", "foo.py"], ["--num_gpu", "did you mean --num_gpus"]),
    ([], ["user_script"]),
])
def test_bad_input_exits_as_argparse_does(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        parse_deepspeed_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("ds-launch: error: ")
    for word in words:
        assert word in err, (word, err)


def test_help_exits_zero(capsys):
    with pytest.raises(SystemExit) as e:
        parse_deepspeed_args(["--help"])
    assert e.value.code == 0 and "--autotuning" in capsys.readouterr().out


def test_default_is_the_programs_command_line(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["deepspeed", "--num_gpus", "2", "train.py", "x"])
    args = parse_deepspeed_args()
    assert (args.num_gpus, args.user_script, args.user_args) == (2, "train.py", ["x"])
    with pytest.raises(TypeError, match="list of strings"):
        parse_deepspeed_args(["--num_gpus", 2, "train.py"])

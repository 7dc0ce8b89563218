"""Config: presets, command-line overrides, validation, and help text from field docstrings."""
import dataclasses

import pytest

from hvdtrain.config import CNN_PRESETS, TrainConfig, field_docs, parse_config
from hvdtrain.errors import UserError


def parse(*argv):
    return parse_config(list(argv), CNN_PRESETS, prog="test", description="")


def test_every_field_has_a_docstring():
    docs = field_docs(TrainConfig)
    undocumented = [f.name for f in dataclasses.fields(TrainConfig) if not docs.get(f.name)]
    assert undocumented == []


@pytest.mark.parametrize("name", sorted(CNN_PRESETS))
def test_every_preset_is_valid(name):
    config = CNN_PRESETS[name]()
    assert dataclasses.replace(config) == config  # __post_init__ accepts it


def test_preset_then_overrides():
    config = parse("--preset", "tiny", "--epochs", "7", "--batch-policy", "global",
                   "--no-tensorboard", "--fp16-allreduce")
    assert config.epochs == 7
    assert config.batch_policy == "global"
    assert config.tensorboard is False and config.fp16_allreduce is True
    assert config.run_dir == CNN_PRESETS["tiny"]().run_dir  # untouched fields keep the preset


@pytest.mark.parametrize("argv, message", [
    (["--batch-policy", "sideways"], "invalid choice"),
    (["--lr-scaling", "cubic"], "invalid choice"),
    (["--epochs", "0"], "--epochs must be at least 1"),
    (["--batch-size", "-4"], "--batch-size must be at least 1"),
    (["--learning-rate", "0"], "--learning-rate must be positive"),
    (["--validation-fraction", "1.5"], "--validation-fraction must be in [0, 1)"),
    (["--data-dir", "a", "--tfrecords", "b"], "either --data-dir or --tfrecords"),
    (["--no-such-flag"], "unrecognized arguments"),
    (["--epochs", "three"], "invalid int value"),
])
def test_bad_values_are_one_line_user_errors(argv, message):
    with pytest.raises(UserError) as error:
        parse(*argv)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_help_lists_flags_with_their_docs(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse("--help")
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "--batch-policy" in text and "--grad-accum-steps" in text
    assert "Goyal" in text  # the --lr-scaling docstring made it into the help

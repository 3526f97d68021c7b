import argparse
import re

import pytest

from hvd_train import config
from hvd_train.data.table import TableOptions
from hvd_train.errors import UserError


def parse(argv):
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    return parser.parse_args(argv)


def test_defaults_then_yaml_then_flags(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  train: /from/yaml\n  batch_size: 48\nmodel:\n  name: ResNet50\nrun:\n  output: out\n")
    cfg = config.from_sources(parse(["--config", str(path), "--batch-size", "12"]))
    assert cfg.data.train == "/from/yaml"  # from the file
    assert cfg.data.batch_size == 12  # the flag wins
    assert cfg.model.name == "ResNet50"
    assert cfg.optim.base_lr == config.OptimConfig().base_lr  # default


def test_boolean_flags_and_yaml_roundtrip(tmp_path):
    cfg = config.from_sources(parse(["--data", "d", "--output", "o", "--no-resume", "--fp16-allreduce"]))
    assert cfg.run.resume is False and cfg.horovod.fp16_allreduce is True
    path = tmp_path / "again.yaml"
    path.write_text(cfg.to_yaml())
    assert config.from_sources(parse(["--config", str(path)])) == cfg


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--val-split", "1.5"], "--val-split"),
        (["--batch-size", "0"], "--batch-size"),
        (["--epochs", "0"], "--epochs"),
        (["--base-lr", "-1"], "--base-lr"),
        (["--grad-accum", "0"], "--grad-accum"),
        (["--image-size", "16"], "--image-size"),
        (["--weights", ""], "--weights"),
        (["--optimizer", "adam", "--head-lr-mult", "10"], "--head-lr-mult"),
        (["--freeze-backbone", "--trainable-layers", "3"], "--trainable-layers"),
        (["--ema", "1.0"], "--ema"),
        (["--augment-magnitude", "11"], "--augment-magnitude"),
        (["--mixup", "-0.2"], "--mixup"),
        (["--cutmix", "nan"], "--cutmix"),
        (["--early-stop", "-1"], "--early-stop"),
        (["--early-stop", "3", "--val-split", "0"], "--early-stop"),
        (["--head-parallel", "-2"], "--head-parallel"),
        (["--head-save", "files"], "--head-save"),
        (["--min-images-per-label", "0"], "--min-images-per-label"),
        (["--image-root", "elsewhere"], "--image-root"),  # --data d is a folder: the option would do nothing
        (["--label-column", "kind"], "--label-column"),
        (["--min-images-per-label", "1"], "--min-images-per-label"),
    ],
)
def test_invalid_values_name_the_flag(argv, flag):
    with pytest.raises(UserError, match=f"`{flag}` is invalid. Received: "):
        config.from_sources(parse(["--data", "d", "--output", "o", *argv]))


def test_base_lr_takes_a_number_or_auto_from_flags_and_yaml(tmp_path):
    assert config.from_sources(parse(["--data", "d", "--output", "o", "--base-lr", "auto"])).optim.base_lr == "auto"
    cfg = config.from_sources(parse(["--data", "d", "--output", "o", "--base-lr", "0.2"]))
    assert cfg.optim.base_lr == 0.2
    path = tmp_path / "auto.yaml"
    path.write_text("data: {train: d}\nrun: {output: o}\noptim: {base_lr: auto}\n")
    cfg = config.from_sources(parse(["--config", str(path)]))
    assert cfg.optim.base_lr == "auto" and "base_lr: auto" in cfg.to_yaml()
    with pytest.raises(SystemExit):  # argparse: "use a number or auto"
        parse(["--base-lr", "fast"])
    path.write_text("data: {train: d}\nrun: {output: o}\noptim: {base_lr: fast}\n")
    with pytest.raises(UserError, match="optim.base_lr"):
        config.from_sources(parse(["--config", str(path)]))


def test_missing_data_and_output():
    with pytest.raises(UserError, match="`--data`"):
        config.from_sources(parse(["--output", "o"]))
    with pytest.raises(UserError, match="`--output`"):
        config.from_sources(parse(["--data", "d"]))


@pytest.mark.parametrize(
    "text, message",
    [
        ("model:\n  nmae: X\n", "unknown key model.nmae"),
        ("modle:\n  name: X\n", "unknown section 'modle'"),
        ("data:\n  batch_size: many\n", "`data.batch_size` must be int"),
        ("run:\n  resume: maybe\n", "`run.resume` must be true or false"),
        ("- a list\n", "must hold a mapping"),
        ("data: [unclosed\n", "is not valid YAML"),
    ],
)
def test_bad_config_files(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(UserError, match=message):
        config.from_sources(parse(["--config", str(path), "--data", "d", "--output", "o"]))


def test_missing_config_file(tmp_path):
    with pytest.raises(UserError, match="cannot read config file"):
        config.from_sources(parse(["--config", str(tmp_path / "nope.yaml")]))


@pytest.mark.parametrize(
    "text, parsed",
    [
        ("", (0, 0.0)),
        ("500", (500, 0.0)),
        ("90s", (0, 90.0)),
        ("15m", (0, 900.0)),
        ("2h", (0, 7200.0)),
        ("1.5m", (0, 90.0)),
    ],
)
def test_checkpoint_every_takes_steps_or_a_duration(text, parsed):
    assert config.parse_every(text) == parsed


def test_the_options_of_a_csv_of_labels_are_taken_where_data_or_val_data_is_one():
    for data in (["--data", "labels.CSV"], ["--data", "d", "--val-data", "s3://b/val.tsv"]):
        options = ["--image-root", "images", "--path-column", "Id", "--label-column", "kind"]
        cfg = config.from_sources(parse([*data, "--output", "o", *options, "--min-images-per-label", "1"]))
        assert cfg.data.table_options() == TableOptions("Id", "kind", "images", 1)


@pytest.mark.parametrize("text", ["0", "15 minutes", "m", "-5s", "10x"])
def test_checkpoint_every_refuses_anything_else(text):
    with pytest.raises(UserError, match="`--checkpoint-every` is invalid.*15m"):
        config.from_sources(parse(["--data", "d", "--output", "o", f"--checkpoint-every={text}"]))


def test_elastic_refuses_gradient_accumulation():
    with pytest.raises(UserError, match="`--grad-accum` is invalid.*elastic job cannot roll back"):
        config.from_sources(parse(["--data", "d", "--output", "o", "--elastic", "--grad-accum", "2"]))


def test_float16_refuses_gradient_accumulation_and_bfloat16_takes_it():
    # Horovod aggregates gradients locally between allreduces while float16's
    # loss scale may change: refused, naming the precisions that work.
    args = ["--data", "d", "--output", "o", "--grad-accum", "2", "--precision"]
    with pytest.raises(UserError, match="`--grad-accum` is invalid.*mixed_bfloat16 or fp32"):
        config.from_sources(parse([*args, "mixed_float16"]))
    assert config.from_sources(parse([*args, "mixed_bfloat16"])).horovod.grad_accum == 2


def test_output_inside_data_is_refused(tmp_path):
    with pytest.raises(UserError, match="`--output` is invalid.*inside --data"):
        config.from_sources(parse(["--data", str(tmp_path), "--output", str(tmp_path / "run")]))
    with pytest.raises(UserError, match="inside --data"):
        config.from_sources(parse(["--data", str(tmp_path), "--output", str(tmp_path)]))
    config.from_sources(parse(["--data", str(tmp_path / "d"), "--output", str(tmp_path / "d2")]))


def test_an_output_in_s3_and_data_in_s3_may_not_hold_each_other():
    # The run's prefix holds the run alone, and its files are no images to train on.
    for data, output, why in (
        ("s3://b/x/train", "s3://b/x", "--data s3://b/x/train is inside it"),
        ("s3://b/x/", "s3://b/x/runs/one", "it is inside --data s3://b/x/"),
        ("s3://b/x", "s3://b/x/", "it is inside --data s3://b/x"),
    ):
        with pytest.raises(UserError, match=f"`--output` is invalid.*{re.escape(why)}"):
            config.from_sources(parse(["--data", data, "--output", output]))
    with pytest.raises(UserError, match=re.escape("--val-data s3://b/x/val/ is inside it")):
        config.from_sources(parse(["--data", "s3://b/train", "--val-data", "s3://b/x/val/", "--output", "s3://b/x"]))
    for data, output in (("s3://b/x/train", "s3://b/x/train-run"), ("s3://b/x", "s3://c/x/run"), ("s3://b/x", "x")):
        assert config.from_sources(parse(["--data", data, "--output", output])).run.output == output


def test_an_elastic_job_refuses_an_output_in_s3():
    with pytest.raises(UserError, match="`--output` is invalid.*rank 0 may change to a host without its staging"):
        config.from_sources(parse(["--data", "d", "--output", "s3://b/runs/x", "--elastic"]))
    assert config.from_sources(parse(["--data", "d", "--output", "s3://b/runs/x"])).run.output == "s3://b/runs/x"


def test_a_config_files_default_weight_decay_follows_the_optimizer_the_command_line_gives(tmp_path):
    """A run_config.yaml records the decay it resolved: its optimizer's default is no choice of the user's."""
    from hvd_train.config.choices import ADAMW_WEIGHT_DECAY

    def decay(optimizer: str, weight_decay: float, *flags: str) -> float:
        path = tmp_path / f"{optimizer}-{weight_decay}.yaml"
        path.write_text(
            f"data: {{train: d}}\nrun: {{output: o}}\noptim: {{optimizer: {optimizer}, weight_decay: {weight_decay}}}\n"
        )
        return config.from_sources(parse(["--config", str(path), *flags])).optim.weight_decay

    assert decay("sgd", 0.0, "--optimizer", "adamw") == ADAMW_WEIGHT_DECAY  # an sgd run's file, now adamw
    assert decay("adam", 0.0, "--optimizer", "adamw") == ADAMW_WEIGHT_DECAY
    assert decay("adamw", ADAMW_WEIGHT_DECAY, "--optimizer", "sgd") == 0.0  # an adamw run's, now sgd
    # A decay chosen (not the file's optimizer's default) is kept; a flag wins.
    assert decay("adamw", 0.05, "--optimizer", "sgd") == 0.05
    assert decay("sgd", 0.01, "--optimizer", "adamw") == 0.01
    assert decay("sgd", 0.0, "--optimizer", "adamw", "--weight-decay", "0.02") == 0.02
    assert decay("adamw", ADAMW_WEIGHT_DECAY) == ADAMW_WEIGHT_DECAY


def test_a_config_files_zero_weight_decay_with_adamw_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "run_config.yaml"
    path.write_text("data: {train: d}\nrun: {output: o}\noptim: {optimizer: adamw, weight_decay: 0.0}\n")
    for flags in ([], ["--optimizer", "adamw"]):
        with pytest.raises(UserError) as refused:
            config.from_sources(parse(["--config", str(path), *flags]))
        message = str(refused.value)
        assert f"config file {path} sets optim.weight_decay 0.0 with the optimizer adamw" in message, message
        assert "set it > 0 there, or remove it" in message and "leave it out" not in message, message
    # Given on the command line, the flag is named.
    with pytest.raises(UserError, match="give --weight-decay > 0, or leave it out"):
        config.from_sources(parse(["--config", str(path), "--optimizer", "adamw", "--weight-decay", "0"]))

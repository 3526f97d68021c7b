"""The table of trackers (``--track NAME``) and the names of their options, older ones included."""

import pytest
import yaml

from hvd_train import config
from hvd_train.errors import UserError


def test_the_trackers_the_config_takes_are_the_tables():
    from hvd_train.config.run_choices import TRACKERS
    from hvd_train.training import tracking
    from hvd_train.training.tracking.base import Tracker

    assert TRACKERS == ("none", *tracking.TRACKERS)
    for name, entry in tracking.TRACKERS.items():
        assert entry.name == name and issubclass(entry, Tracker), entry
    assert tracking.entry("none") is None


# --- the tracker's options by their names before: track_uri, track_experiment, track_run -------------

OLD = {"track_uri": "sqlite:///old.db", "track_experiment": "flowers", "track_run": "first"}
NOW = {"tracker_uri": "sqlite:///old.db", "tracker_project": "flowers", "tracker_run": "first"}
OLD_NAME = {now: old for old, now in zip(OLD, NOW, strict=True)}


def parse(argv):
    from hvd_train.cli import build_parser

    return build_parser().parse_args(["train", "--data", "images", "--output", "out", *argv])


def tracker_options(cfg) -> dict:
    return {name: getattr(cfg.run, name) for name in NOW}


def test_the_older_flags_of_the_tracker_options_still_work():
    old = [word for key, value in OLD.items() for word in ("--" + key.replace("_", "-"), value)]
    assert old[::2] == ["--track-uri", "--track-experiment", "--track-run"]
    assert tracker_options(config.from_sources(parse(old))) == NOW
    new = [word for key, value in NOW.items() for word in ("--" + key.replace("_", "-"), value)]
    assert tracker_options(config.from_sources(parse(new))) == NOW


def test_a_run_config_of_an_earlier_run_with_the_older_keys_is_read(tmp_path):
    """As a resume with ``--config OUTPUT/run_config.yaml`` of a run written before the rename reads it."""
    written = config.build({"data": {"train": "images"}, "run": {"output": "out", "track": "mlflow", **NOW}})
    earlier = yaml.safe_load(written.to_yaml())
    earlier["run"] = {OLD_NAME.get(k, k): v for k, v in earlier["run"].items()}
    assert set(OLD) <= set(earlier["run"]) and not set(NOW) & set(earlier["run"])
    path = tmp_path / "run_config.yaml"
    path.write_text(yaml.safe_dump(earlier, sort_keys=False))
    assert config.from_sources(parse(["--config", str(path)])) == written
    # A flag typed, by either name, wins over the file.
    for flag in ("--tracker-run", "--track-run"):
        assert config.from_sources(parse(["--config", str(path), flag, "second"])).run.tracker_run == "second"


def test_an_option_given_by_both_its_names_in_one_file_is_refused_in_one_line(tmp_path):
    path = tmp_path / "both.yaml"
    path.write_text(yaml.safe_dump({"run": {"track_uri": "a", "tracker_uri": "b"}}))
    with pytest.raises(UserError) as refused:
        config.from_sources(parse(["--config", str(path)]))
    message = str(refused.value)
    assert "run.track_uri is the older name of run.tracker_uri" in message and "\n" not in message, message


def test_a_sweep_file_with_the_older_keys_gives_its_trials_the_names_now(tmp_path):
    from hvd_train.experiments import spec

    train = {"data": {"train": str(tmp_path)}, "run": {"track": "mlflow", "track_uri": "sqlite:///old.db"}}
    sweep = spec.parse({"train": train, "search": {"run.seed": [1, 2]}})
    trial = sweep.trial_config({"run.seed": 2}, str(tmp_path / "trial-0001"), "study")
    assert {k: v for k, v in trial["run"].items() if "track" in k} == {
        "track": "mlflow",
        "tracker_uri": "sqlite:///old.db",
        "tracker_run": "trial-0001",
        "tracker_project": "study",
    }
    # The base's own project, by its older name, is the trials'.
    train["run"]["track_experiment"] = "mine"
    trial = spec.parse({"train": train, "search": {"run.seed": [1]}}).trial_config({}, "t", "study")
    assert trial["run"]["tracker_project"] == "mine" and "track_experiment" not in trial["run"]

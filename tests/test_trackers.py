"""The table of trackers (``--track NAME``), the names of their options (older ones included), and
``--track jsonl``: a run in S3 tracked through the real CLI, read back from the prefix."""

import csv
import json

import pytest
import yaml

from hvd_train import config
from hvd_train.errors import UserError

from conftest import HVD_TRAIN, TINY, output_of, run


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
    # A searched option by its older name is searched under its name now.
    sweep = spec.parse({"train": train, "search": {"run.track_run": ["a", "b"]}})
    assert list(sweep.search) == ["run.tracker_run"]


# --- --track jsonl: the run's events appended to a file, one JSON object a line ------------------


def events_of(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


@pytest.fixture(scope="module")
def jsonl_run(tmp_path_factory, demo_small, s3_server):
    """A run in S3 tracked to jsonl: one epoch on a machine, then a resume to two on another (the prefix's
    files alone): the prefix's files, and both processes."""
    from s3_runs import fresh_bucket, stored

    folder = tmp_path_factory.mktemp("jsonl")
    with pytest.MonkeyPatch.context() as monkeypatch:
        bucket, client = fresh_bucket(s3_server, monkeypatch)
        args = ["train", "--data", demo_small, "--output", f"s3://{bucket}/runs/a", "--val-split", "0.2", *TINY]
        args += ["--track", "jsonl", "--tracker-project", "flowers"]
        procs = [
            run([*HVD_TRAIN, *args, "--epochs", str(epochs)], HVD_TRAIN_CACHE=str(folder / f"machine-{epochs}"))
            for epochs in (1, 2)
        ]
    files = {
        rel: client.get_object(Bucket=bucket, Key=f"runs/a/{rel}")["Body"].read() for rel in stored(client, bucket)
    }
    return files, procs


def test_a_run_tracked_to_jsonl_has_its_events_in_its_prefix_as_its_own_files_have_them(jsonl_run):
    files, procs = jsonl_run
    for proc in procs:
        assert proc.returncode == 0, output_of(proc)
    events = events_of(files["tracking.jsonl"].decode())
    assert [e["event"] for e in events] == ["start", "epoch", "finish", "start", "epoch", "finish"], events
    assert [e["resumed"] for e in events if e["event"] == "start"] == [False, True]
    assert {(e["project"], e["run"]) for e in events} == {("flowers", "a")}
    # The parameters: run_config.yaml's options, as section.option.
    written = yaml.safe_load(files["run_config.yaml"])
    assert events[3]["params"] == {f"{s}.{k}": v for s, body in written.items() for k, v in body.items()}
    assert events[0]["params"]["run.epochs"] == 1 and events[3]["params"]["run.track"] == "jsonl"
    # Every epoch once, as metrics.csv has it.
    rows = list(csv.DictReader(files["metrics.csv"].decode().splitlines()))
    epochs = [e for e in events if e["event"] == "epoch"]
    assert [e["step"] for e in epochs] == [int(row["epoch"]) for row in rows] == [1, 2]
    for event, row in zip(epochs, rows, strict=True):
        numbers = {k: float(v) for k, v in row.items() if k != "epoch" and v}
        assert {k: pytest.approx(v, rel=1e-5) for k, v in numbers.items()} == {k: event["metrics"][k] for k in numbers}
    # The end: summary.json's final numbers, and the run's files.
    summary = json.loads(files["summary.json"])
    results = events[-1]["results"]
    assert set(results) == {"val_accuracy", "val_top5", "val_loss", "images_per_sec", "images_per_sec_first_epoch"}
    assert results == {k: summary[k] for k in results}
    assert {"model.keras", "summary.json", "curves.png", "run_config.yaml"} <= set(events[-1]["files"]), events[-1]


def jsonl_config(output, uri: str = ""):
    run = {"output": str(output), "track": "jsonl", "tracker_uri": uri}
    return config.build({"data": {"train": "images"}, "run": run})


def test_each_call_of_a_jsonl_tracker_is_one_line_a_resumed_run_appends_to_the_same_file(tmp_path):
    from hvd_train.training import tracking

    tracker = tracking.start(jsonl_config(tmp_path / "run"), resumed=False)
    tracker.log_epoch(1, {"loss": float("nan"), "val_accuracy": 0.5, "lr": 0.01, "note": "words are left out"})
    tracker.stopped()
    again = tracking.start(jsonl_config(tmp_path / "run"), resumed=True)
    again.log_epoch(2, {"loss": 0.25, "val_accuracy": 0.75})
    again.failed(UserError("training diverged: lower --base-lr"))
    events = events_of((tmp_path / "run" / "tracking.jsonl").read_text())
    assert [e["event"] for e in events] == ["start", "epoch", "stopped", "start", "epoch", "failed"]
    assert events[1]["metrics"] == {"loss": None, "val_accuracy": 0.5, "lr": 0.01}  # JSON has no NaN
    assert events[-1]["error"] == "training diverged: lower --base-lr"
    assert {(e["project"], e["run"]) for e in events} == {("hvd_train", "run")}


def test_a_jsonl_file_is_inside_the_output_folder_or_where_an_absolute_path_says(tmp_path):
    from hvd_train.training import tracking
    from hvd_train.training.tracking.jsonl import JsonlTracker

    out = tmp_path / "run"
    tracking.start(jsonl_config(out, "logs/events.jsonl"), resumed=False)
    assert [e["event"] for e in events_of((out / "logs" / "events.jsonl").read_text())] == ["start"]
    tracking.start(jsonl_config(out, str(tmp_path / "elsewhere" / "all.jsonl")), resumed=False)
    assert (tmp_path / "elsewhere" / "all.jsonl").is_file()
    # A link inside the output folder that leads out of it is no way out.
    (tmp_path / "outside").mkdir()
    (out / "link").symlink_to(tmp_path / "outside")
    for uri, said in (
        ("../events.jsonl", "--tracker-uri ../events.jsonl leaves the output folder"),
        ("logs/../../events.jsonl", "leaves the output folder"),
        ("link/events.jsonl", "--tracker-uri link/events.jsonl leaves the output folder"),
        ("http://127.0.0.1:5000", "--track jsonl writes a file, and --tracker-uri http://127.0.0.1:5000 is a URI"),
        # Where the run replaces or prunes its own files, or keeps them hidden (not copied to an S3 --output).
        ("checkpoints/events.jsonl", "checkpoints/events.jsonl is where the run keeps its own files"),
        ("tensorboard/hparams/events.jsonl", "is where the run keeps its own files"),
        ("logs/.events.jsonl", "logs/.events.jsonl is where the run keeps its own files"),
    ):
        with pytest.raises(UserError) as refused:
            tracking.start(jsonl_config(out, uri), resumed=False)
        assert said in str(refused.value) and "\n" not in str(refused.value), refused.value
    assert not list((tmp_path / "outside").iterdir()) and not (tmp_path / "events.jsonl").exists()
    # A sweep refuses a base whose path climbs out before any trial.
    with pytest.raises(UserError, match="leaves the output folder"):
        JsonlTracker.prepare_sweep("../events.jsonl", "study")

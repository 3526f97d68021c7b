"""``hvd-train sweep``: the sweep file's checks, trials as real Horovod jobs, pruning, a stop and its resume.

The jobs train the tests' backbone on the small demo set; the study is
Optuna's, in SQLite in the sweep's folder, read back with Optuna itself.
"""

import json
import os
import re
import signal
import time
import warnings
from pathlib import Path

import optuna
import pytest
import yaml

from conftest import HVD_TRAIN, TINY_NET, cli, kill_group, output_of, run, start
from mlflow_server import mlflow_runs_of

BASE = {
    "model": {"name": f"{TINY_NET}:backbone", "weights": "none"},
    "data": {"val_split": 0.2, "batch_size": 8, "image_size": 32},
    "run": {"tensorboard": False},
    "horovod": {"threads_per_rank": 1},
}


def sweep_file(folder: Path, data: Path, epochs: int, **keys) -> Path:
    train = {section: dict(body) for section, body in BASE.items()}
    train["data"]["train"] = str(data)
    train["run"]["epochs"] = epochs
    path = folder / "sweep.yaml"
    path.write_text(yaml.safe_dump({"train": train, **keys}, sort_keys=False))
    return path


def study_of(folder: Path):
    return optuna.load_study(study_name=folder.name, storage=f"sqlite:///{folder / 'study.db'}")


# --- the sweep file, checked before any trial ------------------------------------------------


@pytest.mark.parametrize(
    ("keys", "said"),
    [
        ({"search": {"optim.base_lr": {"log_uniform": [0, 1]}}}, "needs low < high and low > 0"),
        ({"search": {"optim.nope": [1, 2]}}, "unknown key optim.nope"),
        ({"search": {"base_lr": [0.1]}}, "is not a train option"),
        ({"search": {"optim.base_lr": [0.1, -1.0]}}, "optim.base_lr=-1.0 would fail: `--base-lr`"),
        ({"search": {"optim.base_lr": [0.1]}, "objective": "images_per_sec_first_epoch"}, "use pruner: none"),
        ({"search": {"optim.base_lr": {"uniform": [0.1, 1]}}, "sampler": "grid"}, "grid sampler takes"),
        ({"search": {"optim.base_lr": [0.1, 0.2]}, "sampler": "grid", "trials": 3}, "more than the grid's 2"),
        ({"search": {"optim.base_lr": [0.1]}, "trails": 3}, "unknown key 'trails'"),
        ({"search": {"optim.base_lr": [0.1]}, "trials": 1, "first": [{}, {}]}, "more than `trials`"),
        ({"search": {"optim.base_lr": [0.1]}, "first": [{"optim.momentum": 0.5}]}, "searched options only"),
    ],
)
def test_a_bad_sweep_file_is_refused_before_any_trial(tmp_path, keys, said):
    path = sweep_file(tmp_path, tmp_path, epochs=1, **keys)
    proc = cli(["sweep", path, "--output", tmp_path / "out"])
    assert proc.returncode == 2, output_of(proc)
    assert said in proc.stderr, output_of(proc)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("keys", "said"),
    [
        # An objective no trial's summary.json has: a typo, or a number of metrics.csv alone.
        ({"objective": "val_acc", "pruner": "none"}, "`objective` must be a number of each trial's summary.json"),
        ({"objective": "loss", "pruner": "none"}, "Received: 'loss'"),
        ({"objective": "accuracy"}, "Received: 'accuracy'"),
        # A multi-label run's score, and no trial trains a multi-label set: every trial would end without it.
        ({"objective": "val_map"}, "the objective val_map is a multi-label run's, and no trial trains a multi-label"),
        # A value of `first` its space cannot give.
        ({"search": {"optim.optimizer": ["sgd", "adamw"]}, "first": [{"optim.optimizer": "adam"}]}, "adam"),
        ({"search": {"data.batch_size": {"int": [8, 32], "step": 8}}, "first": [{"data.batch_size": 12}]}, "12"),
        ({"search": {"data.batch_size": {"int": [8, 32]}}, "first": [{"data.batch_size": 64}]}, "64"),
        ({"search": {"optim.base_lr": {"log_uniform": [0.001, 0.1]}}, "first": [{"optim.base_lr": 0.5}]}, "0.5"),
    ],
)
def test_an_objective_or_a_first_value_no_trial_can_have_is_refused_in_one_line(tmp_path, keys, said):
    from hvd_train.errors import UserError
    from hvd_train.experiments import spec

    keys = {"search": {"optim.base_lr": [0.1]}, **keys}
    path = sweep_file(tmp_path, tmp_path, epochs=1, **keys)
    with pytest.raises(UserError) as refused:
        spec.load(str(path))
    message = str(refused.value)
    assert said in message and "\n" not in message, message
    if "first" in keys:
        assert "outside its space" in message, message


def test_a_sweep_over_sgd_and_adamw_gives_adamw_its_default_weight_decay(tmp_path):
    from hvd_train.config.choices import ADAMW_WEIGHT_DECAY
    from hvd_train.config.sources import from_mapping
    from hvd_train.experiments import spec

    path = sweep_file(tmp_path, tmp_path, epochs=1, search={"optim.optimizer": ["sgd", "adamw"]})
    sweep = spec.load(str(path))
    decays = [
        from_mapping(sweep.trial_config({"optim.optimizer": o}, "t"), "t").optim.weight_decay for o in ("sgd", "adamw")
    ]
    assert decays == [0.0, ADAMW_WEIGHT_DECAY]


def test_two_values_that_cannot_go_together_are_refused_however_many_corners_the_spaces_have(tmp_path):
    """Past 64 combinations of the spaces' corners, each pair of two options' corners is still checked."""
    from hvd_train.errors import UserError
    from hvd_train.experiments import spec

    search = {
        "optim.optimizer": ["sgd", "adamw"],
        "optim.weight_decay": [0.0, 0.01],  # adamw with no decay is refused by train
        "optim.label_smoothing": {"uniform": [0.0, 0.2]},
        "optim.momentum": {"uniform": [0.8, 0.95]},
        "optim.warmup_epochs": {"uniform": [0.0, 2.0]},
        "data.batch_size": {"int": [8, 32], "step": 8},
        "run.seed": [1, 2, 3],  # 192 combinations of corners in all
    }
    path = sweep_file(tmp_path, tmp_path, epochs=1, search=search)
    with pytest.raises(UserError) as refused:
        spec.load(str(path))
    message = str(refused.value)
    assert "optim.optimizer='adamw', optim.weight_decay=0.0" in message and "would fail" in message, message
    del search["optim.weight_decay"]  # and without that pair, none is refused
    spec.load(str(sweep_file(tmp_path, tmp_path, epochs=1, search=search)))


def test_a_held_out_objective_needs_held_out_images(tmp_path):
    path = sweep_file(tmp_path, tmp_path, epochs=1, search={"optim.base_lr": [0.1]})
    spec = yaml.safe_load(path.read_text())
    spec["train"]["data"]["val_split"] = 0
    path.write_text(yaml.safe_dump(spec))
    proc = cli(["sweep", path, "--output", tmp_path / "out"])
    assert proc.returncode == 2 and "needs held-out images" in proc.stderr, output_of(proc)


@pytest.mark.parametrize("val_split", [[0.2, 0.0], [0.0, 0.2]])
def test_a_held_out_objective_needs_held_out_images_in_every_trial(tmp_path, val_split):
    from hvd_train.errors import UserError
    from hvd_train.experiments import spec

    path = sweep_file(tmp_path, tmp_path, epochs=1, search={"data.val_split": val_split})
    with pytest.raises(UserError, match=r"needs held-out images: .* \(a trial with data.val_split=0.0 has none\)"):
        spec.load(str(path))


@pytest.mark.parametrize(("epochs", "given", "first"), [(12, 0, 4), (2, 0, 1), (12, 3, 3)])
def test_pruning_waits_a_third_of_the_epochs_unless_told(tmp_path, epochs, given, first):
    from hvd_train.experiments import spec

    path = sweep_file(tmp_path, tmp_path, epochs=epochs, search={"optim.base_lr": [0.1]}, prune_warmup_epochs=given)
    assert spec.load(str(path)).first_prunable_epoch() == first


# --- a sweep of four trials, two at once, stopped and resumed -------------------------------


@pytest.fixture(scope="module")
def resumed_sweep(tmp_path_factory, demo_small):
    """A grid of 4 trials, 2 at once, 1 worker each. SIGTERM once a trial is mid-run, then the same command."""
    folder = tmp_path_factory.mktemp("sweep")
    path = sweep_file(
        folder,
        demo_small,
        epochs=20,  # long enough for a stop to land mid-trial (after its third epoch)
        search={"optim.base_lr": [0.02, 0.05], "run.seed": [1, 2]},
        sampler="grid",
        trials=4,
        pruner="none",
        parallel=2,
    )
    out = folder / "out"
    command = [*HVD_TRAIN, "sweep", path, "--output", out]
    proc = start(command)
    try:
        cut = _wait_for_a_trial_mid_run(out, proc)
        os.kill(proc.pid, signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        kill_group(proc)
    stopped = (proc.returncode, stdout + stderr)
    after_stop = [(t.number, t.state.name, dict(t.user_attrs)) for t in study_of(out).get_trials()]
    # Then a sweep killed outright (a lost machine) while a trial it started is mid-run.
    before = {p.name for p in out.glob("trial-*")}
    proc = start(command)
    try:
        killed = _wait_for_a_trial_mid_run(out, proc, skip=before)
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
        left = _jobs_of(out, until=time.monotonic() + 60)
    finally:
        kill_group(proc)
    resumed = run(command, timeout=600)
    return {
        "out": out,
        "stopped": stopped,
        "cut": cut,
        "after_stop": after_stop,
        "killed": killed,
        "left_running": left,
        "resumed": resumed,
    }


def _jobs_of(out: Path, until: float) -> list[str]:
    """The command lines of processes still running a trial of ``out`` at ``until`` (or none before)."""
    while True:
        left = []
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                line = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(out) in line and " train " in line:
                left.append(line)
        if not left or time.monotonic() > until:
            return left
        time.sleep(0.2)


def _wait_for_a_trial_mid_run(out: Path, proc, timeout: float = 240, skip=()) -> str:
    """The folder of a trial that has checkpoints of 3 epochs or more, not yet its summary."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        for trial in sorted(out.glob("trial-*")):
            if trial.name in skip:
                continue
            epochs = list((trial / "checkpoints").glob("epoch-*"))
            if len(epochs) >= 1 and (trial / "metrics.csv").is_file() and not (trial / "summary.json").exists():
                rows = (trial / "metrics.csv").read_text().splitlines()
                if len(rows) >= 4:
                    return trial.name
        time.sleep(0.05)
    pytest.fail("no trial reached its third epoch")


@pytest.mark.multiprocess
def test_a_stopped_sweep_hands_its_running_trials_back(resumed_sweep):
    code, output = resumed_sweep["stopped"]
    assert code == 75, output
    assert "run the same command to go on" in output
    handed_back = [n for n, state, attrs in resumed_sweep["after_stop"] if state == "FAIL"]
    retries = {
        attrs["retry_of"]: attrs["folder"] for n, state, attrs in resumed_sweep["after_stop"] if "retry_of" in attrs
    }
    assert handed_back and set(handed_back) == set(retries), resumed_sweep["after_stop"]
    assert resumed_sweep["cut"] in retries.values()


@pytest.mark.multiprocess
def test_a_killed_sweeps_trial_stops_with_it_and_the_next_sweep_takes_it_back(resumed_sweep):
    out, killed = resumed_sweep["out"], resumed_sweep["killed"]
    assert resumed_sweep["left_running"] == []
    log = (out / killed / "trial.log").read_text()
    assert "stopped by SIGTERM" in log and log.count("resuming from") >= 1, log[-3000:]
    assert f"lost its sweep process: handed back, to go on from its checkpoint in {killed}" in (
        resumed_sweep["resumed"].stderr
    ), output_of(resumed_sweep["resumed"])


@pytest.mark.multiprocess
def test_the_resumed_sweep_runs_the_trials_asked_for_and_the_cut_one_from_its_checkpoint(resumed_sweep):
    proc, out = resumed_sweep["resumed"], resumed_sweep["out"]
    assert proc.returncode == 0, output_of(proc)
    summary = json.loads((out / "sweep.json").read_text())
    assert summary["counts"]["complete"] == 4 and len(summary["rows"]) == 4, summary
    # Every point of the grid once, each finished trial's value the one its run measured.
    assert sorted((r["params"]["optim.base_lr"], r["params"]["run.seed"]) for r in summary["rows"]) == [
        (0.02, 1),
        (0.02, 2),
        (0.05, 1),
        (0.05, 2),
    ]
    for row in summary["rows"]:
        run_summary = json.loads((out / row["folder"] / "summary.json").read_text())
        assert row["value"] == pytest.approx(run_summary["val_accuracy"])
        assert (out / row["folder"] / "report.html").is_file()
    log = (out / resumed_sweep["cut"] / "trial.log").read_text()
    assert "resuming from" in log and "stopped by SIGTERM" in log, log[-3000:]
    # The study is Optuna's own: the same trials, read back from its storage.
    complete = study_of(out).get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    assert sorted(t.value for t in complete) == sorted(r["value"] for r in summary["rows"])


@pytest.mark.multiprocess
def test_the_best_trial_is_written_as_a_config_train_takes(resumed_sweep):
    from hvd_train.config.sources import from_sources

    out = resumed_sweep["out"]
    summary = json.loads((out / "sweep.json").read_text())
    best = max(summary["rows"], key=lambda r: r["value"])
    assert summary["best"]["number"] == best["number"]
    cfg = from_sources(yaml_path=str(out / "best.yaml"))
    assert (cfg.optim.base_lr, cfg.run.seed) == (best["params"]["optim.base_lr"], best["params"]["run.seed"])
    assert cfg.run.output == str(out.resolve() / "best")
    page = (out / "sweep.html").read_text()
    # Each trial linked to its report (the order of the table: test_the_page_ranks_trials_by_the_objective...).
    assert all(f"href='{r['folder']}/report.html'" in page for r in summary["rows"]), page
    assert "data:image/png;base64," in page
    # The importances, or a line saying the four trials tie (their values may well, on 25 held-out images).
    tie = "the options' importances cannot be told apart"
    assert (tie in page) == (tie in resumed_sweep["resumed"].stderr) == summary["importances_tie"], summary
    assert ("Option importances (PED-ANOVA)" in page) != summary["importances_tie"]


def _pages_of(tmp_path: Path, values: list[float]):
    """``sweep.json`` and ``sweep.html`` of a real study whose trials ended with ``values``, in that order."""
    from optuna.distributions import FloatDistribution, IntDistribution

    from hvd_train.experiments import pages, spec

    path = sweep_file(
        tmp_path,
        tmp_path,
        epochs=1,
        search={"optim.base_lr": {"log_uniform": [0.001, 0.1]}, "run.seed": {"int": [1, 9]}},
    )
    sweep = spec.load(str(path))
    study = optuna.create_study(direction="maximize")
    spaces = {"optim.base_lr": FloatDistribution(0.001, 0.1, log=True), "run.seed": IntDistribution(1, 9)}
    for number, value in enumerate(values):
        params = {"optim.base_lr": 0.01 * (number + 1), "run.seed": number + 1}
        attrs = {"folder": f"trial-{number:04d}", "epochs": 1, "seconds": 12.345}
        study.add_trial(optuna.trial.create_trial(params=params, distributions=spaces, value=value, user_attrs=attrs))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing of Optuna's reaches the sweep's log
        summary = pages.write(sweep, study, str(tmp_path), "sqlite:///study.db")
    page = (tmp_path / "sweep.html").read_text()
    ranked = re.findall(r'<tr><td>(\d+)</td><td class="name">complete</td><td>([0-9.]+)</td>', page)
    return summary, page, [(int(n), float(v)) for n, v in ranked]


def test_the_page_ranks_trials_by_the_objective_and_ties_by_number(tmp_path):
    summary, page, ranked = _pages_of(tmp_path, [0.5, 0.9, 0.7, 0.9])
    assert ranked == [(1, 0.9), (3, 0.9), (2, 0.7), (0, 0.5)], ranked
    assert summary["best"]["number"] == 1 and not summary["importances_tie"]
    assert "Option importances (PED-ANOVA)" in page and set(summary["importances"]) == {"optim.base_lr", "run.seed"}


def test_trials_that_all_tie_say_so_instead_of_importances_and_seconds_are_whole(tmp_path):
    summary, page, ranked = _pages_of(tmp_path, [0.6, 0.6, 0.6])
    assert ranked == [(0, 0.6), (1, 0.6), (2, 0.6)]
    assert summary["importances_tie"] and summary["importances"] == {}
    assert "the trials tie on val_accuracy: the options' importances cannot be told apart" in page
    assert "PED-ANOVA" not in page and "0.5000" not in page
    assert "<td>12</td>" in page and "12.3450" not in page  # the seconds column


# --- pruning ---------------------------------------------------------------------------------


def test_a_hopeless_trial_is_pruned_after_an_epoch_and_each_trial_is_an_mlflow_run(tmp_path, demo_small, mlflow_server):
    epochs = 15  # the trials that finish train them all; the hopeless one is cut after an epoch or two
    path = sweep_file(
        tmp_path,
        demo_small,
        epochs=epochs,
        search={"optim.base_lr": {"log_uniform": [0.01, 1e9]}, "run.seed": {"int": [1, 3]}},
        first=[
            {"optim.base_lr": 0.05, "run.seed": 1},
            {"optim.base_lr": 0.05, "run.seed": 2},
            {"optim.base_lr": 8.0, "run.seed": 1},
            {"optim.base_lr": 1e9, "run.seed": 1},  # diverges: a region to leave, pruned with its reason
        ],
        objective="val_loss",
        trials=4,
        sampler="random",
        pruner="median",
        prune_startup_trials=2,
        prune_warmup_epochs=1,
    )
    spec = yaml.safe_load(path.read_text())
    spec["train"]["run"].update(track="mlflow", tracker_uri=mlflow_server)
    path.write_text(yaml.safe_dump(spec))
    proc = run([*HVD_TRAIN, "sweep", path, "--output", tmp_path / "out"], timeout=600)
    assert proc.returncode == 0, output_of(proc)
    summary = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert summary["direction"] == "minimize"
    states = {r["params"]["optim.base_lr"]: r for r in summary["rows"]}
    hopeless = states[8.0]
    assert hopeless["state"] == "pruned", summary
    assert hopeless["epochs"] < epochs and "pruned at epoch" in hopeless["note"]
    diverged = states[1e9]
    assert diverged["state"] == "pruned" and diverged["diverged"] and not hopeless["diverged"], summary
    assert diverged["note"].startswith("training diverged: "), summary
    assert "lower --base-lr" in diverged["note"].lower() and "\n" not in diverged["note"], diverged["note"]
    assert summary["epochs_saved_by_pruning"] == epochs - hopeless["epochs"]  # the pruner's, not divergence's
    assert f"trial {hopeless['number']} pruned at epoch" in proc.stderr
    # Stopped as a scheduler stops a run: on its checkpoint, not killed.
    assert "stopped by SIGTERM" in (tmp_path / "out" / hopeless["folder"] / "trial.log").read_text()
    # The sweep is one MLflow experiment (the study's name), a run per trial; the pruned one KILLED.
    client, runs = mlflow_runs_of(mlflow_server, "out")
    by_name = {r.info.run_name: r for r in runs}
    assert sorted(by_name) == sorted(r["folder"] for r in summary["rows"])
    assert by_name[hopeless["folder"]].info.status == "KILLED" and by_name[diverged["folder"]].info.status == "FAILED"
    for row in summary["rows"]:
        if row["state"] == "complete":
            logged = by_name[row["folder"]]
            assert logged.info.status == "FINISHED"
            assert logged.data.metrics["final_val_loss"] == pytest.approx(row["value"])
            assert float(logged.data.params["optim.base_lr"]) == row["params"]["optim.base_lr"]


def test_a_trial_runs_under_plain_mpirun_too_and_a_second_study_in_its_folder_has_its_own(tmp_path, demo_small):
    path = sweep_file(
        tmp_path, demo_small, epochs=1, search={"run.seed": [1]}, trials=1, pruner="none", launcher="mpirun"
    )
    proc = run([*HVD_TRAIN, "sweep", path, "--output", tmp_path / "out"], timeout=600)
    assert proc.returncode == 0, output_of(proc)
    summary = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert summary["counts"]["complete"] == 1
    log = (tmp_path / "out" / "trial-0000" / "trial.log").read_text()
    assert re.match(r"\$ taskset -c [0-9,]+ mpirun -np 1 --bind-to none ", log) and "outputs in" in log, log[:3000]
    # Every objective a sweep file may name is a number of a trial's summary.json, and every one
    # pruning may read a column of its metrics.csv.
    # (A multi-label run's, val_map and val_f1: test_multilabel's tracked run.)
    from hvd_train.experiments.spec import EPOCH_METRICS, MULTI_LABEL_OBJECTIVES, OBJECTIVES

    single = [name for name in OBJECTIVES if name not in MULTI_LABEL_OBJECTIVES]
    run_summary = json.loads((tmp_path / "out" / "trial-0000" / "summary.json").read_text())
    assert all(isinstance(run_summary[name], int | float) for name in single), run_summary
    columns = (tmp_path / "out" / "trial-0000" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert set(EPOCH_METRICS) - set(MULTI_LABEL_OBJECTIVES) <= set(single) & set(columns), columns
    first_pages = {name: (tmp_path / "out" / name).read_bytes() for name in ("sweep.json", "sweep.html", "best.yaml")}
    # Another study in the same folder: its trials and pages in a folder of its own; the first's untouched.
    # Its 2 trials start at once, tracked in MLflow's default store (mlflow.db in the working folder), new:
    # made by the sweep before them, not by both at once.
    (tmp_path / "second").mkdir()
    other = sweep_file(
        tmp_path / "second", demo_small, epochs=1, search={"run.seed": [2, 3]}, sampler="grid", trials=2, pruner="none"
    )
    spec = yaml.safe_load(other.read_text())
    spec["train"]["run"]["track"] = "mlflow"
    other.write_text(yaml.safe_dump(spec))
    command = [*HVD_TRAIN, "sweep", other, "--output", tmp_path / "out", "--study", "other", "--parallel", "2"]
    proc = run(command, timeout=600, cwd=tmp_path / "second")
    assert proc.returncode == 0, output_of(proc)
    second = json.loads((tmp_path / "out" / "other" / "sweep.json").read_text())
    assert second["study"] == "other" and sorted(r["params"]["run.seed"] for r in second["rows"]) == [2, 3], second
    for name in ("trial-0000", "trial-0001"):
        assert "done already" not in (tmp_path / "out" / "other" / name / "trial.log").read_text()
    assert {name: (tmp_path / "out" / name).read_bytes() for name in first_pages} == first_pages
    _, runs = mlflow_runs_of(f"sqlite:///{tmp_path / 'second' / 'mlflow.db'}", "other")
    assert sorted((r.info.run_name, r.info.status) for r in runs) == [
        ("trial-0000", "FINISHED"),
        ("trial-0001", "FINISHED"),
    ]


def test_a_sweep_whose_first_trials_fail_alike_stops_and_says_why(tmp_path):
    path = sweep_file(tmp_path, tmp_path / "gone", epochs=1, search={"run.seed": [1, 2, 3, 4]}, trials=4, pruner="none")
    proc = run([*HVD_TRAIN, "sweep", path, "--output", tmp_path / "out", "--parallel", "2"], timeout=600)
    assert proc.returncode == 2, output_of(proc)
    said = [line for line in proc.stderr.splitlines() if "failed alike" in line]
    assert (
        len(said) == 1
        and f"error: the first 2 trials failed alike (exit 2: error: data folder {tmp_path / 'gone'} " in said[0]
    ), output_of(proc)
    assert "Traceback" not in proc.stderr, output_of(proc)
    # Two failed, and no more started but the one already asked for beside the second (stopped, handed back).
    summary = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert summary["counts"]["fail"] == 2 and summary["counts"]["complete"] == 0, summary
    assert len(study_of(tmp_path / "out").get_trials()) <= 4


# --- sweep processes sharing one study --------------------------------------------------------


def test_each_study_of_a_folder_has_a_folder_of_its_own_and_one_made_before_goes_on_in_place(tmp_path):
    from hvd_train.errors import UserError
    from hvd_train.experiments import spec
    from hvd_train.experiments import study as studies

    path = sweep_file(tmp_path, tmp_path, epochs=1, search={"optim.base_lr": [0.1]})
    out = tmp_path / "out"
    out.mkdir()

    def folder_of(name=None) -> str:
        return studies.study_folder(studies.open_study(spec.load(str(path), study=name), str(out)), str(out))

    assert folder_of() == folder_of("out") == str(out)  # the study named after its folder
    assert folder_of("other") == str(out / "other")
    # A study made before studies had folders of their own goes on where its trials are.
    earlier = optuna.create_study(study_name="earlier", storage=f"sqlite:///{out / 'study.db'}", direction="maximize")
    earlier.set_user_attr("objective", "val_accuracy")
    assert folder_of("earlier") == str(out)
    for name in ("../elsewhere", "trial-0001", "a b"):
        with pytest.raises(UserError, match="cannot be a folder of its own"):
            folder_of(name)


def test_every_sweep_process_finds_a_studys_folder_where_its_creator_put_it(tmp_path):
    """Sweeps sharing a study (its database a server's; here one SQLite file) may give its folder or
    its parent as --output: the study's trials are in the one folder named after it."""
    from hvd_train.experiments import spec
    from hvd_train.experiments import study as studies

    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    path = sweep_file(tmp_path, tmp_path, epochs=1, search={"optim.base_lr": [0.1]}, storage=storage)
    base = tmp_path / "sw"
    (base / "lr").mkdir(parents=True)

    def folder_of(output: Path, name=None) -> str:
        return studies.study_folder(studies.open_study(spec.load(str(path), study=name), str(output)), str(output))

    assert folder_of(base / "lr") == str(base / "lr")  # made with --output sw/lr (the study named after it)
    assert folder_of(base, "lr") == str(base / "lr")  # then --output sw --study lr
    assert folder_of(base, "wd") == str(base / "wd")  # made with --output sw --study wd
    assert folder_of(base / "wd") == str(base / "wd")  # then --output sw/wd
    # A study of an earlier version with the default name (its folder attribute ""): the same.
    optuna.load_study(study_name="lr", storage=storage).set_user_attr("folder", "")
    assert folder_of(base, "lr") == folder_of(base / "lr") == str(base / "lr")


def test_a_new_study_whose_folder_holds_another_studys_trials_is_refused(tmp_path):
    from hvd_train.errors import UserError
    from hvd_train.experiments import spec
    from hvd_train.experiments import study as studies

    path = sweep_file(tmp_path, tmp_path, epochs=1, search={"optim.base_lr": [0.1]})
    (tmp_path / "sw" / "lr" / "trial-0000").mkdir(parents=True)  # of `--output sw/lr`, its study.db in sw/lr
    (tmp_path / "sw" / "lr" / "study.db").touch()
    with pytest.raises(UserError) as refused:
        studies.open_study(spec.load(str(path), study="lr"), str(tmp_path / "sw"))  # its study.db in sw
    message = str(refused.value)
    assert f"{tmp_path / 'sw' / 'lr'} holds trials of another study" in message and "\n" not in message, message
    assert f"give --output {tmp_path / 'sw' / 'lr'}" in message, message
    assert optuna.get_all_study_names(f"sqlite:///{tmp_path / 'sw' / 'study.db'}") == []
    # The other way round: trials of `--output sw --study lr` (its study.db in sw), then --output sw/lr.
    (tmp_path / "sw" / "lr" / "study.db").unlink()
    with pytest.raises(UserError, match=f"give --output {tmp_path / 'sw'} --study lr"):
        studies.open_study(spec.load(str(path)), str(tmp_path / "sw" / "lr"))


@pytest.mark.parametrize("written", ["/some/dir", "../..", "trial-0001", "other"])
def test_a_study_folder_written_in_its_database_never_leaves_the_sweeps_folder(tmp_path, written):
    from hvd_train.errors import UserError
    from hvd_train.experiments import spec
    from hvd_train.experiments import study as studies

    path = sweep_file(tmp_path, tmp_path, epochs=1, search={"optim.base_lr": [0.1]}, study="lr")
    out = tmp_path / "out"
    out.mkdir()
    studies.open_study(spec.load(str(path)), str(out))
    made = optuna.load_study(study_name="lr", storage=f"sqlite:///{out / 'study.db'}")
    made.set_user_attr("folder", written)  # by anyone who may write to a shared database
    with pytest.raises(UserError) as refused:
        studies.study_folder(studies.open_study(spec.load(str(path)), str(out)), str(out))
    message = str(refused.value)
    assert f"the study 'lr' names its folder {written!r} in its database" in message and "\n" not in message


def test_a_trial_folder_written_in_the_database_never_leaves_the_studys_folder(tmp_path):
    """A trial whose folder attribute is not trial-NNNN is failed, not run (nor handed back) there."""
    import fcntl

    from hvd_train.experiments import spec
    from hvd_train.experiments import study as studies
    from hvd_train.experiments.sweep import SweepRun
    from hvd_train.experiments.trial import Slot

    sweep = spec.load(str(sweep_file(tmp_path, tmp_path, epochs=1, search={"optim.base_lr": [0.1]})))
    out = tmp_path / "out"
    out.mkdir()
    run = SweepRun(sweep, str(out))
    run.study = studies.open_study(sweep, str(out))
    run.storage, run.pages = "storage", str(out)
    run.study.enqueue_trial({"optim.base_lr": 0.1}, user_attrs={"folder": "../escape"})
    escape = tmp_path / "escape"
    escape.mkdir()
    run.stopping.set()  # were the trial to wait for the folder's lock (held below), it would give up at once
    with open(escape / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        run._run(run.study.ask(), Slot(0, (0,)))
    (trial,) = run.study.get_trials()
    assert trial.state.name == "FAIL", trial
    assert "trial 0's folder is '../escape' in the study's database" in trial.user_attrs.get("note", ""), trial
    assert sorted(p.name for p in escape.iterdir()) == [".lock"]


def test_a_trial_folder_of_other_options_is_refused_at_once(tmp_path):
    """Another sweep's trial (its job still running, its folder locked): refused, not waited for."""
    import fcntl
    import threading

    from hvd_train.errors import UserError
    from hvd_train.experiments import spec
    from hvd_train.experiments.trial import Slot, TrialJob

    sweep = spec.load(str(sweep_file(tmp_path, tmp_path, epochs=1, search={"optim.base_lr": [0.1, 0.2]})))
    folder = tmp_path / "out" / "trial-0000"
    folder.mkdir(parents=True)
    written = yaml.safe_dump(sweep.trial_config({"optim.base_lr": 0.1}, str(folder)))
    (folder / "trial.yaml").write_text(written)
    stopping = threading.Event()
    stopping.set()  # were it to wait for the folder's lock, it would give up at once
    with open(folder / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        job = TrialJob(sweep, str(folder), {"optim.base_lr": 0.2}, Slot(0, (0,)), stopping)
        with pytest.raises(UserError, match=r"trial-0000 holds a trial of optim.base_lr=0.1, not 0.2: another sweep's"):
            job.run(trial=None)
        # The same options: its own (a retry), which waits for the lock.
        assert (
            TrialJob(sweep, str(folder), {"optim.base_lr": 0.1}, Slot(0, (0,)), stopping).run(None).state == "stopped"
        )
    assert (folder / "trial.yaml").read_text() == written


def test_a_trial_asked_past_the_count_is_surplus_and_a_retry_never_is():
    from hvd_train.experiments import study as studies

    study = optuna.create_study()
    asked = [study.ask() for _ in range(3)]  # two processes checked the count (2) and asked at once
    for trial in asked[:2]:
        study.tell(trial, 0.5)
    assert not studies.surplus(study, asked[1], 2)
    assert studies.surplus(study, asked[2], 2)
    assert study.trials[2].state.name == "FAIL" and study.trials[2].user_attrs["surplus"] is True
    assert [t.number for t in studies.kept(study)] == [0, 1] and studies.counted(study) == 2
    study.enqueue_trial({}, user_attrs={"retry_of": 1})
    retry = study.ask()
    assert not studies.surplus(study, retry, 2)


def _state_of(study, number: int) -> str:
    return study.trials[number].state.name


def test_a_trial_of_another_host_is_stale_once_its_heartbeat_stops_whatever_that_hosts_clock(tmp_path):
    from hvd_train.experiments import study as studies

    study = optuna.create_study(study_name="s", storage=f"sqlite:///{tmp_path / 'study.db'}")
    heartbeat = 0.05
    watch = studies.Watch(heartbeat)
    for skew in (-3600.0, 3600.0):  # the other host's clock an hour behind this one's, then ahead
        trial = study.ask()
        trial.set_user_attr("claim", {"host": "elsewhere", "pid": 1, "pid_start": "1"})
        for beat in range(2 * studies.STALE_BEATS):  # beating for twice the window: never handed back
            trial.set_user_attr("alive", time.time() + skew + beat)
            last_beat = time.monotonic()
            studies.hand_back_stale(study, watch)
            assert _state_of(study, trial.number) == "RUNNING", (skew, beat)
            time.sleep(heartbeat)
        # Its beats stop: handed back once they have not changed for STALE_BEATS heartbeats of this clock.
        while _state_of(study, trial.number) == "RUNNING":
            assert time.monotonic() - last_beat < 10 * studies.STALE_BEATS * heartbeat, "never handed back"
            studies.hand_back_stale(study, watch)
            time.sleep(heartbeat / 5)
        assert time.monotonic() - last_beat >= studies.STALE_BEATS * heartbeat
        assert study.trials[-1].user_attrs["retry_of"] == trial.number


def test_a_trial_of_this_host_is_stale_when_its_sweep_process_is_gone(tmp_path):
    import subprocess

    from hvd_train.experiments import study as studies

    study = optuna.create_study(study_name="s", storage=f"sqlite:///{tmp_path / 'study.db'}")
    watch = studies.Watch(heartbeat=3600)  # no heartbeat could run out in this test
    mine = study.ask()
    studies.claim(mine)
    gone = subprocess.Popen(["sleep", "60"])  # a sweep process of this host, then no more
    claim = {"host": studies.HOST, "pid": gone.pid, "pid_start": studies.process_start(gone.pid)}
    gone.kill()
    gone.wait()
    lost = study.ask()
    lost.set_user_attr("claim", claim)
    studies.hand_back_stale(study, watch)
    assert [_state_of(study, n) for n in (mine.number, lost.number)] == ["RUNNING", "FAIL"]


def test_a_claim_is_never_read_half_written(tmp_path):
    """Another sweep process reads the trials while this one claims them: none may look stale."""
    import threading

    from hvd_train.experiments import study as studies

    url = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(study_name="s", storage=url)
    reader = optuna.load_study(study_name="s", storage=optuna.storages.RDBStorage(url))
    watch = studies.Watch(heartbeat=3600)
    stale, reads, done = [], [0], threading.Event()

    def read() -> None:
        while not done.is_set():
            for t in reader.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
                reads[0] += 1
                if watch.stale(t.number, t.user_attrs):
                    stale.append((t.number, dict(t.user_attrs)))

    thread = threading.Thread(target=read)
    thread.start()
    try:
        for _ in range(20):
            studies.claim(study.ask())
            time.sleep(0.005)
    finally:
        done.set()
        thread.join()
    assert reads[0] > 20 and not stale, stale[:3]


def test_a_wrong_password_is_a_clear_error_that_shows_no_password(tmp_path, postgres_url):
    from postgres_server import PASSWORD

    wrong = postgres_url.replace(PASSWORD, "not-" + PASSWORD)
    path = sweep_file(tmp_path, tmp_path, epochs=1, search={"optim.base_lr": [0.1]}, storage=wrong)
    proc = cli(["sweep", path, "--output", tmp_path / "out"])
    assert proc.returncode == 2 and "cannot open the study 'out' in postgresql://127.0.0.1:" in proc.stderr, output_of(
        proc
    )
    assert "password authentication failed" in proc.stderr and PASSWORD not in proc.stdout + proc.stderr

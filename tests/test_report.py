"""Pictures and the HTML report, from run files made here."""

import csv
import json
import time

import numpy as np
import pytest
import yaml
from PIL import Image

from hvd_train.errors import UserError
from hvd_train.results import plots, report_page
from hvd_train.results.confusion import Confusion
from hvd_train.training.writers import Reporters


def _colours(path):
    with Image.open(path) as im:
        return len(im.convert("L").getcolors(1 << 16))


def test_curves_are_refreshed_after_every_epoch(tmp_path):
    reporters = Reporters(str(tmp_path), epochs=3, tensorboard=False, title="t")
    logs = {"loss": 2.0, "accuracy": 0.3, "val_loss": 2.2, "val_accuracy": 0.25, "lr": 0.1, "images_per_sec": 90.0}
    for epoch, more in enumerate(({}, {"loss": 1.0, "val_accuracy": 0.6})):
        # As the loop does it: drawn while the checkpoint is written, then the files.
        reporters.draw_soon(epoch, {**logs, **more})
        assert reporters.wait()
        reporters.epoch_end(epoch, {**logs, **more})
        if epoch == 0:
            first = (tmp_path / "curves.png").read_bytes()
    second = (tmp_path / "curves.png").read_bytes()
    assert first != second and second.startswith(b"\x89PNG")
    assert not list(tmp_path.glob(".*.tmp-*"))  # written through a temporary file, renamed
    assert [r["epoch"] for r in csv.DictReader(open(tmp_path / "metrics.csv"))] == ["1", "2"]
    reporters.close()
    assert not reporters._thread.is_alive(), "the painter ends with its writers"


def test_epochs_that_come_faster_than_the_painters_share_are_drawn_together_and_the_last_at_once(tmp_path):
    reporters = Reporters(str(tmp_path), epochs=6, tensorboard=False, title="t")
    logs = {"loss": 2.0, "accuracy": 0.3, "lr": 0.1, "images_per_sec": 90.0}
    for epoch in range(5):  # epochs of 0.2 s: a picture costs more than PAINT_SHARE of that
        reporters.epoch_end(epoch, {**logs, "loss": 2.0 - 0.1 * epoch})
        reporters.draw_soon(epoch, {**logs, "loss": 2.0 - 0.1 * epoch})
        time.sleep(0.2)
    with reporters._painter:
        drawn, handed, pictures = reporters._drawn, reporters._handed, reporters.pictures
    # Drawn together: by now one picture at most, of the epochs handed over before it.
    assert handed == 5 and pictures <= 1 and drawn < handed, f"{pictures} pictures of {drawn} epochs in a second"
    assert reporters.wait(), "a picture somebody waits for is drawn now"
    assert reporters._drawn == 5 and (tmp_path / "curves.png").read_bytes().startswith(b"\x89PNG")
    reporters.epoch_end(5, logs)
    reporters.draw_soon(5, logs)
    reporters.close()  # the last epoch drawn before the painter ends
    assert reporters._drawn == 6 and not reporters._thread.is_alive()


def test_curves_without_held_out_images(tmp_path):
    rows = [
        {
            "epoch": "1",
            "loss": "1.5",
            "accuracy": "0.4",
            "val_loss": "",
            "val_accuracy": "",
            "lr": "0.01",
            "images_per_sec": "",
            "epoch_seconds": "3",
        }
    ]
    plots.curves(rows, str(tmp_path / "c.png"))
    assert _colours(tmp_path / "c.png") > 10


@pytest.mark.parametrize("n", [2, 100])
def test_confusion_grows_with_the_classes(tmp_path, n):
    rng = np.random.default_rng(n)
    matrix = rng.integers(0, 3, (n, n)) + np.eye(n, dtype=int) * 20
    names = [f"a-rather-long-class-name-number-{i:03d}" for i in range(n)]
    plots.confusion(Confusion.of_dense(matrix), names, str(tmp_path / "m.png"), "held-out")
    with Image.open(tmp_path / "m.png") as im:
        width, height = im.size
    # at 100 classes each row keeps about 20 pixels: room for its name
    assert height >= min(500, 40 * n) and height / n >= 5 and width >= height


def test_per_class_rows_are_worst_first_and_name_the_usual_mistake():
    matrix = np.array([[8, 2, 0], [5, 5, 0], [0, 0, 0]])
    rows = report_page.per_class_rows(Confusion.of_dense(matrix), ["cat", "dog", "eel"])
    assert [r[0] for r in rows] == ["dog", "cat", "eel"]  # 0.5, 0.8, then the class without images
    assert rows[0][1:] == [10, 5, 0.5, "cat (5)"] and rows[2][3] is None


def _run_folder(tmp_path, summary=True):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run_config.yaml").write_text(yaml.safe_dump({"data": {"train": "/d"}, "model": {"name": "ResNet50"}}))
    (run / "labels.json").write_text(json.dumps(["a", "b<script>"]))
    with open(run / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["epoch", "loss", "accuracy", "lr", "images_per_sec"])
        writer.writeheader()
        writer.writerow({"epoch": 1, "loss": 1.0, "accuracy": 0.5, "lr": 0.1, "images_per_sec": 50})
    if summary:
        (run / "summary.json").write_text(
            json.dumps({"val_accuracy": 0.75, "val_images": 4, "val_confusion_matrix": [[2, 0], [1, 1]]})
        )
    return run


def test_report_of_a_run_in_progress(tmp_path):
    page = open(report_page.write(str(_run_folder(tmp_path, summary=False)))).read()
    assert "has not finished" in page and page.count("<img") == 1


def test_report_escapes_names_and_embeds_its_pictures(tmp_path):
    path = report_page.write(str(_run_folder(tmp_path)), str(tmp_path / "r.html"))
    page = open(path).read()
    assert "b&lt;script&gt;" in page and "<script>" not in page
    assert page.count('src="data:image/png;base64,') == 2 and "http" not in page


def test_report_needs_a_run_folder(tmp_path):
    with pytest.raises(UserError, match="has no run_config.yaml"):
        report_page.write(str(tmp_path))
    with pytest.raises(UserError, match="does not exist"):
        report_page.write(str(tmp_path / "nope"))


def test_a_thousand_classes_give_the_most_confused_pairs_and_the_worst_classes(tmp_path):
    n = 1000
    rng = np.random.default_rng(0)
    matrix = np.diag(rng.integers(30, 50, n))
    # Class 7 is mostly taken for class 8; class 3 half for class 900.
    matrix[7, 7], matrix[7, 8] = 5, 40
    matrix[3, 3], matrix[3, 900] = 20, 20
    classes = [f"n{c:08d}" for c in range(n)]
    confusion = Confusion.of_dense(matrix)
    pairs = plots.most_confused(confusion, classes, 2)
    assert pairs == [(classes[7], classes[8], 40, 40 / 45), (classes[3], classes[900], 20, 0.5)]

    # summary.json holds only the non-zero cells, and reads back whole.
    stored = json.loads(json.dumps(plots.confusion_to_json(confusion)))
    assert stored["classes"] == n and len(stored["cells"]) == n + 2
    assert np.array_equal(plots.confusion_from_json(stored).dense(), matrix)
    few = Confusion.of_dense(matrix[:3, :3])
    assert plots.confusion_to_json(few) == matrix[:3, :3].tolist()  # few classes: rows, as before

    plots.confusion(confusion, classes, str(tmp_path / "confusion.png"), "held-out")
    with Image.open(tmp_path / "confusion.png") as im:
        assert max(im.size) < 2000, "a summary picture, not a million cells"

    run = _run_folder(tmp_path)
    (run / "labels.json").write_text(json.dumps(classes))
    summary = {"val_accuracy": 0.9, "val_top5": 0.98, "val_images": int(matrix.sum()), "val_confusion_matrix": stored}
    (run / "summary.json").write_text(json.dumps(summary))
    page = open(report_page.write(str(run))).read()
    assert "the 50 worst of 1000 classes" in page and "most confused pairs" in page
    assert page.count("<tr") < 150 and len(page) < 1_000_000
    assert page.index(classes[7]) < page.index(classes[3]), "worst class first"


def test_a_multi_label_runs_curves_draw_its_f1_and_map_where_accuracy_would_be(tmp_path):
    """Its accuracy columns are empty: the top-right panel draws the F1 and mAP columns instead of 'not measured'."""
    scores = {"f1": ("0.3", "0.5"), "val_map": ("0.4", "0.6"), "val_f1": ("0.35", "0.55")}
    rows = [
        {"epoch": str(e + 1), "loss": "0.7", "val_loss": "0.6", "lr": "0.01", "accuracy": "", "val_accuracy": "",
         **{k: v[e] for k, v in scores.items()}}
        for e in range(2)
    ]  # fmt: skip
    plots.curves(rows, str(tmp_path / "multi.png"))
    plots.curves([{k: v for k, v in r.items() if k not in scores} for r in rows], str(tmp_path / "none.png"))

    def top_right(name):
        with Image.open(tmp_path / name) as im:
            width, height = im.size
            return np.asarray(im.convert("RGB").crop((width // 2, 0, width, height // 2)))

    drawn, empty = top_right("multi.png"), top_right("none.png")
    assert (drawn != empty).any(axis=-1).mean() > 0.01  # lines, a legend and a title where there was one word

"""Pictures and the HTML report, from run files made here."""

import csv
import json

import numpy as np
import pytest
import yaml
from PIL import Image

from hvd_train import plots, report_page
from hvd_train.errors import UserError
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
    assert not list(tmp_path.glob(".plot-*"))  # written through a temporary file, renamed
    assert [r["epoch"] for r in csv.DictReader(open(tmp_path / "metrics.csv"))] == ["1", "2"]
    reporters.close()
    assert not reporters._thread.is_alive(), "the painter ends with its writers"


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
    plots.confusion(matrix, names, str(tmp_path / "m.png"), "held-out")
    with Image.open(tmp_path / "m.png") as im:
        width, height = im.size
    # at 100 classes each row keeps about 20 pixels: room for its name
    assert height >= min(500, 40 * n) and height / n >= 5 and width >= height


def test_per_class_rows_are_worst_first_and_name_the_usual_mistake():
    matrix = np.array([[8, 2, 0], [5, 5, 0], [0, 0, 0]])
    rows = report_page.per_class_rows(matrix, ["cat", "dog", "eel"])
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

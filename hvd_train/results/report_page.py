"""``report.html``: one self-contained page about a finished (or running) training run.

Everything comes from the run folder: ``summary.json``, ``run_config.yaml``,
``metrics.csv``, ``labels.json`` and, when ``hvd-train evaluate`` ran,
``evaluation.json``. The pictures are drawn afresh from those numbers and
embedded as data URLs; the page loads nothing else and runs no script, so
it can be mailed, archived or opened offline.
"""

from __future__ import annotations

import base64
import csv
import datetime
import html
import io
import json
import os

import yaml

from hvd_train import __version__
from hvd_train.errors import UserError
from hvd_train.log import get_logger
from hvd_train.results import plots
from hvd_train.results.confusion import Confusion

REPORT = "report.html"

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; padding: 0 1em; }
h1 { font-size: 1.6em; } h2 { margin-top: 1.8em; border-bottom: 1px solid #ddd; padding-bottom: .2em; }
table { border-collapse: collapse; margin: .5em 0; font-size: .92em; }
th, td { border: 1px solid #ddd; padding: .25em .6em; text-align: right; }
th { background: #f4f4f4; } td.name, th.name { text-align: left; }
tr.poor td { background: #fdecea; }
img { max-width: 100%; height: auto; border: 1px solid #eee; }
pre { background: #f7f7f7; padding: 1em; overflow-x: auto; font-size: .85em; }
.note { color: #666; font-size: .9em; }
"""


def _read_json(path: str):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_run(run_dir: str) -> dict:
    """The files of a run folder that the report shows.

    Raises:
        UserError: ``run_dir`` is not a training run's output folder.
    """
    hint = "pass the --output folder of `hvd-train train`"
    if not os.path.isdir(run_dir):
        raise UserError(f"run folder {run_dir} does not exist; {hint}.")
    config_path = os.path.join(run_dir, "run_config.yaml")
    if not os.path.isfile(config_path):
        raise UserError(f"{run_dir} has no run_config.yaml, so it is not a training run; {hint}.")
    run = {"dir": run_dir}
    try:
        with open(config_path, encoding="utf-8") as f:
            run["config_text"] = f.read()
        run["config"] = yaml.safe_load(run["config_text"]) or {}
        for key, name in (
            ("summary", "summary.json"),
            ("classes", "labels.json"),
            ("evaluation", "evaluation.json"),
            ("exports", "exports.json"),
        ):
            path = os.path.join(run_dir, name)
            run[key] = _read_json(path) if os.path.isfile(path) else None
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise UserError(f"cannot read the run in {run_dir} ({e}); {hint}.") from None
    metrics = os.path.join(run_dir, "metrics.csv")
    run["rows"] = []
    if os.path.isfile(metrics):
        with open(metrics, newline="", encoding="utf-8") as f:
            run["rows"] = list(csv.DictReader(f))
    return run


def png_data(draw) -> str:
    buffer = io.BytesIO()
    draw(buffer)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def fmt(value, digits: int = 4) -> str:
    if value is None or value == "":
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value != 0 and abs(value) < 10 ** (1 - digits):
            return f"{value:.3g}"
        return f"{value:.{digits}f}" if abs(value) < 1e4 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def table(header: list[str], rows: list[list], text: tuple[int, ...] = (0,), classes: list[str] | None = None) -> str:
    """An HTML table; the columns ``text`` are left-aligned text, the others numbers."""

    def css(i: int) -> str:
        return ' class="name"' if i in text else ""

    out = ["<table>"]
    if any(header):
        out += ["<thead><tr>", *(f"<th{css(i)}>{html.escape(h)}</th>" for i, h in enumerate(header)), "</tr></thead>"]
    out.append("<tbody>")
    for r, row in enumerate(rows):
        row_css = f' class="{classes[r]}"' if classes and classes[r] else ""
        out.append(f"<tr{row_css}>")
        for i, value in enumerate(row):
            out.append(f"<td{css(i)}>{html.escape(fmt(value))}</td>")
        out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def per_class_rows(matrix: Confusion, classes: list[str]) -> list[list]:
    """Per class: name, images, right, accuracy, the class it is most often taken for; worst first."""
    totals, right, taken = matrix.totals(), matrix.right(), matrix.most_taken_for()
    rows = []
    for c, name in enumerate(classes):
        total, hits = int(totals[c]), int(right[c])
        confused = f"{classes[taken[c][0]]} ({taken[c][1]})" if c in taken else ""
        rows.append([name, total, hits, hits / total if total else None, confused])
    # Worst first; classes without held-out images last.
    return sorted(rows, key=lambda r: (r[3] is None, r[3] if r[3] is not None else 0, r[0]))


WORST_SHOWN = 50  # per-class rows shown when there are many classes


def _pair(a, b) -> str | None:
    """``a; b`` of two scores (None: neither)."""
    if a is None and b is None:
        return None
    return "; ".join("n/a" if x is None else f"{x:.4f}" for x in (a, b))


def _multi_label_section(per_class: dict) -> list[str]:
    """A multi-label run's classes, lowest average precision first (the first ``WORST_SHOWN``)."""
    rows = [
        [name, c["positives"], c["tp"], c["fp"], c["fn"], c["precision"], c["recall"], c["f1"], c["ap"]]
        for name, c in per_class.items()
    ]
    rows.sort(key=lambda r: (r[8] is None, r[8] if r[8] is not None else 0, r[0]))
    heading = f"the {WORST_SHOWN} lowest of {len(rows)} classes" if len(rows) > WORST_SHOWN else "lowest first"
    keys = ["class", "positives", "TP", "FP", "FN", "precision", "recall", "F1", "AP"]
    return [f"<h3>Per class, by average precision, {heading}</h3>", table(keys, rows[:WORST_SHOWN], (0,))]


def _confusion_section(title: str, matrix, classes: list[str], note: str) -> list[str]:
    matrix = plots.confusion_from_json(matrix)
    picture = png_data(lambda f: plots.confusion(matrix, classes, f, title))
    rows = per_class_rows(matrix, classes)
    many = len(classes) > plots.MANY_CLASSES
    heading = f"the {WORST_SHOWN} worst of {len(classes)} classes" if many else "worst first"
    if many:
        rows = rows[:WORST_SHOWN]
    poor = ["poor" if r[3] is not None and r[3] < 0.5 else "" for r in rows]
    out = [
        f'<img alt="confusion matrix, {html.escape(title)}" src="{picture}">',
        f"<h3>Accuracy per class, {heading}</h3><p class='note'>{html.escape(note)}</p>",
        table(["class", "images", "right", "accuracy", "most often taken for (images)"], rows, (0, 4), poor),
    ]
    if many:
        pairs = [[t, p, n, share] for t, p, n, share in plots.most_confused(matrix, classes, WORST_SHOWN)]
        out += [
            f"<h3>The {len(pairs)} most confused pairs</h3>",
            table(["true class", "taken for", "images", "share of the true class"], pairs, (0, 1)),
        ]
    return out


def render(run: dict) -> str:
    """The report page of a run loaded by ``load_run``, as HTML text."""
    summary = run["summary"] or {}
    config = run["config"]
    classes = run["classes"] or []
    model = summary.get("model") or config.get("model", {}).get("name", "?")
    data = config.get("data", {}).get("train", "?")
    title = f"{model} on {data}"
    body = [f"<h1>hvd_train report: {html.escape(title)}</h1>"]
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    body.append(f"<p class='note'>Run folder {html.escape(run['dir'])}; report written {when}.</p>")
    if not summary:
        body.append(
            "<p><strong>The run has not finished</strong> (no summary.json): curves show the epochs so far.</p>"
        )

    body.append("<h2>Summary</h2>")
    rows = [
        [f"held-out mAP; micro F1 at {summary.get('threshold')}", _pair(summary.get("val_map"), summary.get("val_f1"))],
        ["held-out precision; recall (micro)", _pair(summary.get("val_precision"), summary.get("val_recall"))],
        ["held-out accuracy (top-1)", summary.get("val_accuracy")],
        [f"held-out top-{summary.get('val_top_k') or 5}", summary.get("val_top5")],
        ["held-out loss", summary.get("val_loss")],
        ["held-out images", summary.get("val_images")],
        ["classes", len(classes) if classes else None],
        ["epochs", summary.get("epochs") or config.get("run", {}).get("epochs")],
        ["workers (world size)", summary.get("world_size")],
        ["global batch", summary.get("global_batch")],
        ["image size", summary.get("image_size")],
        ["precision", summary.get("precision")],
        ["images/s, all workers (median of epochs after the first)", summary.get("images_per_sec")],
        ["images/s, first epoch", summary.get("images_per_sec_first_epoch")],
        ["weights identical on every rank", summary.get("weights_identical_across_ranks")],
        ["resumed from", summary.get("resumed_from")],
    ]
    if summary.get("base_lr") is not None:
        found = config.get("optim", {}).get("base_lr") == "auto"
        rows.append(
            [f"base learning rate, one worker{' (--base-lr auto: lr-find)' if found else ''}", summary["base_lr"]]
        )
    body.append(table(["", ""], [r for r in rows if r[1] is not None]))
    if summary.get("val_per_class"):  # a multi-label run: each class's counts at the threshold and its AP
        body += _multi_label_section(summary["val_per_class"])

    body.append("<h2>Training curves</h2>")
    if run["rows"]:
        picture = png_data(lambda f: plots.curves(run["rows"], f, title))
        body.append(f'<img alt="training curves" src="{picture}">')
    else:
        body.append("<p>No epoch has finished yet (metrics.csv is empty).</p>")

    if summary.get("task") != "multi_label":  # a multi-label run's scores are in the summary's tables
        body.append("<h2>Held-out images: confusion matrix</h2>")
    if summary.get("val_confusion_matrix") and classes:
        body += _confusion_section(
            f"held-out ({summary.get('val_images')} images)",
            summary["val_confusion_matrix"],
            classes,
            "Rows of the matrix are true classes, columns predictions; colour is the share of the true class.",
        )
    elif summary.get("task") != "multi_label":
        body.append("<p>No held-out images were scored (no --val-data, --val-split 0, or unfinished).</p>")
    evaluation = run["evaluation"]
    if evaluation and evaluation.get("task") == "multi_label":
        body.append(f"<h2>hvd-train evaluate: {html.escape(str(evaluation.get('data')))}</h2>")
        rows = [
            [f"mAP; micro F1 at {evaluation.get('threshold')}", _pair(evaluation.get("map"), evaluation.get("f1"))],
            ["precision; recall (micro)", _pair(evaluation.get("precision"), evaluation.get("recall"))],
            ["images", evaluation.get("images")],
            ["workers", evaluation.get("world_size")],
        ]
        body.append(table(["", ""], [r for r in rows if r[1] is not None]))
        body += _multi_label_section(evaluation.get("per_class") or {})
    elif evaluation:
        body.append(f"<h2>hvd-train evaluate: {html.escape(str(evaluation.get('data')))}</h2>")
        body.append(
            table(
                ["", ""],
                [
                    ["accuracy", evaluation.get("accuracy")],
                    [f"top-{evaluation.get('top_k', 5)}", evaluation.get("top5")],
                    ["images", evaluation.get("images")],
                    ["workers", evaluation.get("world_size")],
                ],
            )
        )
        body += _confusion_section(
            f"evaluate ({evaluation.get('images')} images)",
            evaluation["confusion_matrix"],
            evaluation["classes"],
            "From evaluation.json.",
        )

    if run.get("exports"):
        body += _exports_section(run["exports"])

    body.append("<h2>Throughput and metrics per epoch</h2>")
    if run["rows"]:
        keys = ["epoch", "images_per_sec", "epoch_seconds", "lr", "loss", "accuracy", "val_loss", "val_accuracy"]
        if "val_map" in run["rows"][0]:  # a multi-label run's
            keys = [*keys[:4], "loss", "f1", "val_loss", "val_map", "val_f1"]
        per_epoch = [[_number(r.get(k)) for k in keys] for r in run["rows"]]
        body.append(table(keys, per_epoch, text=()))
        body.append(
            "<p class='note'>images/s counts the training steps of every worker; the first epoch includes "
            "graph tracing and the input pipeline's warm-up.</p>"
        )

    body.append("<h2>Workers and versions</h2>")
    env = [[k, v] for k, v in (summary.get("horovod_environment") or {}).items() if v]
    rows = [
        ["world size", summary.get("world_size")],
        ["world sizes during the run", ", ".join(str(n) for n in summary.get("world_sizes") or []) or None],
        ["elastic resets", len(summary.get("elastic_resets") or []) if summary else None],
        ["TensorFlow", summary.get("tensorflow")],
        ["Keras", summary.get("keras")],
        ["Horovod", summary.get("horovod")],
        ["hvd_train (the run)", summary.get("hvd_train")],
        ["hvd_train (this report)", __version__],
        *env,
    ]
    body.append(table(["", ""], [r for r in rows if r[1] is not None]))

    body.append("<h2>Configuration (run_config.yaml)</h2>")
    body.append(f"<pre>{html.escape(run['config_text'])}</pre>")
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head>"
        f"<body>{''.join(body)}</body></html>\n"
    )


def _exports_section(exports: list[dict]) -> list[str]:
    """``hvd-train export``'s folders, each file with its parity with predict where it was checked."""
    rows = []
    for export in exports:
        for entry in export.get("formats", []):
            parity = entry.get("parity") or {}
            checked = bool(parity)
            rows.append(
                [
                    os.path.join(export.get("folder", ""), entry.get("path", "")),
                    entry.get("format"),
                    entry.get("quantize"),
                    parity.get("images") if checked else "not checked",
                    parity.get("top1_agreement"),
                    parity.get("max_abs_diff"),
                    parity.get("accuracy"),
                    ("passed" if parity.get("passed") else "FAILED: " + "; ".join(parity.get("failed", [])))
                    if checked
                    else "",
                ]
            )
    header = ["file", "format", "quantize", "images", "top-1 agreement", "max |Δp|", "accuracy", "check"]
    return [
        "<h2>Exports (hvd-train export)</h2>",
        table(header, rows, text=(0, 1, 2, 7)),
        "<p class='note'>Each file run in its own runtime (TensorFlow, LiteRT, ONNX Runtime) on the images of "
        "<code>hvd-train export --check</code>, against <code>hvd-train predict</code>'s probabilities.</p>",
    ]


def _number(text):
    if text in (None, ""):
        return None
    try:
        value = float(text)
    except ValueError:
        return text
    return int(value) if value.is_integer() and abs(value) >= 1 else value


def write_or_warn(run_dir: str) -> None:
    """``write``, where a page that cannot be written is a warning (the run's own files hold it all)."""
    try:
        write(run_dir)
    except (UserError, OSError) as e:
        get_logger("report").warning("could not write the report of %s: %s", run_dir, e)


def write(run_dir: str, output: str | None = None) -> str:
    """Writes the report of ``run_dir`` (to ``RUN_DIR/report.html`` by default); returns its path."""
    page = render(load_run(run_dir))
    path = output or os.path.join(run_dir, REPORT)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(page)
    os.replace(tmp, path)
    return path

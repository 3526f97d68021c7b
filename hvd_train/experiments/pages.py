"""What a sweep writes in its folder: ``sweep.json``, ``sweep.html`` and ``best.yaml``.

Written after every finished trial and at the end, each file at once
(``files.replacing``): a sweep stopped at any moment leaves whole files.
"""

from __future__ import annotations

import html
import json
import math
import os
import warnings
from typing import Any

import yaml

from hvd_train import files
from hvd_train.experiments import study as studies
from hvd_train.experiments.spec import Sweep
from hvd_train.results import report_page

SUMMARY = "sweep.json"
PAGE = "sweep.html"
BEST = "best.yaml"


def summarize(sweep: Sweep, study, storage: str) -> dict[str, Any]:
    """The trials (handed-back ones left out), the best one, and what pruning saved; ``storage``: the
    study's storage as shown (no password)."""
    epochs = sweep.epochs()
    rows = []
    for t in studies.kept(study):
        folder_name = t.user_attrs.get("folder", studies.trial_folder_name(t.number))
        rows.append(
            {
                "number": t.number,
                "state": t.state.name.lower(),
                "value": t.value,
                "params": dict(t.params),
                "epochs": t.user_attrs.get("epochs"),
                "seconds": t.user_attrs.get("seconds"),
                "note": t.user_attrs.get("note", ""),
                "folder": folder_name,
                "retry_of": t.user_attrs.get("retry_of"),
                "diverged": bool(t.user_attrs.get("diverged")),
            }
        )
    done = [r for r in rows if r["state"] == "complete"]
    best = None
    if done:
        pick = max if sweep.direction == "maximize" else min
        best = pick(done, key=lambda r: r["value"])
    pruned = [r for r in rows if r["state"] == "pruned" and not r["diverged"]]  # the pruner's, not divergence's
    saved = sum(max(0, epochs - (r["epochs"] or 0)) for r in pruned)
    importances, tie = _importances(study)
    return {
        "study": study.study_name,
        "storage": storage,
        "objective": sweep.objective,
        "direction": sweep.direction,
        "trials": sweep.trials,
        "counts": {s: sum(r["state"] == s for r in rows) for s in ("complete", "pruned", "fail", "running", "waiting")},
        "best": best,
        "epochs_per_trial": epochs,
        "epochs_run": sum(r["epochs"] or 0 for r in rows),
        "epochs_saved_by_pruning": saved,
        "importances": importances,
        "importances_tie": tie,
        "rows": rows,
    }


def write(sweep: Sweep, study, folder: str, storage: str) -> dict[str, Any]:
    """Writes the three files in ``folder`` (the study's, with its trials' folders); returns the summary."""
    summary = summarize(sweep, study, storage)
    with files.replacing(os.path.join(folder, SUMMARY), "w") as f:
        json.dump(summary, f, indent=1)
    if summary["best"] is not None:
        best = summary["best"]
        config = sweep.trial_config(best["params"], os.path.join(os.path.abspath(folder), "best"))
        with files.replacing(os.path.join(folder, BEST), "w") as f:
            f.write(
                f"# The best trial of sweep {summary['study']}: trial {best['number']}, "
                f"{sweep.objective} {best['value']:.4f}.\n# hvd-train train --config {BEST} "
                "(run.output: change it, or add --output)\n"
            )
            yaml.safe_dump(config, f, sort_keys=False)
    with files.replacing(os.path.join(folder, PAGE), "w") as f:
        f.write(render(sweep, summary, folder))
    return summary


def render(sweep: Sweep, summary: dict[str, Any], folder: str) -> str:
    keys = list(sweep.search)
    ranked = sorted(
        summary["rows"],
        key=lambda r: (
            r["state"] != "complete",
            r["value"] is None,
            -(r["value"] or 0) if sweep.direction == "maximize" else (r["value"] or 0),
            r["number"],
        ),
    )
    counts = summary["counts"]
    best = summary["best"]
    title = f"Sweep {summary['study']}"
    out = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{report_page.STYLE}</style></head><body><h1>{html.escape(title)}</h1>",
        report_page.table(
            ["", ""],
            [
                ["objective", f"{sweep.objective} ({sweep.direction})"],
                [
                    "trials",
                    f"{len(summary['rows'])} of {sweep.trials}: "
                    + ", ".join(f"{n} {s}" for s, n in counts.items() if n),
                ],
                ["best", f"trial {best['number']}: {best['value']:.4f}" if best else "none yet"],
                ["epochs run", summary["epochs_run"]],
                ["epochs pruning saved", summary["epochs_saved_by_pruning"]],
                ["study", f"{summary['study']} in {summary['storage']}"],
            ],
            text=(0, 1),
        ),
        "<h2>Trials, best first</h2>",
    ]
    header = ["trial", "state", sweep.objective, *keys, "epochs", "seconds", "note", "report"]
    rows = [
        [
            r["number"],
            r["state"],
            r["value"],
            *(r["params"].get(k) for k in keys),
            r["epochs"],
            None if r["seconds"] is None else round(r["seconds"]),  # whole seconds
            r["note"],
            r["folder"],
        ]
        for r in ranked
    ]
    table = report_page.table(header, rows, text=(1, *range(3, 3 + len(keys)), len(header) - 2, len(header) - 1))
    # Each trial's folder links to its report.html.
    for r in ranked:
        name = html.escape(r["folder"])
        if studies.is_trial_folder(r["folder"]) and os.path.isfile(
            os.path.join(folder, r["folder"], report_page.REPORT)
        ):
            link = f"<a href='{name}/{report_page.REPORT}'>{name}</a>"
            table = table.replace(f'<td class="name">{name}</td></tr>', f'<td class="name">{link}</td></tr>', 1)
    out.append(table)
    finished = [r for r in summary["rows"] if r["value"] is not None]
    if finished:
        out.append(f"<h2>{html.escape(sweep.objective)} against each option</h2>")
        out.append(f"<img src='{report_page.png_data(lambda buf: _scatter(sweep, finished, buf))}' alt='options'>")
    if summary["importances"]:
        out.append("<h2>Option importances (PED-ANOVA)</h2>")
        out.append(report_page.table(["option", "importance"], [[k, v] for k, v in summary["importances"].items()]))
    elif summary["importances_tie"]:
        out.append(f"<h2>Option importances</h2><p>{html.escape(tie_note(sweep), quote=False)}</p>")
    out.append(
        "<p class='note'>Pruned trials show the last value they reported. "
        f"Read the study as it runs: <code>optuna-dashboard {html.escape(summary['storage'])}</code>.</p>"
    )
    out.append("</body></html>")
    return "\n".join(out)


def tie_note(sweep: Sweep) -> str:
    return f"the trials tie on {sweep.objective}: the options' importances cannot be told apart"


def _importances(study) -> tuple[dict[str, float], bool]:
    """PED-ANOVA's importance of each option (from 3 finished trials), and whether the trials tie.

    Where the best trials cannot be told from the rest (every value the
    same), PED-ANOVA warns and gives each option the same share: not an
    importance, so none is shown, and the tie is said instead.
    """
    op = studies.optuna()
    complete = study.get_trials(deepcopy=False, states=(op.trial.TrialState.COMPLETE,))
    if len(complete) < 3:
        return {}, False
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            found = {k: float(v) for k, v in op.importance.get_param_importances(study).items()}
        except (ValueError, RuntimeError):
            found = {}
    if any("importances will be equal" in str(w.message) for w in said):
        return {}, True
    return found, False


def _scatter(sweep: Sweep, rows: list[dict], buffer) -> None:
    from hvd_train.results import plots

    keys = list(sweep.search)
    columns = min(3, len(keys))
    fig = plots.figure(4 * columns, 3.2 * math.ceil(len(keys) / columns))
    for i, key in enumerate(keys):
        ax = fig.add_subplot(math.ceil(len(keys) / columns), columns, i + 1)
        space = sweep.search[key]
        points = [(r["params"].get(key), r["value"], r["state"]) for r in rows if key in r["params"]]
        if space.kind == "choices":
            labels = [str(v) for v in space.values]
            xs = [labels.index(str(p)) if str(p) in labels else -1 for p, _, _ in points]
            ax.set_xticks(range(len(labels)), labels)
        else:
            xs = [float(p) for p, _, _ in points]
            if space.kind == "log_uniform":
                ax.set_xscale("log")
        for state, marker in (("complete", "o"), ("pruned", "x")):
            chosen = [(x, v) for x, (_, v, s) in zip(xs, points) if s == state]
            if chosen:
                ax.scatter(*zip(*chosen), marker=marker, label=state)
        ax.set_xlabel(key)
        ax.set_ylabel(sweep.objective)
        ax.grid(alpha=0.3)
    fig.axes[0].legend()
    plots.save(fig, buffer)

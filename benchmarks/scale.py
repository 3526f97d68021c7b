"""Start-up at ImageNet scale: seconds to the first step, memory per rank, and how both grow.

Builds ImageNet-shaped trees (1,000 class folders) of 10 k to 1.28 M files
by hard-linking a few hundred small JPEGs (seconds, no disk), then runs
``hvd-train train`` on each as a user would, one worker, output to a log
file, and stops it with SIGTERM right after its first step. From the log's
lines (each read as it is written) it takes when the listing ended, when
the check ended and when the first step ended; from ``/proc`` the peak
memory of the training process. ``--s3`` repeats the smaller sizes with the
tree uploaded to a moto server on 127.0.0.1 (its own Python request
overhead limits it to the smaller trees).

    python benchmarks/scale.py [--sizes 10000,100000,300000,1280000] [--np 1] [--check quick]
                               [--s3 10000] [--csv 300000] [--records 300000] [--pack 20000]

``--np N`` runs N workers under ``horovodrun`` (memory is then the largest
rank's). ``--csv`` repeats sizes with the same tree given as a CSV of labels
(``--data tree.csv``, a row per image, written beside the tree).
``--records`` repeats sizes packed (``hvd-train pack``), and with the same
records written again as Model Garden's ImageNet files: read with no index
(one worker, then two), and from the index kept. ``--pack
N`` also times ``hvd-train pack`` of an N-file tree with 1, 2 and 4
processes (``horovodrun -np``).

Prints a Markdown table and the growth from each size to the next;
benchmarks/RESULTS.md keeps the recorded runs.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CLASSES = 1000
SOURCES = 256  # distinct JPEGs, linked over and over


def make_sources(folder: Path, count: int = SOURCES) -> list[Path]:
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    paths = []
    for i in range(count):
        path = folder / f"src{i:04d}.jpg"
        paths.append(path)
        if path.exists():  # kept as they are: a cache of image checks keys on their mtime
            continue
        pixels = rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, "JPEG", quality=80)
        path.write_bytes(buf.getvalue())
    return paths


def make_tree(root: Path, files: int, sources: list[Path]) -> None:
    """``files`` hard links in ``CLASSES`` class folders below ``root`` (ImageNet's naming)."""
    per_class = files // CLASSES
    shutil.rmtree(root, ignore_errors=True)  # what an interrupted run left

    def fill(c: int) -> None:
        wnid = f"n{c:08d}"
        folder = root / wnid
        folder.mkdir(parents=True, exist_ok=True)
        for k in range(per_class):
            os.link(sources[(c * per_class + k) % len(sources)], folder / f"{wnid}_{k}.JPEG")

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(fill, range(CLASSES)))


def ranks_of(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo.extend(children.get(found[-1], []))
    return found


def peak_rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def start_to_first_step(data: str, out: Path, check: str, env: dict, np: int = 1, extra: tuple = ()) -> dict:
    """Runs ``np`` workers until the first step, then stops them; the times of the phases from the log."""
    launcher = []
    if np > 1:
        horovodrun = str(Path(sys.executable).parent / "horovodrun")
        launcher = [horovodrun, "--gloo", "-np", str(np), "-H", f"localhost:{np}"]
    cmd = [
        *launcher,
        sys.executable,
        "-m",
        "hvd_train",
        "train",
        "--data",
        data,
        "--output",
        str(out),
        "--model",
        "mobilenet_v2",
        "--weights",
        "none",
        "--image-size",
        "32",
        "--batch-size",
        "16",
        "--epochs",
        "1",
        "--val-split",
        "0.01",
        "--check-images",
        check,
        "--log-every",
        "1",
        "--no-tensorboard",
        *extra,
    ]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    marks: dict[str, float] = {}
    lines: list[str] = []
    peak = 0.0
    held = None
    for line in proc.stdout:
        now = time.perf_counter() - started
        lines.append(line.rstrip())
        found = re.search(r"the list takes ([\d.]+) MB", line)
        if found:
            held = float(found.group(1))
        found = re.search(r"read \d+ records of \d+ TFRecord files in ([\d.]+) s", line)
        if found:
            marks["records_read"] = float(found.group(1))
        if "training images" in line and "listed+checked" not in marks:
            marks["listed+checked"] = now
        if re.search(r"steps/epoch", line):
            marks["model+state"] = now
        # The first step's line: "step N/" after the first call of --steps-per-call steps (horovodrun
        # prefixes "[rank]<stdout>:").
        if re.search(r"(^|>:)step \d+/", line):
            marks["first_step"] = now
            peak = max((peak_rss_mb(pid) or 0.0) for pid in ranks_of(proc.pid))
            proc.send_signal(signal.SIGTERM)
            break
    proc.stdout.close()
    proc.wait(timeout=300)
    if "first_step" not in marks:
        raise RuntimeError("no first step:\n" + "\n".join(lines[-30:]))
    return {**marks, "peak_rss_mb": peak, "list_mb": held, "log": lines}


def write_garden(tree: Path, work: Path, env: dict) -> Path:
    """``tree`` packed (``hvd-train pack``, shards of 32 MB), then its records written again as Model Garden's
    ImageNet files are (``train-0000i-of-0000n``: ``image/encoded``, ``image/class/label`` from 1, the class
    name as ``image/class/synset``). Returns the pack's folder; the other is ``work/garden``."""
    from hvd_train.compat import tf
    from hvd_train.data import packed

    shards = work / "packed"
    cmd = [sys.executable, "-m", "hvd_train", "pack", str(tree), str(shards), "--overwrite", "--shard-size", "32MB"]
    subprocess.run(cmd, check=True, env=env, capture_output=True)
    shard_set = packed.load(str(shards), "--data")
    garden = work / "garden"
    garden.mkdir(exist_ok=True)

    def feature(**kind):
        return tf.train.Feature(**kind)

    for i, shard in enumerate(shard_set.shards):
        framed = []
        for record in packed.unframe((shards / shard.file).read_bytes(), shard.images, shard.file):
            ours = tf.train.Example.FromString(record).features.feature
            label = ours["image/class/label"].int64_list.value[0]
            fields = {
                "image/encoded": ours["image/encoded"],
                "image/class/label": feature(int64_list=tf.train.Int64List(value=[label + 1])),
                "image/class/synset": feature(bytes_list=tf.train.BytesList(value=[shard_set.classes[label].encode()])),
            }
            framed.append(
                packed.frame(tf.train.Example(features=tf.train.Features(feature=fields)).SerializeToString())
            )
        (garden / f"train-{i:05d}-of-{len(shard_set.shards):05d}").write_bytes(b"".join(framed))
    return shards


def records_runs(tree: Path, n: int, work: Path, check: str, env: dict) -> list[tuple[str, dict]]:
    """Start-up on the pack of ``tree``, then on the same records as another tool's files: with no index (one
    worker, then two), and from the index the first run kept."""
    shards = write_garden(tree, work, env)
    garden = f"{work / 'garden'}/train-*"
    whole = ("--val-split", "0")
    runs = [("pack's shards", start_to_first_step(str(shards), work / "out-shards", check, env, 1, whole))]
    offset = (*whole, "--label-offset", "1")
    size = sum(p.stat().st_size for p in (work / "garden").iterdir()) / n
    print(f"records of {size / 1e3:.1f} kB on average", flush=True)
    for name, np in (("records, no index", 1), ("records, index kept", 1), ("records, no index, 2 workers", 2)):
        if "no index" in name:
            for index in (work / "garden").glob(".hvd_train-index-*"):
                index.unlink()
        runs.append((name, start_to_first_step(garden, work / f"out-{np}-{len(runs)}", check, env, np, offset)))
        print(_row(name, n, runs[-1][1]), f"(records read in {runs[-1][1].get('records_read', 0):.1f} s)", flush=True)
    shutil.rmtree(work / "garden", ignore_errors=True)
    shutil.rmtree(shards, ignore_errors=True)
    return runs


def write_csv(tree: Path, path: Path) -> Path:
    """A CSV of labels naming every image of ``tree`` (``tree/<class>/<file>,<class>``), beside it."""
    with open(path, "w", encoding="utf-8") as f:
        f.write("path,label\n")
        for folder in sorted(os.scandir(tree), key=lambda e: e.name):
            for image in os.scandir(folder.path):
                f.write(f"{tree.name}/{folder.name}/{image.name},{folder.name}\n")
    return path


def list_cost(n: int) -> dict:
    """What ``n`` ImageNet-style paths cost as a Python list and as a ``PathList``: bytes held, pickle bytes
    (what a broadcast sends), and seconds to pickle and unpickle."""
    import pickle
    import tracemalloc

    from hvd_train.data.folder import PathList

    prefix = "/datasets/imagenet/train/"
    names = [f"n{c:08d}/n{c:08d}_{k}.JPEG" for c in range(CLASSES) for k in range(n // CLASSES)]
    out = {}
    for kind in ("list", "PathList"):
        tracemalloc.start()
        held = [prefix + r for r in names] if kind == "list" else PathList.of(prefix, names)
        size = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        t0 = time.perf_counter()
        blob = pickle.dumps(held, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(blob)
        out[kind] = (size / 1e6, len(blob) / 1e6, time.perf_counter() - t0)
        del held, blob
    return out


def pack_rate(tree: Path, dst: Path, processes: int) -> float:
    """images/s of ``hvd-train pack`` with ``processes`` ranks (horovodrun for more than one)."""
    cmd = [sys.executable, "-m", "hvd_train", "pack", str(tree), str(dst), "--overwrite"]
    if processes > 1:
        horovodrun = str(Path(sys.executable).parent / "horovodrun")
        cmd = [horovodrun, "--gloo", "-np", str(processes), "-H", f"localhost:{processes}", *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    text = proc.stdout + proc.stderr
    found = re.search(r"\(([\d.]+) images/s on (\d+) process", text)
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"pack failed:\n{text[-3000:]}")
    return float(found.group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000,300000,1280000")
    parser.add_argument("--check", default="quick", help="--check-images for the runs")
    parser.add_argument("--np", type=int, default=1, help="workers (horovodrun --gloo) for the local runs")
    parser.add_argument("--s3", default="", help="sizes to repeat from S3 (moto on 127.0.0.1), e.g. 10000")
    parser.add_argument("--csv", default="", help="sizes to repeat given as a CSV of labels, e.g. 300000")
    parser.add_argument(
        "--records", default="", help="sizes to repeat packed, and as another tool's TFRecords, e.g. 300000"
    )
    parser.add_argument("--work", default="", help="where the trees go (default: a temporary folder)")
    parser.add_argument("--pack", type=int, default=0, help="also time hvd-train pack of this many files")
    parser.add_argument("--pack-processes", default="1,2,4")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    work = Path(args.work or tempfile.mkdtemp(prefix="hvd-train-scale-"))
    env = {**os.environ, "HVD_TRAIN_CACHE": str(work / "cache")}
    rows = []
    try:
        sources = make_sources(work / "sources")
        for n in sizes:
            tree = work / f"tree-{n}"
            t0 = time.perf_counter()
            make_tree(tree, n, sources)
            made = time.perf_counter() - t0
            result = start_to_first_step(str(tree), work / f"out-{n}", args.check, env, args.np)
            rows.append(("local", n, made, result))
            print(_row("local", n, result), flush=True)
            shutil.rmtree(work / f"out-{n}", ignore_errors=True)
            if str(n) in args.csv.split(","):
                table = write_csv(tree, work / f"tree-{n}.csv")
                rows.append(
                    ("csv", n, 0.0, start_to_first_step(str(table), work / f"out-csv-{n}", args.check, env, args.np))
                )
                print(_row("csv", n, rows[-1][3]), flush=True)
                shutil.rmtree(work / f"out-csv-{n}", ignore_errors=True)
            if str(n) in args.records.split(","):
                rows += [(name, n, 0.0, r) for name, r in records_runs(tree, n, work, args.check, env)]
            if str(n) in args.s3.split(","):
                rows.append(("s3", n, 0.0, _s3_run(tree, n, work, args.check, env)))
                print(_row("s3", n, rows[-1][3]), flush=True)
            shutil.rmtree(tree, ignore_errors=True)
        packs = []
        if args.pack:
            tree = work / f"tree-{args.pack}"
            make_tree(tree, args.pack, sources)
            for processes in [int(p) for p in args.pack_processes.split(",")]:
                packs.append((processes, pack_rate(tree, work / "packed", processes)))
                print(f"pack, {processes} process(es): {packs[-1][1]:.0f} images/s", flush=True)
            shutil.rmtree(tree, ignore_errors=True)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(
        f"{platform.node()}: {os.cpu_count()} CPU(s), Python {platform.python_version()}, "
        f"--check-images {args.check}, {args.np} worker(s)"
    )
    print()
    print(
        "| source | files | listed + checked (s) | model + state (s) | first step done (s) "
        "| list (MB/rank) | peak RSS (MB) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for source, n, _, r in rows:
        print(_row(source, n, r))
    if packs:
        print(f"\n| hvd-train pack, {args.pack:,} files | images/s |\n|---|---:|")
        for processes, rate in packs:
            print(f"| {processes} process(es) | {rate:.0f} |")
    print("\n| paths | as | held (MB) | pickled (MB) | pickle + unpickle (s) |\n|---:|---|---:|---:|---:|")
    for n in sizes:
        for kind, (held, pickled, seconds) in list_cost(n).items():
            print(f"| {n:,} | {kind} | {held:.1f} | {pickled:.1f} | {seconds:.2f} |")
    local = [(n, r) for s, n, _, r in rows if s == "local"]
    for (n0, r0), (n1, r1) in zip(local, local[1:]):
        print(
            f"\n{n0:,} -> {n1:,} files (x{n1 / n0:.1f}): first step x{r1['first_step'] / r0['first_step']:.2f}, "
            f"listing+check x{r1['listed+checked'] / r0['listed+checked']:.2f}, "
            f"memory x{r1['peak_rss_mb'] / r0['peak_rss_mb']:.2f}"
        )
    return 0


def _row(source: str, n: int, r: dict) -> str:
    return (
        f"| {source} | {n:,} | {r['listed+checked']:.1f} | {r['model+state'] - r['listed+checked']:.1f} | "
        f"{r['first_step']:.1f} | {r['list_mb'] or 0:.1f} | {r['peak_rss_mb']:.0f} |"
    )


def _s3_run(tree: Path, n: int, work: Path, check: str, env: dict) -> dict:
    import boto3

    sys.path.insert(0, str(Path(__file__).parent))
    from data_sources import start_s3, upload

    server, url = start_s3()
    try:
        s3_env = {**env, "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "us-east-1"}
        client = boto3.client(
            "s3", endpoint_url=url, aws_access_key_id="k", aws_secret_access_key="s", region_name="us-east-1"
        )
        client.create_bucket(Bucket="scale")
        upload(client, tree, "scale", "tree/")
        s3_env["AWS_ENDPOINT_URL"] = url
        result = start_to_first_step("s3://scale/tree/", work / f"out-s3-{n}", check, s3_env)
        shutil.rmtree(work / f"out-s3-{n}", ignore_errors=True)
        return result
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    sys.exit(main())

"""Input throughput of the four data sources on the same images, in one run.

Local folder, local shards, S3 folder (one object per image) and S3 shards,
all read through the trainer's own input pipeline (``train_dataset`` /
``train_shards``: fetch, decode, random crop + flip, resize, batch) for one
rank, with no model: images/s of the input alone, which is what a GPU would
be waiting on. The S3 store is a moto server on 127.0.0.1 started by this
script, with its own (Python) request overhead.

    python benchmarks/data_sources.py [--images 2000] [--image-size 224] [--epochs 3]

Prints a Markdown table and the ratios to the local folder;
benchmarks/RESULTS.md keeps the recorded runs.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def start_s3() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(f"{url}/moto-api/", timeout=2).close()
            return proc, url
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("moto server did not start")


def s3_env(url: str) -> dict[str, str]:
    """The AWS environment that points boto3 at the moto server ``url``."""
    return {
        "AWS_ENDPOINT_URL": url,
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }


def upload(client, folder: Path, bucket: str, prefix: str) -> None:
    files = [p for p in sorted(folder.rglob("*")) if p.is_file()]

    def put(path):
        client.put_object(Bucket=bucket, Key=prefix + path.relative_to(folder).as_posix(), Body=path.read_bytes())

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, files))


def store_ceiling(client, bucket: str, prefix: str, threads: int) -> float:
    """Objects/s of bare boto3 GETs with ``threads`` threads: what the store can serve here."""
    keys = [
        o["Key"]
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        for o in page.get("Contents", [])
    ]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda k: client.get_object(Bucket=bucket, Key=k)["Body"].read(), keys))
    return len(keys) / (time.perf_counter() - t0)


def measure(make_dataset, steps: int, batch: int, epochs: int) -> float:
    """Median images/s over epochs 2.. of iterating the dataset (epoch 1 warms up)."""
    it = iter(make_dataset())
    rates = []
    for _ in range(epochs):
        t0 = time.perf_counter()
        for _ in range(steps):
            next(it)
        rates.append(steps * batch / (time.perf_counter() - t0))
    return statistics.median(rates[1:]) if len(rates) > 1 else rates[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=2000, help="images in all (5 classes)")
    parser.add_argument("--source-size", type=int, default=256, help="side of the stored images")
    parser.add_argument("--image-size", type=int, default=224, help="model input side")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32, help="S3 requests in flight")
    parser.add_argument("--shard-size", default="32MB")
    args = parser.parse_args()

    from hvd_train import compat  # noqa: F401
    from hvd_train.data import packed
    from hvd_train.data.folder import list_folder
    from hvd_train.data.pipeline import train_input
    from hvd_train.data.sharding import Segment
    from hvd_train.data.storage import S3Options
    from hvd_train.demo import make_demo_data

    work = Path(tempfile.mkdtemp(prefix="hvd-train-bench-"))
    data = Path(make_demo_data(str(work / "data"), per_class=args.images // 5, size=args.source_size))
    proc, url = start_s3()
    os.environ.update(s3_env(url))
    try:
        import boto3
        from botocore.config import Config

        client = boto3.client("s3", config=Config(max_pool_connections=args.concurrency))
        client.create_bucket(Bucket="bench")
        upload(client, data, "bench", "folder/")
        s3 = S3Options(concurrency=args.concurrency)
        size = packed.parse_size(args.shard_size)
        packed.pack(str(data), str(work / "shards"), shard_size=size, on_bad_image="skip", seed=0, s3=s3)
        packed.pack(str(data), "s3://bench/shards/", shard_size=size, on_bad_image="skip", seed=0, s3=s3)

        common = dict(rank=0, image_size=args.image_size, augment="crop,flip", preprocess=lambda x: x, seed=0, s3=s3)
        n = len(list_folder(str(data)))
        segments = [(Segment.whole(e, n, 1, args.batch_size), 0) for e in range(args.epochs)]
        steps = segments[0][0].steps

        def folder(url):
            images = list_folder(url, s3=s3)
            return lambda: train_input(images, segments, **common).dataset

        def shard_set_at(url):
            shard_set = packed.load(url, "--data", s3)
            return lambda: train_input(shard_set, segments, **common).dataset

        sources = {
            "local folder": folder(str(data)),
            "local shards": shard_set_at(str(work / "shards")),
            "S3 folder (one object per image)": folder("s3://bench/folder/"),
            "S3 shards": shard_set_at("s3://bench/shards/"),
        }
        rates = {name: measure(make, steps, args.batch_size, args.epochs) for name, make in sources.items()}
        ceiling = store_ceiling(client, "bench", "folder/", args.concurrency)
    finally:
        proc.terminate()
        proc.wait()

    mb = sum(p.stat().st_size for p in data.rglob("*") if p.is_file()) / 1e6
    print(
        f"\n{n} images ({mb:.0f} MB, {args.source_size}px PNG/JPEG) -> {args.image_size}px, "
        f"batch {args.batch_size}, crop+flip, 1 process; {platform.machine()}, {os.cpu_count()} CPUs\n"
    )
    print("| source | images/s | / local folder |")
    print("|---|---|---|")
    base = rates["local folder"]
    for name, rate in rates.items():
        print(f"| {name} | {rate:.1f} | {rate / base:.2f} |")
    print(
        f"\nThe store's own ceiling: plain boto3 GETs of the same objects, {args.concurrency} threads, no "
        f"TensorFlow: {ceiling:.1f} objects/s; the S3 folder pipeline reaches "
        f"{rates['S3 folder (one object per image)'] / ceiling:.0%} of it."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What a run whose --output is in S3 costs per checkpoint, and what a resume from the prefix alone takes.

    python benchmarks/s3_output.py [--models MobileNetV2,ResNet50] [--repeats 3]

For each model (weights none, 224 px, a 5-class head, SGD with momentum: the
checkpoint holds the weights and one slot per weight, as a run's does):

1. ``checkpoints.save`` to local disk (the staging folder): seconds, bytes;
2. the same checkpoint uploaded by ``s3_mirror.Mirror.push_checkpoint`` (one PUT
   per file, multipart above 16 MB, ``state.json`` last): seconds, MB/s;
3. a resume from nothing: ``s3_mirror.Mirror.pull`` into an empty staging
   folder (list, download, verify every file's CRC32C): seconds.

The store is a moto server on 127.0.0.1 started here: the figures are
loopback figures (no network, moto's in-memory store); on AWS the upload
and download rates are those of the instance's network to S3. Prints
Markdown; benchmarks/RESULTS.md keeps the recorded runs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="MobileNetV2,ResNet50")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from data_sources import s3_env, start_s3  # the same moto server as the input benchmarks

    root = tempfile.mkdtemp(prefix="s3-output-")
    server, url = start_s3()
    os.environ.update(s3_env(url))
    try:
        import boto3
        import numpy as np

        from hvd_train.compat import keras
        from hvd_train.data.storage import S3Options
        from hvd_train.training import checkpoints, s3_mirror
        from hvd_train.training.state import TrainState

        boto3.client("s3").create_bucket(Bucket="bench")
        print(f"{os.cpu_count()} cores; moto server on 127.0.0.1; {args.repeats} repeats, median")
        print()
        print("| model | checkpoint | save to disk | upload | MB/s | resume from the prefix alone |")
        print("|---|---|---|---|---|---|")
        for name in args.models.split(","):
            backbone = getattr(keras.applications, name)(
                weights=None, include_top=False, pooling="avg", input_shape=(224, 224, 3)
            )
            model = keras.Sequential([backbone, keras.layers.Dense(5)])
            optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
            optimizer.apply_gradients([(np.zeros(v.shape, np.float32), v) for v in model.trainable_variables])
            saves, uploads, pulls, size = [], [], [], 0
            for repeat in range(args.repeats):
                staging = os.path.join(root, name, "staging")
                mirror = s3_mirror.Mirror(f"s3://bench/{name}/", staging, S3Options())
                state = TrainState(seed=1, world_size=1, batch_size=32, global_batch=32, total=1000, step=repeat + 1)
                started = time.perf_counter()
                path = checkpoints.save(
                    staging, f"epoch-0000-step-{repeat + 1:06d}", model, optimizer, state,
                    {"rows": np.zeros((1, 4), np.float32)}, {}, keep=1,
                )  # fmt: skip
                saves.append(time.perf_counter() - started)
                size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
                started = time.perf_counter()
                assert mirror.push_checkpoint(path)
                uploads.append(time.perf_counter() - started)
                elsewhere = os.path.join(root, name, f"elsewhere-{repeat}")
                started = time.perf_counter()
                assert s3_mirror.Mirror(f"s3://bench/{name}/", elsewhere, S3Options()).pull() == os.path.basename(path)
                pulls.append(time.perf_counter() - started)
                shutil.rmtree(elsewhere)
            save, upload, pull = (statistics.median(x) for x in (saves, uploads, pulls))
            print(
                f"| {name} | {size / 1e6:.1f} MB | {save:.2f} s | {upload:.2f} s | {size / 1e6 / upload:.0f} "
                f"| {pull:.2f} s |"
            )
    finally:
        server.kill()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

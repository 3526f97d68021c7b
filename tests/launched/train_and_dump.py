"""Launched under horovodrun/mpirun by the tests: train, then dump this rank's weights.

Usage: python train_and_dump.py DUMP_DIR TRAIN-ARGS...
The test compares the files of all ranks; this script asserts what one rank can.
"""

import argparse
import os
import sys

import numpy as np

from hvd_train import config, log
from hvd_train.distributed import start
from hvd_train.model import compute
from hvd_train.training import run

dump_dir, train_args = sys.argv[1], sys.argv[2:]
parser = argparse.ArgumentParser()
config.add_arguments(parser)
cfg = config.from_sources(parser.parse_args(train_args))
# As `hvd-train train` does before Horovod and TensorFlow start (commands/train.py).
os.environ.update(cfg.horovod.environment(cfg.run.output))
os.makedirs(cfg.run.output, exist_ok=True)
compute.xla_environment(cfg.compute.xla)
ctx = start.init(cfg.horovod.threads_per_rank, deterministic=cfg.run.deterministic)
compute.use_xla(cfg.compute.xla)
log.setup(ctx.rank, ctx.size)
outcome = run.run(cfg, ctx)
assert outcome.summary["world_size"] == ctx.size == int(os.environ.get("EXPECTED_SIZE", ctx.size))
weights = outcome.model.get_weights()
np.savez(os.path.join(dump_dir, f"weights-rank{ctx.rank}.npz"), *weights)
node = os.environ.get("SLURMD_NODENAME", "")  # set where SLURM started the process
print(f"rank {ctx.rank}/{ctx.size} dumped {len(weights)} arrays" + (f" on node {node}" if node else ""), flush=True)

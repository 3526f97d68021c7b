"""Predicting images/s and scaling efficiency before renting the machines.

Inputs: one worker's step time (measured: ``hvd-train bench --mode
synthetic``), the bytes the allreduce moves per step (trainable parameters
x 4 bytes, x 2 with ``--fp16-allreduce`` compression), the links (bandwidth
and latency within a host and between hosts: given, or measured with
``hvd-train plan --measure-link``), and optionally what the input pipeline
can feed (``bench --mode io``).

The model: Horovod's ring allreduce of S bytes over n workers takes

    T(S) = 2(n-1)/n * S/B + 2(n-1) * alpha

per fused buffer; gradients are fused into buffers of Horovod's fusion
threshold, so a step makes ceil(S / fusion) such allreduces, each paying the
latency term and one Horovod cycle. B and alpha are those of the slowest
link the ring crosses: between hosts when there are several, within the
host otherwise. The allreduce overlaps the backward pass, taken as 2/3 of a
step, by the fraction ``overlap`` (about 1 on GPUs, where compute and
communication use different engines; 0 on CPUs, where they share the
cores). Workers of one host also share its memory bandwidth, caches and,
on CPUs, each other's spare cycles: a step cannot be shorter than
``t_loaded``, one worker's step while every worker of its host computes at
once (measured by running one ``bench`` per worker at the same time; on
GPUs it is about ``t_compute``). A step then takes

    t = max(t_loaded, t_compute + max(0, T_comm - overlap * 2/3 * t_compute))

with bounds from perfect overlap (max(t_loaded, t_compute, T_comm)) to
none (max(t_loaded, t_compute + T_comm)). The predicted bottleneck is the input when the
pipeline feeds fewer images/s than the step consumes, the network when the
allreduce adds time, the host when its workers slow each other down, and
the compute otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hvd_train.errors import UserError
from hvd_train.model.schedules import linear_scaling

BACKWARD_SHARE = 2 / 3  # of a step: the backward pass, during which gradients are ready to send


@dataclass(frozen=True)
class Link:
    """A network link.

    Attributes:
        bandwidth: bytes per second in each direction.
        latency: seconds per message (one hop).
    """

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Setup:
    """What the prediction needs.

    Attributes:
        step_seconds: one worker's training step at ``batch`` images, measured alone.
        batch: images per worker per step.
        loaded_step_seconds: one worker's step while every worker of its
            host computes at once (0: the same as ``step_seconds``).
        gradient_bytes: bytes one allreduce of all gradients moves per worker.
        intra: the link between workers of one host.
        inter: the link between hosts.
        workers_per_host: workers on each host.
        fusion_bytes: Horovod's fusion buffer.
        cycle_seconds: Horovod's cycle time.
        overlap: fraction of the backward pass the allreduce can hide behind.
        input_rate: images/s one worker's input pipeline feeds (0: not limiting).
        base_lr: learning rate of one worker, for the table.
        accum: gradient accumulation passes per update.
    """

    step_seconds: float
    batch: int
    gradient_bytes: float
    intra: Link
    inter: Link
    workers_per_host: int = 8
    fusion_bytes: float = 128 * 1024 * 1024
    cycle_seconds: float = 0.001
    overlap: float = 1.0
    input_rate: float = 0.0
    base_lr: float = 0.01
    accum: int = 1
    loaded_step_seconds: float = 0.0

    def check(self) -> None:
        """Raises UserError for values no prediction can come from."""
        if not self.step_seconds > 0:
            raise UserError(f"the step time must be > 0 seconds; got {self.step_seconds} (--step-time or --bench).")
        if self.batch < 1:
            raise UserError(f"--batch-size must be a whole number >= 1; got {self.batch}.")
        for name, link in (("intra-host", self.intra), ("between hosts", self.inter)):
            if not link.bandwidth > 0:
                raise UserError(
                    f"the {name} bandwidth must be > 0; got {link.bandwidth} "
                    f"(give e.g. --{'intra' if name == 'intra-host' else 'inter'}-bandwidth 25Gbit)."
                )
            if link.latency < 0:
                raise UserError(f"the {name} latency must be >= 0; got {link.latency}.")
        if not 0 <= self.overlap <= 1:
            raise UserError(f"--overlap must be in [0, 1]; got {self.overlap}.")
        if self.workers_per_host < 1:
            raise UserError(f"--workers-per-host must be >= 1; got {self.workers_per_host}.")


@dataclass(frozen=True)
class Prediction:
    """One row of the plan.

    Attributes:
        workers: number of workers.
        hosts: hosts they run on.
        comm_seconds: allreduce time per step.
        step_seconds: predicted step time (the point estimate).
        step_range: step time with perfect overlap and with none.
        images_per_sec: all workers together.
        efficiency: images_per_sec / (workers x one worker's images/s).
        bottleneck: ``compute``, ``network``, ``host`` (the workers of a host
            share its memory bandwidth and cores) or ``input``.
        global_batch: images per update.
        lr: the learning rate that global batch gets (linear scaling).
    """

    workers: int
    hosts: int
    comm_seconds: float
    step_seconds: float
    step_range: tuple[float, float]
    images_per_sec: float
    efficiency: float
    bottleneck: str
    global_batch: int
    lr: float


def ring_allreduce_seconds(size_bytes: float, workers: int, link: Link, fusion: float, cycle: float) -> float:
    """Seconds for a ring allreduce of ``size_bytes`` in fused buffers of ``fusion`` bytes."""
    if workers <= 1:
        return 0.0
    buffers = max(1, math.ceil(size_bytes / fusion))
    n = workers
    return 2 * (n - 1) / n * size_bytes / link.bandwidth + buffers * (2 * (n - 1) * link.latency + cycle)


def predict(setup: Setup, workers: int) -> Prediction:
    """The prediction for ``workers`` workers, filling hosts of ``setup.workers_per_host``."""
    setup.check()
    hosts = max(1, math.ceil(workers / setup.workers_per_host))
    link = setup.inter if hosts > 1 else setup.intra
    comm = ring_allreduce_seconds(setup.gradient_bytes, workers, link, setup.fusion_bytes, setup.cycle_seconds)
    compute = setup.step_seconds
    # The host's shared resources: only when it runs more than one worker.
    floor = max(compute, setup.loaded_step_seconds) if min(workers, setup.workers_per_host) > 1 else compute
    hidden = setup.overlap * BACKWARD_SHARE * compute
    step = max(floor, compute + max(0.0, comm - hidden))
    low, high = max(floor, comm), max(floor, compute + comm)
    single = _rate(setup, compute)
    rate = _rate(setup, step)
    if setup.input_rate and setup.input_rate < setup.batch / step:
        bottleneck = "input"
    elif step > floor + 1e-12:
        bottleneck = "network"
    elif floor > compute + 1e-12:
        bottleneck = "host"  # the workers of a host slow each other down
    else:
        bottleneck = "compute"
    return Prediction(
        workers=workers,
        hosts=hosts,
        comm_seconds=comm,
        step_seconds=step,
        step_range=(low, high),
        images_per_sec=workers * rate,
        efficiency=rate / single,
        bottleneck=bottleneck,
        global_batch=workers * setup.batch * setup.accum,
        lr=linear_scaling(setup.base_lr, workers * setup.batch * setup.accum, setup.batch),
    )


def _rate(setup: Setup, step: float) -> float:
    """One worker's images/s with steps of ``step`` seconds, capped by its input."""
    rate = setup.batch / step
    return min(rate, setup.input_rate) if setup.input_rate else rate


def table(setup: Setup, workers: list[int]) -> list[Prediction]:
    return [predict(setup, n) for n in workers]


UNITS = {
    "b": 1 / 8,
    "bit": 1 / 8,
    "kbit": 1e3 / 8,
    "mbit": 1e6 / 8,
    "gbit": 1e9 / 8,
    "tbit": 1e12 / 8,
    "": 1,
    "B": 1,
    "KB": 1e3,
    "MB": 1e6,
    "GB": 1e9,
    "TB": 1e12,
}


def parse_bandwidth(text: str, flag: str) -> float:
    """``25Gbit``, ``100Mbit/s``, ``12.5GB/s``, ``3e9`` (bytes/s) as bytes per second.

    Raises:
        UserError: not a bandwidth, or not > 0.
    """
    t = str(text).strip().removesuffix("/s").removesuffix("ps")
    number = t.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    unit = t[len(number) :].strip()
    key = unit if unit in ("B", "KB", "MB", "GB", "TB", "") else unit.lower()
    try:
        value = float(number) * UNITS[key]
    except (KeyError, ValueError):
        raise UserError(f"{flag} {text!r} is not a bandwidth; write e.g. 25Gbit, 100Mbit, 12.5GB/s.") from None
    if not value > 0:
        raise UserError(f"{flag} {text!r}: a bandwidth must be > 0.")
    return value


def parse_latency(text: str, flag: str) -> float:
    """``5us``, ``0.2ms``, ``1e-5`` (seconds) as seconds."""
    t = str(text).strip()
    for unit, scale in (("us", 1e-6), ("µs", 1e-6), ("ms", 1e-3), ("ns", 1e-9), ("s", 1.0)):
        if t.endswith(unit):
            t, factor = t[: -len(unit)], scale
            break
    else:
        factor = 1.0
    try:
        value = float(t) * factor
    except ValueError:
        raise UserError(f"{flag} {text!r} is not a latency; write e.g. 5us, 0.2ms.") from None
    if value < 0:
        raise UserError(f"{flag} {text!r}: a latency must be >= 0.")
    return value


def fit_link(sizes: list[float], seconds: list[float], workers: int, cycle: float = 0.0) -> Link:
    """The link that explains measured ring allreduce times: least squares of T = a + b S.

    With T(S) = 2(n-1)/n S/B + 2(n-1) alpha + cycle: B = 2(n-1)/n / b and
    alpha = (a - cycle) / (2(n-1)), so that ``ring_allreduce_seconds``
    gives the measured times back.
    """
    n = len(sizes)
    mean_s, mean_t = sum(sizes) / n, sum(seconds) / n
    var = sum((s - mean_s) ** 2 for s in sizes)
    slope = sum((s - mean_s) * (t - mean_t) for s, t in zip(sizes, seconds)) / var
    if not slope > 0:
        raise UserError("the allreduce times do not grow with the size: measure with larger sizes or more repeats.")
    intercept = max(0.0, mean_t - slope * mean_s)
    factor = 2 * (workers - 1)
    return Link(bandwidth=factor / workers / slope, latency=max(0.0, intercept - cycle) / factor)

"""``hvd-train doctor``: what a user needs to know before a long run."""

from __future__ import annotations

import argparse
import os

from hvd_train.distributed import launchers

REQUIREMENTS = ("gpu", "nccl", "mpi", "gloo")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="check the Horovod build, GPUs, network interfaces and S3 before a long run",
        description="Print the Horovod build (frameworks, controllers, tensor operations), TensorFlow and Keras "
        "versions, visible GPUs and the local-rank pinning, network interfaces and the one Horovod/NCCL will "
        "use, and S3 reachability when data is in S3. Exits 1 naming what a requested run needs and lacks.",
    )
    parser.add_argument(
        "--require",
        default="",
        help=f"comma-separated needs of the run: {', '.join(REQUIREMENTS)} (e.g. gpu,nccl for a GPU cluster)",
    )
    parser.add_argument("--data", default="", help="check that this s3:// (or local) data location is reachable")
    parser.add_argument("--s3-endpoint", default="", help="URL of an S3-compatible store (default: AWS_ENDPOINT_URL)")
    parser.add_argument("--network-interface", default="", help="the NIC the run will be told to use")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from hvd_train import compat  # noqa: F401  (the run's Keras before Horovod)
    from hvd_train.errors import UserError

    needs = [n.strip() for n in args.require.split(",") if n.strip()]
    unknown = [n for n in needs if n not in REQUIREMENTS]
    if unknown:
        raise UserError(f"--require {unknown[0]!r} is unknown; use any of {', '.join(REQUIREMENTS)}.")
    problems: list[str] = []

    from hvd_train.compat import KERAS_MAJOR, keras, tf

    print("versions")
    print(f"  tensorflow  {tf.__version__}")
    which = "tf_keras, Keras 2" if KERAS_MAJOR == 2 else "Keras 3, TensorFlow backend"
    print(f"  keras       {keras.__version__} ({which}; HVD_TRAIN_KERAS={KERAS_MAJOR})")
    build = _horovod_build()
    print(f"  horovod     {build.get('version', 'not importable')}")
    print("horovod build")
    if "error" in build:
        print(f"  cannot import horovod.tensorflow: {build['error']}")
        problems.append("Horovod is not importable; run launch/install.sh")
    else:
        for key in ("tensorflow", "mpi", "gloo", "nccl", "cuda", "rocm"):
            print(f"  {key:<11} {'yes' if build[key] else 'no'}")
        for need in ("mpi", "gloo", "nccl"):
            if need in needs and not build[need]:
                fix = (
                    "HVD_TRAIN_GPU=1 bash launch/install.sh (with CUDA and NCCL installed)"
                    if need == "nccl"
                    else ("bash launch/install.sh")
                )
                problems.append(f"Horovod was built without {need.upper()}; rebuild it: {fix}")

    gpus = tf.config.list_physical_devices("GPU")
    local_rank = _local_rank()
    print("gpus")
    print(f"  visible     {len(gpus)}{'' if gpus else ' (training runs on the CPU)'}")
    for i, gpu in enumerate(gpus):
        print(f"  [{i}] {gpu.name}")
    if gpus:
        print(f"  pinning     local rank {local_rank} -> GPU {local_rank % len(gpus)} (one GPU per local rank)")
    if "gpu" in needs and not gpus:
        problems.append("no GPU is visible to TensorFlow; check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES")

    from hvd_train.distributed import cpus

    local_ranks = _local_size()
    found_cpus = cpus.budget(local_ranks)
    print("cpus")
    print(f"  machine     {found_cpus.machine_cpus}")
    own = " (narrower than its parent's: set for this process alone)" if found_cpus.affinity_own else ""
    print(f"  affinity    {found_cpus.affinity_cpus}{own}")
    quota = found_cpus.cgroup_quota
    print(f"  cgroup      {'no CPU quota' if quota is None else f'quota of {quota:g} CPUs'}")
    print(f"  threads     {found_cpus.threads} per rank, from the {found_cpus.source} ({local_ranks} local rank(s))")

    print("network")
    interfaces = _interfaces()
    for name, addresses in interfaces.items():
        print(f"  {name:<11} {', '.join(addresses) or '-'}")
    chosen = args.network_interface or os.environ.get("HOROVOD_GLOO_IFACE") or os.environ.get("NCCL_SOCKET_IFNAME")
    if chosen:
        for name in chosen.split(","):
            if name not in interfaces:
                problems.append(
                    f"network interface {name!r} does not exist here; choose one of {', '.join(interfaces)}"
                )
            elif name == "lo":
                problems.append("network interface 'lo' only reaches this host; workers on other hosts need a real NIC")
        print(f"  chosen      {chosen} (horovodrun --network-interface / NCCL_SOCKET_IFNAME / HOROVOD_GLOO_IFACE)")
    else:
        print("  chosen      none set: horovodrun probes the hosts for common interfaces; NCCL takes the first")
        print("              non-loopback one. Set --network-interface when hosts have several networks.")

    from hvd_train.distributed import hostname

    found = hostname.resolve()  # the real name, also in a rank that runs under the loopback fix
    print(f"  hostname    {found.name} -> {found.address or '(does not resolve)'}")
    if found.address is None or found.loopback:
        fix = f"an /etc/hosts entry '<cluster address> {found.name}' (with --network-interface), or mpirun"
        if found.address is None:
            shim = hostname.shim_path()
            print("  single host Horovod's Gloo would crash on this name; hvd-train preloads a fix so that it")
            print(f"              uses loopback ({shim}: {'built' if shim.exists() else 'missing'})")
            if not shim.exists():
                problems.append(f"{found.describe()} and the loopback fix is not built: run launch/install.sh")
        else:
            print("  single host Horovod uses loopback: fine")
        print("  multi-host  Gloo jobs stop before training: the other hosts cannot reach this name's address;")
        print(f"              fix: {fix}")

    data = args.data
    endpoint = args.s3_endpoint or os.environ.get("AWS_ENDPOINT_URL", "")
    if data.startswith("s3://") or endpoint:
        problems += _check_s3(data, endpoint)
    elif data:
        print("data")
        ok = os.path.exists(data)
        print(f"  {data}: {'found' if ok else 'missing'}")
        if not ok:
            problems.append(f"data location {data} does not exist")

    if problems:
        print("problems")
        for p in problems:
            print(f"  - {p}")
        return 1
    print("ok" + (f": {', '.join(needs)} available" if needs else ""))
    return 0


def _horovod_build() -> dict:
    try:
        import horovod
        import horovod.tensorflow as hvd
    except Exception as e:  # a broken build raises all sorts of errors
        return {"error": f"{type(e).__name__}: {e}"}
    return {
        "version": horovod.__version__,
        "tensorflow": True,
        "mpi": hvd.mpi_built(),
        "gloo": hvd.gloo_built(),
        "nccl": hvd.nccl_built() > 0,
        "cuda": hvd.cuda_built(),
        "rocm": hvd.rocm_built(),
    }


def _local_rank(env=None) -> int:
    """This process's local rank, as the first launcher of the table that tells it says; 0 under none."""
    env = os.environ if env is None else env
    for var in launchers.variables("local_rank"):
        if var in env:
            return int(env[var])
    return 0


def _local_size(env=None) -> int:
    """The ranks on this host, as the first launcher of the table that tells them says; 1 under none."""
    env = os.environ if env is None else env
    for var in launchers.variables("local_size"):
        if var in env:
            return int(env[var])
    return 1


def _interfaces() -> dict[str, list[str]]:
    import socket

    import psutil  # a dependency of Horovod

    stats = psutil.net_if_stats()
    found = {}
    for name, addresses in sorted(psutil.net_if_addrs().items()):
        up = stats.get(name)
        label = [a.address for a in addresses if a.family in (socket.AF_INET, socket.AF_INET6)]
        found[name] = label + ([] if up is None or up.isup else ["(down)"])
    return found


def _check_s3(data: str, endpoint: str) -> list[str]:
    from hvd_train.data.storage import S3Options, client_for, redact_url, s3_message

    print("s3")
    options = S3Options(endpoint=endpoint, max_attempts=2, connect_timeout=5, read_timeout=10)
    client = client_for(options)
    shown = redact_url(client.meta.endpoint_url)
    print(f"  endpoint    {shown}")
    if not data.startswith("s3://"):
        return []
    bucket, _, prefix = data[len("s3://") :].partition("/")
    try:
        listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix, MaxKeys=1)
    except Exception as e:
        message = s3_message(e, "list", bucket, prefix, shown, "--data")
        print(f"  {data}: unreachable")
        return [message]
    print(f"  {data}: reachable, {'has objects' if listed.get('KeyCount') else 'EMPTY'}")
    return [] if listed.get("KeyCount") else [f"no objects below {data}"]

# hvd_train image. GPU by default (NVIDIA's CUDA 12.5 + cuDNN 9 images;
# Horovod with NCCL, MPI and Gloo; not built by our CI: docs/launching.md);
# CPU (Debian 13, Python 3.13) with
#   DOCKER_BUILDKIT=1 docker build --build-arg VARIANT=cpu -t hvd-train:cpu .
# Both install through launch/install.sh, the script `make demo` / `make test`
# use. The runtime stage has no compilers; it runs as the user hvd and its
# entrypoint is hvd-train (launch/docker.sh runs horovodrun / sshd instead).
#
# No `# syntax=` line: the frontend built into Docker 20.10+ handles
# RUN --mount, and fetching another one needs a registry. Behind a
# TLS-inspecting proxy, pass the CA bundle to trust as a BuildKit secret:
#   --secret id=ca,src=/etc/ssl/certs/ca-certificates.crt
# Only the download steps mount it (at /run/secrets/ca); no layer keeps it.
# Without a registry, make the base image first: launch/base-image.sh.
ARG VARIANT=gpu
ARG CUDA_TAG=12.5.1-cudnn

# --- build stages: compilers, headers, the Horovod build ----------------------
FROM nvidia/cuda:${CUDA_TAG}-devel-ubuntu22.04 AS build-gpu
ENV HVD_TRAIN_GPU=1 PYTHON=python3.11 \
    HOROVOD_CUDA_HOME=/usr/local/cuda HOROVOD_NCCL_LINK=SHARED
RUN --mount=type=secret,id=ca \
    ca=/run/secrets/ca; if [ -s "$ca" ]; then set -- -o "Acquire::https::CAInfo=$ca"; fi \
    && apt-get "$@" update && DEBIAN_FRONTEND=noninteractive apt-get "$@" install -y --no-install-recommends \
        python3.11 python3.11-dev python3.11-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*

FROM debian:trixie-slim AS build-cpu
ENV HVD_TRAIN_GPU=0 PYTHON=python3
RUN --mount=type=secret,id=ca \
    ca=/run/secrets/ca; if [ -s "$ca" ]; then set -- -o "Acquire::https::CAInfo=$ca"; fi \
    && apt-get "$@" update && DEBIAN_FRONTEND=noninteractive apt-get "$@" install -y --no-install-recommends \
        python3 python3-dev python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# hadolint ignore=DL3006
FROM build-${VARIANT} AS build
ENV HVD_TRAIN_VENV=/opt/hvd_train/venv HVD_TRAIN_EXTRAS="" HVD_TRAIN_EDITABLE=0 \
    HVD_TRAIN_CACHE=/root/.cache/hvd_train
WORKDIR /src
# The dependencies first, in a layer that only a change to the stack
# (setup.cfg, launch/install.sh) rebuilds. The pip and Horovod wheel caches
# live in a BuildKit cache: rebuilds skip the compile, and no layer keeps
# them. HVD_TRAIN_CA_BUNDLE: see the top.
COPY setup.cfg pyproject.toml ./
COPY launch/install.sh launch/
COPY launch/patches/ launch/patches/
RUN --mount=type=cache,target=/root/.cache --mount=type=secret,id=ca \
    HVD_TRAIN_CA_BUNDLE=/run/secrets/ca HVD_TRAIN_DEPS_ONLY=1 bash launch/install.sh
# Then hvd_train itself: the same script finds every earlier step done.
COPY README.md Makefile ./
COPY launch/ launch/
COPY hvd_train/ hvd_train/
RUN --mount=type=cache,target=/root/.cache --mount=type=secret,id=ca \
    HVD_TRAIN_CA_BUNDLE=/run/secrets/ca bash launch/install.sh

# --- runtime stages: Python, Open MPI and sshd, no compilers ------------------
FROM nvidia/cuda:${CUDA_TAG}-runtime-ubuntu22.04 AS runtime-gpu
RUN --mount=type=secret,id=ca \
    ca=/run/secrets/ca; if [ -s "$ca" ]; then set -- -o "Acquire::https::CAInfo=$ca"; fi \
    && apt-get "$@" update && DEBIAN_FRONTEND=noninteractive apt-get "$@" install -y --no-install-recommends \
        python3.11 libpython3.11 openmpi-bin libopenmpi3 openssh-client openssh-server iproute2 ca-certificates \
    && rm -rf /var/lib/apt/lists/*

FROM debian:trixie-slim AS runtime-cpu
RUN --mount=type=secret,id=ca \
    ca=/run/secrets/ca; if [ -s "$ca" ]; then set -- -o "Acquire::https::CAInfo=$ca"; fi \
    && apt-get "$@" update && DEBIAN_FRONTEND=noninteractive apt-get "$@" install -y --no-install-recommends \
        python3 libpython3.13 openmpi-bin libopenmpi40 openssh-client openssh-server iproute2 ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# hadolint ignore=DL3006
FROM runtime-${VARIANT} AS runtime
COPY --from=build /opt/hvd_train /opt/hvd_train
# The launch scripts (mpirun.sh passes preemption signals on; discovery scripts for elastic jobs).
COPY launch/ /opt/hvd_train/launch/
# The user hvd, whose home is the working folder: open to other uids too
# (box runs --user <caller>; Debian 13's useradd makes homes 0700). sshd for
# multi-node launches (launch/docker.sh worker, the MPI Operator): runs as hvd
# on port 12345 with a host key made at build time.
RUN useradd --create-home --uid 1000 --shell /bin/bash hvd \
    && chmod 755 /home/hvd \
    && mkdir -p /etc/ssh/hvd /run/sshd \
    && ssh-keygen -q -t ed25519 -N "" -f /etc/ssh/hvd/ssh_host_ed25519_key \
    && chown -R hvd:hvd /etc/ssh/hvd \
    && printf '%s\n' 'Port 12345' 'HostKey /etc/ssh/hvd/ssh_host_ed25519_key' 'PidFile /tmp/sshd.pid' \
        'UsePAM no' 'PasswordAuthentication no' 'StrictModes no' 'AuthorizedKeysFile .ssh/authorized_keys' \
        'AcceptEnv AWS_* HOROVOD_* NCCL_* TF_*' > /etc/ssh/sshd_config_hvd
ENV PATH=/opt/hvd_train/venv/bin:$PATH \
    TF_USE_LEGACY_KERAS=1 \
    OMPI_MCA_plm_rsh_args="-p 12345 -o StrictHostKeyChecking=no"
USER 1000:1000
WORKDIR /home/hvd
ENTRYPOINT ["hvd-train"]
CMD ["--help"]

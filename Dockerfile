# hvd_train image: Debian 13 with its Python 3.13, Open MPI, TensorFlow with
# Keras 3 and tf-keras, and Horovod (MPI, Gloo). GPU by default: TensorFlow's CUDA
# libraries and Horovod with NCCL, all from PyPI's wheels (`make gpu-image`;
# needs an NVIDIA driver >= 580: docs/launching.md). CPU only with
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

# --- build stages: compilers, headers, the Horovod build ----------------------
# (The GPU build takes its CUDA compiler from PyPI's wheels inside
# launch/install.sh, for the build only.)
FROM debian:trixie-slim AS build-base
ENV PYTHON=python3
RUN --mount=type=secret,id=ca \
    ca=/run/secrets/ca; if [ -s "$ca" ]; then set -- -o "Acquire::https::CAInfo=$ca"; fi \
    && apt-get "$@" update && DEBIAN_FRONTEND=noninteractive apt-get "$@" install -y --no-install-recommends \
        python3 python3-dev python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*

FROM build-base AS build-cpu
ENV HVD_TRAIN_GPU=0
FROM build-base AS build-gpu
ENV HVD_TRAIN_GPU=1

# hadolint ignore=DL3006
FROM build-${VARIANT} AS deps
ENV HVD_TRAIN_VENV=/opt/hvd_train/venv HVD_TRAIN_EXTRAS=export HVD_TRAIN_EDITABLE=0 \
    HVD_TRAIN_CACHE=/root/.cache/hvd_train
WORKDIR /src
# The dependencies first, in a layer that only a change to the stack
# (setup.cfg, launch/install.sh) rebuilds. The pip and Horovod wheel caches
# live in a BuildKit cache: rebuilds skip the compile, and no layer keeps
# them. HVD_TRAIN_CA_BUNDLE: see the top.
COPY setup.cfg ./
COPY launch/install.sh launch/
COPY launch/patches/ launch/patches/
RUN --mount=type=cache,target=/root/.cache --mount=type=secret,id=ca \
    HVD_TRAIN_CA_BUNDLE=/run/secrets/ca HVD_TRAIN_DEPS_ONLY=1 bash launch/install.sh

# Then hvd_train itself: the same script finds every earlier step done. Its
# own files (the package, its console script, the hostname fix) are gathered
# under /code at their paths, so that the runtime image takes the stack and
# the code as two layers: a change to the code alone is a layer of about
# 1.3 MB, not a copy of the whole venv (2.5 GB).
FROM deps AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
COPY README.md Makefile pyproject.toml ./
COPY launch/ launch/
COPY hvd_train/ hvd_train/
RUN --mount=type=cache,target=/root/.cache --mount=type=secret,id=ca \
    HVD_TRAIN_CA_BUNDLE=/run/secrets/ca bash launch/install.sh \
    && mkdir /code && { "$HVD_TRAIN_VENV/bin/python" -I -c 'import importlib.metadata as m, pathlib; \
d = m.distribution("hvd_train"); [print(pathlib.Path(d.locate_file(f)).resolve()) for f in d.files]' \
        && echo "$HVD_TRAIN_VENV/lib/hvd_train/gethostname.so"; } | xargs -d '\n' cp -a --parents -t /code

# --- runtime stages: Python, Open MPI and sshd, no compilers ------------------
FROM debian:trixie-slim AS runtime-base
RUN --mount=type=secret,id=ca \
    ca=/run/secrets/ca; if [ -s "$ca" ]; then set -- -o "Acquire::https::CAInfo=$ca"; fi \
    && apt-get "$@" update && DEBIAN_FRONTEND=noninteractive apt-get "$@" install -y --no-install-recommends \
        python3 libpython3.13 openmpi-bin libopenmpi40 openssh-client openssh-server iproute2 ca-certificates \
    && rm -rf /var/lib/apt/lists/*

FROM runtime-base AS runtime-cpu
# The CUDA libraries are in the venv (TensorFlow's and-cuda wheels); the
# driver's come from the host through the NVIDIA Container Toolkit, which
# these variables ask for (as NVIDIA's own images do).
FROM runtime-base AS runtime-gpu
ENV NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility

# hadolint ignore=DL3006
FROM runtime-${VARIANT} AS runtime
COPY --from=deps /opt/hvd_train /opt/hvd_train
# The user hvd, whose home is the working folder: open to other uids too
# (box runs --user <caller>; Debian 13's useradd makes homes 0700). sshd for
# multi-node launches (launch/docker.sh worker, the MPI Operator): runs as hvd
# on port 12345 with a host key made at build time. ssh from the image goes to
# that port by default (ssh_config.d): the MPI Operator sets
# OMPI_MCA_plm_rsh_args itself, so a port given there would be lost.
RUN useradd --create-home --uid 1000 --shell /bin/bash hvd \
    && chmod 755 /home/hvd \
    && mkdir -p /etc/ssh/hvd /run/sshd \
    && ssh-keygen -q -t ed25519 -N "" -f /etc/ssh/hvd/ssh_host_ed25519_key \
    && chown -R hvd:hvd /etc/ssh/hvd \
    && printf '%s\n' 'Port 12345' 'HostKey /etc/ssh/hvd/ssh_host_ed25519_key' 'PidFile /tmp/sshd.pid' \
        'UsePAM no' 'PasswordAuthentication no' 'StrictModes no' 'AuthorizedKeysFile .ssh/authorized_keys' \
        'AcceptEnv AWS_* HOROVOD_* NCCL_* TF_*' > /etc/ssh/sshd_config_hvd \
    && printf '%s\n' 'Host *' '    Port 12345' '    StrictHostKeyChecking no' '    UserKnownHostsFile /dev/null' \
        > /etc/ssh/ssh_config.d/hvd.conf
ENV PATH=/opt/hvd_train/venv/bin:$PATH \
    OMPI_MCA_plm_rsh_args="-p 12345 -o StrictHostKeyChecking=no"
# The launch scripts (mpirun.sh passes preemption signals on; discovery
# scripts for elastic jobs), then hvd_train's own files: the last layers.
COPY launch/ /opt/hvd_train/launch/
COPY --from=build /code/ /
USER 1000:1000
WORKDIR /home/hvd
ENTRYPOINT ["hvd-train"]
CMD ["--help"]

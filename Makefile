# The README's commands. Every target installs what it needs first
# (idempotent and cached: see launch/install.sh).
VENV ?= .venv
export HVD_TRAIN_VENV := $(abspath $(VENV))
BIN := $(HVD_TRAIN_VENV)/bin
PYTEST_ARGS ?=
# The other Keras (the suite runs on the default one): it runs the tests marked both_kerases again.
# The default is Keras 3 on the 2.21 stack, tf-keras on 2.18 (hvd_train/compat.py), or HVD_TRAIN_KERAS.
OTHER_KERAS ?= $(if $(HVD_TRAIN_KERAS),$(if $(filter 2,$(HVD_TRAIN_KERAS)),3,2),$(if $(filter 2.18,$(HVD_TRAIN_TF)),3,2))

.PHONY: install demo test test-docker test-fast gpu-image lint clean

install:
	bash launch/install.sh

demo: install
	$(BIN)/hvd-train demo

SHELL_SCRIPTS := launch/install.sh launch/_common.sh launch/mpirun.sh launch/horovodrun.sh launch/docker.sh \
	launch/discover-hosts.sh launch/discover-slurm.sh launch/aws-spot-watch.sh \
	launch/slurm.sbatch launch/srun-ssh/ssh launch/base-image.sh .ci/run tests/launched/netns-agent

test: install
	$(BIN)/ruff check hvd_train tests benchmarks
	$(BIN)/ruff format --check hvd_train tests benchmarks
	$(BIN)/shellcheck -x $(SHELL_SCRIPTS)
	$(BIN)/hadolint Dockerfile
	$(BIN)/python -m pytest -n auto --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)
	HVD_TRAIN_KERAS=$(OTHER_KERAS) $(BIN)/python -m pytest -n auto --dist loadfile --no-loadscope-reorder \
		-m both_kerases $(PYTEST_ARGS)

# The Docker image, built from this checkout and run (root; installs docker.io).
# `make test` runs these too where HVD_TRAIN_REQUIRE has docker (CI).
test-docker: install
	$(BIN)/python -m pytest -m docker tests/test_docker.py $(PYTEST_ARGS)

# The GPU image, CUDA and NCCL from PyPI's wheels (longer than CI allows:
# docs/launching.md), then its Horovod's own check, which must list NCCL.
# CA_BUNDLE: the CA bundle the build's downloads trust (a BuildKit secret).
CA_BUNDLE ?= $(wildcard /etc/ssl/certs/ca-certificates.crt)
GPU_IMAGE ?= hvd-train:gpu
DOCKER ?= docker
comma := ,
gpu-image:
	DOCKER=$(DOCKER) bash launch/base-image.sh
	DOCKER_BUILDKIT=1 $(DOCKER) build --build-arg VARIANT=gpu $(if $(CA_BUNDLE),--secret id=ca$(comma)src=$(CA_BUNDLE)) -t $(GPU_IMAGE) .
	$(DOCKER) run --rm --entrypoint horovodrun $(GPU_IMAGE) --check-build | awk '{ print } /\[X\] NCCL/ { ok = 1 } END { exit !ok }'
	$(DOCKER) image ls $(GPU_IMAGE)

# Unit tests only: no horovodrun / mpirun jobs.
test-fast: install
	$(BIN)/python -m pytest -m "not multiprocess" $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check hvd_train tests benchmarks
	$(BIN)/ruff format --check hvd_train tests benchmarks
	$(BIN)/shellcheck -x $(SHELL_SCRIPTS)
	$(BIN)/hadolint Dockerfile

clean:
	rm -rf demo .pytest_cache build *.egg-info

# Two-command set-up: `make demo` and `make test` each build the virtual env when it is missing.
# On a CUDA machine pick the torch build you want, e.g.  make test TORCH="torch==2.8.0" EXTRAS=test,gpu
# or keep the torch the machine already has: TORCH= (empty) installs no torch and builds the virtual
# env with --system-site-packages, so it sees that torch, e.g.  make gpu-check TORCH=
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
# The index torch is installed from (empty: pip's own). On Linux, PyPI's torch==2.13.0 is the CUDA build
# (several GB); where no CPU wheel is already at hand, as it is on our CI machine, get the CPU build with
#   make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
EXTRAS ?= test,deepspeed
PYTEST_ARGS ?=
# The versions we tested (pip constraints); LOCK= (empty) installs the newest releases allowed by
# setup.cfg instead, as `make test-latest` does.
LOCK   ?= constraints.txt
# Extra pip flags for the package install (test-latest: upgrade what an older run installed).
PIP_INSTALL_FLAGS ?=
# OFFLINE=1 (with TORCH=): no package index, as on a lent GPU machine. Every package the machine has
# is kept and only this one is installed (--no-deps, --no-build-isolation; editable, because
# patches/ becomes distca_hf.patches only through the install); tests whose extras are missing skip.
#   make gpu-check TORCH= OFFLINE=1
OFFLINE ?=
ifneq ($(OFFLINE),)
ifneq ($(TORCH),)
$(error OFFLINE=1 keeps the machine's torch: pass TORCH= (empty) too)
endif
endif

BIN   := $(VENV)/bin
comma := ,
# One stamp per (torch, extras) choice, so changing either reinstalls.
STAMP := $(VENV)/.installed-$(subst /,_,$(subst =,_,$(subst $(comma),_,$(subst $() ,_,$(TORCH)-$(EXTRAS)-$(or $(LOCK),latest)$(if $(OFFLINE),-offline)))))

.PHONY: setup test test-fast test-latest test-oldest lock gpu-check demo demo-single kernel-bench bench-sim env docs clean-venv

setup: $(STAMP)

$(STAMP): setup.cfg pyproject.toml Makefile $(LOCK)
	test -x $(BIN)/python || $(PYTHON) -m venv $(if $(TORCH),,--system-site-packages) $(VENV)
ifneq ($(OFFLINE),)
	$(BIN)/python -m pip install --quiet --no-index --no-deps --no-build-isolation -e .
else
	$(BIN)/python -m pip install --quiet --upgrade pip setuptools wheel
	# Torch first and pinned: an unpinned `torch` dependency would pull the CUDA build (several GB).
	# TORCH= (empty): the torch already installed is kept (pip then finds `torch>=2.4` satisfied).
	$(if $(TORCH),$(BIN)/python -m pip install --quiet $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH)",$(BIN)/python -c "import torch; print('keeping torch', torch.__version__)")
	# flash-attn compiles against the installed torch, so it must see it (no build isolation).
	$(if $(findstring gpu,$(EXTRAS)),$(BIN)/python -m pip install --quiet --no-build-isolation "flash-attn>=2.6")
	# DeepSpeed's ops are JIT-built when first used; building them at install time needs CUDA.
	# The torch chosen above is named again, so that an upgrade (test-latest) cannot replace it with
	# PyPI's newest torch, a CUDA build of several GB.
	DS_BUILD_OPS=0 $(BIN)/python -m pip install --quiet $(PIP_INSTALL_FLAGS) $(if $(LOCK),-c $(LOCK)) \
		"$(or $(TORCH),torch==$$($(BIN)/python -c 'import torch; print(torch.__version__)'))" -e ".[$(EXTRAS)]"
endif
	rm -f $(VENV)/.installed-*
	touch $@

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The whole suite against the newest releases that setup.cfg allows (transformers, accelerate, TRL,
# DeepSpeed, ...; torch stays $(TORCH)), in its own virtual env: how we learn of a breaking release
# before users do. Not run by CI, which installs the lock. If it passes, `make lock` records them.
LATEST_VENV ?= .venv-latest
test-latest:
	rm -f $(LATEST_VENV)/.installed-*
	$(MAKE) test VENV=$(LATEST_VENV) LOCK= EXTRAS=$(EXTRAS),docs PIP_INSTALL_FLAGS="--upgrade --upgrade-strategy eager"

# The fast tier against the oldest releases setup.cfg allows (its lower bounds of transformers and accelerate;
# the rest resolved by pip around them), in its own virtual env: how we learn that the range we state is
# still true (5.0's mask interface broke every forward once, unnoticed). Not run by CI.
OLDEST_VENV ?= .venv-oldest
OLDEST ?= transformers==5.0.0 accelerate==1.10.1
test-oldest:
	rm -f $(OLDEST_VENV)/.installed-*
	$(MAKE) setup VENV=$(OLDEST_VENV) LOCK=
	$(OLDEST_VENV)/bin/python -m pip install --quiet "$(or $(TORCH),torch==$$($(OLDEST_VENV)/bin/python -c 'import torch; print(torch.__version__)'))" $(OLDEST)
	$(OLDEST_VENV)/bin/python -m pytest -m "not distributed" $(PYTEST_ARGS)

# Rewrite constraints.txt from the env `make test-latest` built (review the diff, then commit it).
lock:
	test -x $(LATEST_VENV)/bin/python || { echo "make lock: run make test-latest first"; exit 1; }
	{ sed -n '/^#/p' constraints.txt; $(LATEST_VENV)/bin/python -m pip freeze --exclude-editable | grep -v '^torch=='; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

# The fast tier: no spawned processes (tests marked `distributed` are left out).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not distributed" $(PYTEST_ARGS)

# On a CUDA machine: the tests marked `gpu` (they are skipped without CUDA; they include spawned
# two-rank runs on one GPU), then the CUDA kernel benchmark and a measured time model
# (GPU_CHECK_OUT/time_model.json). Without CUDA the two measurements are skipped with a message.
GPU_CHECK_OUT ?= gpu-check-out
gpu-check: $(STAMP)
	$(BIN)/python -m pytest -m gpu -rs $(PYTEST_ARGS)
	@if $(BIN)/python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
		mkdir -p $(GPU_CHECK_OUT) && \
		$(BIN)/distca-hf env > $(GPU_CHECK_OUT)/env.txt && cat $(GPU_CHECK_OUT)/env.txt && \
		$(BIN)/distca-hf kernel-bench --device cuda --out $(GPU_CHECK_OUT)/kernel_bench.json \
			> $(GPU_CHECK_OUT)/kernel_bench.md && cat $(GPU_CHECK_OUT)/kernel_bench.md && \
		$(BIN)/distca-hf profile --device cuda --out $(GPU_CHECK_OUT)/time_model.json; \
	else \
		echo "gpu-check: torch sees no CUDA device; the gpu tests above were skipped, and distca-hf kernel-bench --device cuda and distca-hf profile --device cuda are not run"; \
	fi

# The main job: two CPU processes fine-tune a tiny Llama through DistCATrainer (a per-step table of
# loss, attention imbalance before -> after and tokens/s), then the same run colocated, then both
# again (timed only: each step counts its faster run, since a noisy machine only adds time); prints
# the largest loss difference and the speedup. The same line runs any recipe in recipes/.
DEMO_ARGS ?= --compare-colocated --timing-repeats 2 --distca-config recipes/distca.yaml
demo: $(STAMP)
	$(BIN)/accelerate launch --config_file recipes/cpu-2proc.yaml examples/finetune_long_context.py $(DEMO_ARGS)

# The first demo: one process, exactness check, then a few steps.
demo-single: $(STAMP)
	$(BIN)/python examples/train_packed_tiny.py

kernel-bench: $(STAMP)
	$(BIN)/distca-hf kernel-bench

# The simulator table of docs/planner.md (needs ../shared/data/doc_lengths_*.json).
bench-sim: $(STAMP)
	$(BIN)/python examples/bench_sim.py --update-docs

# The documentation site: installs the docs extra (mkdocs, its material theme) into the same virtual
# env, rewrites the generated pages (settings and CLI references, the supported-models tables), then
# builds docs/ into site/ in strict mode: any warning (a broken link or anchor, a page left out of
# the nav) fails.
DOCS_STAMP := $(VENV)/.docs-installed-$(or $(LOCK),latest)
$(DOCS_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet $(if $(LOCK),-c $(LOCK)) -e ".[docs]"
	touch $@

docs: $(DOCS_STAMP)
	$(BIN)/python -m distca_hf.tools.docs_reference
	$(BIN)/mkdocs build --strict

env: $(STAMP)
	$(BIN)/distca-hf env

clean-venv:
	rm -rf $(VENV)

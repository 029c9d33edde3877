VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup train test test-all bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	VENV=$(VENV) bash scripts/setup.sh

# The main job on its built-in default: ManiSkill3 PushCube from state, 100k env steps, with a
# learned value baseline (GAE and a critic); the group baseline is configs/maniskill_pushcube_grpo.yaml.
train: setup
	$(VENV)/bin/mmrl train configs/maniskill_pushcube_gae.yaml

test: setup
	$(PY) -m pytest -q

test-all: setup
	$(PY) -m pytest -q -m ""

clean:
	rm -rf $(VENV) build dist *.egg-info runs

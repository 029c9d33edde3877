VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup train test test-all bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	VENV=$(VENV) bash scripts/setup.sh

# The main job: ManiSkill3 PushCube from state with RLPD (SAC on a replay buffer, 20 scripted
# demonstrations in half of every batch; 1,000 + 60,000 env steps). The demonstrations are
# collected first, once; the on-policy recipes are configs/maniskill_pushcube_gae.yaml (PPO with
# a critic) and configs/maniskill_pushcube_grpo.yaml (the group baseline).
train: setup
	test -f runs/demos/pushcube/index.json || $(VENV)/bin/mmrl collect --config configs/maniskill_pushcube_rlpd.yaml --out runs/demos/pushcube
	$(VENV)/bin/mmrl train configs/maniskill_pushcube_rlpd.yaml

test: setup
	$(PY) -m pytest -q

test-all: setup
	$(PY) -m pytest -q -m ""

clean:
	rm -rf $(VENV) build dist *.egg-info runs

# LeRobot 0.4.4 in a venv of its own (it pins torch < 2.11 and transformers < 5; PyPI's torch
# 2.10 is the CUDA build: ~8 GB, ~4 min), the reference of parity-lerobot. Neither target is
# part of setup or test. docs/parity.md, "LeRobot SmolVLA".
LEROBOT_VENV ?= .venv-lerobot
LEROBOT_REF ?= runs/parity-lerobot

.PHONY: lerobot-venv parity-lerobot

lerobot-venv: $(LEROBOT_VENV)/.installed

$(LEROBOT_VENV)/.installed: scripts/lerobot_venv.sh
	LEROBOT_VENV=$(LEROBOT_VENV) bash scripts/lerobot_venv.sh

# LeRobot writes the tiny SmolVLM (transformers 4.57; mmrl's transformers 5 reads it), builds,
# saves and runs a tiny random SmolVLA; mmrl's test then loads LeRobot's directory and compares.
parity-lerobot: setup lerobot-venv
	rm -rf $(LEROBOT_REF)
	OMP_NUM_THREADS=1 $(LEROBOT_VENV)/bin/python tests/parity/lerobot_smolvla_reference.py --vlm $(LEROBOT_REF)/vlm --out $(LEROBOT_REF) --seed 0
	OMP_NUM_THREADS=1 MMRL_LEROBOT_REFERENCE=$(abspath $(LEROBOT_REF)) MMRL_REQUIRE_LEROBOT=1 MMRL_LEROBOT_PYTHON=$(abspath $(LEROBOT_VENV))/bin/python \
		$(PY) -m pytest -q -rs tests/parity/test_lerobot_smolvla.py

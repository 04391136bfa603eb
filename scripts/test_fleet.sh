#!/usr/bin/env bash
# The fleet tests (python/tests/test_fleet.py; test_fleet_faults.py: killed workers, engine
# panics, clients that leave; test_edge.py: bad HTTP input at the edge; test_fleet_speech.py: spoken
# replies, OpenAI's audio output through the edge and Dynamo's KV router): Dynamo's OpenAI frontend and omniprefix workers
# as real processes on loopback, driven over HTTP; and test_encoder.py (the checkpoint encoder,
# which needs this venv's torch and transformers). Installs into VENV with
# scripts/install_fleet.sh (idempotent: reuses the venv and cargo's build), adds
# python/requirements-fleet-test.txt, then runs pytest with OMNIPREFIX_REQUIRE_FLEET=1 so a
# missing Dynamo fails instead of skipping. Called by scripts/test.sh.
# Then a 30-s soak of a fleet (scripts/fleet_soak.py).
# Usage: bash scripts/test_fleet.sh [VENV]   (default target/fleet-venv)
# Env: OMNIPREFIX_WHEEL_PROFILE (install_fleet.sh's; CI passes dev to reuse its test build).
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${1:-${CARGO_TARGET_DIR:-target}/fleet-venv}"
bash scripts/install_fleet.sh "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check -r python/requirements-fleet-test.txt
# From outside the source tree, so the tests import the installed wheel, not python/omniprefix.
python="$(cd "$venv" && pwd)/bin/python"
(cd python/tests && OMNIPREFIX_REQUIRE_FLEET=1 "$python" -m pytest -q -p no:cacheprovider test_encoder.py test_fleet.py \
  test_fleet_faults.py test_edge.py test_fleet_speech.py)
# A short soak (scripts/fleet_soak.py; its defaults are 32 clients for 600 s): 4 clients for 30 s
# of image and text chats through a 2-worker fleet and its edge, replies checked against
# Engine.generate (about 50 s with the fleet's start and the check). RSS is flat after 3 s here, but
# mimalloc grows in 2 MiB steps, and one step in a 15 s window reads as 5.8 MiB/min (seen in CI):
# so the short run measures from 5 s and allows 15 MiB/min, which two steps stay under and a
# planted 33 MiB/min per-request leak does not. The 600 s default keeps 2 MiB/min.
"$python" scripts/fleet_soak.py --clients 4 --seconds 30 --scripts 8 --warm-up 5 --max-rss-slope 15

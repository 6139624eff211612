#!/usr/bin/env bash
# The wheels a lent GPU machine lacks (it reaches no network), fetched here into .whl/ for the call's carry: the
# versions tested here of transformers and datasets with what they need beyond the machine's own packages, peft (the
# machine has one, of a version unread, and `transformers.Trainer` imports any peft it finds: one before 0.18 fails
# that import, `HybridCache`), and the peers' optimizers. The machine runs Python 3.12 on x86-64. In .whl/fallback/,
# datasets 4.0.0 for a machine whose own pyarrow is older than 19, which datasets 5.2 cannot import beside
# (`pa.json_`); 4.0.0 loads the shipped corpora on pyarrow 18 (checked here by hand, docs/gpu-suite.md).
#
#   bash scripts/gpu_wheels.sh   # then: run(command="CALL=1 OUT=$OUT bash scripts/gpu_session.sh", carry=[".whl"])
set -eu
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  transformers==5.24.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 peft==0.21.2 schedulefree prodigyopt \
  mechanic-pytorch==0.0.1
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl/fallback datasets==4.0.0
du -sh .whl

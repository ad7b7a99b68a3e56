# Source on the GPU machine from the repository root (benchmarks/README.md, "Device recipe"): installs the carried
# wheels once (lhotse and what it needs, soundfile, gguf), points at the carried flite, the benchmark cache in /tmp
# and a results folder outside the working tree (each call replaces the machine's copy of the working tree, so
# anything written under docs/ there is lost at the next call).
if [ ! -d /tmp/site/lhotse ]; then
  [ -d .devcarry/.whl ] || { echo "carry .devcarry/.whl in the first call"; return 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .devcarry/.whl/*.whl || return 1
fi
export REPO=$PWD PYTHONPATH=/tmp/site:$PWD DFLASH_BENCH_CACHE=/tmp/bench TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export FLITE=/tmp/flite/usr/bin/flite
export LD_LIBRARY_PATH="/tmp/flite/usr/lib/x86_64-linux-gnu:/tmp/flite/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
B="python3 benchmarks/real_targets.py"
mkdir -p /tmp/stage /tmp/stage2 /tmp/logs /tmp/results /tmp/bench/data/corpus

# One device call of the benchmark session (benchmarks/README.md, "One device session"), so that no command has to be
# written between calls (the machine is given back after about 30 s without one). Run from the call's repository
# root: `bash benchmarks/device/session.sh STEP [ARGS]`.
#   setup [TRAIN_CLIPS] [BENCH]  carry .devcarry/.whl .devcarry/debs .devcarry/flite_env.sh .devcarry/corpus (and,
#                                for the speech LLM, .devcarry/smollm2-gguf/group_02): wheels, flite, corpus; speech
#                                synthesis starts in the background; BENCH=1 runs the training-benchmark rows in the
#                                foreground, BENCH=2 only the compiled padded Qwen3-ASR row's diagnosis, BENCH=3 the
#                                speech-like 1.7B text row, BENCH=4 the 1.7B and 8B text full steps with compiled
#                                target and draft layers (issue 16)
#   carry GROUP...               copy carried groups (e.g. whisper-base/group_00) to their staging folders
#   unpack MODEL...              whisper-base | smollm2 | qwen2.5-coder: reassemble, verify, convert (smollm2, qwen)
#   launch CHAIN [ARGS]          start a background chain of chains.sh from /tmp/repo_CODE (a copy per code version,
#                                CODE its scripts' checksum; the latest is /tmp/repo_current: a chain must not
#                                import from the call's copy, which the next call replaces)
#   poll SECONDS                 wait, then one line per log, the finished chains, GPU use; results into $OUT/r.tgz
#   ab ROUNDS ARGS...            scripts/benchmark_train.py ARGS on this tree and on .devcarry/base (carried: an export of
#                                an earlier commit's dflash_hf/ and scripts/, `git archive C dflash_hf scripts`),
#                                alternated ROUNDS times in the same call; one summary line each, JSONs into $OUT
#   bring RUN [GROUP...]         a trained draft (runs/RUN/draft) back through $OUT: packed once into <= 15 MiB
#                                pieces with sha256 (carry groups group_NN, the last holding pieces.json); each call
#                                brings the named groups (default all; at most 8 files and 64 MiB come back a call,
#                                r.tgz included: a bf16 Whisper DFlash2 export, 76 MB, takes two calls). Copy them home
#                                into .devcarry/drafts/RUN/ and carry them in a later session (`carry
#                                drafts/RUN/group_NN ...`, then `unpack drafts/RUN`: to $DFLASH_BENCH_CACHE/init/RUN,
#                                the whisper chain's INIT)
set -u
step=${1:?STEP: setup, carry, unpack, launch or poll}; shift
if [ "$step" = setup ]; then
  cp benchmarks/device/*.sh /tmp/ || exit 1
fi
. "${DFLASH_DEVICE_ENV:-/tmp/env.sh}" || exit 1  # (an override only for a dry run off the device)
stage_of() { case $1 in whisper-base/*) echo /tmp/stage ;; smollm2-gguf/*) echo /tmp/stage2 ;;
                        qwencoder-gguf/*) echo /tmp/stage3 ;; drafts/*) echo /tmp/stage_"${1#drafts/}" ;;
                        *) echo "unknown carry group $1" >&2; return 1 ;; esac; }
case $step in
  setup)
    train=${1:-20000}; bench=${2:-0}
    . .devcarry/flite_env.sh || exit 1
    cp .devcarry/corpus/* /tmp/bench/data/corpus/ && mkdir -p /tmp/stage /tmp/stage2 /tmp/stage3 || exit 1
    if [ -d .devcarry/smollm2-gguf/group_02 ]; then cp .devcarry/smollm2-gguf/group_02/* /tmp/stage2/ || exit 1; fi
    # the speech chains wait for its stamp (speech.json); the smol chain makes its prompts itself
    setsid nohup $B data speech --train "$train" --dev 300 --eval 200 --workers 12 > /tmp/logs/speech.log 2>&1 < /dev/null &
    if [ "$bench" = 3 ]; then  # issue 16's speech-like text row while the GPU waits for the synthesis
      timeout 240 python3 scripts/benchmark_train.py --shape qwen3-1.7b-speechlike --modes draft full --steps 10 \
        --out /tmp/results/speechlike_rows.json > /tmp/logs/bench_speechlike.log 2>&1; tail -c 1500 /tmp/logs/bench_speechlike.log
    elif [ "$bench" = 4 ]; then  # issue 16's text rows as a training run pays them: compiled target and draft layers
      timeout 240 python3 scripts/benchmark_train.py --shape qwen3-1.7b qwen3-8b --modes full --full-configs \
        attn=flex,ce=2048,compile=layers --compile-target --steps 10 --out /tmp/results/text_rows_compiled.json \
        > /tmp/logs/bench_text_compiled.log 2>&1; tail -c 1500 /tmp/logs/bench_text_compiled.log
    elif [ "$bench" != 0 ]; then
      # the padded Qwen3-ASR row failed compiling the draft layers on 2026-12-03 (InductorError): eager layers here,
      # and the compiled case with dynamo's verbose trace for the diagnosis
      [ "$bench" = 1 ] && timeout 150 python3 scripts/benchmark_train.py --shape qwen3-asr-1.7b smollm2-135m \
        --modes full --full-configs attn=flex,ce=2048,compile=none --steps 10 --out /tmp/results/speech_rows.json \
        > /tmp/logs/bench.log 2>&1
      TORCHDYNAMO_VERBOSE=1 timeout 90 python3 scripts/benchmark_train.py --shape qwen3-asr-1.7b --modes full \
        --full-configs attn=flex,ce=2048,compile=layers --steps 10 --out /tmp/results/speech_rows_compiled.json \
        > /tmp/logs/bench_compiled.log 2>&1
      [ "$bench" = 1 ] && tail -c 1500 /tmp/logs/bench.log
      [ -f /tmp/results/speech_rows_compiled.json ] || { echo "the compiled case wrote no row (timeout?)"; exit 0; }
      python3 -c "import json; [print(r['error'], *r.get('traceback', []), sep='\n') for r in json.load(open('/tmp/results/speech_rows_compiled.json'))['results'] if 'error' in r]" | tail -c 4000
    fi ;;
  carry)
    for g in "$@"; do d=$(stage_of "$g") || exit 1; mkdir -p "$d" && cp -r .devcarry/"$g"/* "$d"/ || exit 1; done
    ls -R /tmp/stage* | wc -l ;;
  unpack)
    for m in "$@"; do
      case $m in
        whisper-base) $B unpack /tmp/stage $DFLASH_BENCH_CACHE/whisper-base/hf ;;
        smollm2) $B unpack /tmp/stage2 $DFLASH_BENCH_CACHE/smollm2/gguf && $B fetch smollm2 ;;
        qwen2.5-coder) $B unpack /tmp/stage3 $DFLASH_BENCH_CACHE/qwen2.5-coder/gguf && $B fetch qwen2.5-coder ;;
        drafts/*) $B unpack /tmp/stage_"${m#drafts/}" $DFLASH_BENCH_CACHE/init/"${m#drafts/}" ;;
        *) echo "unknown model $m (whisper-base, smollm2, qwen2.5-coder, drafts/RUN)"; exit 2 ;;
      esac > /tmp/logs/unpack_"${m//\//_}".log 2>&1 || { tail -5 /tmp/logs/unpack_"${m//\//_}".log; exit 1; }
      tail -1 /tmp/logs/unpack_"${m//\//_}".log
    done ;;
  launch)
    chain=${1:?CHAIN}; tag=$(echo "$*" | tr ' /' '__')
    # one copy per code version (a machine can come back with an earlier session's /tmp): chains already running
    # keep the copy they started in, a changed tree gets a copy of its own
    code=$(find . -path ./.devcarry -prune -o -path ./.git -prune -o -type f \( -name '*.py' -o -name '*.sh' -o \
      -name '*.yaml' -o -name '*.toml' \) -print | LC_ALL=C sort | xargs md5sum | md5sum | cut -c1-12)
    repo=/tmp/repo_$code
    if [ ! -d "$repo"/dflash_hf ]; then
      mkdir -p "$repo" && tar cf - --exclude=.devcarry --exclude=.git . | tar xf - -C "$repo" || exit 1
    fi
    ln -sfn "$repo" /tmp/repo_current
    (cd "$repo" && REPO="$repo" setsid nohup bash /tmp/chains.sh "$@" > /tmp/logs/ch_"$tag".log 2>&1 < /dev/null &)
    echo "launched $* (code $code)" ;;
  poll)
    sleep "${1:-0}"
    cd /tmp/logs || exit 1
    for f in *.log; do
      printf '%s: %s\n' "$f" "$(tail -c 400 "$f" | tr '\r' '\n' | grep -av '^\s*$' | tail -1 | cut -c1-160)"
    done
    echo "done: $(ls *.done 2>/dev/null | tr '\n' ' ')"
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>/dev/null
    tar czf "${OUT:-/tmp}"/r.tgz /tmp/results /tmp/logs $DFLASH_BENCH_CACHE/runs/*/train_done.json \
      $DFLASH_BENCH_CACHE/speech_llm/trained/recipe.json 2>/dev/null; true ;;
  ab)
    rounds=${1:?ab ROUNDS ARGS...}; shift
    [ -d .devcarry/base/dflash_hf ] || { echo "carry .devcarry/base (git archive C dflash_hf scripts)"; exit 1; }
    mkdir -p /tmp/base && cp -r .devcarry/base/* /tmp/base/ || exit 1
    for r in $(seq "$rounds"); do
      for tree in new base; do
        root=$PWD; [ $tree = base ] && root=/tmp/base
        (cd "$root" && PYTHONPATH=/tmp/site:$root python3 scripts/benchmark_train.py "$@" --out "${OUT:-/tmp}/ab_${tree}_$r.json" \
          2>&1 | grep -E "^\S+ +(full|draft) " | sed "s/^/$tree $r: /")
      done
    done ;;
  bring)
    n=${1:?bring RUN [GROUP...]}; shift
    packed=/tmp/bring/$n
    if [ ! -f "$packed"/pieces.json ]; then  # packed once; later calls bring the other groups
      [ -d $DFLASH_BENCH_CACHE/runs/"$n"/draft ] || { echo "no draft $DFLASH_BENCH_CACHE/runs/$n/draft"; exit 1; }
      $B pack $DFLASH_BENCH_CACHE/runs/"$n"/draft "$packed" --max_mib 15 > /tmp/logs/bring_"$n".log 2>&1 \
        || { tail -3 /tmp/logs/bring_"$n".log; exit 1; }
    fi
    groups=("$@"); [ ${#groups[@]} -gt 0 ] || groups=($(cd "$packed" && ls -d group_*))
    mkdir -p "${OUT:?}/$n" && for g in "${groups[@]}"; do cp -r "$packed/$g" "$OUT/$n/" || exit 1; done
    echo "groups of $n: $(cd "$packed" && ls -d group_* | tr '\n' ' ')($(du -sh "$packed" | cut -f1)); brought: ${groups[*]}"
    files=$(find "$OUT" -type f | wc -l); echo "$files files under \$OUT: $(du -sh "$OUT" | cut -f1)"
    [ "$files" -le 8 ] || { echo "more than the 8 files a call brings back: name fewer groups per call"; exit 1; }
    [ "$(du -sm "$OUT" | cut -f1)" -lt 64 ] || { echo "more than the 64 MiB a call brings back: name fewer groups"; exit 1; } ;;
  *) echo "unknown step $step (setup, carry, unpack, launch, poll, ab, bring)"; exit 2 ;;
esac

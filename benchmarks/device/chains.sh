# Background chains on the GPU machine (whisper, smol, qwen, sllm, sllmdraft, sllmall, sllmduo, sllmgen, timing,
# trainrows, f8q, f8lin; see the case labels). Copy out of the working tree first (the next call replaces it), then:
#   cp benchmarks/device/*.sh /tmp/ && setsid nohup bash /tmp/chains.sh KIND ARGS > /tmp/logs/KIND.log 2>&1 < /dev/null &
# Results and logs go to /tmp/results and /tmp/logs; bring them back with `tar czf $OUT/r.tgz /tmp/results /tmp/logs`
# ($OUT returns only a few files).
cd "${REPO:?export REPO=<repository root on the device>}" || exit 1
. /tmp/env.sh || exit 1
C=/tmp/bench; M=$C/speech_llm; S="python3 benchmarks/speech_llm.py"; SP=$C/data/speech
speech_ready() { while [ ! -f $SP/speech.json ]; do sleep 5; done; }  # session.sh setup synthesizes in the background
keep() { cp docs/results/quality_"$1"_* /tmp/results/ 2>/dev/null; cp -r docs/figures/quality_"$1"_* /tmp/results/ 2>/dev/null; }
# dflash-eval of a draft on the 40 held-out clips, fp32, 128 new tokens: DRAFT [FLAGS...] (Whisper-base) and
# DRAFT FAMILY [FLAGS...] (the speech LLM)
whisper_eval() { local draft=$1; shift; python3 -m dflash_hf.cli.eval --draft "$draft" --target $C/whisper-base/hf \
  --data $SP/eval.json --max_new_tokens 128 --num_samples 40 --device cuda --precision fp32 "$@"; }
sllm_eval() { local draft=$1 family=$2; shift 2; python3 -m dflash_hf.cli.eval --draft "$draft" --target $M/trained \
  --family "$family" --prompt "Transcribe the audio." --data $SP/eval.json --num_samples 40 --max_new_tokens 128 \
  --device cuda --precision fp32 "$@"; }
kind=$1; shift
case $kind in
  whisper)  # NAME [MINUTES [STEPS [WORKERS [INIT]]]]: train (warm-started from $C/init/INIT, a draft of an earlier
    # session brought home with `session.sh bring`), then evaluate on 40 held-out clips. Alone on the machine a
    # Whisper-base step takes 60 ms and the log-mel of ~55 clips a step needs ~10 loader workers to keep up
    speech_ready
    n=$1; minutes=${2:-7}; steps=${3:-800}; workers=${4:-4}; init=()
    [ -n "${5:-}" ] && init=(--init_from_pretrained "$C/init/$5")
    # whisper-gen-*: Whisper's own transcripts first (one set for every such run; a second chain waits for it)
    case $n in whisper-gen-*) $B labels "$n" --device cuda --dtype float32 --batch_size 128 --shards 4 \
      > /tmp/logs/$n.labels.log 2>&1 || { echo "rc=labels" > /tmp/logs/$n.done; exit 1; } ;; esac
    $B train "$n" -- ${init[@]+"${init[@]}"} --precision bf16 --dataloader_num_workers "$workers" --max_steps "$steps" \
      --max_train_minutes "$minutes" --eval_steps $(( steps / 5 )) --real_tau_steps 0 --save_steps $(( steps / 2 )) \
      > /tmp/logs/$n.train.log 2>&1
    $B eval "$n" --device cuda --precision fp32 --num_samples 40 > /tmp/logs/$n.eval.log 2>&1
    keep "$n"; echo "rc=$?" > /tmp/logs/$n.done ;;
  smol)  # [MINUTES]: prompts, the target's own labels, then the four text configurations at once
    minutes=${1:-6}
    $B data prompts --train 16000 --eval 64 > /tmp/logs/smol.prompts.log 2>&1
    $B labels smollm2-dflash-b8 --device cuda --batch_size 256 --dtype bfloat16 > /tmp/logs/smol.labels.log 2>&1
    for n in smollm2-dflash-b8 smollm2-dflash-b8-argmax smollm2-dflash-b8-dpace smollm2-dflash-b8-softlabels; do
      ( $B train $n -- --precision bf16 --max_steps 1000 --max_tokens 16384 --num_anchors 256 --num_draft_layers 2 \
          --learning_rate 1e-3 --max_train_minutes "$minutes" --eval_steps 250 --save_steps 500 > /tmp/logs/$n.train.log 2>&1
        $B eval $n --device cuda --precision fp32 --num_samples 32 > /tmp/logs/$n.eval.log 2>&1
        keep $n; echo "rc=$?" > /tmp/logs/$n.done ) &
    done
    wait ;;
  qwen)  # [MINUTES]: Qwen2.5-Coder-1.5B (after `$B fetch qwen2.5-coder`): prompts, its own labels, one draft
    minutes=${1:-6}
    [ -f $C/data/prompts/train.json ] || $B data prompts --train 16000 --eval 64 > /tmp/logs/qwen.prompts.log 2>&1
    $B labels qwencoder-dflash-b8 --device cuda --batch_size 128 --dtype bfloat16 > /tmp/logs/qwen.labels.log 2>&1
    $B train qwencoder-dflash-b8 -- --precision bf16 --max_train_minutes "$minutes" > /tmp/logs/qwencoder.train.log 2>&1
    # fp32: a bf16 verify and bf16 greedy round differently on this 1.5B model (10 of 32 outputs differed, 2026-12-04)
    $B eval qwencoder-dflash-b8 --device cuda --precision fp32 --num_samples 32 > /tmp/logs/qwencoder.eval.log 2>&1
    keep qwencoder-dflash-b8; echo "rc=$?" > /tmp/logs/qwencoder.done ;;
  sllm)  # [MINUTES [speech_llm.py train flags]]: assemble the speech LLM, teach it (projector + LoRA), WER
    minutes=${1:-5}; shift $(( $# > 0 ? 1 : 0 ))
    speech_ready
    $S assemble --whisper $C/whisper-base/hf --llm $C/smollm2/hf --out $M/assembled \
      --check_audio "$(ls $SP/wav/slt/*.wav | head -1)" > /tmp/logs/sllm.assemble.log 2>&1 \
      || { echo "rc=assemble" > /tmp/logs/sllm.done; exit 1; }
    # every other training clip: the tower pass over all 20000 would take ~3 minutes of a 30-minute session
    [ -f $SP/train_half.json ] || awk 'NR % 2 == 1' $SP/train.json > $SP/train_half.json
    $S train --model $M/assembled --train $SP/train_half.json --out $M/trained --device cuda --precision bf16 \
      --steps 2000 --batch_size 32 --max_minutes "$minutes" "$@" > /tmp/logs/sllm.train.log 2>&1 \
      || { echo "rc=train" > /tmp/logs/sllm.done; exit 1; }  # the chains after it need the trained model
    $S wer --model $M/trained --manifest $SP/eval.json --num_samples 200 --batch_size 32 --device cuda \
      --precision bf16 --output /tmp/results/speech_llm_wer_eval.json > /tmp/logs/sllm.wer.log 2>&1
    cp $M/assembled/assembled.json $M/trained/recipe.json /tmp/results/ 2>/dev/null; echo done > /tmp/logs/sllm.done ;;
  sllmdraft)  # NAME FAMILY MINUTES [dflash-train flags]: one draft on the speech LLM, then dflash-eval
    n=$1; fam=$2; minutes=$3; shift 3
    speech_ready
    [ -f $SP/dev64.json ] || head -64 $SP/dev.json > $SP/dev64.json  # in-training dev set (the manifests are JSONL)
    python3 -m dflash_hf.cli.train --target_name_or_path $M/trained --target_family "$fam" --prompt "Transcribe the audio." \
      --mask_token_id 8 --train_data $SP/train.json --eval_data dev=$SP/dev64.json --label_source target_argmax \
      --num_draft_layers 2 --precision bf16 --max_tokens 16000 --num_anchors 64 --learning_rate 6e-4 \
      --lr_scheduler_type cosine --warmup_steps 100 --max_steps 800 --max_train_minutes "$minutes" --eval_strategy steps \
      --eval_steps 200 --save_steps 400 --logging_steps 10 --report_to none --dataloader_num_workers 2 \
      --output_dir $C/runs/$n "$@" > /tmp/logs/$n.train.log 2>&1
    sllm_eval $C/runs/$n/draft "$fam" --output_json /tmp/results/sllm_$n.json > /tmp/logs/$n.eval.log 2>&1
    echo "rc=$?" > /tmp/logs/$n.done ;;
  sllmall)  # LLM_MINUTES DRAFT_MINUTES ADAPT_MINUTES: the speech LLM, its four drafts at once, then projection-only
    # adaptation of the block-8 draft to block 16 and to the held-out voice (slt dev sentences; eval sentences differ)
    lm=$1; dm=$2; am=$3
    bash /tmp/chains.sh sllm "$lm" --lr 3e-3 --lora_lr 1e-3 --warmup 50 --steps 3000 \
      || { echo "rc=sllm" > /tmp/logs/sllmall.done; exit 1; }
    head -64 $SP/dev.json > $SP/dev64.json; tail -n +65 $SP/dev.json > $SP/dev_rest.json  # adapt on the rest
    for spec in "sllm-dflash-b8 qwen2_audio --block_size 8" \
                "sllm-dflash-b8-single qwen2_audio_single_placeholder --block_size 8" \
                "sllm-dflash2-b8 qwen2_audio --block_size 8 --variant dflash2" \
                "sllm-dflash-b16 qwen2_audio --block_size 16"; do
      set -- $spec; n=$1; fam=$2; shift 2
      bash /tmp/chains.sh sllmdraft "$n" "$fam" "$dm" "$@" &
    done
    wait
    base=$C/runs/sllm-dflash-b8/draft
    bash /tmp/chains.sh sllmdraft sllm-adapt-b16 qwen2_audio "$am" --init_from_pretrained $base --projection_only true \
      --block_size 16 --warmup_steps 10 --learning_rate 1e-3 &
    bash /tmp/chains.sh sllmdraft sllm-adapt-slt qwen2_audio "$am" --init_from_pretrained $base --projection_only true \
      --train_data $SP/dev_rest.json --warmup_steps 10 --learning_rate 1e-3 &
    wait; echo done > /tmp/logs/sllmall.done ;;
  sllmgen)  # LLM_MINUTES DRAFT_MINUTES CLIPS [dflash-train flags]: the speech LLM, its own greedy transcripts of the first
    # CLIPS training clips and of the 64 dev clips (5 dflash-generate-labels processes: 4 train shards and dev; fp32
    # as dflash-eval decodes; a failed one ends the chain, the others finish on their own),
    # then its DFlash2 b8 draft on them with ground_truth labels (docs/GENERATED_LABELS.md; ninth session: 7 5 6000)
    lm=$1; dm=$2; clips=$3; shift 3
    bash /tmp/chains.sh sllm "$lm" --lr 3e-3 --lora_lr 1e-3 --warmup 50 --steps 4000 \
      || { echo "rc=sllm" > /tmp/logs/sllmgen.done; exit 1; }
    [ -f $SP/dev64.json ] || head -64 $SP/dev.json > $SP/dev64.json
    G=$SP/sllm_generated; rm -rf $G $SP/.sllm_shard*; mkdir -p $G  # labels of this run's speech LLM only
    head -n "$clips" $SP/train.json > $SP/.sllm_first.json
    split -n l/4 -d --additional-suffix=.json $SP/.sllm_first.json $SP/.sllm_shard  # beside the manifest: its paths
    gen() { python3 -m dflash_hf.cli.generate_labels --model $M/trained --manifest "$1" --output "$2" --batch_size 128 \
      --max_new_tokens 128 --prompt "Transcribe the audio." --device cuda --dtype float32 \
      > /tmp/logs/sllmgen_"$(basename "$1" .json)".log 2>&1; }
    pids=(); for f in $SP/.sllm_shard*.json $SP/dev64.json; do gen "$f" $G/"$(basename "$f")" & pids+=($!); done
    for p in "${pids[@]}"; do wait "$p" || { echo "rc=labels" > /tmp/logs/sllmgen.done; exit 1; }; done
    cat $G/.sllm_shard*.json > $G/train.json
    for pair in "$G/train.json $clips" "$G/dev64.json 64"; do read -r f want <<< "$pair"  # ("$@" holds the flags)
      [ "$(wc -l < "$f")" = "$want" ] || { echo "rc=labels: $(wc -l < "$f") of $want in $f" > /tmp/logs/sllmgen.done; exit 1; }
    done
    bash /tmp/chains.sh sllmdraft sllm-gen-dflash2-b8 qwen2_audio "$dm" --block_size 8 --variant dflash2 \
      --train_data $G/train.json --eval_data dev=$G/dev64.json --label_source ground_truth "$@"
    echo done > /tmp/logs/sllmgen.done ;;
  sllmduo)  # LLM_MINUTES DRAFT_MINUTES [dflash-train flags]: the speech LLM (taught on every other training clip), then its DFlash b8 and
    # DFlash2 b8 drafts at once (the sixth session's plan: longer drafts than sllmall's four, no adaptations)
    lm=$1; dm=$2
    bash /tmp/chains.sh sllm "$lm" --lr 3e-3 --lora_lr 1e-3 --warmup 50 --steps 4000 \
      || { echo "rc=sllm" > /tmp/logs/sllmduo.done; exit 1; }
    shift 2  # more dflash-train flags for both drafts (e.g. --max_steps, planned for the shared rate)
    bash /tmp/chains.sh sllmdraft sllm-dflash-b8 qwen2_audio "$dm" --block_size 8 "$@" &
    bash /tmp/chains.sh sllmdraft sllm-dflash2-b8 qwen2_audio "$dm" --block_size 8 --variant dflash2 "$@" &
    wait; echo done > /tmp/logs/sllmduo.done ;;
  timing)  # ITEM...: decoding timed alone (nothing else running), 40 samples each (32 prompts for t:), to /tmp/results/clean.
    # ITEM = w:NAME[:GRAPH] (a Whisper run of real_targets.py; GRAPH = auto|on|off, dflash-eval's --draft_cuda_graph;
    # the target's verify as dflash-eval's default: a CUDA graph on a GPU since the ninth session),
    # v:NAME (the verify as a graph explicitly: --verify_cuda_graph on; sv:NAME:FAMILY likewise for a speech-LLM draft),
    # c:NAME / sc:NAME:FAMILY (the growing-cache verify, --verify_cuda_graph off, for the comparison),
    # gb:NAME / sgb:NAME:FAMILY (benchmarks/greedy_baselines.py: beside static-cache greedy, compiled by transformers),
    # t:NAME (a text run: with prompt lookup), s:NAME:FAMILY (speech LLM), p:NAME[:GRAPH] (a Whisper run's per-phase
    # decode breakdown with CUDA events: benchmarks/decode_profile.py)
    mkdir -p /tmp/results/clean
    for item in "$@"; do
      IFS=: read -r k n fam <<< "$item"
      d=$C/runs/$n/draft; [ -d "$d" ] || d=$C/init/$n  # this session's run, else a carried one (`session.sh unpack drafts/NAME`)
      [ -d "$d" ] || { echo "timing: no draft $C/runs/$n/draft nor $C/init/$n; skipped"; continue; }
      g=${fam:-auto}; case $k in s|sv|sc|sgb) g=auto ;; esac
      case $k in
        w) whisper_eval "$d" --draft_cuda_graph "$g" --output_json /tmp/results/clean/$n-graph-$g.json ;;
        v) whisper_eval "$d" --verify_cuda_graph on --output_json /tmp/results/clean/$n-verify-graph.json ;;
        t) mv $C/runs/$n/eval_cuda_fp32.json $C/runs/$n/eval_cuda_fp32_shared.json 2>/dev/null
           $B eval $n --device cuda --precision fp32 --num_samples 32 && cp docs/results/quality_"$n"_* /tmp/results/clean/ ;;
        p) python3 benchmarks/decode_profile.py --target $C/whisper-base/hf --draft "$d" --data $SP/eval.json \
             --num_prompts 40 --max_new_tokens 128 --device cuda --precision fp32 --no_progress --draft_cuda_graph "$g" \
             --output_json /tmp/results/clean/decode_profile_$n-graph-$g.json ;;
        c) whisper_eval "$d" --verify_cuda_graph off --output_json /tmp/results/clean/$n-growing-cache.json ;;
        sc) sllm_eval "$d" "$fam" --verify_cuda_graph off --output_json /tmp/results/clean/sllm_$n-growing-cache.json ;;
        gb) python3 benchmarks/greedy_baselines.py --draft "$d" --target $C/whisper-base/hf --data $SP/eval.json \
             --num_samples 40 --device cuda --output_json /tmp/results/clean/greedy_baselines_$n.json ;;
        sgb) python3 benchmarks/greedy_baselines.py --draft "$d" --target $M/trained --family "$fam" \
             --prompt "Transcribe the audio." --data $SP/eval.json --num_samples 40 --device cuda \
             --output_json /tmp/results/clean/greedy_baselines_sllm_$n.json ;;
        sv) sllm_eval "$d" "$fam" --verify_cuda_graph on --output_json /tmp/results/clean/sllm_$n-verify-graph.json ;;
        s) sllm_eval "$d" "$fam" --output_json /tmp/results/clean/sllm_$n.json ;;
        *) echo "timing: unknown item $item (w:NAME, v:NAME, c:NAME, gb:NAME, t:NAME, s:NAME:FAMILY, sv:NAME:FAMILY, sc:NAME:FAMILY, sgb:NAME:FAMILY, p:NAME)" ;;
      esac > /tmp/logs/timing_${k}_${n}_$g.log 2>&1
    done; echo done > /tmp/logs/timing.done ;;
  trainrows)  # [ROW...]: issue 16's full training steps with the target's forward as a CUDA graph (and without), the
    # GPU tests of the graph and of FP8 first; rows: 17off 17graph 17cgraph wboff wbgraph 8bgraph 8bcgraph slcgraph
    # smoff smgraph (default: all but the SmolLM2 ones), 17fp8 8bfp8 slfp8: draft side and full step (compiled
    # target as a graph) with bf16 and with FP8 draft linears, one process per shape, and 17fp8lm 8bfp8lm slfp8lm:
    # the same with FP8 draft linears and the FP8 lm_head gradient (float8_lm_head) only. GPU_TESTS_K narrows the tests
    timeout 300 python3 -m pytest -q -m gpu tests/gpu/test_gpu.py -k "${GPU_TESTS_K:-target_forward_graph or prebuilt or synchron or float8}" \
      > /tmp/logs/gpu_tests.log 2>&1
    layers=(--modes full --steps 10 --full-configs attn=flex,ce=2048,compile=layers)
    for row in ${@:-17off 17graph 17cgraph wboff wbgraph 8bgraph 8bcgraph slcgraph}; do
      case $row in
        17*) shape=qwen3-1.7b ;; wb*) shape=whisper-base ;; 8b*) shape=qwen3-8b ;; sl*) shape=qwen3-1.7b-speechlike ;;
        sm*) shape=smollm2-135m ;;
        *) echo "trainrows: unknown row $row"; continue ;;
      esac
      case $row in *off) extra=(--target-cuda-graph off) ;; *cgraph) extra=(--compile-target) ;; *) extra=() ;; esac
      case $row in *fp8) extra=(--modes draft full --steps 10 --compile-target --configs attn=flex,ce=2048,compile=layers
        attn=flex,ce=2048,compile=layers,fp8=1 --full-configs attn=flex,ce=2048,compile=layers
        attn=flex,ce=2048,compile=layers,fp8=1) ;;
        *fp8lm) extra=(--modes draft full --steps 10 --compile-target --configs attn=flex,ce=2048,compile=layers,fp8=1,fp8lm=1
        --full-configs attn=flex,ce=2048,compile=layers,fp8=1,fp8lm=1) ;; esac  # (the later flags win)
      limit=420; case $row in *fp8) limit=900 ;; *fp8lm) limit=600 ;; esac  # cases compile in processes of their own
      timeout $limit python3 scripts/benchmark_train.py --shape $shape "${layers[@]}" "${extra[@]}" \
        --out /tmp/results/trainrows_$row.json > /tmp/logs/trainrows_$row.log 2>&1
    done; echo done > /tmp/logs/trainrows.done ;;
  f8q)  # [FP8 [STEPS [SEED]]]: FP8 (layers | lm_head | both) against bf16 on SmolLM2-135M (after `unpack smollm2`),
    # two dflash-train runs one after the other from the same seed on 20,000 corpus sentences
    # (benchmarks/float8_quality.py); chains of other seeds may run beside it (a 135M target leaves the GPU mostly idle;
    # with no loader workers the fourteenth session's runs waited half of each step for batches: 3 workers each)
    fp8=${1:-both}; steps=${2:-2000}; seed=${3:-42}; n=${fp8}_seed$seed
    python3 benchmarks/float8_quality.py --target $C/smollm2/hf --sentences $C/data/corpus/sentences.jsonl \
      --device cuda --fp8 "$fp8" --train 20000 --dev 256 --max_steps "$steps" --evals 10 --work /tmp/f8q_$n \
      --out /tmp/results/float8_quality_smollm2_h200_$n.json -- --max_tokens 8192 --num_anchors 64 --seed "$seed" \
      --dataloader_num_workers 3 \
      > /tmp/logs/f8q_$n.log 2>&1
    echo "rc=$?" > /tmp/logs/f8q_$n.done ;;
  f8lin)  # [SHAPE...]: where FP8 draft linears pay (scripts/benchmark_float8_linears.py: each projection bf16, FP8,
    # FP8 matmuls alone), then the 1.7B FP8 draft side under the profiler (its operator table: what quantizing costs)
    timeout 540 python3 scripts/benchmark_float8_linears.py --shape ${@:-qwen3-1.7b qwen3-8b qwen3-1.7b-speechlike} \
      --out /tmp/results/float8_linears.json > /tmp/logs/f8lin.log 2>&1; rc=$?
    timeout 300 python3 scripts/benchmark_train.py --shape qwen3-1.7b --modes draft --steps 10 --profile /tmp/results/f8lin_profile \
      --configs attn=flex,ce=2048,compile=layers,fp8=1,fp8lm=1 --out /tmp/results/f8lin_profile_17.json \
      > /tmp/logs/f8lin_profile.log 2>&1
    echo "rc=$rc profile_rc=$?" > /tmp/logs/f8lin.done ;;
  *) echo "unknown chain $kind (whisper, smol, qwen, sllm, sllmdraft, sllmall, sllmduo, sllmgen, timing, trainrows, f8q, f8lin)"; exit 2 ;;
esac

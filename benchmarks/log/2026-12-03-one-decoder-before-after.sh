#!/bin/bash
# before (ba4d601) / after (this session's HEAD) in alternating processes, same prompts and settings
for round in 2; do
  for v in before after; do
    if [ $v = before ]; then dir=/tmp/before; else dir=/tmp/after; fi
    cd $dir
    PYTHONPATH=$dir /work/main/.venv/bin/python scripts/bench.py --methods hf,baseline,treespec,treespec_lookup \
      --num-prompts 6 --max-new-tokens 96 --dtype float32 --lookup 4 --tree /work/main/heads/smollm2-135m-instruct --out /tmp/ba/one-$v-$round.json > /tmp/ba/one-$v-$round.log 2>&1
    PYTHONPATH=$dir /work/main/.venv/bin/python scripts/bench_batch.py --batch-sizes 4 --num-prompts 8 \
      --max-new-tokens 64 --dtype float32 --tree /work/main/heads/smollm2-135m-instruct --methods hf,plain,treespec,treespec_auto --out /tmp/ba/batch-$v-$round.json > /tmp/ba/batch-$v-$round.log 2>&1
  done
done
echo done > /tmp/ba/finished

#!/bin/bash
# Short comparison runs (same data order and settings except the one named), after the main run.
set -e
D=data/distill/smollm2-135m-instruct
C=runs/eagle-cache
PY=.venv/bin/python
while [ ! -f runs/eagle-ttt5/training.json ]; do sleep 20; done
COMMON="--data $D --cache $C --max-steps ${STEPS:-60} --warmup-steps 10 --lr 1e-3 --eval-every 60 --checkpoint-every 30 --batch-tokens 2048"
$PY scripts/train_eagle.py $COMMON --out runs/cmp-ttt5 --resume
$PY scripts/train_eagle.py $COMMON --out runs/cmp-ttt1 --ttt-steps 1 --resume
$PY scripts/train_eagle.py $COMMON --out runs/cmp-last --feature-layers 30 --resume
$PY scripts/train_eagle.py $COMMON --out runs/cmp-small --max-sequences 100 --resume

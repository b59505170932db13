#!/bin/bash
# EAGLE drafter study on the committed distillation data (1,425 training prompts); features cached once.
set -e
D=data/distill/smollm2-135m-instruct
C=runs/eagle-cache
PY=.venv/bin/python
COMMON="--data $D --cache $C --max-steps ${STEPS:-300} --eval-every 100 --checkpoint-every 50 --batch-tokens 2048"
$PY scripts/train_eagle.py $COMMON --out runs/eagle-ttt5 --resume
$PY scripts/train_eagle.py $COMMON --out runs/eagle-ttt1 --ttt-steps 1 --resume
$PY scripts/train_eagle.py $COMMON --out runs/eagle-last --feature-layers 30 --resume
$PY scripts/train_eagle.py $COMMON --out runs/eagle-half --max-sequences 712 --resume

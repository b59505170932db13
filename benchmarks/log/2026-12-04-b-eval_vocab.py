"""Held-out chain acceptance (teacher-forced) of drafter folders, as the trainer evaluates: eval split of
the greedy distillation data, features of the bf16 target."""
import sys, json, torch
from pathlib import Path
from treespec.drafters.eagle_model import EagleDraftModel
from treespec.training.eagle_train import cached_features, evaluate
from treespec.tools.models import load_model
model, _ = load_model(None, dtype="bfloat16")
layers = [2, 15, 27]
store = cached_features(model, "data/distill/smollm2-135m-instruct", Path("runs/eagle-cache"), "eval", layers, 512)
embed = model.get_input_embeddings().weight.detach().float()
W = model.get_output_embeddings().weight.detach().float()
for folder in sys.argv[1:]:
    d = EagleDraftModel.from_pretrained(folder, model=model, dtype=torch.float32)
    with torch.no_grad():
        r = evaluate(d, store, embed, W[d.draft_vocab], 5)
    print(folder, d.draft_vocab_size, "acc", [round(a, 4) for a in r["acceptance"]], "E", round(r["expected_accept_length"], 4), "by chain", [round(x, 3) for x in r["expected_accept_length_by_chain"]], "anchors", r["anchors"], flush=True)

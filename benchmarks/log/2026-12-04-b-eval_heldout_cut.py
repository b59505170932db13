"""Held-out teacher-forced acceptance with answers cut to their first N tokens (vs whole 256)."""
import glob, sys, torch
from safetensors.torch import load_file
from treespec.drafters.eagle_model import EagleDraftModel
from treespec.training.eagle_train import evaluate
from treespec.tools.models import load_model
model, _ = load_model(None, dtype="bfloat16")
s = load_file(glob.glob("runs/eagle-cache/features-eval-*.safetensors")[0])
embed = model.get_input_embeddings().weight.detach().float()
W = model.get_output_embeddings().weight.detach().float()
d = EagleDraftModel.from_pretrained("heads/smollm2-135m-instruct-eagle", model=model, dtype=torch.float32)
starts, pl = s["starts"].tolist(), s["prompt_lengths"].tolist()
for lo, hi in [(0, 128), (128, 10**6)]:
    keep = []
    for i in range(len(pl)):
        a, b = starts[i], min(starts[i + 1], starts[i] + pl[i] + hi)
        keep.append((a, b, pl[i]))
    cut = {}
    for k, v in s.items():
        if k in ("starts", "prompt_lengths"):
            continue
        cut[k] = torch.cat([v[a:b] for a, b, _ in keep])
    cut["starts"] = torch.tensor([0] + torch.tensor([b - a for a, b, _ in keep]).cumsum(0).tolist())
    cut["prompt_lengths"] = torch.tensor([p + lo for _, _, p in keep])  # answer positions from lo on
    with torch.no_grad():
        r = evaluate(d, cut, embed, W[d.draft_vocab], 5)
    print(f"answer tokens [{lo}, {hi})", [round(a, 3) for a in r["acceptance"]], "E", round(r["expected_accept_length"], 3), "anchors", r["anchors"], flush=True)

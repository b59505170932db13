"""Experiment: extend the shipped EAGLE drafter's draft vocabulary with the target's own output rows."""
import sys, torch
import treespec
from treespec.drafters.eagle_model import EagleDraftModel
from treespec.training.heads_train import draft_vocabulary
from treespec.tools.models import load_model
model, _ = load_model(None, dtype="float32")
src = "heads/smollm2-135m-instruct-eagle"
d = EagleDraftModel.from_pretrained(src, model=model, dtype=torch.float32)
W = model.get_output_embeddings().weight.detach()
rows = W[d.draft_vocab]
cos = torch.nn.functional.cosine_similarity(d.lm_head.weight, rows, dim=1)
ratio = d.lm_head.weight.norm(dim=1) / rows.norm(dim=1)
print("drift: cos mean %.3f min %.3f; norm ratio mean %.3f" % (cos.mean(), cos.min(), ratio.mean()))
for size in map(int, sys.argv[1:]):
    have = set(d.draft_vocab.tolist())
    extra = []
    for data in ("data/distill/smollm2-135m-instruct", "data/distill/smollm2-135m-instruct-sampled-t0.8-s1"):
        for t in draft_vocabulary(data, size, W.shape[0]).tolist():
            if t not in have and t not in extra:
                extra.append(t)
    vocab = torch.cat([d.draft_vocab, torch.tensor(extra[: size - len(have)])])
    fields = {k: v for k, v in d.config.items() if k not in ("format", "version", "dtype")}
    fields["draft_vocab_size"] = len(vocab)
    e = EagleDraftModel(**fields, dtype=torch.float32)
    state = {k: v for k, v in d.state_dict().items() if k not in ("lm_head.weight", "draft_vocab")}
    e.load_state_dict(state, strict=False)
    with torch.no_grad():
        e.draft_vocab.copy_(vocab)
        e.lm_head.weight.copy_(torch.cat([d.lm_head.weight, W[vocab[len(have):]] * ratio.mean()]))
    e.tree = d.tree
    e.save_pretrained(f"runs/eagle-v{size}")
    print(size, len(vocab))

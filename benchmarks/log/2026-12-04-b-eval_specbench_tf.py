"""Teacher-forced chain acceptance of the EAGLE drafter on a bench run's prompts + greedy answers
(evaluation only), beside the held-out ShareGPT figure."""
import sys, json, torch
from treespec.drafters.eagle_model import EagleDraftModel
from treespec.training.eagle_train import evaluate
from treespec.tools.models import load_model
from treespec.tools.workloads import load_questions, select_prompts
from treespec.tools.models import default_data_file
import treespec
model, tok = load_model(None, dtype="bfloat16")
layers, last = [2, 15, 27], model.config.num_hidden_layers
run = json.load(open(sys.argv[1]))
qs = {q["question_id"]: q for q in load_questions(default_data_file())}
seqs, plens, cats = [], [], []
for p in run["prompts"]:
    prompt = treespec.encode_prompt(qs[p["question_id"]]["turns"][0], tok)
    seqs.append(torch.tensor(list(prompt) + p["methods"]["baseline"]["token_ids"])); plens.append(len(prompt)); cats.append(p["category"])
def store_of(idx):
    st = {f"layer{k}": [] for k in layers + [last]}; st["lse"], st["greedy"], toks = [], [], []
    with torch.no_grad():
        for i in idx:
            out = model.base_model(input_ids=seqs[i][None], output_hidden_states=True)
            logits = model.get_output_embeddings()(out.last_hidden_state).float()[0]
            for k in layers + [last]:
                st[f"layer{k}"].append(out.hidden_states[k][0].to(torch.bfloat16))
            st["lse"].append(logits.logsumexp(-1)); st["greedy"].append(logits.argmax(-1)); toks.append(seqs[i])
    st = {k: torch.cat(v) for k, v in st.items()}
    st["tokens"] = torch.cat(toks)
    st["starts"] = torch.tensor([0] + torch.tensor([len(seqs[i]) for i in idx]).cumsum(0).tolist())
    st["prompt_lengths"] = torch.tensor([plens[i] for i in idx])
    return st
embed = model.get_input_embeddings().weight.detach().float()
W = model.get_output_embeddings().weight.detach().float()
d = EagleDraftModel.from_pretrained(sys.argv[2] if len(sys.argv) > 2 else "heads/smollm2-135m-instruct-eagle", model=model, dtype=torch.float32)
with torch.no_grad():
    r = evaluate(d, store_of(range(len(seqs))), embed, W[d.draft_vocab], 5)
    print("all", [round(a, 3) for a in r["acceptance"]], "E", round(r["expected_accept_length"], 3), "anchors", r["anchors"])
    for c in dict.fromkeys(cats):
        r = evaluate(d, store_of([i for i in range(len(seqs)) if cats[i] == c]), embed, W[d.draft_vocab], 5)
        print(f"{c:16s}", [round(a, 3) for a in r["acceptance"][:3]], "E", round(r["expected_accept_length"], 3))

# Ran at commit 660e87e (issue 4); training/features.py was replaced by training/store.py + the online trainer in issue 16.
"""One-off: add teacher-forced ShareGPT conversations (target labels) to a cached data.pt."""
import random, sys, time, torch
from diffspec.target import Target
from diffspec.training.data import load_corpus, drop_evaluation_overlap, evaluation_prompts
from diffspec.training.features import render_conversation, extract_features
src, dst, first, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
t = Target.load(None, quiet=True)
convs = load_corpus("sharegpt")
convs, dropped = drop_evaluation_overlap(convs, evaluation_prompts())
random.Random(0).shuffle(convs)
teacher = [render_conversation(t.tokenizer, c, 384) for c in convs[first:first + count]]
teacher = [(i, s) for i, s in teacher if len(i) - s > 8]
t0 = time.time()
feats = extract_features(t.model, teacher, [1, 14, 27], batch_size=8, pad_id=t.tokenizer.pad_token_id or 0,
                         progress=lambda i, n: print(i, n, round(time.time() - t0), flush=True) if i % 80 == 0 else None)
data = torch.load(src, weights_only=False)
data["train"] += [f.to_dict() for f in feats]
data["stats"]["teacher_forced_sequences"] += len(teacher)
data["stats"]["teacher_forced_tokens"] += sum(len(i) - s for i, s in teacher)
data["stats"]["note"] = f"teacher-forced conversations {first}..{first + count} added by augment"
torch.save(data, dst)
print("done", len(teacher), sum(len(i) - s for i, s in teacher), round(time.time() - t0))

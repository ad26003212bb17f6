# Runs the CUDA-only tests of tests/test_batch_step.py on a CPU (from the repository root): .cuda() a no-op, the
# eager stand-in for the graphs, `graph` (and `auto`) accepted as on a CUDA model. Checks the tests themselves
# before a lease runs them; the graphs need CUDA.
import sys, torch
sys.path.insert(0, "tests")
import test_batch_step as T
from diffspec.training import batch_step
from conftest import make_tokenizer
torch.nn.Module.cuda = lambda self, *a, **k: self
batch_step.record = T.eager_record
real = batch_step.choose_kind
batch_step.choose_kind = lambda kind, m: "graph" if kind in ("graph", "auto") else real(kind, m)
tok = make_tokenizer()
T.test_cuda_graph_steps_give_the_model_forwards_answers(tok)
print("answers ok")
for dt in (torch.float32, torch.bfloat16):
    T.test_cuda_graph_step_logits_in_the_models_dtype(tok, dt)
    print(dt, "ok")

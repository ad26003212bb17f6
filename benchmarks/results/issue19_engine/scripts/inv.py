import torch, torch.nn.functional as F
torch.set_num_threads(2)
for n, k in ((49152, 576), (1536, 576), (576, 1536), (192, 576), (576, 576)):
    W = torch.randn(n, k)
    X = torch.randn(70, k)
    ref2 = torch.mm(W, X[:2].t()).t()[0]
    lin1 = F.linear(X[:1], W)[0]
    out = []
    for M in (2, 3, 4, 5, 6, 8, 9, 10, 12, 16, 17, 32, 33, 64, 65):
        y = torch.mm(W, X[:M].t()).t()[0]
        out.append(f"{M}:{'=' if torch.equal(y, ref2) else 'x'}")
    ylin = [f"{M}:{'=' if torch.equal(F.linear(X[:M], W)[0], lin1) else 'x'}" for M in (2, 3, 5, 9, 17)]
    print(n, k, "mm row0 vs M=2:", " ".join(out), "| mm2 vs linear1:", torch.equal(ref2, lin1), "| linear rows:", " ".join(ylin))

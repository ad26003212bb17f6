"""Which way of asking one row as a two-column mm gives outputs bitwise equal to the rows of 2- and
3-row mm(W, x^T): expand (stride-0 view), cat (a copy), x^T expanded. 1 and 2 threads."""
import torch
for threads in (1, 2):
    torch.set_num_threads(threads)
    for n, k in ((300, 64), (64, 200), (49152, 576), (1536, 576), (576, 1536), (192, 576), (70, 32), (64,32)):
        W = torch.randn(n, k); X = torch.randn(4, k)
        e = torch.mm(W, X[:1].expand(2, -1).t())[:, 0]
        c = torch.mm(W, torch.cat([X[:1], X[:1]]).t())[:, 0]
        c2 = torch.mm(W, X[:1].t().expand(-1, 2))[:, 0]
        print(threads, n, k, "expand", [torch.equal(e, torch.mm(W, X[:m].t())[:, 0]) for m in (2, 3)],
              "cat", [torch.equal(c, torch.mm(W, X[:m].t())[:, 0]) for m in (2, 3)], "c2",  [torch.equal(c2, torch.mm(W, X[:m].t())[:, 0]) for m in (2, 3)])

"""Copy fused_layers.c (+ the kernels it includes) from SRC to DST with timers: the four products, the attention
loop, the whole layer loop (diffspec_timers() -> double[3], seconds accumulated)."""
import re, shutil, sys
src, dst = sys.argv[1], sys.argv[2]
for f in ("fused_layers.c", "packed_linear.c", "q8_linear.c"):
    shutil.copy(f"{src}/{f}", f"{dst}/{f}")
s = open(f"{dst}/fused_layers.c").read()
s = s.replace('#define MAX_HEAD_DIM 256', '#define MAX_HEAD_DIM 256\ndouble diffspec_t[4];\ndouble *diffspec_timers(void){return diffspec_t;}\n'
              '#define TIC(i) double _t##i = omp_get_wtime();\n#define TOC(i,k) diffspec_t[k] += omp_get_wtime() - _t##i;\n', 1)
b = s.index('void diffspec_fused_layers(')
head, body = s[:b], s[b:]
e = body.index('/* make-data')
fl, rest = body[:e], body[e:]
n = [0]
def wrap(m):
    n[0] += 1
    return f'        {{ TIC(L{n[0]}) {m.group(0).strip()} TOC(L{n[0]},0) }}'
fl = re.sub(r'        linear\([^;]*;', wrap, fl, flags=re.S)
fl = fl.replace('#pragma omp parallel for schedule(static) num_threads(threads) if (n * H * positions > 1024)',
                'TIC(A)\n#pragma omp parallel for schedule(static) num_threads(threads) if (n * H * positions > 1024)')
fl = fl.replace('                   att + (i * H + j) * hd);\n        }', '                   att + (i * H + j) * hd);\n        }\n        TOC(A,1)')
fl = fl.replace('    for (int64_t l = 0; l < L; l++) {', '    TIC(W)\n    for (int64_t l = 0; l < L; l++) {', 1)
fl = fl.replace('        if (hidden) memcpy(hidden + l * n * D, h, n * D * sizeof(float));\n    }',
                '        if (hidden) memcpy(hidden + l * n * D, h, n * D * sizeof(float));\n    }\n    TOC(W,2)')
assert n[0] == 4 and fl.count("TOC(") == 6
if "diffspec_fused_elementwise_check" not in rest + head:  # an older source: the symbol fused_layers.py declares
    rest += "\nvoid diffspec_fused_elementwise_check(void) {}\n"
open(f"{dst}/fused_layers.c", "w").write(head + fl + rest)

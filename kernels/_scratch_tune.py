# temporary tuning script (removed before hand-off)
import functools, sys, importlib.util, torch, triton
from kernels.moe_dense import _moe_gemv_kernel, _prep
from kernels.expert_formats import FMT_CODES

spec = importlib.util.spec_from_file_location("b", "bench/moe_layer.py")
b = importlib.util.module_from_spec(spec)
spec.loader.exec_module(b)
dev = torch.device("cuda")
H, E, K, F = 2048, 128, 8, 768
for fmt in ["bf16", "q8_0"]:
    w = b.make_experts(E, F, H, fmt, dev)
    for T in [1, 4]:
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        routes = [b.routing(T, E, K, i, dev) for i in range(8)]
        ids, tw = routes[0][0].clone(), routes[0][1].clone()
        timer = b.Timer(dev, routes, ids, tw)
        _, _, _, rb, _, _ = _prep(x, w, fmt, ids, tw, "silu")
        y = torch.zeros(T, H, device=dev)
        g = torch.empty(T * K, F, device=dev)
        nbytes = T * K * F * 3 * (rb * (2 if fmt == "bf16" else 1))
        for gate_only in [True, False]:
            res = []
            for bn, bh, nw, a2 in [
                (c[0], c[1], c[2], a)
                for c in [
                    (4, 512, 4),
                    (4, 256, 2),
                    (8, 512, 2),
                    (8, 256, 4),
                    (16, 512, 2),
                    (16, 256, 4),
                    (16, 512, 4),
                    (8, 1024, 4),
                    (4, 1024, 4),
                    (32, 256, 4),
                ]
                for a in (False, True)
            ]:
                if True:
                    if True:

                        def fn(bn=bn, bh=bh, nw=nw, a2=a2):
                            _moe_gemv_kernel[(T * K, triton.cdiv(F, bn))](
                                x,
                                w,
                                ids,
                                tw,
                                g if gate_only else y,
                                H,
                                F,
                                rb,
                                K,
                                x.stride(0),
                                FMT=FMT_CODES[fmt],
                                ACT=0,
                                GATE_ONLY=gate_only,
                                BLOCK_N=bn,
                                BLOCK_H=bh,
                                num_warps=nw,
                                ACC2D=a2,
                            )

                        try:
                            t, _ = timer(fn, 20)
                        except Exception as ex:
                            print("fail", bn, bh, nw, ex)
                            continue
                        by = nbytes / (3 if gate_only else 1)
                        res.append((t * 1e6, bn, bh, nw, by / t / 1e9, a2))
            res.sort()
            print(
                fmt,
                "T",
                T,
                "gate_only" if gate_only else "fused",
                [
                    f"{r[0]:.1f}us bn{r[1]} bh{r[2]} w{r[3]} {r[4]:.0f}GB/s a{int(r[5])}"
                    for r in res[:6]
                ],
                "worst",
                f"{res[-1][0]:.1f}",
                flush=True,
            )

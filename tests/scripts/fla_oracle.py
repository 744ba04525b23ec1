#!/usr/bin/env python3
"""Independent oracle for lt2's linear-recurrence ops: flash-linear-attention's naive PyTorch
references (pip package flash-linear-attention / fla-core), run on the CPU.

Usage: fla_oracle.py OUT_DIR
Writes OUT_DIR/<case>.pt, each a dict of input tensors and fla's outputs, all stored as float64
(o, and ht = final state where the reference returns one), via torch.save. Inputs come from a
fixed seed. fla's references compute in fp32, so callers compare at fp32 accuracy.
Exit code 2 (and a message) when fla cannot be imported here.
"""
import os
import sys
import warnings

try:
    import torch
    import torch.nn.functional as F
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fla.ops.delta_rule.naive import delta_rule_recurrence
        from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
        from fla.ops.gla.naive import naive_recurrent_gla
        from fla.ops.kda.naive import naive_recurrent_kda
        from fla.ops.linear_attn.naive import naive_recurrent_linear_attn
        from fla.ops.retention.naive import naive_retention
        from fla.ops.simple_gla.naive import naive_recurrent_simple_gla
except Exception as e:  # fla missing, or it needs something this machine lacks
    print(f"fla_oracle: flash-linear-attention naive references unavailable: {e!r}", file=sys.stderr)
    sys.exit(2)

B, T, H, K, V = 2, 37, 3, 8, 6


def inputs(seed, heads_v=H):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    # fla's references run in fp32: hand them fp32 inputs, and save those same values (exactly
    # representable in float64) for lt2's float64 reference.
    return {name: t.float() for name, t in dict(
        q=r(B, T, H, K),
        k=F.normalize(r(B, T, H, K), dim=-1),
        v=r(B, T, heads_v, V),
        beta=torch.sigmoid(r(B, T, heads_v)),
        g_head=-F.softplus(r(B, T, heads_v)),
        g_channel=-F.softplus(r(B, T, heads_v, K)) * 0.5,
        h0=r(B, heads_v, K, V),
    ).items()}


def to_bhtd(x):
    return x.transpose(1, 2).contiguous()


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    scale = K ** -0.5
    cases = {}

    x = inputs(1)
    o, ht = naive_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["beta"], x["g_head"], scale,
                                             x["h0"], True)
    cases["gated_delta_rule"] = dict(q=x["q"], k=x["k"], v=x["v"], beta=x["beta"], g=x["g_head"],
                                     h0=x["h0"], o=o, ht=ht)

    x = inputs(2, heads_v=2 * H)  # grouped value heads: value head i reads q/k head i // 2
    o, ht = naive_recurrent_kda(x["q"], x["k"], x["v"], x["g_channel"], x["beta"], scale, x["h0"], True)
    cases["kda_gva"] = dict(q=x["q"], k=x["k"], v=x["v"], beta=x["beta"], g=x["g_channel"], h0=x["h0"],
                            o=o, ht=ht)

    x = inputs(3)
    o, ht = delta_rule_recurrence(to_bhtd(x["q"]), to_bhtd(x["k"]), to_bhtd(x["v"]), to_bhtd(x["beta"]),
                                  x["h0"], True)
    cases["delta_rule"] = dict(q=x["q"], k=x["k"], v=x["v"], beta=x["beta"], h0=x["h0"],
                               o=to_bhtd(o), ht=ht)

    x = inputs(4)
    o, ht = naive_recurrent_gla(x["q"], x["k"], x["v"], x["g_channel"], x["h0"], True)
    cases["gla"] = dict(q=x["q"], k=x["k"], v=x["v"], g=x["g_channel"], h0=x["h0"], o=o, ht=ht)

    x = inputs(5)
    o, ht = naive_recurrent_simple_gla(x["q"], x["k"], x["v"], x["g_head"], scale, x["h0"], True)
    cases["simple_gla"] = dict(q=x["q"], k=x["k"], v=x["v"], g=x["g_head"], h0=x["h0"], o=o, ht=ht)

    x = inputs(6)
    o = naive_retention(to_bhtd(x["q"]), to_bhtd(x["k"]), to_bhtd(x["v"]))
    cases["retention"] = dict(q=x["q"], k=x["k"], v=x["v"], o=to_bhtd(o))

    x = inputs(7)
    o, ht = naive_recurrent_linear_attn(x["q"], x["k"], x["v"], scale, x["h0"], True)
    cases["linear_attn"] = dict(q=x["q"], k=x["k"], v=x["v"], h0=x["h0"], o=o, ht=ht)

    for name, tensors in cases.items():
        torch.save({k: t.detach().double().contiguous() for k, t in tensors.items()},
                   os.path.join(out_dir, name + ".pt"))
    print(f"fla_oracle: wrote {len(cases)} cases to {out_dir}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(1)
    main(sys.argv[1])

#!/usr/bin/env python3
"""flash-linear-attention (fla) 0.6.0 as the peer of bench/mixer_bench: one delta-rule layer, or
its chunked kernel alone, forward and forward + backward, on the GPU, one JSON line per run
("RESULT {...}", the fields of mixer_bench's).

  fla_peer.py --what layer,core --mixer gdn,kda --shape 8x4096,1x32768 \
      [--hidden 2048 --heads 16 --head-k 96 --head-v 192] [--iters 10]
  fla_peer.py --what layer --mixer gla,retnet,hgrn2,linear --shape 8x4096
  fla_peer.py --what core --mixer mamba2,linear,gla --shape 8x4096 --head-k 128 --head-v 128
  fla_peer.py --what layer --mixer gdn --shape 8x4096 --precision bf16,autocast

Every combination runs in one process, so Triton's autotuning of a kernel is paid once.

The layer is fla's GatedDeltaNet / KimiDeltaAttention / DeltaNet in bf16 (--precision bf16) or in
fp32 under bf16 autocast (--precision autocast, the regime mixer_bench runs lt2's layer in, and a
mixed-precision training run's: the input cast to bf16 for the projections, the input's gradient and
the weights' in fp32) with a short convolution
and (GDN) the output gate, d = hidden, or its GatedLinearAttention / MultiScaleRetention /
HGRN2Attention / LinearAttention at the dims of lt2's mixer of that name; the core is chunk_gated_delta_rule / chunk_kda /
chunk_delta_rule on bf16 q, k (unit rows), v, fp32 gates, as mixer_bench --core times ours; for the
gated linear family chunk_simple_gla (mamba2: one decay per head; linear: none) and chunk_gla (gla: one
per key channel) on bf16 q, k, v and fp32 gates, as mixer_bench --core --mixer mamba2|linear|gla.

Two things this stack needs, both recorded in the output:
- fla.layers imports names from `transformers`, which the GPU machine lacks: a stand-in module
  supplies the few names the imports need (logging, Unpack, ACT2FN), and fla.models (its model
  zoo, unused here) is marked absent.
- fla refuses its gated backward on Hopper with Triton < 3.7.1 (its issue #640: wrong gradients).
  For timing only, the guard is lifted and those rows carry "fla_gated_bwd_guard_lifted": true.
Triton autotunes every new shape on first use (minutes): each configuration is run once
untimed before timing.
"""
import argparse
import json
import logging
import math
import sys
import time
import types

import torch


def install_transformers_stand_in():
    if "transformers" in sys.modules:
        return
    names = {
        "transformers": {},
        "transformers.utils": {"logging": logging, "is_torch_npu_available": lambda: False},
        "transformers.utils.logging": {"get_logger": logging.getLogger},
        "transformers.utils.versions": {"require_version": lambda *a, **k: None},
        "transformers.processing_utils": {"Unpack": object},
        "transformers.activations": {"ACT2FN": {"silu": torch.nn.functional.silu, "swish": torch.nn.functional.silu,
                                                "sigmoid": torch.sigmoid}},
        "transformers.modeling_utils": {"_init_weights": True},
        "transformers.generation": {"GenerationMixin": object},
    }
    for name, attrs in names.items():
        module = types.ModuleType(name)
        for k, v in attrs.items():
            setattr(module, k, v)
        sys.modules[name] = module
    logging.get_logger = logging.getLogger  # transformers.utils.logging.get_logger via the stand-in
    sys.modules["fla.models"] = None  # the model zoo needs the real transformers; fla treats it as absent


def time_ms(run, backward, iters):
    """Mean milliseconds of run(backward) over `iters` calls, and the seconds of the first call
    (Triton's autotuning of a new shape)."""
    warm_start = time.time()
    run(backward)
    torch.cuda.synchronize()
    warm = time.time() - warm_start
    for _ in range(2):
        run(backward)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        run(backward)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters, warm


def make_layer(mixer, hidden, H, K, V):
    """fla's layer for an lt2 mixer, at the dims lt2's mixer takes by default at d = hidden and H heads
    (mixers/*.cpp): the delta-rule family at head dims K and V; GLA (expand_k 0.5, expand_v 1),
    RetNet (expand_k 1, expand_v 2) and linear attention (elu + 1 features, expand 1) with H heads;
    HGRN2 at d / 128 heads."""
    import fla.layers as L
    if mixer in ("gdn", "kda", "deltanet"):
        cls = {"gdn": L.GatedDeltaNet, "kda": L.KimiDeltaAttention, "deltanet": L.DeltaNet}[mixer]
        return cls(hidden_size=hidden, head_dim=K, num_heads=H, expand_v=V / K, mode="chunk")
    if mixer == "gla":
        return L.GatedLinearAttention(mode="chunk", hidden_size=hidden, num_heads=H, expand_k=0.5, expand_v=1.0)
    if mixer == "retnet":
        return L.MultiScaleRetention(mode="chunk", hidden_size=hidden, num_heads=H, expand_k=1.0, expand_v=2.0)
    if mixer == "hgrn2":
        return L.HGRN2Attention(mode="chunk", hidden_size=hidden, num_heads=max(1, hidden // 128))
    if mixer == "linear":
        return L.LinearAttention(mode="chunk", hidden_size=hidden, num_heads=H, feature_map="elu")
    raise SystemExit(f"fla_peer: no fla layer for mixer {mixer!r}")


def layer_params(run):
    """Parameters of the layer a layer run closes over."""
    return sum(p.numel() for p in run.layer.parameters())


def make_run(what, mixer, B, T, hidden, H, K, V, precision="bf16"):
    """The function that runs one forward (and backward) of the layer or the core. The layer in
    `precision` bf16 (weights and input) or autocast (fp32 weights and input, the forward under bf16
    autocast: mixer_bench's regime, and a training run's)."""
    dev = torch.device("cuda")
    bf16 = dict(device=dev, dtype=torch.bfloat16)
    if what == "layer":
        dtype = torch.float32 if precision == "autocast" else torch.bfloat16
        layer = make_layer(mixer, hidden, H, K, V).to(device=dev, dtype=dtype)
        x = torch.randn(B, T, hidden, device=dev, dtype=dtype, requires_grad=True)

        def run(backward):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "autocast"):
                y = layer(x)[0]
            if backward:
                y.float().square().mean().backward()
        run.layer = layer
        return run
    from fla.ops.delta_rule import chunk_delta_rule
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.gla import chunk_gla
    from fla.ops.kda import chunk_kda
    from fla.ops.simple_gla import chunk_simple_gla
    gated = mixer in ("mamba2", "gla", "linear")  # the gated linear family: no beta, keys as drawn
    if not gated and mixer not in ("gdn", "kda", "deltanet"):
        raise SystemExit(f"fla_peer: no fla kernel for --what core --mixer {mixer!r}")
    k = torch.randn(B, T, H, K, **bf16)
    inputs = dict(q=torch.randn(B, T, H, K, **bf16), k=k if gated else k / k.norm(dim=-1, keepdim=True),
                  v=torch.randn(B, T, H, V, **bf16))
    if not gated:
        inputs["beta"] = torch.rand(B, T, H, **bf16)
    if mixer in ("gdn", "mamba2"):
        inputs["g"] = -torch.rand(B, T, H, device=dev)
    elif mixer in ("kda", "gla"):
        inputs["g"] = -torch.rand(B, T, H, K, device=dev)
    for t in inputs.values():
        t.requires_grad_(True)
    fn = {"gdn": chunk_gated_delta_rule, "kda": chunk_kda, "deltanet": chunk_delta_rule, "mamba2": chunk_simple_gla,
          "linear": chunk_simple_gla, "gla": chunk_gla}[mixer]

    def run(backward):
        o = fn(**inputs, scale=1.0 / math.sqrt(K))[0]
        if backward:
            o.float().square().mean().backward()
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--what", default="layer,core", help="comma-separated: layer, core")
    ap.add_argument("--mixer", default="gdn",
                    help="comma-separated: gdn, kda, deltanet, gla, linear (layer and core); retnet, hgrn2 "
                         "(layer); mamba2 (core)")
    ap.add_argument("--shape", default="8x4096,1x32768", help="comma-separated BATCHxSEQ")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-k", type=int, default=96)
    ap.add_argument("--head-v", type=int, default=192)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--precision", default="bf16",
                    help="comma-separated, for the layer: bf16 (bf16 weights and input) or autocast (fp32 weights "
                         "and input, the forward under bf16 autocast, as mixer_bench runs lt2's layer)")
    a = ap.parse_args()

    install_transformers_stand_in()
    import fla
    import fla.ops.common.chunk_o as chunk_o
    guard_lifted = not chunk_o.TRITON_ABOVE_3_7_1
    chunk_o.TRITON_ABOVE_3_7_1 = True

    runs = [(mixer, what, shape, precision) for mixer in a.mixer.split(",") for what in a.what.split(",")
            for shape in a.shape.split(",") for precision in (a.precision.split(",") if what == "layer" else ["bf16"])]
    for mixer, what, shape, precision in runs:
        B, T = (int(x) for x in shape.split("x"))
        run = make_run(what, mixer, B, T, a.hidden, a.heads, a.head_k, a.head_v, precision)
        with torch.no_grad():
            fwd, warm_fwd = time_ms(run, False, a.iters)
        fwd_bwd, warm_bwd = time_ms(run, True, a.iters)
        row = {"peer": f"fla {getattr(fla, '__version__', '?')}", "what": what, "mixer": mixer, "batch": B,
               "seq": T, "heads": a.heads, "head_k": a.head_k, "head_v": a.head_v,
               "hidden": a.hidden if what == "layer" else None, "precision": precision, "forward_ms": fwd,
               "params": layer_params(run) if what == "layer" else None,
               "forward_backward_ms": fwd_bwd, "tokens_per_s_fwd_bwd": B * T / (fwd_bwd / 1000),
               "autotune_s": round(warm_fwd + warm_bwd, 1),
               "fla_gated_bwd_guard_lifted": guard_lifted and mixer not in ("deltanet", "linear")}
        print("RESULT " + json.dumps(row), flush=True)
        del run
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

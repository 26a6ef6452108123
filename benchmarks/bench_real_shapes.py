"""Real-shape GPU benchmark: the paper profile's code paths at Qwen3.5-4B shapes, random weights.

    . scripts/offline_env.sh && python3 benchmarks/bench_real_shapes.py --out results.json [--only qad,drafter,decode]

Sections (each prints a markdown table with medians and the ratio to the hardware ceiling measured first):
  ceiling  device-to-device copy bandwidth and a bf16 8192^3 GEMM on this GPU
  gdn      the Gated-DeltaNet kernel alone, forward + backward at seq --qad-seq: flash-linear-attention against
           transformers' pure-PyTorch fallback (agreement with a float32 reference, ms per layer call, memory)
  qad      one QAD optimiser step (eqc_utils.quant: modelopt INT4 g32 grid on the 200 paper modules, pinned
           _amax, chunked per-token KL to a frozen teacher, gradient checkpointing, bf16, AdamW) at seq
           4096 / 8192 / 16384, micro-batch 1: step time, tokens/s, peak memory, model-FLOP utilisation;
           plus the full-logits KL at the shortest length to show what chunking saves; --qad-profile adds the
           operators that take the longest step's GPU time, summed by kernel class. The student's INT4 forward and
           compile follow params/paper.yaml's qad.fake_quant / qad.compile (--qad-fake-quant, --qad-compile to choose)
  drafter  one DFlash training step (eqc_utils.drafter: 5 layers, block 16, 512 anchors, flex_attention,
           target features captured online) vs sequence length: tokens/s and peak memory
  decode   the reference decoder's pieces: a 1-token and a 16-token target verify step with a KV/recurrent
           cache at 1K and 8K context, and the drafter's block pass at 1K/8K context with and without SWA 1024
Needs CUDA; exits with a message without it. Random weights: timings are real, outputs are meaningless.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

QWEN35_4B = dict(  # docs/models_and_data.md: the Qwen3.5-4B text config
    vocab_size=248320, hidden_size=2560, intermediate_size=9216, num_hidden_layers=32,
    num_attention_heads=16, num_key_value_heads=4, head_dim=256, linear_conv_kernel_dim=4,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
    max_position_embeddings=32768, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
)


def cuda_time(fn, repeats: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def table(title: str, rows: list[dict]) -> str:
    if not rows:
        return f"\n### {title}\n(no rows)\n"
    # rows may differ (gdn: agreement only at the first length); nested results (top_ops) stay in the JSON only
    keys = list(dict.fromkeys(k for r in rows for k, v in r.items() if not isinstance(v, (list, dict))))

    def cell(value) -> str:
        return "" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)

    lines = [f"\n### {title}", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        lines.append("| " + " | ".join(cell(r.get(k)) for k in keys) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------ ceilings

def ceilings() -> dict:
    n = 2 * 1024 ** 3  # 2 GiB copy
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_s = statistics.median(cuda_time(lambda: dst.copy_(src), 10, 3))
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_s = statistics.median(cuda_time(lambda: a @ b, 10, 3))
    del src, dst, a, b
    torch.cuda.empty_cache()
    return {"copy_TBps": 2 * n / copy_s / 1e12, "bf16_gemm_TFLOPs": 2 * 8192 ** 3 / mm_s / 1e12}


def qwen35_4b(device="cuda", dtype=torch.bfloat16, layers: int | None = None):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    cfg = dict(QWEN35_4B)
    if layers:
        cfg["num_hidden_layers"] = layers
    config = Qwen3_5TextConfig(**cfg)
    with torch.device(device):
        model = Qwen3_5ForCausalLM(config).to(dtype)
    return model


def param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------ QAD step

KERNEL_CLASSES = {  # kernel-name fragments -> what the time is spent on (first match wins)
    "gemm": ("nvjet", "gemm", "cutlass", "xmma", "cublas"),
    "attention": ("sdpa", "flash", "fmha", "attention"),
    "gated_deltanet": ("chunk", "delta", "fused_recurrent", "tilelang", "kernel_kernel"),
    "conv1d": ("conv",),
    "softmax_kl": ("softmax", "log_softmax", "kl_div", "xlogy"),
    "optimizer": ("optimizer", "adam", "foreach", "multi_tensor"),
    "copy_cast": ("copy", "cast", "fill", "memcpy", "memset"),
    "elementwise": ("elementwise", "functor", "reduce"),
}


def kernel_classes(ops: list[dict]) -> list[dict]:
    """Sum top_ops rows into KERNEL_CLASSES, so a profile reads as 'GEMMs x%, elementwise y%'."""
    sums: dict[str, float] = {}
    for op in ops:
        name = op["op"].lower()
        kind = next((k for k, keys in KERNEL_CLASSES.items() if any(f in name for f in keys)), "other")
        sums[kind] = sums.get(kind, 0.0) + op["self_ms"]
    total = sum(sums.values()) or 1.0
    return [{"class": k, "ms": v, "share": v / total} for k, v in sorted(sums.items(), key=lambda kv: -kv[1])]


def top_ops(step, n: int = 20) -> list[dict]:
    """One call of step() under torch.profiler: the n operators with the most self device time (CPU time without
    CUDA), each with its share of the total, so a slow step says where its time goes."""
    from torch.profiler import ProfilerActivity, profile

    on_device = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])) as prof:
        step()
        if on_device:
            torch.cuda.synchronize()

    def own(event) -> float:  # microseconds spent in the operator itself, not in what it calls
        return event.self_device_time_total if on_device else event.self_cpu_time_total

    from torch.autograd import DeviceType

    # on the GPU only kernels and copies count: operator rows (aten::mm) repeat their kernels' time, and CUPTI's
    # "Command Buffer Full" marks the host waiting on a full launch queue, not work done by the device
    events = [e for e in prof.key_averages() if own(e) > 0 and (not on_device or (
        e.device_type == DeviceType.CUDA and not e.key.startswith(("aten::", "Command Buffer"))))]
    total = sum(own(e) for e in events) or 1.0
    events.sort(key=own, reverse=True)
    return [{"op": e.key[:80], "calls": e.count, "self_ms": own(e) / 1e3, "share": own(e) / total}
            for e in events[:n]]


def bench_qad(seq_lens: list[int], peak_tflops: float, chunk_tokens: int, repeats: int,
              profile_ops: bool = False, fake_quant: str = "modelopt", compile_decoder: bool = False) -> list[dict]:
    from eqc_utils.params import load_params
    from eqc_utils.quant import grid, kl

    quant = load_params("paper")["quant"]
    teacher = qwen35_4b().eval().requires_grad_(False)
    student = qwen35_4b()
    student.load_state_dict(teacher.state_dict())
    modules = grid.attach_int4_quantizers(student, quant)
    pinned = grid.pin_grid(student, {name: grid.grid_scales(m) for name, m in modules.items()})
    if fake_quant == "pinned":      # the pipeline's qad.fake_quant: pinned (one autograd function per weight)
        from eqc_utils.quant.fake_quant import use_pinned_int4_forward
        use_pinned_int4_forward(student)
    if compile_decoder:             # the pipeline's qad.compile on CUDA
        student.model.compile()
    student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    student.config.use_cache = False
    student.train()
    optimizer = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=2e-6, betas=(0.9, 0.95),
                                  weight_decay=0.0)
    n_params = param_count(student)
    print(f"qad: {n_params / 1e9:.2f}B parameters, {pinned} INT4 modules pinned (paper: 200)", flush=True)

    rows = []
    for seq in seq_lens:
        # the full-logits KL only at the shortest length: it is there to show what chunking saves
        for mode in ("chunked", "full") if seq == min(seq_lens) else ("chunked",):
            ids = torch.randint(0, QWEN35_4B["vocab_size"] - 300, (1, seq), device="cuda")
            weights = torch.ones(1, seq, device="cuda")

            def step():
                with torch.no_grad():
                    t_hidden = teacher.model(input_ids=ids).last_hidden_state
                s_hidden = student.model(input_ids=ids).last_hidden_state
                if mode == "chunked":
                    loss = kl.chunked_forward_kl(s_hidden, t_hidden, weights, student.lm_head, teacher.lm_head,
                                                 1.0, chunk_tokens)
                else:
                    with torch.no_grad():
                        t_logits = teacher.lm_head(t_hidden)
                    loss = kl.forward_kl(student.lm_head(s_hidden), t_logits, weights, 1.0)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            try:
                times = cuda_time(step, repeats, warmup=1)
                s = statistics.median(times)
                flops = 8 * n_params * seq  # student fwd+bwd (6NT) + teacher fwd (2NT); recompute not counted
                rows.append({"seq": seq, "kl": mode, "step_s": s, "tokens_per_s": seq / s,
                             "peak_GiB": torch.cuda.max_memory_allocated() / 2 ** 30,
                             "MFU": flops / s / (peak_tflops * 1e12)})
                if profile_ops and seq == max(seq_lens) and mode == "chunked":
                    ops = top_ops(step, n=10_000)
                    classes = kernel_classes(ops)
                    print(table(f"qad step at seq {seq}: operators by own GPU time", ops[:20]), flush=True)
                    print(table(f"qad step at seq {seq}: GPU time by kernel class", classes), flush=True)
                    rows[-1]["top_ops"], rows[-1]["kernel_classes"] = ops[:40], classes
            except torch.OutOfMemoryError:
                rows.append({"seq": seq, "kl": mode, "step_s": float("nan"), "tokens_per_s": float("nan"),
                             "peak_GiB": torch.cuda.max_memory_allocated() / 2 ** 30, "MFU": float("nan")})
                optimizer.zero_grad(set_to_none=True)
            print(rows[-1], flush=True)
    del teacher, student, optimizer
    torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------ Gated DeltaNet kernel

def gdn_inputs(seq: int, dtype, seed: int = 0) -> list[torch.Tensor]:
    """One layer's linear-attention inputs at Qwen3.5-4B's shape (16 key heads, 32 value heads of 128), batch 1,
    with the model's own ranges: decay g <= 0 (log space), beta in (0, 1); q, k are l2-normalised in the kernel."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hk, hv, d = QWEN35_4B["linear_num_key_heads"], QWEN35_4B["linear_num_value_heads"], QWEN35_4B["linear_key_head_dim"]
    q = torch.randn(1, seq, hk, d, device="cuda", generator=gen)
    k = torch.randn(1, seq, hk, d, device="cuda", generator=gen)
    v = torch.randn(1, seq, hv, d, device="cuda", generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(1, seq, hv, device="cuda", generator=gen)) * 0.5
    beta = torch.rand(1, seq, hv, device="cuda", generator=gen)
    q, k = q.repeat_interleave(hv // hk, 2), k.repeat_interleave(hv // hk, 2)
    # the model computes the decay in float32 whatever its dtype
    return [x.to(torch.float32 if x is g else dtype).requires_grad_(True) for x in (q, k, v, g, beta)]


def gdn_fwd_bwd(fn, inputs: list[torch.Tensor], grad_out: torch.Tensor):
    for x in inputs:
        x.grad = None
    out, _ = fn(*inputs, use_qk_l2norm_in_kernel=True)
    out.backward(grad_out.to(out.dtype))
    return out.detach(), [x.grad.detach() for x in inputs]


def bench_gdn(seq_lens: list[int], repeats: int) -> list[dict]:
    """fla's chunked Gated-DeltaNet forward + backward (the one the QAD step needs; on Hopper with Triton < 3.7.1 fla
    routes its gated backward through tilelang) against transformers' pure-PyTorch fallback: agreement with a float32
    fallback reference at the shortest length, then time per layer call. Keys repeated to the value heads, as
    Qwen3.5's layer does before the kernel."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from transformers.models.qwen3_5 import modeling_qwen3_5
    fallback = getattr(modeling_qwen3_5.torch_chunk_gated_delta_rule, "__wrapped__",
                       modeling_qwen3_5.torch_chunk_gated_delta_rule)
    rows = []
    for seq in seq_lens:
        row = {"seq": seq}
        inputs = gdn_inputs(seq, torch.bfloat16)
        grad_out = torch.randn(inputs[2].shape, device="cuda")
        if seq == min(seq_lens):  # correctness: fla bf16 and fallback bf16, each against the fallback in float32
            ref_out, ref_grads = gdn_fwd_bwd(fallback, gdn_inputs(seq, torch.float32), grad_out)
            for name, fn in (("fla", chunk_gated_delta_rule), ("torch", fallback)):
                out, grads = gdn_fwd_bwd(fn, inputs, grad_out)
                rel = [((a.float() - b).norm() / b.norm()).item() for a, b in zip([out, *grads], [ref_out, *ref_grads])]
                row[f"{name}_rel_err_out"] = rel[0]
                row[f"{name}_rel_err_grad_max"] = max(rel[1:])
        for name, fn in (("fla", chunk_gated_delta_rule), ("torch", fallback)):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            try:
                row[f"{name}_ms"] = 1e3 * statistics.median(cuda_time(lambda: gdn_fwd_bwd(fn, inputs, grad_out),
                                                                      repeats, warmup=1))
            except torch.OutOfMemoryError:
                row[f"{name}_ms"] = float("nan")
            row[f"{name}_peak_GiB"] = torch.cuda.max_memory_allocated() / 2 ** 30
        row["fla_speedup"] = row["torch_ms"] / row["fla_ms"]
        rows.append(row)
        print(row, flush=True)
    return rows


# ------------------------------------------------------------------ drafter training step

def paper_drafter_config(target, block: int = 16, sliding_window: int | None = None):
    from eqc_utils.drafter.model import DrafterConfig, drafter_config_for
    base = drafter_config_for(target.config, num_layers=5, block_size=block, target_layer_ids=[1, 8, 15, 22, 29],
                              mask_token_id=248070, intermediate_size=9728)
    # docs/recipe.md §3.1: the released drafter has 32 query / 8 KV heads of 128 (not the target's 16 x 256)
    fields = {**base.__dict__, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}
    if sliding_window is not None and "sliding_window" in fields:
        fields["sliding_window"] = sliding_window
    return DrafterConfig(**fields)


def bench_drafter(seq_lens: list[int], peak_tflops: float, repeats: int, batch: int) -> list[dict]:
    from eqc_utils.drafter.model import DFlashDrafter
    from eqc_utils.drafter.train import drafter_step

    target = qwen35_4b().eval().requires_grad_(False)
    drafter = DFlashDrafter(paper_drafter_config(target)).to("cuda", torch.bfloat16).train()
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-3)
    P = {"num_anchors": 512, "loss_decay_gamma": 7.0, "attention": "flex", "labels": "data"}
    n_draft = param_count(drafter)
    n_target = param_count(target)
    print(f"drafter: {n_draft / 1e6:.0f}M trainable parameters, target {n_target / 1e9:.2f}B (frozen)", flush=True)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for seq in seq_lens:
        ids = torch.randint(0, QWEN35_4B["vocab_size"] - 300, (batch, seq), device="cuda")
        loss_mask = torch.zeros(batch, seq, dtype=torch.long, device="cuda")
        loss_mask[:, seq // 8:] = 1  # responses after a short prompt
        data = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}
        P["max_length"] = seq          # anchors are drawn over this many keys (drafter.max_length)

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = drafter_step(drafter, target, data, P, generator)
            loss = out[0] if isinstance(out, tuple) else out
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        try:
            s = statistics.median(cuda_time(step, repeats, warmup=2))
            blocks = batch * 512 * 16
            # target forward 2·N·T, drafter fwd+bwd on the block tokens (plus the context K/V projections)
            flops = 2 * n_target * batch * seq + 6 * n_draft * blocks
            rows.append({"seq": seq, "batch": batch, "step_s": s, "seq_tokens_per_s": batch * seq / s,
                         "peak_GiB": torch.cuda.max_memory_allocated() / 2 ** 30,
                         "MFU": flops / s / (peak_tflops * 1e12)})
        except torch.OutOfMemoryError:
            rows.append({"seq": seq, "batch": batch, "step_s": float("nan"), "seq_tokens_per_s": float("nan"),
                         "peak_GiB": torch.cuda.max_memory_allocated() / 2 ** 30, "MFU": float("nan")})
        print(rows[-1], flush=True)
    del target, drafter, optimizer
    torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------ decoder pieces

@torch.no_grad()
def bench_decode(contexts: list[int], bandwidth_tbps: float, repeats: int) -> list[dict]:
    from transformers import DynamicCache
    from eqc_utils.drafter.model import DFlashDrafter, DraftCache
    from eqc_utils.drafter.features import input_embedding

    target = qwen35_4b().eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
    rows = []
    for ctx in contexts:
        prompt = torch.randint(0, 240000, (1, ctx), device="cuda")
        for new in (1, 16):
            cache = DynamicCache(config=target.config)
            target(input_ids=prompt, past_key_values=cache, use_cache=True)
            step_ids = torch.randint(0, 240000, (1, new), device="cuda")

            def verify():
                # one verification step on a fresh copy would need a cache copy; time the forward on the
                # same cache and accept that it grows by `new` per call (a few tokens over `ctx`)
                target(input_ids=step_ids, past_key_values=cache, use_cache=True)

            s = statistics.median(cuda_time(verify, repeats, warmup=2))
            rows.append({"piece": f"target verify {new} tok", "context": ctx, "ms": s * 1e3,
                         "weights_GB_per_s": weight_bytes / s / 1e9,
                         "of_copy_bw": weight_bytes / s / (bandwidth_tbps * 1e12)})
            print(rows[-1], flush=True)
    for window in (None, 1024):
        drafter = DFlashDrafter(paper_drafter_config(target, sliding_window=window)).to("cuda", torch.bfloat16).eval()
        for ctx in contexts:
            features = torch.randn(1, ctx, 5 * 2560, device="cuda", dtype=torch.bfloat16)
            block = torch.full((1, 16), 248070, device="cuda")
            embeds = input_embedding(target)(block)

            def draft():
                cache = DraftCache()
                positions = torch.arange(ctx + 16, device="cuda")[None]
                drafter(embeds, features, positions, cache=cache)

            s = statistics.median(cuda_time(draft, repeats, warmup=2))
            rows.append({"piece": f"drafter block pass (SWA {window or 'off'}, context prefill)", "context": ctx,
                         "ms": s * 1e3, "weights_GB_per_s": float("nan"), "of_copy_bw": float("nan")})
            print(rows[-1], flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="ceiling,gdn,qad,drafter,decode")
    ap.add_argument("--qad-seq", default="4096,8192,16384")
    ap.add_argument("--drafter-seq", default="1024,2048,3072")
    ap.add_argument("--drafter-batch", type=int, default=2)
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--kl-chunk", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--qad-profile", action="store_true",
                    help="profile one QAD step at the longest --qad-seq: operators by own GPU time (top_ops in JSON)")
    ap.add_argument("--qad-fake-quant", choices=("modelopt", "pinned"), default=None,
                    help="the student's INT4 forward: modelopt's quantiser, or one autograd function per weight "
                         "(default: params/paper.yaml's qad.fake_quant)")
    ap.add_argument("--qad-compile", choices=("on", "off"), default=None,
                    help="torch.compile the student's decoder (default: params/paper.yaml's qad.compile)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_real_shapes: needs a CUDA GPU (run it on a GPU node, see docs/gpu.md)")
        return 0
    import transformers
    only = set(args.only.split(","))
    results = {"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d %H:%M")}
    try:
        import fla  # noqa: F401
        results["flash_linear_attention"] = getattr(fla, "__version__", "present")
    except ImportError:
        results["flash_linear_attention"] = "absent (pure-PyTorch Gated DeltaNet fallback)"
    try:   # fla builds its Gated-DeltaNet backward through tilelang on Hopper when Triton < 3.7.1
        import tilelang
        results["tilelang"] = getattr(tilelang, "__version__", "present")
    except ImportError:
        results["tilelang"] = "absent"
    from eqc_utils.devices import wants_compile
    from eqc_utils.params import load_params
    paper_qad = load_params("paper")["qad"]
    results["qad_fake_quant"] = args.qad_fake_quant or paper_qad["fake_quant"]
    results["qad_compile"] = wants_compile(args.qad_compile or paper_qad["compile"], "cuda")
    print(json.dumps(results), flush=True)
    ceiling = ceilings()
    results["ceiling"] = ceiling
    print(table("ceilings", [ceiling]), flush=True)
    sections = {
        "gdn": lambda: bench_gdn([int(x) for x in args.qad_seq.split(",")], args.repeats),
        "qad": lambda: bench_qad([int(x) for x in args.qad_seq.split(",")], ceiling["bf16_gemm_TFLOPs"],
                                 args.kl_chunk, args.repeats, args.qad_profile, results["qad_fake_quant"],
                                 results["qad_compile"]),
        "drafter": lambda: bench_drafter([int(x) for x in args.drafter_seq.split(",")],
                                         ceiling["bf16_gemm_TFLOPs"], args.repeats, args.drafter_batch),
        "decode": lambda: bench_decode([int(x) for x in args.contexts.split(",")], ceiling["copy_TBps"],
                                       args.repeats + 2),
    }
    for name, run in sections.items():
        if name not in only:
            continue
        try:
            rows = run()
            results[name] = rows
            print(table(name, rows), flush=True)
        except Exception as err:  # one section failing must not hide the others' numbers
            results[name] = {"error": f"{type(err).__name__}: {err}"}
            traceback.print_exc()
        torch.cuda.empty_cache()
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What one machine with one GPU can show about autopar's runtime (issue 11's GPU check).

Run on a machine with one CUDA GPU (no torchrun needed: it joins a world of one itself):

    python benchmarks/gpu_check.py [--layers 12 --hidden 768 --seq-len 1024 --batch 8]

It prints, for a GPT-2-small-sized model (autopar's GPT class) on ``cuda:0`` under NCCL,
with plans priced on the preset of that GPU (:func:`device_preset`):

1. the rank's device and backend (world size 1, NCCL): the device-generic path;
2. verify, fp32: 3 SGD steps of the parallelized program against the plain model trained
   eagerly on the same GPU (same seed, same batches): losses (relative difference below
   1e-4) and the parameter updates (:func:`update_difference` below 1e-3);
3. bf16 (fp32 master weights, the scheme the cost model prices):
   ``last_step_stats()`` against the plan's ``predicted.stage_stats[0]`` — communication
   bytes (all zero at world size 1 but the step's loss/norm all-reduce, skipped for one
   rank), model-state bytes, saved-activation bytes — and the allocator's peak memory
   (``torch.accelerator.max_memory_allocated``) against ``predicted.peak_memory_bytes``
   plus the step's temporaries (figures);
4. tokens/s of the parallelized bf16 program against the same model's plain eager loop
   (``torch.autocast`` bf16, fp32 weights, fused AdamW: :func:`adamw`; median of --steps
   steps after 3 warm-up steps), and their ratio (the target: the parallelized program
   within 5%);
5. issue 13's check: a few one-GPU bf16 plans (micro-batch size and recompute varied), each
   its step time (median, as above; figures), its peak allocation
   (``max_memory_allocated``) against the predicted peak + temporaries, and the caching
   allocator's peak reservation (``max_memory_reserved``) against the allocator's predicted
   share (that plus fragmentation: the memory reserve less the CUDA context, NCCL buffers
   and headroom, which live outside the allocator); the check is that every plan stays
   within both;
6. the host's dispatch per graph node, against the preset's ``op_overhead_s`` (figures).

Exit status 0 when every check holds, 1 otherwise. On a host without a GPU it exits 2
saying so, unless ``--cpu``: a rehearsal of the same code on the CPU (gloo, world of one;
memory is "n/a" there and the speed target is not judged), as far as a CPU can go, e.g.
under torch 2.11 before a GPU is lent::

    python benchmarks/gpu_check.py --cpu --layers 2 --hidden 64 --heads 4 --vocab 256 \
        --seq-len 64 --batch 4 --steps 4

``--out FILE`` also writes everything printed to FILE. On a lent GPU machine (torch 2.11,
Python 3.12, no registry, no OR-Tools) the README's "GPU check" paragraph gives the one
command, with the wheels ``benchmarks/gpu_wheels.py`` prepares.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import autopar
from autopar.models import GPT, GPTConfig
from autopar.runtime import device as rank_device_module
from autopar.runtime.calibrate import measure_host_overheads_s
from cost_models.reserve import MemoryReserve


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per program")
    p.add_argument("--cpu", action="store_true",
                   help="rehearse on the CPU (gloo, world of one) where no GPU is")
    p.add_argument("--out", type=str, default=None, metavar="FILE",
                   help="also write everything printed to FILE")
    return p.parse_args()


class _Tee:
    """stdout that also writes to a file (``--out``)."""

    def __init__(self, stream, path: str) -> None:
        self.stream, self.file = stream, open(path, "w", encoding="utf-8")

    def write(self, text: str) -> int:
        self.file.write(text)
        self.file.flush()
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()
        self.file.flush()


def _batches(config: GPTConfig, batch: int, seq: int, steps: int, device) -> list:
    g = torch.Generator().manual_seed(1234)
    return [(torch.randint(0, config.vocab_size, (batch, seq), generator=g).to(device),
             torch.randint(0, config.vocab_size, (batch, seq), generator=g).to(device))
            for _ in range(steps)]


def _model(config: GPTConfig, dtype=torch.float32) -> GPT:
    torch.manual_seed(0)
    return GPT(config).to(dtype)


PRESET_BY_DEVICE = (("H200", "dgx-h200"), ("H100", "dgx-h100"), ("H800", "dgx-h800"),
                    ("A100", "dgx-a100"), ("V100", "dgx2h-v100"))
"""The cluster preset whose device a GPU's name (``torch.cuda.get_device_name``) names."""


def device_preset(device_name: str) -> str:
    """The preset to price plans for the GPU called ``device_name`` ("NVIDIA H200" gives
    "dgx-h200"); "dgx-h100" for a GPU no preset describes, and for the CPU rehearsal."""
    return next((preset for key, preset in PRESET_BY_DEVICE if key in device_name), "dgx-h100")


def _plan(config: GPTConfig, batch: int, seq: int, dtype: str, preset: str,
          **layout) -> autopar.Plan:
    """A one-GPU plan (tp = pp = dp = 1) priced on ``preset``; ``layout`` pins more
    of :class:`autopar.Layout` (micro_batch_size, recompute)."""
    with torch.device("meta"):
        meta = GPT(config)
    one_gpu = dataclasses.replace(autopar.Cluster.from_name(preset), gpus_per_node=1,
                                  dtype=dtype)
    return autopar.plan(meta, one_gpu, global_batch_size=batch, seq_len=seq,
                        layout=autopar.Layout(tp=1, pp=1, dp=1, dtype=dtype, **layout))


def update_difference(initial: dict, ours: dict, eager: dict) -> tuple[float, str]:
    """Relative difference of two runs' parameter updates from the same ``initial`` state,
    ``||Δours - Δeager|| / ||Δeager||`` over all tensors together (Δ = trained - initial),
    and the name of the tensor that contributes most to the numerator.

    Updates, not parameters: a parameter's own relative difference is meaningless where its
    gradient is zero in exact arithmetic (nanoGPT's key bias: softmax ignores a constant
    added to every score, so ``c_k.bias`` moves by rounding alone, ~1e-11, and two
    correct GPU runs differ by 100% of that). NaN anywhere gives NaN (a failed check)."""
    num, den, worst = 0.0, 0.0, ("", -1.0)
    for key, want in eager.items():
        start = initial[key].double()
        step = want.double() - start
        diff = ((ours[key].double() - start) - step).square().sum().item()
        num += diff
        den += step.square().sum().item()
        if not diff <= worst[1]:  # NaN takes the place
            worst = (key, diff)
    return (num / den) ** 0.5 if den > 0 else float("nan"), worst[0]


ALLOCATOR_OUTSIDE = tuple(MemoryReserve().fixed_bytes(0))
"""Kinds of the memory reserve held outside PyTorch's caching allocator: its fixed part
(CUDA context, NCCL buffers, headroom; :meth:`MemoryReserve.fixed_bytes`)."""


def predicted_allocator_bytes(plan: autopar.Plan) -> tuple[float, float]:
    """What the plan predicts the caching allocator holds on stage 0, in bytes: (its peak
    allocation, the predicted peak plus the step's temporaries; its reservation, that plus
    fragmentation), the memory reserve less what lives outside the allocator."""
    reserve = plan.predicted.memory_reserve_bytes_by_stage[0]
    allocation = plan.predicted.peak_memory_bytes + sum(
        v for k, v in reserve.items() if k not in ALLOCATOR_OUTSIDE and k != "fragmentation")
    return allocation, allocation + reserve["fragmentation"]


def check_verify(config, args, device) -> bool:
    """fp32: the parallelized program equals the eager model on the same GPU."""
    plan = _plan(config, args.batch, args.seq_len, "fp32", args.preset)
    data = _batches(config, args.batch, args.seq_len, 3, device)
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    pm = autopar.parallelize(_model(config), plan=plan, optimizer=sgd)
    got = [pm.train_step(idx, tgt) for idx, tgt in data]
    state = pm.full_state_dict()
    model = _model(config).to(device)
    optim = sgd(model.parameters())
    want = []
    for idx, tgt in data:
        optim.zero_grad()
        loss = model(idx, tgt)[1]
        loss.backward()
        optim.step()
        want.append(loss.item())
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    eager = {k: v.cpu() for k, v in model.state_dict().items()}
    update_err, worst = update_difference(_model(config).state_dict(), state, eager)
    ok = loss_err < 1e-4 and update_err < 1e-3
    print(f"verify fp32 (3 SGD steps vs eager on {device}): losses {got} vs {want}; "
          f"max rel. difference loss {loss_err:.2e} (< 1e-4), parameter updates "
          f"{update_err:.2e} (< 1e-3; most from {worst}) -> {'OK' if ok else 'FAIL'}")
    return ok


def adamw(device: torch.device):
    """The optimizer the GPU presets price (``DeviceSpec.optimizer_bytes_per_param``: one
    fused kernel over fp32 master, m and v): torch's AdamW with ``fused=True`` on a GPU,
    the default (for-each) one on the CPU. The for-each one also allocates a parameter-sized
    fp32 temporary per step (``_multi_tensor_adam``'s square root of v)."""
    return functools.partial(torch.optim.AdamW, lr=1e-4, fused=device.type != "cpu" or None)


def _fresh_memory(device: torch.device) -> None:
    """Free what an earlier measurement left (modules and optimizers in reference cycles
    outlive ``del`` until the collector runs) and restart the peak counters."""
    gc.collect()
    if device.type != "cpu":
        torch.accelerator.empty_cache()
    rank_device_module.reset_peak_memory(device)


def _time_steps(step, data, device) -> float:
    """Median wall seconds of one step over ``data`` after 3 warm-up steps."""
    for idx, tgt in data[:3]:
        step(idx, tgt)
    times = []
    for idx, tgt in data[3:]:
        rank_device_module.synchronize(device)
        start = time.perf_counter()
        step(idx, tgt)
        rank_device_module.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def check_bf16(config, args, device) -> bool:
    """bf16: measured bytes and memory against the plan, tokens/s against eager."""
    plan = _plan(config, args.batch, args.seq_len, "bf16", args.preset)
    data = _batches(config, args.batch, args.seq_len, args.steps + 3, device)
    _fresh_memory(device)
    pm = autopar.parallelize(_model(config), plan=plan, optimizer=adamw(device))
    ours_s = _time_steps(pm.train_step, data, device)
    peak = rank_device_module.peak_memory_bytes(device)
    measured, predicted = pm.last_step_stats(), plan.predicted.stage_stats[0]
    ok = True
    print(f"plan: {plan.layout()}, micro_batch_size {plan.micro_batch_size}, "
          f"{plan.num_micro_batches} micro-batches, recompute {plan.recompute}")
    for key in ("model_state_bytes", "saved_activation_bytes"):
        ratio = measured[key] / predicted[key]
        # the plan prices the GPU's kernels (a GPU preset): on the CPU (a rehearsal) the
        # saved activations are figures, not a verdict
        ok &= abs(ratio - 1) < 0.05 or (key == "saved_activation_bytes" and device.type == "cpu")
        print(f"{key}: measured {measured[key] / 2**30:.3f} GiB, predicted "
              f"{predicted[key] / 2**30:.3f} GiB, ratio {ratio:.3f}")
    comm = {k: v for k, v in measured["comm_bytes"].items() if v}
    ok &= not comm
    print(f"comm bytes at world size 1: {comm or 'none'} (predicted "
          f"{ {k: v for k, v in predicted['comm_bytes'].items() if v} or 'none'})")
    predicted_peak, _ = predicted_allocator_bytes(plan)
    print(f"peak memory: predicted {predicted_peak / 2**30:.2f} GiB (peak + temporaries), "
          "measured " + ("n/a on the CPU" if peak is None else
             f"{peak / 2**30:.2f} GiB (allocator), ratio {peak / predicted_peak:.3f}"))
    del pm
    _fresh_memory(device)

    model = _model(config).to(device)
    optim = adamw(device)(model.parameters())

    def eager_step(idx, tgt):
        optim.zero_grad()
        for mb_idx, mb_tgt in zip(idx.split(plan.micro_batch_size), tgt.split(plan.micro_batch_size)):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(mb_idx, mb_tgt)[1] / plan.num_micro_batches
            loss.backward()
        optim.step()

    eager_s = _time_steps(eager_step, data, device)
    tokens = args.batch * args.seq_len
    ratio = ours_s / eager_s
    ok &= ratio <= 1.05 or device.type == "cpu"  # the target is the GPU's
    print(f"tokens/s: autopar {tokens / ours_s:,.0f}, eager {tokens / eager_s:,.0f}; step "
          f"time ratio autopar/eager {ratio:.3f} (target <= 1.05) "
          f"(predicted step {plan.predicted.step_time_s:.3f} s, measured {ours_s:.3f} s)")
    return ok


def plan_variants(batch: int) -> list[dict]:
    """The one-GPU layouts issue 13 measures: the whole batch in one micro-batch and in
    micro-batches of 1, without recompute, with selective and with full recompute."""
    return [dict(micro_batch_size=batch, recompute="none"),
            dict(micro_batch_size=batch, recompute="selective"),
            dict(micro_batch_size=batch, recompute="full"),
            dict(micro_batch_size=1, recompute="none")]


def _gib(nbytes: float | None) -> str:
    """``nbytes`` in GiB to two places; "n/a" where nothing was measured (the CPU)."""
    return "n/a" if nbytes is None else f"{nbytes / 2**30:.2f}"


def check_plans(config, args, device) -> bool:
    """bf16 plans on one GPU: measured step time, allocation and allocator reservation
    against the prediction (issue 13). False when a plan allocates more than its predicted
    peak + temporaries (the cost model's claim) or reserves more than its predicted
    allocator share (that plus fragmentation, ``MemoryReserve.fragmentation``)."""
    data = _batches(config, args.batch, args.seq_len, args.steps + 3, device)
    on_gpu = device.type != "cpu"
    ok = True
    print("| micro_batch_size | recompute | predicted step (s) | measured step (s) | error | "
          "predicted peak + temporaries (GiB) | max_memory_allocated (GiB) | predicted "
          "allocator share (GiB) | max_memory_reserved (GiB) | reserved / allocated |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for layout in plan_variants(args.batch):
        plan = _plan(config, args.batch, args.seq_len, "bf16", args.preset, **layout)
        _fresh_memory(device)
        pm = autopar.parallelize(_model(config), plan=plan, optimizer=adamw(device))
        measured_s = _time_steps(pm.train_step, data, device)
        reserved = torch.accelerator.max_memory_reserved(device) if on_gpu else None
        allocated = torch.accelerator.max_memory_allocated(device) if on_gpu else None
        predicted = plan.predicted
        allocation, share = predicted_allocator_bytes(plan)
        ok &= reserved is None or (allocated <= allocation and reserved <= share)
        ratio = "n/a" if reserved is None else f"{reserved / allocated:.3f}"
        recompute = ",".join(sorted(set(plan.recompute)))  # one per layer
        print(f"| {plan.micro_batch_size} | {recompute} | {predicted.step_time_s:.4f} | "
              f"{measured_s:.4f} | {(predicted.step_time_s - measured_s) / measured_s:+.1%} | "
              f"{allocation / 2**30:.2f} | {_gib(allocated)} | {share / 2**30:.2f} | "
              f"{_gib(reserved)} | {ratio} |")
        del pm
    print(f"every plan's allocation within its predicted peak + temporaries and its reservation "
          f"within its predicted allocator share: {ok}")
    return ok


def check_host(args, device) -> None:
    """The host's dispatch per graph node (tiny GPT blocks: ``autopar calibrate``'s
    measurement, on this device) against the preset's ``op_overhead_s`` and
    ``recompute_overhead_s``; figures, not a verdict (a host's speed is its own)."""
    measured = measure_host_overheads_s(str(device))
    spec = autopar.Cluster.from_name(args.preset).device
    print(f"host dispatch per graph node: {measured[0] * 1e6:.1f} µs (preset "
          f"{spec.op_overhead_s * 1e6:.1f}), checkpointing's extra {measured[1] * 1e6:.1f} µs "
          f"(preset {spec.recompute_overhead_s * 1e6:.1f})")


def main() -> int:
    args = _args()
    if args.out:
        sys.stdout = _Tee(sys.stdout, args.out)
    if not args.cpu and not torch.accelerator.is_available():  # a CUDA build sees 0 GPUs
        print(f"gpu_check: torch {torch.__version__} sees no accelerator on this machine; run "
              "it on a GPU host (or rehearse with --cpu)")
        return 2
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    dist.init_process_group("gloo" if args.cpu else "nccl", rank=0, world_size=1)
    device = rank_device_module.rank_device()
    name = "CPU" if device.type == "cpu" else torch.cuda.get_device_name(device)
    args.preset = device_preset(name)
    print(f"torch {torch.__version__}, Python {sys.version.split()[0]}, {name}, backend "
          f"{dist.get_backend()}, rank device {device}; plans priced on {args.preset}")
    config = GPTConfig(n_layer=args.layers, n_head=args.heads, n_embd=args.hidden,
                       vocab_size=args.vocab, block_size=args.seq_len)
    start = time.perf_counter()
    try:
        ok = check_verify(config, args, device)
        ok &= check_bf16(config, args, device)
        ok &= check_plans(config, args, device)
        check_host(args, device)
    finally:
        dist.destroy_process_group()
    print(f"gpu_check: {'every check holds' if ok else 'a check FAILED'} "
          f"({time.perf_counter() - start:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

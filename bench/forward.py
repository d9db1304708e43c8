"""Forward benchmark: ms per decode step of the default model (SmolLM2-135M) against its limit.

A decode step is what :class:`constrain.decode.loop.DecodeLoop` runs: one new token per row, fed with a
``DynamicCache`` already holding ``--context`` tokens (rows of batch 8 left-padded by 0, 3, ..., 21
tokens), the attention mask over the cache plus the new token and explicit position ids, under
``torch.inference_mode``; the full logits come out (the loop's output-layer hook only acts on
drafts of unequal widths). After each step the cache is cropped back, so every step sees the same
context. Configurations are timed round-robin in one process (each round visits all of them, a
warm-up step after each switch), and the tables give the median step of all rounds: the machine
may be shared, and drift then hits every configuration alike.

Configurations: float32 against bfloat16 (``load_model``'s pick is marked), ``sdpa`` against
``eager`` attention, 1 against 2 threads, all with transformers' own forward
(``load_model(prepack=False)``); then variants, compared with their row of that grid: linear layers
with their weights prepacked for oneDNN (:func:`constrain.models.loading.prepack_linears`, what
``load_model`` does by default on a CPU for float32, and for bfloat16 where it is native), ``no_grad`` against
``inference_mode``, float32 weights with oneDNN's bfloat16 matmul precision, oneDNN-layout linear
layers (``torch.utils.mkldnn.to_mkldnn``), and ``torch.compile``: with dynamic shapes on the loop's
``DynamicCache`` (what the loop could use), the same with inductor's freezing (weights folded in as
constants and prepacked: inference only), and frozen on a ``StaticCache`` (which the loop cannot
use: its rows join, leave and merge). A compile is cold (inductor's caches off); its seconds (the
first two calls at each batch size) are a column of their own. The "floor" row is a model of the
same 30 layers and heads with 64-wide layers and a 256-token vocabulary: what the framework costs
per step whatever the arithmetic. Variants run at ``--extras-threads`` (default 1: on a shared
2-core machine, a 2-thread step waits for the scheduler to give its second thread a core).

The limit: from the config, the weight bytes a step reads (linear layers, the tied output layer
once) plus the KV cache, and the FLOPs (2 per weight per row, plus attention over the context);
against the machine's measured memory bandwidth (the faster of a large tensor's copy, counted as
read plus write, and its sum, a pure read) and measured matmul GFLOP/s (a large float32 and
bfloat16 matmul), at the configuration's thread count. The bound is the larger of the two times;
"x bound" is measured / bound.

Usage: ``python bench/forward.py [--isa native|avx2] [--rounds 5] [--steps 3] [--context 100]
[--extras-threads 1] [--no-compile] [--only NAME ...]`` (about 15 minutes with the compiles on 2
busy cores, 3 without). ``--isa avx2`` re-executes itself with ``ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2``: an AVX2-only CPU, emulated (torch's, oneDNN's
and MKL's kernels; ``load_model`` then picks float32, as oneDNN reports no native bfloat16).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parent.parent)

AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
"""The environment that makes torch, oneDNN and MKL use AVX2 kernels only (read when they load)."""

_AVX2_WANTED = "avx2" in " ".join(sys.argv[1:])
if __name__ == "__main__" and _AVX2_WANTED and any(os.environ.get(k) != v for k, v in AVX2_ENV.items()):
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **AVX2_ENV})

import torch  # noqa: E402
import torch.utils.mkldnn  # noqa: E402
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache  # noqa: E402

import constrain  # noqa: E402
from bench.machine import machine_line  # noqa: E402
from constrain.models.loading import PrepackedLinear, default_dtype, prepack_linears  # noqa: E402

BATCHES = (1, 8)
COMPILE_LIMIT_S = 180
"""A compiled forward whose first calls at a batch size take longer is abandoned (reported as such)."""


@dataclass(frozen=True)
class Config:
    """One way to run the forward."""

    dtype: torch.dtype
    attention: str = "sdpa"
    threads: int = 2
    grad: str = "inference_mode"  # or "no_grad"
    variant: str = "plain"  # "prepacked" | "mkldnn" | "bf16 matmul" | "floor" | "compile" | "compile freezing" | ...

    @property
    def name(self) -> str:
        parts = [str(self.dtype).removeprefix("torch."), self.attention, f"{self.threads}T"]
        if self.grad != "inference_mode":
            parts.append(self.grad)
        if self.variant != "plain":
            parts.append(self.variant)
        return " ".join(parts)


def configurations(picked: torch.dtype, *, compile_: bool, threads: int = 1) -> list[Config]:
    """The grid (dtype x attention x threads), then the variants on ``load_model``'s dtype ``picked``
    at ``threads`` threads (prepacking at both thread counts, and on the other dtype too)."""
    other = torch.float32 if picked == torch.bfloat16 else torch.bfloat16
    grid = [Config(d, a, t) for d in (picked, other) for a in ("sdpa", "eager") for t in (1, 2)]
    packed = [Config(picked, threads=t, variant="prepacked") for t in (1, 2)]
    packed.append(Config(other, threads=threads, variant="prepacked"))
    variants = ["mkldnn", "floor"] + (["compile", "compile freezing", "compile static"] if compile_ else [])
    extras = [
        Config(picked, threads=threads, grad="no_grad"),
        Config(torch.float32, threads=threads, variant="bf16 matmul"),
    ]
    extras += [Config(picked, threads=threads, variant=v) for v in variants]
    return grid + packed + extras


def base_of(config: Config, picked: torch.dtype, threads: int) -> Config:
    """What a row is compared with: a variant with its grid row (same dtype, attention and threads), a
    grid row with ``load_model``'s dtype in sdpa at ``threads``."""
    if config.grad != "inference_mode" or config.variant != "plain":
        return Config(config.dtype, config.attention, config.threads)
    return Config(picked, threads=threads)


# --- the limit ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Machine:
    """Measured memory bandwidth (GB/s) and matmul GFLOP/s, by thread count (and dtype)."""

    copy_gbs: dict[int, float]
    read_gbs: dict[int, float]
    gflops: dict[tuple[int, torch.dtype], float]

    def bandwidth(self, threads: int) -> float:
        return max(self.copy_gbs[threads], self.read_gbs[threads])


def _best_seconds(fn: Callable[[], Any], budget: float = 0.6, least: int = 3) -> float:
    """The fastest of repeated calls of ``fn`` (at least ``least``, until ``budget`` seconds are spent)."""
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < least or time.perf_counter() - start < budget:
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return min(times)


def measure_machine(threads: tuple[int, ...]) -> Machine:
    """Copy and sum of a 256 MiB float32 tensor; 1536-square float32 and bfloat16 matmuls."""
    src = torch.rand(1 << 26)  # 256 MiB: far past the caches
    dst = torch.empty_like(src)
    copy_gbs, read_gbs, gflops = {}, {}, {}
    n = 1536
    for t in threads:
        torch.set_num_threads(t)
        copy_gbs[t] = 2 * src.nbytes / _best_seconds(lambda: dst.copy_(src)) / 1e9
        read_gbs[t] = src.nbytes / _best_seconds(src.sum) / 1e9
        for dtype in (torch.float32, torch.bfloat16):
            a, b = torch.rand(n, n, dtype=dtype), torch.rand(n, n, dtype=dtype)
            gflops[t, dtype] = 2 * n**3 / _best_seconds(lambda a=a, b=b: a @ b, least=2) / 1e9
    return Machine(copy_gbs, read_gbs, gflops)


@dataclass(frozen=True)
class Work:
    """What one decode step of a row must do, from the model's config."""

    weights: int  # parameters of the linear layers (the tied output layer once)
    kv_per_token: int  # KV cache elements per context token
    attention_flops_per_token: int  # per row, per context token

    @classmethod
    def of(cls, config: Any) -> Work:
        h, layers, head_dim = config.hidden_size, config.num_hidden_layers, config.head_dim
        q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * config.intermediate_size
        return cls(layers * per_layer + h * config.vocab_size, 2 * layers * kv, 4 * layers * q)

    def flops(self, batch: int, context: int) -> float:
        return batch * (2 * self.weights + self.attention_flops_per_token * context)

    def bytes(self, batch: int, context: int, itemsize: int) -> float:
        return (self.weights + batch * self.kv_per_token * context) * itemsize

    def bound_ms(self, machine: Machine, config: Config, batch: int, context: int) -> float:
        """The larger of the weights' and KV's read time and the matmuls' time, in ms."""
        weight_dtype = config.dtype
        compute_dtype = torch.bfloat16 if config.variant == "bf16 matmul" else config.dtype
        itemsize = torch.empty(0, dtype=weight_dtype).element_size()
        memory = self.bytes(batch, context, itemsize) / (machine.bandwidth(config.threads) * 1e9)
        compute = self.flops(batch, context) / (machine.gflops[config.threads, compute_dtype] * 1e9)
        return 1e3 * max(memory, compute)


# --- the step ----------------------------------------------------------------------------------


def _prompt(batch: int, context: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, attention mask and positions of a left-padded batch: row i has ``3 * i`` padding."""
    generator = torch.Generator().manual_seed(batch)
    ids = torch.randint(100, vocab, (batch, context), generator=generator)  # [B, C]
    mask = torch.ones(batch, context, dtype=torch.long)  # [B, C]
    for i in range(batch):
        mask[i, : 3 * i] = 0
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


class Step:
    """One decode step of ``batch`` rows after ``context`` tokens, repeatable: the cache is cut back
    after each call. ``static``: a ``StaticCache`` (its length counter reset) instead of a ``DynamicCache``."""

    def __init__(self, model: Any, batch: int, context: int, *, static: bool = False, mode: Any = None) -> None:
        ids, mask, positions = _prompt(batch, context, model.config.vocab_size)
        cache = StaticCache(config=model.config, max_cache_len=context + 16) if static else DynamicCache()
        with mode or torch.inference_mode():  # the step's own: a compiled forward guards on the KV's kind
            model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, cache=cache)
        self.cache, self.context, self.static = cache, context, static
        self._contiguous()
        generator = torch.Generator().manual_seed(batch + 1)
        self.inputs = {
            "input_ids": torch.randint(100, model.config.vocab_size, (batch, 1), generator=generator),  # [B, 1]
            "attention_mask": torch.cat([mask, mask.new_ones(batch, 1)], dim=1),  # [B, C + 1]
            "position_ids": mask.sum(-1, keepdim=True),  # [B, 1]
        }

    def __call__(self, forward: Callable[..., Any]) -> float:
        """Seconds of one forward through ``forward``."""
        began = time.perf_counter()
        out = forward(**self.inputs, use_cache=True, cache=self.cache)
        out.logits[0, -1, 0].item()
        elapsed = time.perf_counter() - began
        if self.static:
            for layer in self.cache.layers:
                layer.cumulative_length.fill_(self.context)
        else:
            self.cache.crop(-1)
            self._contiguous()
        return elapsed

    def _contiguous(self) -> None:
        """Lay the KV out as the loop's steady state has it (``torch.cat``'s output, not a view): a
        compiled forward would otherwise see new strides and recompile."""
        if not self.static:
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys.contiguous(), layer.values.contiguous()


@contextlib.contextmanager
def _time_limit(seconds: int) -> Iterator[None]:
    def expire(*_: Any) -> None:
        raise TimeoutError(f"over {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _floor_model(model: Any) -> Any:
    """A model with ``model``'s layer count and heads but 64-wide layers and a 256-token vocabulary."""
    base = model.config
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, head_dim=base.head_dim,
                         num_hidden_layers=base.num_hidden_layers, num_attention_heads=1, num_key_value_heads=1,
                         tie_word_embeddings=True)  # fmt: skip
    return LlamaForCausalLM(config).to(model.dtype).eval()


class Runner:
    """Each configuration's forward and its steps, set up once."""

    def __init__(self, context: int, picked: torch.dtype) -> None:  # picked: the floor model's dtype
        self.context = context
        # transformers' forward, as load_model(prepack=False) gives it
        self.models = {d: constrain.load_model(dtype=d, prepack=False).model for d in (torch.float32, torch.bfloat16)}
        self.steps: dict[tuple[str, int], Step] = {}
        self.forwards: dict[Config, Callable[..., Any]] = {}
        self.compile_s: dict[Config, float | str] = {}
        self.floor = _floor_model(self.models[picked])

    def model(self, config: Config) -> Any:
        return self.models[config.dtype]

    def step(self, config: Config, batch: int) -> Step:
        kind = {"compile static": "static", "floor": "floor"}.get(config.variant, "dynamic")
        key = (f"{config.dtype} {kind} {config.grad}", batch)
        if key not in self.steps:
            model = self.floor if kind == "floor" else self.model(config)
            self.steps[key] = Step(model, batch, self.context, static=kind == "static", mode=self.mode(config))
        return self.steps[key]

    def prepare(self, config: Config) -> None:
        """Build ``config``'s forward (compiling it, for the compiled variants, under a time limit)."""
        model = self.model(config)
        if config.variant == "prepacked":
            if config.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
                self.compile_s[config] = "oneDNN packs no bfloat16 here (F.linear serves it)"
                return
            self.forwards[config] = copy.deepcopy(model)
            prepack_linears(self.forwards[config])
        elif config.variant == "mkldnn":
            self.forwards[config] = torch.utils.mkldnn.to_mkldnn(copy.deepcopy(model), dtype=config.dtype)
        elif config.variant == "floor":
            self.forwards[config] = self.floor
        elif config.variant.startswith("compile"):
            static = config.variant == "compile static"
            torch._inductor.config.force_disable_caches = True  # a cold compile: what a first run pays
            options = {"freezing": config.variant != "compile"}  # folds the weights in as constants, prepacked
            # a copy: switching the shared model's attention would fail the compiled graph's guards
            forward = torch.compile(copy.deepcopy(model), dynamic=not static, options=options)
            torch.set_num_threads(config.threads)
            began = time.perf_counter()
            for batch in BATCHES:
                try:
                    with _time_limit(COMPILE_LIMIT_S), self.mode(config):
                        self.step(config, batch)(forward)
                        self.step(config, batch)(forward)  # a recompile would show here
                except Exception as err:  # a failed or abandoned compile is a result
                    timeout = "over" in str(err) and "TimeoutError" in repr(err) + repr(err.__cause__)
                    reason = f"over {COMPILE_LIMIT_S} s" if timeout else f"{type(err).__name__}: {err}"
                    self.compile_s[config] = f"batch {batch} failed: {reason.splitlines()[0][:100]}"
                    return
            self.compile_s[config] = time.perf_counter() - began
            self.forwards[config] = forward
        else:
            self.forwards[config] = model

    @staticmethod
    def mode(config: Config) -> contextlib.AbstractContextManager[Any]:
        return torch.inference_mode() if config.grad == "inference_mode" else torch.no_grad()

    def time(self, config: Config, batch: int, steps: int) -> list[float]:
        """``steps`` timed steps (after one untimed) of ``config`` at ``batch``, in ms."""
        forward = self.forwards[config]
        torch.set_num_threads(config.threads)
        if not config.variant.startswith("compile"):
            forward.set_attn_implementation(config.attention)
        step = self.step(config, batch)
        with self.mode(config), _matmul_precision("bf16" if config.variant == "bf16 matmul" else None):
            step(forward)
            return [1e3 * step(forward) for _ in range(steps)]


@contextlib.contextmanager
def _matmul_precision(precision: str | None) -> Iterator[None]:
    """oneDNN's float32 matmul precision within the block (``"bf16"``: bfloat16 arithmetic)."""
    if precision is None:
        yield
        return
    previous = torch.backends.mkldnn.matmul.fp32_precision
    torch.backends.mkldnn.matmul.fp32_precision = precision
    try:
        yield
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = previous


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _load() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--isa", choices=("native", "avx2"), default="native")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration and batch, per round")
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--extras-threads", type=int, default=1, help="threads of the rows past the grid")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--only", nargs="*", help="configurations whose name contains one of these")
    args = parser.parse_args()
    print(machine_line("cpu"))
    if args.isa == "avx2":
        print(f"emulating an AVX2-only CPU: {' '.join(f'{k}={v}' for k, v in AVX2_ENV.items())}; "
              f"torch's CPU capability: {torch.backends.cpu.get_cpu_capability()}")  # fmt: skip
    picked = default_dtype("cpu")
    loaded = constrain.load_model().model
    packed = isinstance(loaded.lm_head.forward, PrepackedLinear)
    print(f"load_model picks {_name(picked)}, {loaded.config._attn_implementation} attention, "
          f"{'prepacked' if packed else 'plain'} linear layers and torch's default threads")  # fmt: skip
    del loaded

    threads = (1, 2)
    machine = measure_machine(threads)
    runner = Runner(args.context, picked)
    work = Work.of(runner.models[torch.float32].config)
    configs = configurations(picked, compile_=not args.no_compile, threads=args.extras_threads)
    if args.only:
        configs = [c for c in configs if any(word in c.name for word in args.only)]
    for config in configs:
        runner.prepare(config)
    timed = [c for c in configs if c in runner.forwards]
    ms: dict[tuple[Config, int], list[float]] = {(c, b): [] for c in timed for b in BATCHES}
    began, load_before = time.perf_counter(), _load()
    for round_ in range(args.rounds):
        order = timed[round_ % len(timed) :] + timed[: round_ % len(timed)]  # a different first each round
        for config in order:
            for batch in BATCHES:
                ms[config, batch] += runner.time(config, batch, args.steps)
    elapsed = time.perf_counter() - began

    print(f"\nthe limit ({args.context} tokens of context): {work.weights / 1e6:.1f} M weights read per step, "
          f"{work.flops(1, args.context) / 1e9:.3f} GFLOP per row")  # fmt: skip
    print("\n| threads | copy GB/s | read GB/s | float32 GFLOP/s | bfloat16 GFLOP/s |\n|---|---|---|---|---|")
    for t in threads:
        print(f"| {t} | {machine.copy_gbs[t]:.1f} | {machine.read_gbs[t]:.1f} | "
              f"{machine.gflops[t, torch.float32]:.0f} | {machine.gflops[t, torch.bfloat16]:.0f} |")  # fmt: skip
    print("\nbound, ms at batch 1 / 8: " + "; ".join(
        f"{_name(d)} {t}T {work.bound_ms(machine, Config(d, threads=t), 1, args.context):.1f}"
        f" / {work.bound_ms(machine, Config(d, threads=t), 8, args.context):.1f}"
        for d in (torch.float32, torch.bfloat16) for t in threads
    ))  # fmt: skip

    print(f"\nmedian ms per decode step: {args.rounds} rounds x {args.steps} steps, round-robin, {elapsed:.0f} s "
          f"({load_before} before, {_load()} after). vs: the grid against "
          f"`{Config(picked, threads=args.extras_threads).name}`, a variant against its grid row (same dtype, "
          "attention, threads)\n")  # fmt: skip
    print("| configuration | batch 1 ms | x bound | vs | batch 8 ms | x bound | vs | compile s |")
    print("|---|---|---|---|---|---|---|---|")
    for config in configs:
        if config not in runner.forwards:
            print(f"| {config.name} | {' | '.join(['-'] * 6)} | {runner.compile_s.get(config, '-')} |")
            continue
        cells = []
        for batch in BATCHES:
            median = statistics.median(ms[config, batch])
            bound = work.bound_ms(machine, config, batch, args.context)
            base = ms.get((base_of(config, picked, args.extras_threads), batch))
            cells += [
                f"{median:.1f}",
                "-" if config.variant == "floor" else f"{median / bound:.1f}",
                f"{median / statistics.median(base):.2f}" if base else "-",
            ]
        compiled = runner.compile_s.get(config)
        print(f"| {config.name} | {' | '.join(cells)} | {'-' if compiled is None else f'{compiled:.0f}'} |")


if __name__ == "__main__":
    main()

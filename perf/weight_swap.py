"""Pause = swap: how long the embedded engine's decoding stands still when a new version goes in,
and how long preparing that version takes beside generation, at three model sizes.

For each size an embedded engine (its own process, one torch thread) decodes a streamed greedy
request while a new version goes in, --reps times each way:

- swap: `/stage_weights_from_disk` (read, check and copy the version beside the served one,
  generation going on), then `/activate_staged_weights` (each parameter takes the staged storage
  between two decode steps). Reported: `prepare_s` (staging, the engine's figure), the stream's
  `tokens_during_prepare` and `prepare_gap_ms` (its longest step gap meanwhile: staging shares the
  engine's process, and on a small model both are bound by Python's GIL), `pause_ms` (the
  engine's figure for the swap of `tensors` tensors) and `stream_gap_ms` (the longest gap between
  two streamed steps overlapping the activation request, against `step_ms`, the median step);
- pause: SGLang's pause → `/update_weights_from_disk` → continue, as with an SGLang engine:
  `pause_ms` is the wall time from pausing to continuing (generation stands still throughout),
  and `stream_gap_ms` as above.

Sizes: `demo` (the arithmetic bootstrap model the demo trains, ~3 MB) and random Qwen2 shapes
`medium` (~50 MB) and `large` (~400 MB), float32 (and `tiny`, what CI smoke-tests). Prints JSON
(medians) and writes a plot.

    .venv/bin/python perf/weight_swap.py [--sizes demo medium large] [--reps 5] [--plot docs/img/weight_swap.png]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# Random Qwen2 shapes beside the demo model (float32; tied embeddings).
SHAPES = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,  # CI's smoke run
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
    "medium": dict(vocab_size=8192, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                   num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=2048),
    "large": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048),
}
SIZES = ("demo", *SHAPES)
DEFAULT_SIZES = ("demo", "medium", "large")


def model_directory(size: str, root: Path) -> Path:
    if size == "demo":
        from policyloop.models.bootstrap import BootstrapConfig, bootstrap

        return Path(bootstrap(BootstrapConfig()))
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from policyloop.models.tokenizer import save_tokenizer

    torch.manual_seed(0)
    config = Qwen2Config(**SHAPES[size], tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=2,
                         architectures=["Qwen2ForCausalLM"])
    directory = root / size
    Qwen2ForCausalLM(config).save_pretrained(directory)
    save_tokenizer(directory)
    return directory


def next_versions(base: Path, root: Path, count: int) -> list[Path]:
    """`count` versions of the model: 2% of each tensor's elements moved (a realistic step)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(base / "model.safetensors"))
    out = []
    for n in range(count):
        generator = torch.Generator().manual_seed(n)
        changed = {}
        for name, tensor in tensors.items():
            mask = torch.rand(tensor.shape, generator=generator) < 0.02
            changed[name] = tensor + mask * torch.randn(tensor.shape, generator=generator) * 1e-3
        directory = root / f"{base.name}-v{n + 1}"
        shutil.copytree(base, directory, ignore=shutil.ignore_patterns("*.safetensors"))
        save_file(changed, str(directory / "model.safetensors"), metadata={"format": "pt"})
        out.append(directory)
    return out


class Stream:
    """Streamed greedy requests, one after another until stopped, and when each step arrived."""

    def __init__(self, client, rid: str, prompt: list[int], max_new_tokens: int) -> None:  # type: ignore[no-untyped-def]
        from policyloop.engines.protocol import GenerateRequest, SamplingParams

        self.arrivals: list[tuple[float, int]] = []  # (when, which request)
        self.client = client
        self.rid = rid
        self.current = rid
        self.stopping = False
        self.request = GenerateRequest(input_ids=prompt, rid=rid, sampling_params=SamplingParams(
            max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True))
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        n = 0
        while not self.stopping:
            request = self.request.model_copy(update={"rid": f"{self.rid}-{n}"})
            self.current = request.rid or ""
            async for _chunk in self.client.generate_stream(request):
                self.arrivals.append((time.perf_counter(), n))
            n += 1

    async def steps(self, n: int) -> None:
        while len(self.arrivals) < n:
            if self.task.done():
                self.task.result()
            await asyncio.sleep(0.001)

    def count_between(self, start: float, end: float) -> int:
        return sum(start <= t <= end for t, _ in self.arrivals)

    def gap_around(self, start: float, end: float) -> tuple[float, float]:
        """(the longest gap between two steps of one request that spans or falls in [start,
        end], the median such gap elsewhere): a new request's round trip is not a stall."""
        gaps = [(a, b) for (a, i), (b, j) in zip(self.arrivals, self.arrivals[1:], strict=False) if i == j]
        around = [b - a for a, b in gaps if b >= start and a <= end]
        elsewhere = [b - a for a, b in gaps if b < start or a > end]
        return max(around, default=0.0), statistics.median(elsewhere) if elsewhere else 0.0

    async def stop(self) -> None:
        self.stopping = True
        await self.client.abort_request(self.current)
        await self.task


async def measure(size: str, model: Path, versions: list[Path], reps: int, max_new_tokens: int) -> dict:
    from policyloop.common.ports import free_port
    from policyloop.engines.embedded_client import EmbeddedEngineClient

    port = free_port()
    engine = subprocess.Popen([sys.executable, "-m", "policyloop.engines.embedded", "--model-path", str(model),
                               "--port", str(port), "--threads", "1", "--weight-version", "0"],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    swap: dict[str, list[float]] = {"prepare_s": [], "tokens_during_prepare": [], "prepare_gap_ms": [],
                                    "pause_ms": [], "stream_gap_ms": [], "step_ms": [], "tensors": []}
    paused: dict[str, list[float]] = {"pause_ms": [], "stream_gap_ms": [], "step_ms": []}
    version = 0
    try:
        async with EmbeddedEngineClient(f"http://127.0.0.1:{port}", timeout_s=600, retries=0) as client:
            await client.wait_healthy(timeout_s=300)
            prompt = [3 + i % 7 for i in range(8)]
            context = json.loads((model / "config.json").read_text())["max_position_embeddings"]
            max_new_tokens = min(max_new_tokens, context - len(prompt))
            for rep in range(reps):
                for way in ("swap", "pause"):
                    version += 1
                    directory = str(versions[version % len(versions)])
                    stream = Stream(client, f"{way}-{rep}", prompt, max_new_tokens)
                    await stream.steps(5)
                    if way == "swap":
                        started = time.perf_counter()
                        staged = await client.stage_weights_from_disk(directory, str(version))
                        prepared = time.perf_counter()
                        activated = await client.activate_staged_weights(str(version))
                        done = time.perf_counter()
                        swap["prepare_s"].append(staged.prepare_s)
                        swap["tensors"].append(staged.tensors)
                        swap["pause_ms"].append(activated.pause_s * 1000)
                        window, preparing = (prepared, done), (started, prepared)
                    else:
                        started = time.perf_counter()
                        await client.pause_generation("in_place")
                        await client.update_weights_from_disk(directory, str(version), flush_cache=False)
                        await client.continue_generation()
                        done = time.perf_counter()
                        paused["pause_ms"].append((done - started) * 1000)
                        window = (started, done)
                    await stream.steps(len(stream.arrivals) + 3)
                    await stream.stop()
                    if way == "swap":
                        swap["tokens_during_prepare"].append(stream.count_between(*preparing))
                        swap["prepare_gap_ms"].append(stream.gap_around(*preparing)[0] * 1000)
                    gap, step = stream.gap_around(*window)
                    target = swap if way == "swap" else paused
                    target["stream_gap_ms"].append(gap * 1000)
                    target["step_ms"].append(step * 1000)
    finally:
        engine.terminate()
        engine.wait(30)
    params = sum(t.numel() for t in _tensors(model))

    def medians(figures: dict[str, list[float]]) -> dict[str, float]:
        return {name: round(float(statistics.median(values)), 4 if name.endswith("_s") else 3)
                for name, values in figures.items()}

    return {"size": size, "params": params, "bytes": params * 4, "swap": medians(swap), "pause": medians(paused)}


def _tensors(model: Path) -> list[torch.Tensor]:
    from safetensors.torch import load_file

    return list(load_file(str(model / "model.safetensors")).values())


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['size']}\n{r['bytes'] / 1e6:.0f} MB" for r in results]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.2
    series = [("swap: activation pause", [r["swap"]["pause_ms"] for r in results]),
              ("swap: longest step while preparing", [r["swap"]["prepare_gap_ms"] for r in results]),
              ("pause → load → continue: generation stopped", [r["pause"]["pause_ms"] for r in results]),
              ("a decode step (median)", [r["swap"]["step_ms"] for r in results])]
    for i, (label, values) in enumerate(series):
        ax.bar([x + (i - 1.5) * width for x in range(len(results))], values, width, label=label)
    ax.set_xticks(range(len(results)), labels)
    ax.set_yscale("log")
    ax.set_ylabel("ms per version (median)")
    ax.set_title("Embedded engine: what generation waits for when a version goes in", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", choices=SIZES, default=list(DEFAULT_SIZES))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=1000,
                        help="each streamed request's budget (the model's context bounds it; requests follow one "
                             "another until the version is in)")
    parser.add_argument("--plot", type=Path, default=None, help="write a bar chart here (PNG)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = []
    with tempfile.TemporaryDirectory(prefix="policyloop-weight-swap-") as tmp:
        root = Path(tmp)
        for size in args.sizes:
            model = model_directory(size, root)
            versions = next_versions(model, root, 2)
            results.append(asyncio.run(measure(size, model, versions, args.reps, args.max_new_tokens)))
            print(json.dumps(results[-1]), file=sys.stderr)
    if args.plot:
        plot(results, args.plot)
    print(json.dumps({"reps": args.reps, "results": results}, indent=2))


if __name__ == "__main__":
    main()

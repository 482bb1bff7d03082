"""'memory' under a Keras mixed-precision policy against float32, on the model zoo.

Each zoo model's plain and 'memory' steps are measured as the `determinism` suite measures
them (`determinism.measure_model`: a fresh interpreter per model and policy, two inter-op
threads, a grown allocator, the worst of several steps), once in float32 and once under the
mixed policy of the device: `mixed_bfloat16` on a CPU, whose float16 kernels are slow
without AVX512_FP16, `mixed_float16` on a GPU. Half-precision compute halves activations,
but not what stays float32: batch-norm statistics (Keras casts a half-precision input up),
the float32 copies a float16 MatMul holds on CPUs without AVX512_FP16, and, under
`mixed_float16`, every weight gradient, which Keras's `LossScaleOptimizer` checks before
applying any. So 'memory''s share of plain's peak need not stay what it is in float32.
"""

from __future__ import annotations

from memory_saving_gradients.cli.suites import determinism, isolated
from memory_saving_gradients.cli.suites.page import Page, progress

TITLE = "Mixed precision"
CONFIGS = ["plain", "'memory'"]


def run(page: Page, quick: bool, device: str) -> None:
    size = determinism.QUICK if quick else determinism.FULL
    mixed = "mixed_float16" if device.startswith("GPU") else "mixed_bfloat16"
    dtypes = ("float32", mixed)
    page.text(
        f"The zoo at {determinism.zoo_at(size.scale)}, "
        f"in float32 and under `{mixed}`, on {device}; each model and policy in a process of "
        f"its own ({determinism.THREADS} inter-op threads, allocator first grown by "
        f"{determinism.GROWN_MIB} MiB). *MiB*: the worst of {size.steps} steps' allocator "
        "peaks above resident memory; *'memory' / plain*: 'memory''s worst over plain's; "
        f"*time*: the median of {size.repeats} turns' ratios of 'memory''s step time to "
        "plain's in the same turn."
    )
    rows = []
    for name in size.models:
        ratios, cells = {}, []
        for dtype in dtypes:
            progress(f"mixed_precision: {name}, {dtype}")
            found = isolated.run_alone(
                "determinism:measure_model",
                name=name,
                scale=size.scale,
                steps=size.steps,
                repeats=size.repeats,
                device=device,
                dtype=dtype,
                configs=CONFIGS,
                profile=False,
            )
            plain, memory = (max(found[c]["peaks"]) for c in CONFIGS)
            ratios[dtype] = memory / plain
            cells += [
                f"{plain:.1f}",
                f"{memory:.1f}",
                f"{ratios[dtype]:.2f}",
                f"{found[CONFIGS[1]]['time_ratio']:.2f}x",
            ]
        rows.append([name, *cells, f"{ratios[mixed] / ratios['float32']:.2f}"])
    page.table(
        [
            "model",
            *(
                f"{dtype}: {column}"
                for dtype in dtypes
                for column in ("plain MiB", "'memory' MiB", "'memory' / plain", "time")
            ),
            f"ratio {mixed} / float32",
        ],
        rows,
    )

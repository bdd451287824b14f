"""Results of bench/throughput.py: ratios, the issue's targets, the sanity check, table and plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Issue 2 "Bench targets": (workload, baseline) -> minimum baton/baseline ratio.
TARGETS = {
    ("decode", "hf_static"): 2.0,
    ("decode", "generate_batch"): 3.0,
    ("prefill", "hf_static"): 1.2,
    ("decode", "hf_forward_bound"): 0.85,
    ("prefill", "hf_forward_bound"): 0.85,
}


def ratios(rows: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """baton's generated tok/s over each other system's (all generate the same token count)."""
    baton = rows.get("baton", {}).get("gen_tok_s")
    out: dict[str, float | None] = {}
    for name, row in rows.items():
        if name != "baton":
            other = row.get("gen_tok_s")
            out[f"baton/{name}"] = baton / other if baton and other else None
    return out


def targets(workload: str, rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    found = {}
    rs = ratios(rows)
    for (wname, base), want in TARGETS.items():
        if wname == workload and f"baton/{base}" in rs:
            got = rs[f"baton/{base}"]
            found[f"baton/{base}"] = {"target": want, "value": got, "met": got is not None and got >= want}
    return found


def sanity(outputs: dict[str, list[list[int]]], check: int) -> dict[str, Any]:
    """Token equality of each system's greedy output with HF static generate's, first `check`."""
    ref = outputs.get("hf_static")
    if ref is None:
        return {}
    out = {}
    for name, outs in outputs.items():
        if name == "hf_static":
            continue
        div = [first_divergence(a, b) for a, b in zip(outs[:check], ref[:check], strict=True)]
        out[f"{name}_vs_hf_static"] = {
            "checked": len(div), "equal": sum(d is None for d in div), "first_divergence": div,
        }
    return out


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_report(name: str, res: dict[str, Any]) -> None:
    print(f"\n== {name}-heavy: {res['workload']['num_prompts']} prompts, "
          f"{res['prompt_tokens']} prompt + {res['generated_tokens']} generated tokens ==")
    print(f"{'system':<18}{'seconds':>9}{'gen tok/s':>11}{'total tok/s':>13}{'cpu/wall':>10}")
    for sname, row in res["systems"].items():
        if row.get("error"):
            print(f"{sname:<18}  ERROR {row['error']}")
            continue
        print(f"{sname:<18}{row['seconds']:>9.1f}{row['gen_tok_s']:>11.1f}"
              f"{row['total_tok_s']:>13.1f}{row['cpu_per_wall']:>10.2f}")
    print("  (cpu/wall: CPU seconds per wall second of this process; well under the thread count"
          " means other jobs took the cores, or the system ran serial Python)")
    for key, value in res["ratios"].items():
        tgt = res["targets"].get(key)
        note = f"  (target >= {tgt['target']}: {'met' if tgt['met'] else 'MISSED'})" if tgt else ""
        print(f"  {key:<28}{fmt(value, '.2f'):>6}x{note}")
    for key, chk in res["sanity"].items():
        print(f"  sanity {key}: {chk['equal']}/{chk['checked']} prompts token-equal; "
              f"first divergence per prompt: {chk['first_divergence']}")


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    for ax, (wname, res) in zip(axes[0], results.items(), strict=True):
        names = list(res["systems"])
        values = [res["systems"][n].get("gen_tok_s") or 0.0 for n in names]
        colors = ["tab:orange" if n == "baton" else "tab:gray" for n in names]
        bars = ax.bar(names, values, color=colors)
        ax.bar_label(bars, labels=[f"{v:.0f}" if v else "error" for v in values])
        ratio_text = ", ".join(
            f"{k.split('/')[1]} {v:.2f}x" for k, v in res["ratios"].items() if v is not None
        )
        ax.set_title(f"{wname}-heavy\nbaton vs {ratio_text}", fontsize=9)
        ax.set_ylabel("generated tokens / s")
        ax.tick_params(axis="x", labelrotation=15)
    fig.suptitle("baton vs HF transformers, fp32 greedy, same prompts and threads")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None when equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))

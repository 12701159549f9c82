"""What the demo prints: the summary a person reads, the side-by-side table, the plot.

Every figure comes from one arm's row (:class:`~velomux_quic.programs.demo.engine.ArmResult`),
the same dictionary ``--json`` prints, so the text and the machine output never differ.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ... import ConfigurationError
from .engine import ArmResult

__all__ = ["arm_ok", "arm_summary", "compare_table", "plot_cdf", "require_matplotlib"]

Row = dict[str, Any]


def arm_ok(row: Row) -> bool:
    """Every token delivered, every stream complete and in order, nothing left live."""
    return (
        bool(row["all_complete_in_order"])
        and row["live_slots_end"] in (0, None)
        and (row["live_senders_end"] in (0, None))
    )


def _ms(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.2f} ms" if value >= 1 else f"{value:.3f} ms"


def _number(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def arm_summary(row: Row) -> str:
    """One arm, in words."""
    lines = [
        f"  {row['arm']} ({row['transport']})",
        f"    delivered            {row['tokens_delivered']:,} of {row['tokens_expected']:,} "
        f"tokens; {row['streams_complete_in_order']:,} of {row['requests']:,} streams "
        "complete and in order",
        f"    throughput           {row['tokens_per_s']:,.0f} tokens/s over "
        f"{row['elapsed_s']:.2f} s ({row['tokens_per_request']} passes, "
        f"{row['late_passes']} started late)",
    ]
    if row["records_per_write"] is not None:
        lines.append(
            f"    records per write    {row['records_per_write']:.1f} "
            f"(velo_streaming_mux_records / _batches sent by the engine: "
            f"{row['mux_batches_sent']:,.0f} batches)"
        )
    if row["datagrams_per_token"] is not None:
        lines.append(
            f"    datagrams per token  {row['datagrams_per_token']:.4f} both ways "
            f"(the engine's: {row['engine_datagrams_out_per_token']:.4f})"
        )
    lines += [
        f"    first token          p50 {_ms(row['first_token_p50_ms'])}, "
        f"p99 {_ms(row['first_token_p99_ms'])} (engine's stamp to the consumer's code)",
        f"    inter-token          p50 {_ms(row['inter_token_p50_ms'])}, "
        f"p99 {_ms(row['inter_token_p99_ms'])} (between two tokens of a stream, as read)",
        f"    later tokens         p50 {_ms(row['token_latency_p50_ms'])}, "
        f"p99 {_ms(row['token_latency_p99_ms'])} (stamp to consumer)",
        f"    CPU per token        engine {row['engine_cpu_us_per_token']:.1f} µs, "
        f"frontends {row['frontends_cpu_us_per_token']:.1f} µs (getrusage)",
    ]
    if row.get("opened_with_tickets") is not None:
        lines.append(
            f"    streams opened       {row['opened_with_tickets']:,} of {row['requests']:,} "
            f"from zero-RTT tickets, in {1e3 * row['open_s']:.0f} ms once every request was in"
        )
    if row["live_slots_end"] is not None:
        lines.append(
            f"    at the end           {row['live_slots_end']} live mux slots, "
            f"{row['live_senders_end']} live senders (node.snapshot())"
        )
    if "proxy" in row:
        dropped = sum(int(way.get("dropped_loss", 0)) for way in row["proxy"].values())
        forwarded = sum(int(way.get("forwarded", 0)) for way in row["proxy"].values())
        lines.append(
            f"    impairment proxy     {forwarded:,} datagrams forwarded, {dropped:,} dropped"
        )
    if "note" in row:
        lines.append(f"    ({row['note']})")
    return "\n".join(lines)


_Better = Callable[[float, float], float]


def _higher(mux: float, other: float) -> float:
    return mux / other


def _lower(mux: float, other: float) -> float:
    return other / mux


COMPARED: tuple[tuple[str, str, str, _Better | None], ...] = (
    ("tokens/s", "tokens_per_s", ",.0f", _higher),
    ("engine CPU µs/token", "engine_cpu_us_per_token", ".1f", _lower),
    ("frontends CPU µs/token", "frontends_cpu_us_per_token", ".1f", _lower),
    ("datagrams/token", "datagrams_per_token", ".4f", _lower),
    ("records per write", "records_per_write", ".1f", _higher),
    ("first token p50 ms", "first_token_p50_ms", ".2f", _lower),
    ("first token p99 ms", "first_token_p99_ms", ".2f", _lower),
    ("inter-token p50 ms", "inter_token_p50_ms", ".2f", None),  # the pace, on every arm
    ("inter-token p99 ms", "inter_token_p99_ms", ".2f", _lower),
    ("later tokens p50 ms", "token_latency_p50_ms", ".2f", _lower),
    ("later tokens p99 ms", "token_latency_p99_ms", ".2f", _lower),
)
"""(label, row key, format, how many times better the mux is; None: no ratio, as for the
median gap between tokens, which is the pace whenever an arm keeps up)."""


def ratios(rows: Sequence[Row]) -> dict[str, dict[str, float | None]]:
    """Per other arm, per figure: how many times better the mux arm did (>1: the mux)."""
    by_arm = {row["arm"]: row for row in rows}
    mux = by_arm.get("mux")
    found: dict[str, dict[str, float | None]] = {}
    if mux is None:
        return found
    for arm, row in by_arm.items():
        if arm == "mux":
            continue
        found[arm] = {}
        for _, key, _, better in COMPARED:
            ours, theirs = mux[key], row[key]
            usable = ours is not None and theirs is not None and ours > 0 and theirs > 0
            if better is None or not usable:
                found[arm][key] = None
            else:
                found[arm][key] = better(float(ours), float(theirs))
    return found


def compare_table(rows: Sequence[Row]) -> str:
    """The arms side by side, then how many times better the mux did than each other."""
    found = ratios(rows)
    others = list(found)
    header = ["", *(row["arm"] for row in rows), *(f"mux vs {arm}" for arm in others)]
    table = [header]
    for label, key, fmt, _ in COMPARED:
        cells = [label, *(_number(row[key], fmt) for row in rows)]
        for arm in others:
            value = found[arm][key]
            cells.append("n/a" if value is None else f"{value:.2f}x")
        table.append(cells)
    widths = [max(len(line[column]) for line in table) for column in range(len(header))]
    text = [
        "  ".join(
            cell.ljust(width) if column == 0 else cell.rjust(width)
            for column, (cell, width) in enumerate(zip(line, widths, strict=True))
        )
        for line in table
    ]
    text.insert(1, "  ".join("-" * width for width in widths))
    text.append("(mux vs X: how many times better the mux did; above 1 it did better)")
    return "\n".join(text)


def require_matplotlib() -> None:
    """Fail before any run when ``--plot`` cannot draw."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigurationError(
            "--plot needs matplotlib: pip install 'velomux_quic[demo]' (or matplotlib alone)"
        ) from None


def plot_cdf(results: Sequence[ArmResult], path: Path, title: str) -> None:
    """Each arm's CDF of token latency (every token, stamp to consumer), log time axis;
    an arm with percentiles only (gRPC) is drawn as its p50 and p99 points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    for result in results:
        row = result.row
        if result.latencies is not None:
            samples = sorted([*result.latencies.first, *result.latencies.later])
            if not samples:
                continue
            step = max(1, len(samples) // 2000)
            xs = [value / 1e6 for value in samples[::step]] + [samples[-1] / 1e6]
            ys = [index * step / len(samples) for index in range(len(xs) - 1)] + [1.0]
            axes.plot(xs, ys, label=f"{row['arm']} ({row['tokens_per_s']:,.0f} tokens/s)")
        else:
            points = [
                (row["token_latency_p50_ms"], 0.50),
                (row["token_latency_p99_ms"], 0.99),
            ]
            usable = [(x, y) for x, y in points if x is not None and x > 0]
            if usable:
                axes.plot(
                    [x for x, _ in usable], [y for _, y in usable], "o--",
                    label=f"{row['arm']} p50/p99 only ({row['tokens_per_s']:,.0f} tokens/s)",
                )  # fmt: skip
    axes.set_xscale("log")
    axes.set_xlabel("token latency, engine stamp to the consumer's code (ms, log)")
    axes.set_ylabel("fraction of tokens")
    axes.set_ylim(0, 1.01)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(loc="lower right")
    axes.set_title(title)
    figure.tight_layout()
    try:
        figure.savefig(path, dpi=120)
    except OSError as exc:
        raise ConfigurationError(f"--plot {path}: cannot write it ({exc})") from None
    finally:
        plt.close(figure)

"""Human view of Topology.stats(): one row per priority class per link direction, drops where they happen."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.table import Table


def _size(n: float) -> str:
    for unit, mult in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= mult:
            return f"{n / mult:.1f}{unit}"
    return str(int(n))


def render(stats: dict[str, Any], console: Console | None = None, all_rows: bool = False) -> None:
    """Print hosts and per-class counters. Idle classes are left out unless all_rows."""
    # piped output (logs, CI) gets room for every column instead of an 80-column squeeze
    console = console or Console(width=None if sys.stdout.isatty() else 132)
    hosts = ", ".join(f"{h['name']}={h['addr']} ({h['ns']})" for h in stats["hosts"])
    backends = ["netem" if stats["netem"] else "", "nftables loss" if stats["nft_loss"] else "",
                "delay relay" if stats.get("relay_delay") else ""]
    console.print(f"[bold]prefix {stats['prefix']}[/bold]: {hosts}")
    for link in stats["links"]:
        if link["direction"].startswith(("h0→", "sw0→sw1")):
            console.print(f"{link['link'] if link['link'] == 'bottleneck' else 'host links'}: {link['spec']}")
    if any(backends):
        console.print("emulation via " + " + ".join(b for b in backends if b) + "; lost = randomly dropped/seen "
                      "at the receiving end")
    table = Table(show_lines=False, title="egress queues per link direction (drops = queue overflow)")
    for col, just in (("direction", "left"), ("class", "left"), ("pkts", "right"), ("bytes", "right"),
                      ("drops", "right"), ("overlimits", "right"), ("backlog", "right"), ("lost", "right"),
                      ("delay", "right"), ("held", "right")):
        table.add_column(col, justify=just, no_wrap=True)  # type: ignore[arg-type]
    for link in stats["links"]:
        loss = link.get("loss")
        loss_txt = f"{loss['dropped']}/{loss['seen']}" if loss else ""
        delay_txt, held_txt = _delay_cells(link.get("delay"))
        rows = [c for c in link["classes"] if all_rows or c["packets"] or c["drops"] or c["class"] in ("link", "FIFO")]
        if not link["classes"]:
            if all_rows or loss or delay_txt:
                table.add_row(link["direction"], "unshaped", "", "", "", "", "", loss_txt, delay_txt, held_txt)
            continue
        for n, c in enumerate(rows):
            style = "bold red" if c["drops"] and c["class"] != "link" else None
            table.add_row(
                link["direction"] if n == 0 else "", c["class"], str(c["packets"]), _size(c["bytes"]),
                str(c["drops"]), str(c["overlimits"]), f"{c['qlen']}p/{_size(c['backlog_bytes'])}B",
                loss_txt if n == 0 else "", delay_txt if n == 0 else "", held_txt if n == 0 else "", style=style,
            )
        table.add_section()
    console.print(table)
    drops = drops_by_class(stats)
    if drops:
        console.print("queue drops per class: " + ", ".join(f"{k} {v}" for k, v in drops.items()))


def _delay_cells(delay: dict[str, Any] | None) -> tuple[str, str]:
    """'25ms±2ms' and 'now/max (sent)' for a delayed direction; relay overflow and a dead relay are shown."""
    if not delay:
        return "", ""
    txt = f"{delay['delay_s'] * 1e3:g}ms" + (f"±{delay['jitter_s'] * 1e3:g}ms" if delay["jitter_s"] else "")
    if delay.get("reorder"):
        txt += f" reorder {delay['reorder'] * 100:g}%"
    if delay.get("backend") != "relay":
        return txt, f"{delay.get('held', 0)}p"
    if not delay.get("alive"):
        return txt, "[bold red]relay down[/bold red]"
    held = f"{delay['held']}p (max {delay['max_held']}, sent {delay['sent']})"
    if delay.get("overflow"):
        held += f" [bold red]overflow {delay['overflow']}[/bold red]"
    return txt, held


def drops_by_class(stats: dict[str, Any]) -> dict[str, int]:
    """Total queue drops per class over all link directions (EF/AF/BE/LE or FIFO)."""
    out: dict[str, int] = {}
    for link in stats["links"]:
        for c in link["classes"]:
            if c["class"] != "link":
                out[c["class"]] = out.get(c["class"], 0) + c["drops"]
    return out
